// The memory facade (memory.hpp) against fake adapters: a model whose K/V are a function of the
// tokens a token sees (tests/common/fake_model.hpp), a bag-of-words embedder, and a contiguous
// host cache. Expected cache contents are recomputed from the fake model's formula; refusals are
// checked to leave the store and the index exactly as they were. A scheduler step (serve_step)
// is checked against the same requests served one at a time, and its refusals against the bytes
// of the store, the index and the cache before it.

#include "fake_model.hpp"
#include "memory_checks.hpp"
#include "memory_fixtures.hpp"
#include "stream_type.hpp"

#include <inferscale/memory.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::fake;
using namespace inferscale_test::memory_fixtures;

namespace {

memory make_memory() { return memory{tiny_memory_config(dtype::float32, 512)}; }

/// Everything observable about a memory, to compare before and after a refused call.
struct snapshot {
  std::int64_t facts;
  std::int64_t free_pages;
  std::uint64_t indexed;
  std::uint64_t index_version;
  std::vector<unsigned char> pool;  // the bytes of every live fact's pages, in id order
  // (the store's version() may advance: a rolled-back insert still invalidates older plans)
  bool operator==(snapshot const& o) const
  {
    return facts == o.facts && free_pages == o.free_pages && indexed == o.indexed &&
           index_version == o.index_version && pool == o.pool;
  }
};
std::vector<unsigned char> live_bytes(memory const& m)
{
  std::vector<unsigned char> const pool = m.store().pool_to_host();
  std::size_t const page = pool.size() / static_cast<std::size_t>(m.store().num_pages());
  std::vector<unsigned char> out;
  for (std::uint64_t ns : m.index().namespaces()) {
    std::vector<std::uint64_t> ids = m.index().ids(ns);
    std::sort(ids.begin(), ids.end());
    for (std::uint64_t id : ids) {
      for (std::int64_t p : m.store().at(id).pages) {
        out.insert(out.end(),
                   pool.begin() + static_cast<std::ptrdiff_t>(p * page),
                   pool.begin() + static_cast<std::ptrdiff_t>((p + 1) * page));
      }
    }
  }
  return out;
}
snapshot snap(memory const& m)
{
  return {m.store().num_facts(),
          m.store().free_pages(),
          m.index().total_size(),
          m.index().version(),
          live_bytes(m)};
}

static_assert(is_cache_adapter_v<sequence_adapter>);

/// A memory with the instruction prefix and three users (namespaces 7, 8, 9) added.
struct step_fixture {
  memory m = make_memory();
  branching_model model;
  word_embedder embedder;
  user_data a = make_user(7, 100, 12);
  user_data b = make_user(8, 200, 9);
  user_data c = make_user(9, 300, 6, 2);
  step_fixture()
  {
    encoding_options o;
    o.window = 3;
    m.set_instruction_prefix(model, {11, 12, 13}, 1, 0);
    m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o);
    m.add_conversation(model, embedder, 8, b.c, b.facts, b.texts, o);
    m.add_conversation(model, embedder, 9, c.c, c.facts, c.texts, o);
  }
  /// Five requests of the three users (the last one matches no fact's words).
  std::vector<step_ask> asks() const
  {
    return {{7, a.texts[4], 5},
            {8, b.texts[2], 0},
            {9, c.texts[1] + " " + a.texts[3], 17},
            {7, a.texts[9], 3},
            {8, "no word of any fact", 40}};
  }
};

}  // namespace

TEST_CASE("memory: one fact_order default, the same as compose's", "[memory]")
{
  REQUIRE(memory_config{}.order == fact_order::best_last);
  REQUIRE(compose_options{}.order == fact_order::best_last);
}

