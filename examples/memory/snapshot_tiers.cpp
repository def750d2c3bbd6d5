// Example: snapshots and tiers on the CPU. A deployment saves its memory (store, index, prefix and
// lifecycle state) with save_memory and restarts from it with load_memory, without encoding
// anything again: the restarted memory serves the same request into the same cache bytes. Then
// the same facts live in a tiered_store: a small "device" tier (here host memory too, the host
// backend) in front of a larger host tier. A request whose facts are only in the host tier is
// admitted (its facts staged into the device tier, evicting others when it is full) and injected
// with tiered_store::run; the cache bytes equal those of one plain store holding every fact. The
// tiers are saved with save_tiers and restarted with load_tiers, residency and LRU order kept.
// Last, the same tiers hold int4 pages (compression.hpp): the cache is within the quantization
// error of the plain run's.
//
// The engine is played by the adapters of toy_engine.hpp (as in memory_cpu.cpp). The program
// checks every result above and exits 1 when anything differs (CTest: examples.snapshot_tiers).
// No GPU, no model files; it writes two snapshot directories under the system's temporary
// directory and removes them.
//
// usage: example_snapshot_tiers
#include "toy_engine.hpp"

#include <inferscale/memory.hpp>
#include <inferscale/tier.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using namespace inferscale;
using namespace toy;

