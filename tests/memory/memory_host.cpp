// The memory facade (memory.hpp) against fake adapters: a model whose K/V are a function of the
// tokens a token sees (tests/common/fake_model.hpp), a bag-of-words embedder, and a contiguous
// host cache. Expected cache contents are recomputed from the fake model's formula; refusals are
// checked to leave the store and the index exactly as they were.

#include <inferscale/memory.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "fake_model.hpp"
#include "memory_fixtures.hpp"

using namespace inferscale;
using namespace inferscale_test::fake;
using namespace inferscale_test::memory_fixtures;

namespace {

memory make_memory()
{
  memory_config c;
  c.store.model       = tiny;
  c.store.store_dtype = dtype::float32;
  c.store.page_size   = 4;
  c.store.num_pages   = 512;
  c.store.space       = memory_space::host;
  c.index.dim         = 32;
  c.index.metric      = distance_metric::cosine;
  return memory{c};
}

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
        out.insert(out.end(), pool.begin() + static_cast<std::ptrdiff_t>(p * page),
                   pool.begin() + static_cast<std::ptrdiff_t>((p + 1) * page));
      }
    }
  }
  return out;
}
snapshot snap(memory const& m)
{
  return {m.store().num_facts(), m.store().free_pages(), m.index().total_size(),
          m.index().version(), live_bytes(m)};
}

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
  o.window   = 3;
  o.strategy = encoding_strategy::aligned;
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
  memory_request const r =
    m.serve(embedder, 7, a.texts[4], 2, 5, cache, model.rotation());
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
  std::int64_t slot = 3;  // after the prefix
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
  refused([&] {
    auto texts = b.texts;
    texts.pop_back();
    m.add_conversation(model, embedder, 8, b.c, b.facts, texts, o);
  }, "facts but 8 texts");
  refused([&] { m.add_conversation(model, embedder, 9, b.c, b.facts, b.texts, o); },
          "the conversation is added to namespace 9");
  refused([&] {
    auto facts       = b.facts;
    facts[2].fact_id = a.facts[0].fact_id;
    m.add_conversation(model, embedder, 8, b.c, facts, b.texts, o);
  }, "is already indexed");
  refused([&] {
    word_embedder wrong;
    wrong.dim = 16;
    m.add_conversation(model, wrong, 8, b.c, b.facts, b.texts, o);
  }, "the embedder gives 16-d vectors, the index holds 32-d");
  refused([&] {
    word_embedder nan;
    nan.nan_for = b.texts[5];
    m.add_conversation(model, nan, 8, b.c, b.facts, b.texts, o);
  }, "non-finite embedding");
  refused([&] {
    auto facts            = b.facts;
    facts[1].source_turns = std::vector<std::int64_t>{99};
    m.add_conversation(model, embedder, 8, b.c, facts, b.texts, o);
  }, "source turn 99");
  refused([&] {
    branching_model failing;  // fails on the third of its per-fact forwards
    failing.fail_at = 2;
    encoding_options per_fact = o;
    per_fact.strategy         = encoding_strategy::per_fact;
    m.add_conversation(failing, embedder, 8, b.c, b.facts, b.texts, per_fact);
  }, "fake engine failure");
  // The index refuses a zero vector after the facts were encoded: the store is restored.
  refused([&] {
    word_embedder zero;
    zero.zero_for = b.texts[3];
    m.add_conversation(model, zero, 8, b.c, b.facts, b.texts, o);
  }, "zero");

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