TEST_CASE("memory: add a conversation, retrieve in the user's namespace, serve a request",
          "[memory]")
{
  memory m = make_memory();
  branching_model model;
  word_embedder embedder;
  m.set_instruction_prefix(model, {11, 12, 13}, 1, 0);
  CHECK(m.instruction_prefix() == std::optional<std::uint64_t>{1});

  user_data const a = make_user(7, 100, 12);
  user_data const b = make_user(8, 200, 9);
  encoding_options o;
  o.window                   = 3;
  o.strategy                 = encoding_strategy::aligned;
  memory_add_report const ra = m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o);
  m.add_conversation(model, embedder, 8, b.c, b.facts, b.texts, o);
  CHECK(ra.embedded == 11);
  CHECK(ra.encode.facts == 11);
  CHECK(ra.encode.branched);
  CHECK(ra.encode.forward_tokens == ra.plan.forward_tokens);
  CHECK(m.store().namespace_facts(7) == 11);
  CHECK(m.store().namespace_facts(8) == 8);
  CHECK(m.index().size(7) == 11);
  CHECK(m.index().size(8) == 8);

  // A query equal to a fact's text finds that fact first, and only the user's own facts.
  for (std::size_t i = 0; i < a.facts.size(); ++i) {
    std::vector<std::uint64_t> const got = m.retrieve(embedder, 7, a.texts[i], 3);
    REQUIRE(got.size() == 3);
    CHECK(got[0] == a.facts[i].fact_id);
    for (std::uint64_t id : got) {
      CHECK(m.store().at(id).namespace_id == 7);
    }
  }
  CHECK(m.retrieve(embedder, 8, a.texts[0], 50).size() == 8);  // fewer than k: all of them

  // serve(): prefix, then the retrieved facts best-last, injected at p0 = 5 and committed.
  host_cache cache;
  memory_request const r = m.serve(embedder, 7, a.texts[4], 2, 5, cache, model.rotation());
  REQUIRE(r.fact_ids.size() == 2);
  CHECK(r.fact_ids[0] == a.facts[4].fact_id);
  std::vector<std::int32_t> want = {11, 12, 13};
  for (auto it = r.fact_ids.rbegin(); it != r.fact_ids.rend(); ++it) {
    auto const& t = m.store().at(*it).token_ids;
    want.insert(want.end(), t.begin(), t.end());
  }
  CHECK(r.plan.token_ids == want);
  CHECK(r.plan.first_position == 5);
  CHECK(cache.first == 5);
  CHECK(cache.committed == std::vector<std::int64_t>{static_cast<std::int64_t>(want.size())});

  // The V rows in the cache are the fact's V as the fake model computed it behind its window:
  // recomputed here from the formula over the plan's trunk (V is not rotated).
  encoding_plan const plan = plan_encoding(a.c, a.facts, o);
  std::int64_t slot        = 3;  // after the prefix
  for (auto it = r.fact_ids.rbegin(); it != r.fact_ids.rend(); ++it) {
    for (encoding_job const& job : plan.jobs) {
      for (encoding_branch const& br : job.branches) {
        if (br.fact_id != *it) { continue; }
        std::vector<std::int32_t> seen(job.trunk.begin(), job.trunk.begin() + br.attach);
        for (std::size_t j = 0; j < br.token_ids.size(); ++j, ++slot) {
          seen.push_back(br.token_ids[j]);
          for (std::int32_t l = 0; l < 2; ++l) {
            float k[4], v[4];
            fake_row(seen, br.position + static_cast<std::int64_t>(j), l, k, v);
            for (int d = 0; d < 4; ++d) {
              CHECK(cache.value(l, slot, d) == v[d]);
            }
          }
        }
      }
    }
  }
  CHECK(slot == static_cast<std::int64_t>(want.size()));

  // Forgetting user 7 leaves user 8 intact.
  CHECK(m.erase_namespace(7) == 11);
  CHECK(m.store().namespace_facts(7) == 0);
  CHECK_FALSE(m.index().has_namespace(7));
  CHECK(m.retrieve(embedder, 8, b.texts[2], 1) == std::vector<std::uint64_t>{b.facts[2].fact_id});
  CHECK_THROWS_WITH(m.erase_namespace(0), Catch::Contains("holds the instruction prefix"));
}