namespace {

checks check{"example_snapshot_tiers"};
void expect(bool ok, std::string const& what) { check.expect(ok, what); }

/// An engine cache: one float32 tensor per layer, every element -100 at first.
struct toy_cache {
  std::vector<std::vector<float>> layers;
  paged_kv_cache desc;
  toy_cache() : layers(num_layers, std::vector<float>(layer_elements, -100.0f))
  {
    desc = make_toy_cache({layers[0].data(), layers[1].data()});
  }
};

/// A fresh directory under the system's temporary directory (removed by the destructor).
struct temp_dir {
  std::filesystem::path path;
  temp_dir()
  {
    std::string t = (std::filesystem::temp_directory_path() / "inferscale-example-XXXXXX").string();
    if (mkdtemp(t.data()) == nullptr) { throw std::runtime_error("mkdtemp failed"); }
    path = t;
  }
  ~temp_dir()
  {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// A fact's pre-RoPE K or V as the toy model produces it: [layers, tokens, heads, head_dim].
std::vector<float> fact_rows(int kv, std::vector<std::int32_t> const& tokens)
{
  std::vector<float> rows;
  for (std::int32_t l = 0; l < num_layers; ++l) {
    for (std::int32_t token : tokens) {
      for (std::int32_t h = 0; h < num_kv_heads; ++h) {
        for (std::int32_t d = 0; d < head_dim; ++d) {
          rows.push_back(toy_kv(kv, token, l, h, d));
        }
      }
    }
  }
  return rows;
}

template <class Store>
void insert_fact(Store& store,
                 std::uint64_t id,
                 std::uint64_t ns,
                 std::vector<std::int32_t> const& tokens,
                 fact_residency where)
{
  std::vector<float> const k = fact_rows(0, tokens), v = fact_rows(1, tokens);
  auto const n    = static_cast<std::int32_t>(tokens.size());
  auto const keys = make_fact_kv_view<float const>(k.data(), num_layers, n, num_kv_heads, head_dim);
  auto const values =
    make_fact_kv_view<float const>(v.data(), num_layers, n, num_kv_heads, head_dim);
  if constexpr (std::is_same_v<Store, tiered_store>) {
    store.template insert<float>(id, ns, tokens, keys, values, where);
  } else {
    store.template insert<float>(id, ns, tokens, keys, values);
  }
}

}  // namespace

int main()
{
  try {
    toy_model model;
    word_embedder embedder;
    std::vector<std::string> const turns{
      "Alice: I finally adopted a bird last week!",
      "Alice: A green parrot. I named him Kiwi. Work at the hospital keeps me busy though.",
      "Alice: My sister Clara lives in Porto and visits in June.",
    };
    std::vector<std::string> const fact_texts{
      "Alice keeps a parrot named Kiwi.",
      "Alice works as a nurse at a hospital.",
      "Alice's sister Clara lives in Porto.",
    };
    std::vector<std::int64_t> const fact_turns{1, 1, 2};  // the turn each fact comes from
    std::uint64_t const user   = 7;
    std::string const question = "What is my parrot called?";

    // A deployment's memory, as in memory_cpu.cpp.
    memory_config config;
    config.store.model       = model.geometry();
    config.store.store_dtype = dtype::float32;
    config.store.num_pages   = 64;
    config.store.space       = memory_space::host;
    config.index.dim         = embedder.dimension();
    config.index.metric      = distance_metric::cosine;
    memory mem{config};
    mem.set_instruction_prefix(model, tokenize("Facts about the user:"), /*id*/ 1, /*ns*/ 0);
    conversation chat;
    for (std::string const& turn : turns) {
      chat.turns.push_back({tokenize(turn), /*session*/ 0});
    }
    std::vector<conversation_fact> facts;
    for (std::size_t i = 0; i < fact_texts.size(); ++i) {
      facts.push_back({100 + i, user, tokenize(fact_texts[i]), {fact_turns[i]}});
    }
    mem.add_conversation(model, embedder, user, chat, facts, fact_texts, {/*window*/ 1});

    // 1. Snapshot: save, restart from the directory, serve the same request from both.
    temp_dir memory_dir;
    save_memory(mem, memory_dir.path.string());
    memory restarted = load_memory(memory_dir.path.string(), config);

    toy_cache before, after;
    paged_sequence seq_before{before.desc, {5, 2, 7}}, seq_after{after.desc, {5, 2, 7}};
    memory_request const a =
      mem.serve(embedder, user, question, /*k*/ 2, /*p0*/ 0, seq_before, model.rotation());
    memory_request const b =
      restarted.serve(embedder, user, question, /*k*/ 2, /*p0*/ 0, seq_after, model.rotation());
    expect(!a.fact_ids.empty() && a.fact_ids[0] == 100, "the parrot fact (100) ranks first");
    expect(a.fact_ids == b.fact_ids, "the restarted memory retrieves the same facts");
    expect(a.plan.token_ids == b.plan.token_ids, "the restarted memory composes the same segment");
    expect(before.layers == after.layers, "the restarted memory writes the same cache bytes");

    // 2. Tiers: a device tier of 2 pages (16 tokens each) in front of a host tier of 16 pages.
    //    Every fact goes to the host tier only; `reference` is one plain store holding them all.
    tiered_store_config tiers_config;
    tiers_config.device           = config.store;
    tiers_config.device.num_pages = 2;
    tiers_config.host_pages       = 16;
    tiered_store tiers{tiers_config};
    kv_store_config reference_config = config.store;
    reference_config.num_pages       = 16;
    kv_store reference{reference_config};
    for (std::size_t i = 0; i < fact_texts.size(); ++i) {
      insert_fact(tiers, 100 + i, user, tokenize(fact_texts[i]), fact_residency::host);
      insert_fact(reference, 100 + i, user, tokenize(fact_texts[i]), fact_residency::host);
    }
    expect(tiers.residency(100) == fact_residency::host, "fact 100 starts in the host tier only");

    // A request for two facts: admitted (staged into the device tier), injected, compared with
    // the plain store's run into another cache at the same slots.
    auto serve_tiered =
      [&](tiered_store& t, std::vector<std::uint64_t> const& ids, toy_cache& cache) {
        tier_request request = t.admit(ids);
        compose_options o;
        o.first_position       = 3;
        composition const plan = compose(t.device_tier(), ids, o);
        std::vector<std::int64_t> const slots =
          slots_from_block_table(std::vector<std::int32_t>{4, 1}.data(),
                                 2,
                                 static_cast<std::int32_t>(block_size),
                                 o.first_position,
                                 plan.length());
        injection_batch batch{t.device_tier()};
        batch.add(plan, slots);
        t.run(request, batch, cache.desc, model.rotation());
        return std::make_pair(plan, slots);
      };
    auto serve_plain = [&](std::vector<std::uint64_t> const& ids, toy_cache& cache) {
      compose_options o;
      o.first_position       = 3;
      composition const plan = compose(reference, ids, o);
      std::vector<std::int64_t> const slots =
        slots_from_block_table(std::vector<std::int32_t>{4, 1}.data(),
                               2,
                               static_cast<std::int32_t>(block_size),
                               o.first_position,
                               plan.length());
      injection_batch batch{reference};
      batch.add(plan, slots);
      batch.run(cache.desc, model.rotation());
    };

    toy_cache tiered_cache, plain_cache;
    serve_tiered(tiers, {100, 102}, tiered_cache);
    serve_plain({100, 102}, plain_cache);
    expect(tiered_cache.layers == plain_cache.layers,
           "the tiered injection writes the plain store's bytes");
    expect(tiered_cache.layers != toy_cache{}.layers, "the tiered injection wrote something");
    expect(
      tiers.residency(100) == fact_residency::both && tiers.residency(102) == fact_residency::both,
      "the request's facts are staged into the device tier");

    // The device tier holds 2 pages: the next request (fact 101) evicts the least recently used
    // device copy; the host tier keeps every fact.
    toy_cache tiered_next, plain_next;
    serve_tiered(tiers, {101}, tiered_next);
    serve_plain({101}, plain_next);
    expect(tiered_next.layers == plain_next.layers,
           "the next request's bytes equal the plain run's");
    int on_device = 0;
    for (std::uint64_t id : {100, 101, 102}) {
      on_device += tiers.residency(id) == fact_residency::both ? 1 : 0;
    }
    expect(tiers.residency(101) == fact_residency::both, "fact 101 is staged");
    expect(on_device == 2, "the 2-page device tier holds two one-page facts after an eviction");

    // 3. Tier snapshot: save, restart, the same residency and LRU order; serve from the restart.
    temp_dir tiers_dir;
    save_tiers(tiers, tiers_dir.path.string());
    tiered_store back = load_tiers(tiers_dir.path.string(), tiers_config);
    for (std::uint64_t id : {100, 101, 102}) {
      expect(back.residency(id) == tiers.residency(id),
             "fact " + std::to_string(id) + " keeps its residency across the tier snapshot");
    }
    expect(back.lru_order(user) == tiers.lru_order(user), "the LRU order survives the snapshot");
    toy_cache restarted_cache, plain_again;
    serve_tiered(back, {102, 100}, restarted_cache);
    serve_plain({102, 100}, plain_again);
    expect(restarted_cache.layers == plain_again.layers,
           "the restarted tiers write the plain store's bytes");

    // 4. Compressed facts: the same tiers holding int4 pages (compression.hpp). Injection
    //    dequantizes them; the cache is within the quantization error of the plain run's.
    // [snippet:compressed_store]
    tiered_store_config small = tiers_config;
    small.device.compression  = kv_compression::int4;  // or kv_compression::fp8_e4m3
    tiered_store compressed{small};
    // [/snippet:compressed_store]
    for (std::size_t i = 0; i < fact_texts.size(); ++i) {
      insert_fact(compressed, 100 + i, user, tokenize(fact_texts[i]), fact_residency::host);
    }
    expect(compressed.host_tier().page_bytes() * 3 < tiers.host_tier().page_bytes(),
           "an int4 page takes under a third of a float32 page");
    toy_cache compressed_cache, plain_last;
    serve_tiered(compressed, {100, 102}, compressed_cache);
    serve_plain({100, 102}, plain_last);
    float worst = 0.0f, largest = 0.0f;
    for (std::size_t l = 0; l < plain_last.layers.size(); ++l) {
      for (std::size_t e = 0; e < plain_last.layers[l].size(); ++e) {
        worst = std::max(worst, std::fabs(compressed_cache.layers[l][e] - plain_last.layers[l][e]));
        if (plain_last.layers[l][e] != -100.0f) {  // written by the request
          largest = std::max(largest, std::fabs(plain_last.layers[l][e]));
        }
      }
    }
    // int4: each element within half a step of its group's scale (amax / 7), rotated.
    expect(worst > 0.0f && worst <= largest / 7.0f,
           "the int4 tiers write the plain run's cache within the quantization error");

    if (!check.passed()) { return 1; }
    std::printf(
      "example_snapshot_tiers: the restarted memory served facts %llu, %llu into the "
      "same cache bytes; tiered requests (staging, an eviction, a restart from the tier "
      "snapshot) wrote the plain store's bytes; int4 tiers wrote them within the "
      "quantization error (worst %.4f of %.4f); every check passed\n",
      static_cast<unsigned long long>(a.fact_ids.at(0)),
      static_cast<unsigned long long>(a.fact_ids.at(1)),
      static_cast<double>(worst),
      static_cast<double>(largest));
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "example_snapshot_tiers: %s\n", e.what());
    return 1;
  }
}
