// Example: the memory facade on the CPU, the place to start. One `memory` holds the fact store and
// the fact index of a deployment (one namespace per user). A user's conversation is added once:
// its facts are encoded behind the turns they came from (context-window encoding), their texts
// embedded and indexed. A request is then served: the user's top facts are retrieved, composed
// behind an instruction prefix and injected into the engine's paged KV cache (a vLLM
// FlashAttention layout in host memory), so the engine prefills only the question.
//
// The engine is played by the small adapters of toy_engine.hpp, each what a real engine supplies:
// a model adapter (a forward handing over pre-RoPE K and V), an embedder and a paged-cache
// adapter. The program then checks what was written against the rotation formula written out
// here, and exits 1 when anything differs (CTest: examples.memory_cpu). No GPU, no model files.
//
// usage: example_memory_cpu
#include "toy_engine.hpp"

#include <inferscale/memory.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

using namespace inferscale;
using namespace toy;

namespace {

checks check{"example_memory_cpu"};
void expect(bool ok, std::string const& what) { check.expect(ok, what); }

}  // namespace

int main()
{
  try {
    toy_model model;
    word_embedder embedder;
    // The engine's paged cache: one (2, blocks, 16, heads, head_dim) tensor per layer, every
    // element -100 at first (never a value the memory writes: tells untouched cells apart).
    std::vector<std::vector<float>> layers(num_layers, std::vector<float>(layer_elements, -100.0f));
    paged_kv_cache const cache = make_toy_cache({layers[0].data(), layers[1].data()});
    auto at = [&](int kv, std::int32_t l, std::int64_t slot, std::int32_t h, std::int32_t d) {
      return layers[static_cast<std::size_t>(l)][cache_offset(kv, slot, h, d)];
    };
    std::vector<std::string> const turns{
      "Alice: I finally adopted a bird last week!",
      "Assistant: How lovely, what kind of bird?",
      "Alice: A green parrot. I named him Kiwi. Work at the hospital keeps me busy though.",
      "Alice: My sister Clara lives in Porto and visits in June.",
    };
    std::vector<std::string> const fact_texts{
      "Alice keeps a parrot named Kiwi.",
      "Alice works as a nurse at a hospital.",
      "Alice's sister Clara lives in Porto.",
    };
    std::vector<std::int64_t> const fact_turns{2, 2, 3};
    std::string const question = "What is my parrot called?";

    // The README shows this region as written (docs.snippets): not reformatted.
    // clang-format off
    // [snippet:quick_start]
    memory_config config;                               // one per deployment
    config.store.model       = model.geometry();        // layers, KV heads, head_dim
    config.store.store_dtype = dtype::float32;          // or float16, bfloat16
    config.store.num_pages   = 64;                      // 16 tokens each, allocated once
    config.store.space       = memory_space::host;
    config.index.dim         = embedder.dimension();
    config.index.metric      = distance_metric::cosine;
    memory mem{config};
    mem.set_instruction_prefix(model, tokenize("Facts about the user:"), /*id*/ 1, /*ns*/ 0);

    // Once per conversation: each fact encoded behind the turns before it, embedded, indexed.
    std::uint64_t const user = 7;  // the user's namespace
    conversation chat;
    for (std::string const& turn : turns) {
      chat.turns.push_back({tokenize(turn), /*session*/ 0});
    }
    std::vector<conversation_fact> facts;
    for (std::size_t i = 0; i < fact_texts.size(); ++i) {
      facts.push_back({100 + i, user, tokenize(fact_texts[i]), {fact_turns[i]}});
    }
    mem.add_conversation(model, embedder, user, chat, facts, fact_texts, {/*window*/ 2});

    // Per request: the user's top k facts retrieved, composed behind the prefix at p0 = 0 and
    // injected into the sequence's paged cache; the engine then prefills only the question.
    paged_sequence sequence{cache, /*block table*/ {5, 2, 7}};
    memory_request const got = mem.serve(embedder, user, question, /*k*/ 2, /*p0*/ 0, sequence,
                                         model.rotation());
    // [/snippet:quick_start]
    // clang-format on

    // What was retrieved: the parrot fact first (the only one sharing a word with the question).
    expect(got.fact_ids.size() == 2, "2 facts retrieved");
    expect(!got.fact_ids.empty() && got.fact_ids[0] == 100, "the parrot fact (100) ranks first");

    // The segment: the prefix, then the facts in best_last order (the most relevant last).
    std::vector<std::int32_t> expected = tokenize("Facts about the user:");
    for (auto it = got.fact_ids.rbegin(); it != got.fact_ids.rend(); ++it) {
      std::vector<std::int32_t> const t = tokenize(fact_texts.at(*it - 100));
      expected.insert(expected.end(), t.begin(), t.end());
    }
    expect(got.plan.token_ids == expected, "the segment holds the prefix, then the facts");
    expect(got.plan.first_position == 0, "the segment starts at p0 = 0");
    expect(sequence.computed_tokens == got.plan.length(), "the sequence committed the segment");

    // What the cache holds: at position p (slot block_table[p / 16] * 16 + p % 16) each value as
    // the model produced it, and each key rotated to p: NeoX pairs (d, d + 4), angle
    // p * theta^(-2i / head_dim), computed here in double precision.
    std::vector<bool> written(static_cast<std::size_t>(num_blocks * block_size), false);
    for (std::int64_t p = 0; p < got.plan.length(); ++p) {
      std::int64_t const slot =
        std::int64_t{sequence.block_table[static_cast<std::size_t>(p / block_size)]} * block_size +
        p % block_size;
      written[static_cast<std::size_t>(slot)] = true;
      std::int32_t const token                = got.plan.token_ids[static_cast<std::size_t>(p)];
      for (std::int32_t l = 0; l < num_layers; ++l) {
        for (std::int32_t h = 0; h < num_kv_heads; ++h) {
          for (std::int32_t d = 0; d < head_dim; ++d) {
            std::int32_t const i    = d % (head_dim / 2);
            double const angle      = double(p) * std::pow(rope_theta, -2.0 * i / head_dim);
            double const x          = toy_kv(0, token, l, h, i);
            double const y          = toy_kv(0, token, l, h, i + head_dim / 2);
            double const key        = d < head_dim / 2 ? x * std::cos(angle) - y * std::sin(angle)
                                                       : x * std::sin(angle) + y * std::cos(angle);
            std::string const where = "position " + std::to_string(p) + ", layer " +
                                      std::to_string(l) + ", head " + std::to_string(h) + ", dim " +
                                      std::to_string(d);
            expect(at(1, l, slot, h, d) == toy_kv(1, token, l, h, d), "value at " + where);
            expect(std::fabs(at(0, l, slot, h, d) - key) <= 1e-5 * (1.0 + std::fabs(key)),
                   "key at " + where);
          }
        }
      }
    }
    // Every other cell of the cache is untouched.
    for (std::int64_t slot = 0; slot < num_blocks * block_size; ++slot) {
      if (written[static_cast<std::size_t>(slot)]) { continue; }
      for (std::int32_t l = 0; l < num_layers; ++l) {
        expect(at(0, l, slot, 0, 0) == -100.0f && at(1, l, slot, 1, head_dim - 1) == -100.0f,
               "slot " + std::to_string(slot) + " untouched");
      }
    }

    std::printf(
      "\"%s\": retrieved facts %llu, %llu; %lld memory tokens injected through the "
      "block table; the engine prefills the question from position %lld\n",
      question.c_str(),
      static_cast<unsigned long long>(got.fact_ids.at(0)),
      static_cast<unsigned long long>(got.fact_ids.at(1)),
      static_cast<long long>(got.plan.length()),
      static_cast<long long>(got.plan.length()));
    if (!check.passed()) { return 1; }
    std::printf("example_memory_cpu: every check passed\n");
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "example_memory_cpu: %s\n", e.what());
    return 1;
  }
}