TEST_CASE("memory: refused additions leave the store and the index unchanged", "[memory]")
{
  memory m = make_memory();
  branching_model model;
  word_embedder embedder;
  user_data const a = make_user(7, 100, 12);
  encoding_options o;
  o.window = 2;
  m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o);
  snapshot const before = snap(m);
  user_data const b     = make_user(8, 300, 10);

  auto refused = [&](auto&& call, char const* what) {
    CHECK_THROWS_WITH(call(), Catch::Contains(what));
    CHECK(snap(m) == before);
  };
  refused(
    [&] {
      auto texts = b.texts;
      texts.pop_back();
      m.add_conversation(model, embedder, 8, b.c, b.facts, texts, o);
    },
    "facts but 8 texts");
  refused([&] { m.add_conversation(model, embedder, 9, b.c, b.facts, b.texts, o); },
          "the conversation is added to namespace 9");
  refused(
    [&] {
      auto facts       = b.facts;
      facts[2].fact_id = a.facts[0].fact_id;
      m.add_conversation(model, embedder, 8, b.c, facts, b.texts, o);
    },
    "is already indexed");
  refused(
    [&] {
      word_embedder wrong;
      wrong.dim = 16;
      m.add_conversation(model, wrong, 8, b.c, b.facts, b.texts, o);
    },
    "the embedder gives 16-d vectors, the index holds 32-d");
  refused(
    [&] {
      word_embedder nan;
      nan.nan_for = b.texts[5];
      m.add_conversation(model, nan, 8, b.c, b.facts, b.texts, o);
    },
    "non-finite embedding");
  refused(
    [&] {
      auto facts            = b.facts;
      facts[1].source_turns = std::vector<std::int64_t>{99};
      m.add_conversation(model, embedder, 8, b.c, facts, b.texts, o);
    },
    "source turn 99");
  refused(
    [&] {
      branching_model failing;  // fails on the third of its per-fact forwards
      failing.fail_at           = 2;
      encoding_options per_fact = o;
      per_fact.strategy         = encoding_strategy::per_fact;
      m.add_conversation(failing, embedder, 8, b.c, b.facts, b.texts, per_fact);
    },
    "fake engine failure");
  // The index refuses a zero vector after the facts were encoded: the store is restored.
  refused(
    [&] {
      word_embedder zero;
      zero.zero_for = b.texts[3];
      m.add_conversation(model, zero, 8, b.c, b.facts, b.texts, o);
    },
    "zero");

  // Requests: unknown namespace, wrong query dimension, k == 0; nothing committed.
  host_cache cache;
  CHECK_THROWS(m.serve(embedder, 99, "anything", 3, 0, cache, model.rotation()));
  CHECK_THROWS_WITH(m.retrieve(7, std::vector<float>(8, 0.1f), 3),
                    Catch::Contains("the query has 8 values, the index 32"));
  CHECK_THROWS_WITH(m.retrieve(7, std::vector<float>(32, 0.1f), 0),
                    Catch::Contains("k must be positive"));
  CHECK(cache.committed.empty());
  CHECK(snap(m) == before);
}

TEST_CASE("memory: a scheduler step serves every request as serve() alone does, with one search",
          "[memory]")
{
  step_fixture f;
  memory& m = f.m;
  // Five requests of three users; request i's tokens go to slots i, i + 5, i + 10, .. (the
  // requests interleave in the cache, as paged sequences do).
  std::vector<step_ask> const asks = f.asks();
  std::uint32_t const k            = 3;
  std::int64_t const n             = static_cast<std::int64_t>(asks.size());

  // The expectation: each request served alone (serve(), checked against the fake model's formula
  // above), into one cache, at the same slots.
  host_cache alone{n, 0};
  std::vector<memory_request> expected;
  std::uint64_t searches = m.searches();
  for (std::int64_t i = 0; i < n; ++i) {
    alone.offset      = i;
    step_ask const& q = asks[static_cast<std::size_t>(i)];
    expected.push_back(m.serve(f.embedder, q.ns, q.query, k, q.p0, alone, f.model.rotation()));
  }
  CHECK(m.searches() == searches + static_cast<std::uint64_t>(n));

  host_cache step_cache;
  std::vector<sequence_adapter> sequences;
  auto const requests                   = interleaved_step(asks, step_cache, sequences);
  searches                              = m.searches();
  std::int64_t const calls              = f.embedder.calls;
  std::vector<memory_request> const got = m.serve_step(f.embedder, requests, k, f.model.rotation());
  CHECK(m.searches() == searches + 1);   // one batched search for the whole step
  CHECK(f.embedder.calls == calls + n);  // one embedding per request
  REQUIRE(got.size() == asks.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].fact_ids == expected[i].fact_ids);
    CHECK(got[i].fact_ids.size() == k);
    for (std::uint64_t id : got[i].fact_ids) {
      CHECK(m.store().at(id).namespace_id == asks[i].ns);  // only the user's own facts
    }
    CHECK(got[i].plan.first_position == asks[i].p0);
    CHECK(got[i].plan.token_ids == expected[i].plan.token_ids);
    REQUIRE(got[i].plan.sources.size() == expected[i].plan.sources.size());
    for (std::size_t j = 0; j < got[i].plan.sources.size(); ++j) {
      CHECK(got[i].plan.sources[j].fact_id == expected[i].plan.sources[j].fact_id);
      CHECK(got[i].plan.sources[j].offset == expected[i].plan.sources[j].offset);
    }
    CHECK(sequences[i].allocated_at == asks[i].p0);
    CHECK(sequences[i].committed == std::vector<std::int64_t>{got[i].plan.length()});
  }
  CHECK(alone.committed.size() == asks.size());
  // The step's cache holds the bytes the requests alone wrote, every other element still -1.
  CHECK(step_cache.data != std::vector<float>(step_cache.data.size(), -1.0f));
  CHECK(std::memcmp(step_cache.data.data(), alone.data.data(), alone.data.size() * sizeof(float)) ==
        0);

  // An empty step runs nothing.
  CHECK(m.serve_step(
           f.embedder, std::vector<memory_step_request<sequence_adapter>>{}, k, f.model.rotation())
          .empty());
  CHECK(m.searches() == searches + 1);
}

namespace {
/// word_embedder that also embeds a batch at once (embeds_batches_v): counts the batch calls
/// and the texts each held; `short_by` drops that many embeddings from the answer.
struct batch_word_embedder : word_embedder {
  std::vector<std::vector<std::string>> batches;
  std::size_t short_by{0};
  using word_embedder::embed;
  std::vector<std::vector<float>> embed(std::vector<std::string> const& texts)
  {
    batches.push_back(texts);
    std::vector<std::vector<float>> out;
    for (std::size_t i = 0; i + short_by < texts.size(); ++i) {
      out.push_back(word_embedder::embed(texts[i]));
    }
    return out;
  }
};
static_assert(embeds_batches_v<batch_word_embedder>);
static_assert(!embeds_batches_v<word_embedder>);
}  // namespace

TEST_CASE("memory: a step embeds its queries with one call of a batch embedder", "[memory]")
{
  step_fixture f;
  memory& m = f.m;
  std::vector<std::pair<std::uint64_t, std::string>> const asks{
    {7, f.a.texts[4]}, {8, f.b.texts[2]}, {9, f.c.texts[1]}, {7, "no word of any fact"}};
  std::uint32_t const k = 3;
  auto step = [&](auto& embedder, host_cache& cache, std::vector<sequence_adapter>& sequences) {
    std::vector<memory_step_request<sequence_adapter>> requests;
    for (std::size_t i = 0; i < asks.size(); ++i) {
      sequences[i].shared = &cache;
      for (std::int64_t j = 0; j < 40; ++j) {
        sequences[i].slots.push_back(static_cast<std::int64_t>(i) +
                                     static_cast<std::int64_t>(asks.size()) * j);
      }
      requests.push_back({asks[i].first, asks[i].second, 0, &sequences[i]});
    }
    return m.serve_step(embedder, requests, k, f.model.rotation());
  };
  host_cache plain_cache, batch_cache;
  std::vector<sequence_adapter> plain_seqs(asks.size()), batch_seqs(asks.size());
  std::vector<memory_request> const plain = step(f.embedder, plain_cache, plain_seqs);
  batch_word_embedder batched;
  batched.dim                           = f.embedder.dim;
  std::vector<memory_request> const got = step(batched, batch_cache, batch_seqs);
  // one batch call holding the step's queries in request order, no single-text call
  REQUIRE(batched.batches.size() == 1);
  REQUIRE(batched.batches[0].size() == asks.size());
  for (std::size_t i = 0; i < asks.size(); ++i) {
    CHECK(batched.batches[0][i] == asks[i].second);
  }
  CHECK(batched.calls == static_cast<std::int64_t>(asks.size()));  // each text embedded once
  // the same answers as one embed(text) per request (the same embedding function)
  REQUIRE(got.size() == plain.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CHECK(got[i].fact_ids == plain[i].fact_ids);
    CHECK(got[i].plan.token_ids == plain[i].plan.token_ids);
  }
  CHECK(batch_cache.data == plain_cache.data);

  // a batch answer of the wrong length is refused before any adapter allocates
  batch_word_embedder bad;
  bad.dim               = f.embedder.dim;
  bad.short_by          = 1;
  snapshot const before = snap(m);
  host_cache untouched;
  std::vector<float> const original = untouched.data;
  std::vector<sequence_adapter> seqs(asks.size());
  CHECK_THROWS_WITH(step(bad, untouched, seqs),
                    Catch::Contains("memory::serve_step: the embedder returned 3 embeddings for "
                                    "4 queries"));
  CHECK(snap(m) == before);
  CHECK(untouched.data == original);
  for (auto const& s : seqs) {
    CHECK(s.committed.empty());
  }
}

TEST_CASE(
  "memory: a refused step leaves the store, the index, the cache and every sequence as "
  "they were",
  "[memory]")
{
  step_fixture f;
  memory& m             = f.m;
  snapshot const before = snap(m);
  host_cache shared;
  std::vector<float> const original = shared.data;
  std::vector<sequence_adapter> sequences(4);
  std::vector<memory_step_request<sequence_adapter>> good;
  std::uint64_t const namespaces[] = {7, 8, 9, 8};
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    sequences[i].shared = &shared;
    for (std::int64_t j = 0; j < 20; ++j) {
      sequences[i].slots.push_back(static_cast<std::int64_t>(i) * 20 + j);
    }
    user_data const& u = namespaces[i] == 7 ? f.a : namespaces[i] == 8 ? f.b : f.c;
    good.push_back({namespaces[i], u.texts[i + 1], 4, &sequences[i]});
  }

  // `what` names the request; `why` (if given) is the refusal of the call it was refused by.
  // `allocated`: how many of the step's first requests got slots from their adapter before the
  // refusal; each of them must have been given its slots back (release of the m it asked for),
  // and no other adapter asked to release anything.
  auto refused = [&](std::vector<memory_step_request<sequence_adapter>> const& requests,
                     std::uint32_t k,
                     char const* what,
                     bool searched,
                     char const* why       = "",
                     std::size_t allocated = 0) {
    std::uint64_t const searches = m.searches();
    CHECK_THROWS_WITH(m.serve_step(f.embedder, requests, k, f.model.rotation()),
                      Catch::Contains(what) && Catch::Contains(why));
    CHECK(snap(m) == before);
    CHECK(std::memcmp(shared.data.data(), original.data(), original.size() * sizeof(float)) == 0);
    for (std::size_t i = 0; i < sequences.size(); ++i) {
      sequence_adapter& s = sequences[i];
      CHECK(s.committed.empty());
      if (i < allocated) {
        CHECK(s.allocated.size() == 1);
        CHECK(s.released == s.allocated);
      } else {
        CHECK(s.allocated.empty());
        CHECK(s.released.empty());
      }
      s.allocated.clear();
      s.released.clear();
    }
    CHECK(m.searches() == searches + (searched ? 1 : 0));
  };
  std::vector<memory_step_request<sequence_adapter>> r;

  // Refused before the search: k, the adapters, the namespaces.
  refused(good, 0, "memory::serve_step: k must be positive", false);
  r       = good;
  r[2].ns = 99;
  refused(r, 3, "memory::serve_step: request 2 (namespace 99): unknown namespace 99", false);
  r          = good;
  r[1].cache = nullptr;
  refused(r, 3, "request 1 (namespace 8): no cache adapter", false);
  r          = good;
  r[3].cache = r[0].cache;
  refused(r, 3, "request 3 (namespace 8): its cache adapter is an earlier request's", false);
  host_cache other;
  sequence_adapter elsewhere;
  elsewhere.shared = &other;
  elsewhere.slots  = sequences[1].slots;
  r                = good;
  r[1].cache       = &elsewhere;
  refused(r, 3, "request 1 (namespace 8): its cache adapter addresses another cache", false);
  CHECK(elsewhere.committed.empty());
  CHECK(other.data == original);
  // An embedding refused (no search runs).
  f.embedder.nan_for = good[2].query;
  refused(good, 3, "request 2 (namespace 9): the query has a non-finite embedding", false);
  f.embedder.nan_for.clear();
  f.embedder.throw_for = good[3].query;
  refused(good, 3, "fake embedder failure", false);
  f.embedder.throw_for.clear();

  // Refused after the search, before anything is written: too few slots, a slot of another
  // request, an adapter that throws, a slot beyond the cache.
  sequences[3].slots.resize(5);
  refused(good,
          3,
          "request 3 (namespace 8): the cache adapter allocated 5 slots for 12 tokens",
          true,
          "",
          4);
  sequences[3].slots.clear();
  for (std::int64_t j = 0; j < 20; ++j) {
    sequences[3].slots.push_back(60 + j);
  }
  sequences[2].slots[7] = 3;  // request 0's
  refused(good,
          3,
          "memory::serve_step: request 2 (namespace 9): ",
          true,
          "injection_batch::add: slot 3 is written twice in this batch",
          3);
  sequences[2].slots[7] = 47;
  sequences[1].fail     = true;
  refused(good, 3, "fake adapter failure", true, "", 1);  // request 0 had its slots
  sequences[1].fail      = false;
  sequences[0].slots[11] = 256;  // the cache holds 256 slots
  // Refused at the run, after every adapter allocated: all four give their slots back.
  refused(good, 3, "memory::serve_step: ", true, "slot 256 is beyond the cache's 256 slots", 4);
  sequences[0].slots[11] = 11;

  // The same step, corrected, goes through and commits every request.
  std::vector<memory_request> const got = m.serve_step(f.embedder, good, 3, f.model.rotation());
  REQUIRE(got.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(sequences[i].committed == std::vector<std::int64_t>{got[i].plan.length()});
    CHECK(sequences[i].allocated == sequences[i].committed);
    CHECK(sequences[i].released.empty());
  }
  CHECK(shared.data != original);
}

namespace {
/// The search of serve / serve_step given a device_context of resources, supplied from outside
/// (as memory_device_index.cuh supplies the device one for raft::resources): it records what it
/// is asked and answers with the host index through the host `search`.
struct external_retrieval {
  mutable std::int64_t calls{0};
  mutable std::vector<std::uint64_t> namespaces;
  mutable std::vector<float> queries;
};
/// The same, claiming to search a device index (to see the facade refuse a host one).
struct device_claiming_retrieval {
  mutable std::int64_t calls{0};
};
}  // namespace

namespace inferscale::detail {
template <>
struct memory_index_search<external_retrieval> {
  static constexpr memory_space index_space = memory_space::host;
  static stream_ref stream(external_retrieval const&) { return cudaStream_t{}; }
  static void run(external_retrieval const& r,
                  graph_index const& index,
                  matrix_view<float const> queries,
                  cuda::std::span<std::uint64_t const> namespaces,
                  std::uint32_t k,
                  search_params const& params,
                  matrix_view<std::uint64_t> ids,
                  matrix_view<float> distances)
  {
    ++r.calls;
    r.namespaces.assign(namespaces.begin(), namespaces.end());
    r.queries.assign(queries.data_handle(),
                     queries.data_handle() + queries.extent(0) * queries.extent(1));
    inferscale::search(index, queries, namespaces, k, params, ids, distances);
  }
};
template <>
struct memory_index_search<device_claiming_retrieval> {
  static constexpr memory_space index_space = memory_space::device;
  static stream_ref stream(device_claiming_retrieval const&) { return cudaStream_t{}; }
  template <class... Args>
  static void run(device_claiming_retrieval const& r, Args&&...)
  {
    ++r.calls;
  }
};
}  // namespace inferscale::detail

TEST_CASE(
  "memory: a step whose search is supplied from outside serves as the host step, byte for "
  "byte; each search refuses the other memory's index",
  "[memory]")
{
  step_fixture f;
  memory& m                  = f.m;
  std::vector<step_ask> asks = f.asks();
  asks.pop_back();  // the first four
  std::uint32_t const k = 3;
  host_cache host_step_cache;
  std::vector<sequence_adapter> host_sequences;
  auto const host_requests = interleaved_step(asks, host_step_cache, host_sequences);
  std::vector<memory_request> const expected =
    m.serve_step(f.embedder, host_requests, k, f.model.rotation());

  host_cache external_cache;
  std::vector<sequence_adapter> external_sequences;
  auto const external_requests = interleaved_step(asks, external_cache, external_sequences);
  external_retrieval external;
  std::uint64_t const searches = m.searches();
  std::vector<memory_request> const got =
    m.serve_step(f.embedder, external_requests, k, f.model.rotation(), device_context{external});
  CHECK(m.searches() == searches + 1);
  // One search of every request's embedded query, each in its namespace.
  CHECK(external.calls == 1);
  std::vector<float> queries;
  std::vector<std::uint64_t> namespaces;
  for (step_ask const& q : asks) {
    std::vector<float> const v = word_embedder{}.embed(q.query);
    queries.insert(queries.end(), v.begin(), v.end());
    namespaces.push_back(q.ns);
  }
  CHECK(external.queries == queries);
  CHECK(external.namespaces == namespaces);
  check_same_step(
    got, expected, external_sequences, host_sequences, external_cache.data, host_step_cache.data);

  // serve(..., rotation, device_context{res}) is a step of one request, as serve() is.
  host_cache alone{1, 0};
  host_cache alone_external{1, 0};
  memory_request const one = m.serve(f.embedder, 8, asks[1].query, k, 0, alone, f.model.rotation());
  memory_request const one_external = m.serve(f.embedder,
                                              8,
                                              asks[1].query,
                                              k,
                                              0,
                                              alone_external,
                                              f.model.rotation(),
                                              device_context{external});
  CHECK(external.calls == 2);
  CHECK(one_external.fact_ids == one.fact_ids);
  CHECK(one_external.plan.token_ids == one.plan.token_ids);
  CHECK(alone_external.data == alone.data);

  // A search of device memory refuses this host index, before anything is embedded or searched.
  device_claiming_retrieval device_search;
  std::int64_t const calls = f.embedder.calls;
  device_context const on_device{device_search};
  CHECK_THROWS_WITH(
    m.serve_step(f.embedder, external_requests, k, f.model.rotation(), on_device),
    Catch::Contains("memory::serve_step: the index is in host memory; serve a host index with a "
                    "device_context without raft::resources"));
  CHECK_THROWS_WITH(
    m.serve(f.embedder, 8, asks[1].query, k, 0, alone_external, f.model.rotation(), on_device),
    Catch::Contains("memory::serve: the index is in host memory"));
  CHECK(device_search.calls == 0);
  CHECK(f.embedder.calls == calls);

  // The host search refuses a device index (constructing one allocates nothing on the device),
  // naming the overload to use, before anything is embedded.
  memory_config dc = m.config();
  dc.index.space   = memory_space::device;
  memory const on_gpu{dc};
  CHECK_THROWS_WITH(on_gpu.serve_step(f.embedder, external_requests, k, f.model.rotation()),
                    Catch::Contains("memory::serve_step: the index is in device memory; serve a "
                                    "device index with a device_context holding its "
                                    "raft::resources, memory::serve_step(..., rotation, "
                                    "device_context{res[, workspace, stream]}) "
                                    "(memory_device_index.cuh)"));
  CHECK_THROWS_WITH(on_gpu.serve(f.embedder, 8, asks[1].query, k, 0, alone, f.model.rotation()),
                    Catch::Contains("memory::serve: the index is in device memory") &&
                      Catch::Contains("memory::serve(..., rotation, device_context{res"));
  CHECK(f.embedder.calls == calls);
  for (sequence_adapter const& s : external_sequences) {
    CHECK(s.committed.size() == 1);  // only the step that went through
  }
}

TEST_CASE(
  "memory: erase_fact and erase_namespace on a stream zero a host store's pages as the "
  "plain calls do",
  "[memory]")
{
  step_fixture plain;
  step_fixture streamed;
  std::uint64_t const id                = plain.a.facts[2].fact_id;
  std::vector<std::int64_t> const pages = plain.m.store().at(id).pages;
  REQUIRE(streamed.m.store().at(id).pages == pages);
  plain.m.erase_fact(id);
  streamed.m.erase_fact(
    id, inferscale_test::stream_t{});  // a host store never reaches the CUDA runtime
  CHECK_FALSE(streamed.m.tracks(id));
  CHECK_FALSE(streamed.m.store().contains(id));
  CHECK_FALSE(streamed.m.index().contains(id));
  std::vector<unsigned char> const pool = streamed.m.store().pool_to_host();
  std::size_t const page = pool.size() / static_cast<std::size_t>(streamed.m.store().num_pages());
  for (std::int64_t p : pages) {
    for (std::size_t b = 0; b < page; ++b) {
      REQUIRE(pool[static_cast<std::size_t>(p) * page + b] == 0);
    }
  }
  CHECK(pool == plain.m.store().pool_to_host());
  CHECK(snap(streamed.m) == snap(plain.m));

  CHECK(streamed.m.erase_namespace(8, inferscale_test::stream_t{}) == plain.m.erase_namespace(8));
  CHECK(streamed.m.store().namespace_facts(8) == 0);
  CHECK(streamed.m.store().pool_to_host() == plain.m.store().pool_to_host());
  CHECK(snap(streamed.m) == snap(plain.m));
  CHECK_THROWS_WITH(streamed.m.erase_fact(id, inferscale_test::stream_t{}),
                    Catch::Contains("erase_fact"));

  // The user added again takes the zeroed pages back.
  encoding_options o;
  o.window = 3;
  for (step_fixture* f : {&plain, &streamed}) {
    f->m.add_conversation(f->model, f->embedder, 8, f->b.c, f->b.facts, f->b.texts, o);
  }
  CHECK(streamed.m.store().namespace_facts(8) == 8);
  CHECK(streamed.m.store().pool_to_host() == plain.m.store().pool_to_host());
}

TEST_CASE("memory: a compressed store is encoded through the facade and serves its facts",
          "[memory][compression]")
{
  // The facade captures each fact's K/V into host buffers and inserts them (kv_store::insert
  // quantizes host views), so a memory over a compressed store encodes, retrieves and serves as
  // one over an uncompressed store, its values within the codes' rounding of the exact ones.
  user_data const a = make_user(7, 100, 12);
  encoding_options o;
  o.window   = 3;
  o.strategy = encoding_strategy::aligned;
  branching_model model;
  word_embedder embedder;
  memory exact = make_memory();
  exact.set_instruction_prefix(model, {11, 12, 13}, 1, 0);
  exact.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o);
  host_cache want;
  memory_request const rw = exact.serve(embedder, 7, a.texts[4], 3, 5, want, model.rotation());

  for (kv_compression const c : {kv_compression::fp8_e4m3, kv_compression::int4}) {
    CAPTURE(to_string(c));
    memory_config config     = tiny_memory_config(dtype::bfloat16, 512);
    config.store.compression = c;
    memory m{config};
    REQUIRE(m.store().compression() == c);
    m.set_instruction_prefix(model, {11, 12, 13}, 1, 0);
    memory_add_report const r = m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o);
    CHECK(r.encode.facts == 11);
    CHECK(m.store().namespace_facts(7) == 11);
    // The compressed page layout (compression.hpp): per layer, K and V blocks of codes (4 tokens
    // x 1 head x 4 dims: 16 bytes of fp8, 8 of int4) and scales (4 E8M0 or bf16 key channels; 4
    // bf16 or E8M0 value tokens), each padded to 16 bytes: 2 layers x 2 blocks x 32 bytes.
    CHECK(m.store().page_bytes() == std::size_t{2 * 2 * 32});

    host_cache got;
    memory_request const rg = m.serve(embedder, 7, a.texts[4], 3, 5, got, model.rotation());
    REQUIRE(rg.fact_ids == rw.fact_ids);
    REQUIRE(rg.plan.token_ids == rw.plan.token_ids);
    REQUIRE(got.committed == want.committed);
    // V is not rotated: each element is the exact one rounded as its token's scale allows
    // (compression.hpp: scale >= amax / q_max, the code rounded to nearest, then the product
    // rounded to bfloat16).
    bool any_rounded = false;
    for (std::int64_t slot = 0; slot < rg.plan.length(); ++slot) {
      for (std::int32_t l = 0; l < 2; ++l) {
        double amax = 0;
        for (int d = 0; d < 4; ++d) {
          amax = std::max(amax, std::abs(double(want.value(l, slot, d))));
        }
        for (int d = 0; d < 4; ++d) {
          double const x = want.value(l, slot, d), y = got.value(l, slot, d);
          double const bound =
            c == kv_compression::int4
              ? amax * (1.0 / 14.0 * (1.0 + 1.0 / 128) + 1.0 / 256) * 1.001
              : std::abs(x) * (1.0 / 16 + 1.0 / 128) + amax / 448.0 * 2.0 / 1024.0 + 1e-6;
          CAPTURE(slot, l, d, x, y, bound);
          CHECK(std::abs(y - x) <= bound);
          any_rounded = any_rounded || y != x;
        }
      }
    }
    CHECK(any_rounded);  // the codes are not the exact values: the store did compress
  }
}
