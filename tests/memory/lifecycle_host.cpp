// The fact lifecycle of the memory facade (memory.hpp): update in place or under a superseding id,
// re-encoding after a conversation turn changed, directly added facts with the caller's turn map,
// erasing a fact or a namespace. The fake model's K/V depend on every token a token sees and on
// its position (tests/common/fake_model.hpp), so the expected K/V of every re-encoded fact are
// recomputed here from that formula over a context built by hand from the documented window rule;
// untouched facts are checked byte for byte, and every refusal or adapter failure is checked to
// leave the store, the index and the memory's own records exactly as they were.

#include "fake_model.hpp"
#include "memory_fixtures.hpp"

#include <inferscale/memory.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using namespace inferscale;
// graph_index's internals (raw rows, tenant segments, search plans): the detail accessor
using inferscale::detail::index::index_access;
using namespace inferscale_test::fake;
using namespace inferscale_test::memory_fixtures;

namespace {

memory make_memory(std::int64_t pages = 512, search_algo algo = search_algo::automatic)
{
  memory_config c = tiny_memory_config(dtype::float32, pages);
  c.search.algo   = algo;
  return memory{c};
}

/// The window start each strategy gives a fact at turn t (w = 3, stride 3; single_pass without a
/// budget is one segment from turn 0), written out from the documented rules.
std::int64_t window_start(encoding_strategy s, std::int64_t t)
{
  std::int64_t const w = 3;
  switch (s) {
    case encoding_strategy::per_fact:
    case encoding_strategy::shared_window: return std::max<std::int64_t>(0, t - w);
    case encoding_strategy::aligned: return std::max<std::int64_t>(0, t - w) / 3 * 3;
    case encoding_strategy::single_pass: return 0;
  }
  return -1;
}

/// Row `token` of fact `id`'s K (kv = 0) or V (kv = 1) in layer `l`, read from the fp32 pool.
std::vector<float> stored_row(
  kv_store const& store, std::uint64_t id, std::int32_t token, std::int32_t l, std::int32_t kv)
{
  fact_record const& r   = store.at(id);
  kv_store_ref const ref = store.ref();
  float const* p =
    static_cast<float const*>(ref.pool) + ref.row_offset(store.store_token(r, token), l, kv);
  return std::vector<float>(p, p + 4);
}

/// True when fact `id` holds exactly the fake model's K/V of `tokens` behind `context`, the first
/// context token at position `p0`.
bool holds_encoding(kv_store const& store,
                    std::uint64_t id,
                    std::vector<std::int32_t> context,
                    std::vector<std::int32_t> const& tokens,
                    std::int64_t p0)
{
  if (store.at(id).token_ids != tokens) { return false; }
  std::int64_t const attach = static_cast<std::int64_t>(context.size());
  for (std::size_t j = 0; j < tokens.size(); ++j) {
    context.push_back(tokens[j]);
    for (std::int32_t l = 0; l < 2; ++l) {
      float k[4], v[4];
      fake_row(context, p0 + attach + static_cast<std::int64_t>(j), l, k, v);
      if (stored_row(store, id, static_cast<std::int32_t>(j), l, 0) !=
            std::vector<float>(k, k + 4) ||
          stored_row(store, id, static_cast<std::int32_t>(j), l, 1) !=
            std::vector<float>(v, v + 4)) {
        return false;
      }
    }
  }
  return true;
}

/// The pool bytes of fact `id`'s pages, in page order.
std::vector<unsigned char> fact_bytes_of(kv_store const& store, std::uint64_t id)
{
  std::vector<unsigned char> const pool = store.pool_to_host();
  std::size_t const page                = pool.size() / static_cast<std::size_t>(store.num_pages());
  std::vector<unsigned char> out;
  for (std::int64_t p : store.at(id).pages) {
    out.insert(out.end(),
               pool.begin() + static_cast<std::ptrdiff_t>(p * page),
               pool.begin() + static_cast<std::ptrdiff_t>((p + 1) * page));
  }
  return out;
}

/// Everything observable about a memory over namespaces `nss`: the store's catalogue (ids,
/// namespaces, tokens, pages) and live bytes, its accounting, the index's version and sizes and
/// ids, and the memory's lifecycle records and kept conversations.
struct snapshot {
  std::map<std::uint64_t, fact_record> catalogue;
  std::map<std::uint64_t, std::vector<unsigned char>> bytes;
  std::int64_t free_pages{};
  std::vector<std::int64_t> ns_accounting;
  std::uint64_t index_version{};
  std::uint64_t index_total{};
  std::vector<std::vector<std::uint64_t>> index_ids;
  std::vector<std::string> records;
  std::vector<std::vector<std::int32_t>> kept_turns;

  bool operator==(snapshot const& o) const
  {
    auto same_record = [](fact_record const& a, fact_record const& b) {
      return a.fact_id == b.fact_id && a.namespace_id == b.namespace_id &&
             a.token_ids == b.token_ids && a.pages == b.pages;
    };
    if (catalogue.size() != o.catalogue.size()) { return false; }
    for (auto const& [id, r] : catalogue) {
      auto it = o.catalogue.find(id);
      if (it == o.catalogue.end() || !same_record(r, it->second)) { return false; }
    }
    return bytes == o.bytes && free_pages == o.free_pages && ns_accounting == o.ns_accounting &&
           index_version == o.index_version && index_total == o.index_total &&
           index_ids == o.index_ids && records == o.records && kept_turns == o.kept_turns;
  }
};

std::string describe(fact_state const& s)
{
  std::ostringstream o;
  o << s.fact_id << " ns " << s.namespace_id << " conv " << s.conversation.value_or(0) << " ["
    << s.first_turn << "," << s.source_turn << ") turns";
  for (auto t : s.turns) {
    o << ' ' << t;
  }
  o << " sup " << s.supersedes.value_or(0) << " by " << s.superseded_by.value_or(0);
  return o.str();
}

snapshot snap(memory const& m, std::vector<std::uint64_t> const& nss)
{
  snapshot s;
  s.free_pages    = m.store().free_pages();
  s.index_version = m.index().version();
  s.index_total   = m.index().total_size();
  for (std::uint64_t ns : nss) {
    for (std::uint64_t id : m.store().namespace_fact_ids(ns)) {
      s.catalogue[id] = m.store().at(id);
      s.bytes[id]     = fact_bytes_of(m.store(), id);
      if (m.tracks(id)) { s.records.push_back(describe(m.fact(id))); }
    }
    s.ns_accounting.push_back(m.store().namespace_facts(ns));
    s.ns_accounting.push_back(m.store().namespace_bytes(ns));
    s.ns_accounting.push_back(m.store().namespace_pages(ns));
    std::vector<std::uint64_t> ids = m.index().ids(ns);
    std::sort(ids.begin(), ids.end());
    s.index_ids.push_back(ids);
    for (std::uint64_t h : m.conversations(ns)) {
      for (auto const& t : m.conversation_of(h).turns) {
        s.kept_turns.push_back(t.token_ids);
      }
    }
  }
  std::sort(s.records.begin(), s.records.end());
  return s;
}

encoding_options options_for(encoding_strategy s)
{
  encoding_options o;
  o.window         = 3;
  o.stride         = 3;
  o.strategy       = s;
  o.first_position = 3;
  return o;
}

/// Bytes of K and V of a fact of `c` tokens in the tiny fp32 store: 2 * L * c * h * d * 4.
std::int64_t kv_bytes(std::int64_t c) { return 2 * 2 * c * 1 * 4 * 4; }

}  // namespace

TEST_CASE("lifecycle: a fact updated in place is re-encoded behind its window and re-embedded",
          "[memory][lifecycle]")
{
  encoding_strategy const strategy = GENERATE(encoding_strategy::per_fact,
                                              encoding_strategy::shared_window,
                                              encoding_strategy::aligned,
                                              encoding_strategy::single_pass);
  CAPTURE(to_string(strategy));
  memory m = make_memory();
  branching_model model;
  word_embedder embedder;
  user_data const a             = make_user(7, 100, 12);
  encoding_options const o      = options_for(strategy);
  memory_add_report const added = m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o);
  REQUIRE(added.conversation != 0);
  CHECK(m.conversations(7) == std::vector<std::uint64_t>{added.conversation});

  // Every planned fact's recorded window is the documented one, and its K/V are what the fake
  // model gives behind it.
  for (conversation_fact const& f : a.facts) {
    std::int64_t const t = f.source_turns[0];
    fact_state const s   = m.fact(f.fact_id);
    CHECK(s.conversation == std::optional<std::uint64_t>{added.conversation});
    CHECK(s.first_turn == window_start(strategy, t));
    CHECK(s.source_turn == t);
    CHECK(static_cast<std::int64_t>(s.turns.size()) == t - s.first_turn);
    CHECK(
      holds_encoding(m.store(), f.fact_id, window_tokens(a.c, s.first_turn, t), f.token_ids, 3));
  }

  std::uint64_t const id = 106;  // the fact of turn 6
  std::map<std::uint64_t, std::vector<unsigned char>> others;
  for (conversation_fact const& f : a.facts) {
    if (f.fact_id != id) { others[f.fact_id] = fact_bytes_of(m.store(), f.fact_id); }
  }
  std::int64_t const free_before  = m.store().free_pages();
  std::int64_t const bytes_before = m.store().namespace_bytes(7);

  // Five tokens instead of three: two pages instead of one, in place.
  fact_update u;
  u.fact_id                = id;
  u.new_id                 = id;
  u.token_ids              = std::vector<std::int32_t>{8101, 8102, 8103, 8104, 8105};
  u.text                   = "moved to lisbon in spring";
  lifecycle_report const r = m.update_fact(model, embedder, u);
  CHECK(r.reencoded == std::vector<std::uint64_t>{id});
  CHECK(r.embedded == 1);
  CHECK(r.encode.facts == 1);

  CHECK(holds_encoding(
    m.store(), id, window_tokens(a.c, window_start(strategy, 6), 6), u.token_ids, 3));
  for (auto const& [other, bytes] : others) {
    CHECK(fact_bytes_of(m.store(), other) == bytes);
  }
  CHECK(m.store().namespace_facts(7) == 11);
  CHECK(m.store().namespace_bytes(7) == bytes_before + kv_bytes(5) - kv_bytes(3));
  CHECK(m.store().free_pages() == free_before - 1);
  CHECK(m.index().size(7) == 11);
  CHECK(m.index().contains(id));
  CHECK(m.retrieve(embedder, 7, u.text, 1) == std::vector<std::uint64_t>{id});
  fact_state const s = m.fact(id);
  CHECK(s.retrievable());
  CHECK_FALSE(s.supersedes.has_value());
  CHECK(s.first_turn == window_start(strategy, 6));

  // Back to one page: the page it no longer needs is returned and zeroed.
  std::vector<std::int64_t> const two_pages = m.store().at(id).pages;
  REQUIRE(two_pages.size() == 2);
  u.token_ids = std::vector<std::int32_t>{8201, 8202};
  u.text      = "moved to porto";
  m.update_fact(model, embedder, u);
  CHECK(m.store().free_pages() == free_before);
  CHECK(m.store().at(id).pages == std::vector<std::int64_t>{two_pages[0]});
  std::vector<unsigned char> const pool = m.store().pool_to_host();
  std::size_t const page = pool.size() / static_cast<std::size_t>(m.store().num_pages());
  CHECK(std::all_of(pool.begin() + static_cast<std::ptrdiff_t>(two_pages[1] * page),
                    pool.begin() + static_cast<std::ptrdiff_t>((two_pages[1] + 1) * page),
                    [](unsigned char b) { return b == 0; }));
  CHECK(holds_encoding(
    m.store(), id, window_tokens(a.c, window_start(strategy, 6), 6), u.token_ids, 3));
}

TEST_CASE("lifecycle: a superseding id keeps the old fact for audit until it is erased",
          "[memory][lifecycle]")
{
  memory m = make_memory(512, search_algo::graph);
  plain_model model;  // one forward per fact
  word_embedder embedder;
  user_data const a        = make_user(7, 100, 12);
  encoding_options const o = options_for(encoding_strategy::per_fact);
  std::uint64_t const conv =
    m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o).conversation;
  m.set_instruction_prefix(model, {11, 12}, 1, 0);

  std::uint64_t const old_id                 = 104;
  std::vector<unsigned char> const old_bytes = fact_bytes_of(m.store(), old_id);
  fact_record const old_record               = m.store().at(old_id);
  std::int64_t const free_before             = m.store().free_pages();

  // The new version comes from turn 9: its window is [6, 9) (w = 3), not the old fact's [1, 4).
  fact_update u;
  u.fact_id      = old_id;
  u.new_id       = 500;
  u.token_ids    = std::vector<std::int32_t>{8301, 8302, 8303, 8304};
  u.text         = "now works as a pilot";
  u.source_turns = std::vector<std::int64_t>{9, 10};
  m.update_fact(model, embedder, u);

  CHECK(holds_encoding(m.store(), 500, window_tokens(a.c, 6, 9), u.token_ids, 3));
  CHECK(m.store().contains(old_id));
  CHECK(fact_bytes_of(m.store(), old_id) == old_bytes);
  CHECK(m.store().at(old_id).token_ids == old_record.token_ids);
  CHECK(m.store().free_pages() == free_before - 1);
  CHECK_FALSE(m.index().contains(old_id));
  CHECK(m.index().contains(500));
  CHECK(m.index().size(7) == 11);
  fact_state const olds = m.fact(old_id);
  fact_state const news = m.fact(500);
  CHECK(olds.superseded_by == std::optional<std::uint64_t>{500});
  CHECK_FALSE(olds.retrievable());
  CHECK(news.supersedes == std::optional<std::uint64_t>{old_id});
  CHECK(news.retrievable());
  CHECK(news.conversation == std::optional<std::uint64_t>{conv});
  CHECK(news.first_turn == 6);
  CHECK(news.source_turn == 9);

  // Never retrieved, whatever the query and however large k; refused by prepare and update.
  for (std::string const& q : {a.texts[3], u.text, std::string{"anything at all"}}) {
    std::vector<std::uint64_t> const got = m.retrieve(embedder, 7, q, 100);
    CHECK(got.size() == 11);
    CHECK(std::find(got.begin(), got.end(), old_id) == got.end());
  }
  CHECK(m.retrieve(embedder, 7, u.text, 1) == std::vector<std::uint64_t>{500});
  CHECK_THROWS_WITH(m.prepare({103, old_id}, 0), Catch::Contains("superseded by fact 500"));
  fact_update again = u;
  again.new_id      = 501;
  CHECK_THROWS_WITH(m.update_fact(model, embedder, again),
                    Catch::Contains("is superseded by fact 500"));

  // A turn both versions' windows hold is re-encoded into the current version only: the audit
  // record keeps its bytes. Turn 2 is in [1, 4) (old) and not in [6, 9) (new): nothing changes.
  std::vector<std::uint64_t> seen = m.facts_seeing_turn(conv, 2);
  CHECK(std::find(seen.begin(), seen.end(), old_id) == seen.end());
  CHECK(std::find(seen.begin(), seen.end(), std::uint64_t{500}) == seen.end());
  m.update_turns(model, conv, {{2, {4001, 4002, 4003}}});
  CHECK(fact_bytes_of(m.store(), old_id) == old_bytes);
  seen = m.facts_seeing_turn(conv, 7);
  CHECK(std::find(seen.begin(), seen.end(), std::uint64_t{500}) != seen.end());

  // Erasing the audit record: store pages back, accounting by the formula, links kept as history.
  std::int64_t const ns_bytes = m.store().namespace_bytes(7);
  std::int64_t const free_now = m.store().free_pages();
  m.erase_fact(old_id);
  CHECK_FALSE(m.store().contains(old_id));
  CHECK_FALSE(m.tracks(old_id));
  CHECK(m.store().namespace_bytes(7) == ns_bytes - kv_bytes(3));
  CHECK(m.store().free_pages() == free_now + 1);
  CHECK(m.index().size(7) == 11);
  CHECK(m.fact(500).supersedes == std::optional<std::uint64_t>{old_id});
  CHECK_THROWS_WITH(m.erase_fact(old_id), Catch::Contains("is not a fact of this memory"));
  CHECK_THROWS_WITH(m.erase_fact(1), Catch::Contains("instruction prefix"));
}

TEST_CASE("lifecycle: a changed turn re-encodes exactly the facts whose window held it",
          "[memory][lifecycle]")
{
  encoding_strategy const strategy = GENERATE(encoding_strategy::per_fact,
                                              encoding_strategy::shared_window,
                                              encoding_strategy::aligned,
                                              encoding_strategy::single_pass);
  bool const branching             = GENERATE(false, true);
  std::int64_t const new_length    = GENERATE(3, 5);  // same length, or later positions move
  CAPTURE(to_string(strategy), branching, new_length);

  memory m = make_memory();
  plain_model plain;
  branching_model branched;
  word_embedder embedder;
  user_data a = make_user(7, 100, 12);
  // A second fact at turn 6, and one with two source turns (anchored at 8).
  a.facts.push_back({150, 7, {5150, 6150}, {6}});
  a.texts.push_back("second fact of turn six");
  a.facts.push_back({151, 7, {5151, 6151, 7151}, {9, 8}});
  a.texts.push_back("fact from turns eight and nine");
  user_data const b        = make_user(8, 200, 9);  // another user, untouched throughout
  encoding_options const o = options_for(strategy);
  auto add                 = [&](user_data const& d, std::uint64_t ns) {
    return branching ? m.add_conversation(branched, embedder, ns, d.c, d.facts, d.texts, o)
                                     : m.add_conversation(plain, embedder, ns, d.c, d.facts, d.texts, o);
  };
  std::uint64_t const conv = add(a, 7).conversation;
  add(b, 8);

  std::int64_t const changed = 5;
  std::map<std::uint64_t, std::int64_t> anchor;
  for (conversation_fact const& f : a.facts) {
    anchor[f.fact_id] = *std::min_element(f.source_turns.begin(), f.source_turns.end());
  }
  std::set<std::uint64_t> expected;
  for (auto const& [id, t] : anchor) {
    if (window_start(strategy, t) <= changed && changed < t) { expected.insert(id); }
  }
  std::vector<std::uint64_t> const seeing = m.facts_seeing_turn(conv, changed);
  CHECK(std::set<std::uint64_t>(seeing.begin(), seeing.end()) == expected);
  REQUIRE_FALSE(expected.empty());

  std::map<std::uint64_t, std::vector<unsigned char>> before;
  std::map<std::uint64_t, std::vector<std::int64_t>> pages_before;
  for (std::uint64_t ns : {7, 8}) {
    for (std::uint64_t id : m.store().namespace_fact_ids(ns)) {
      before[id]       = fact_bytes_of(m.store(), id);
      pages_before[id] = m.store().at(id).pages;
    }
  }
  std::uint64_t const index_version = m.index().version();
  std::int64_t const free_before    = m.store().free_pages();

  std::vector<std::int32_t> tokens;
  for (std::int64_t j = 0; j < new_length; ++j) {
    tokens.push_back(static_cast<std::int32_t>(3000 + 7 * j));
  }
  lifecycle_report const r = branching ? m.update_turns(branched, conv, {{changed, tokens}})
                                       : m.update_turns(plain, conv, {{changed, tokens}});
  CHECK(std::set<std::uint64_t>(r.reencoded.begin(), r.reencoded.end()) == expected);
  CHECK(r.reencoded.size() == expected.size());
  CHECK(r.encode.facts == static_cast<std::int64_t>(expected.size()));
  CHECK(r.encode.branched == branching);
  CHECK(r.embedded == 0);

  conversation updated             = a.c;
  updated.turns[changed].token_ids = tokens;
  CHECK(m.conversation_of(conv).turns[changed].token_ids == tokens);
  CHECK(m.index().version() == index_version);  // texts unchanged: the index is not touched
  CHECK(m.store().free_pages() == free_before);

  // Re-encoded facts hold the fake model's K/V behind their window of the updated conversation;
  // every other fact (the other user's too) keeps its bytes and its pages.
  for (auto const& [id, bytes] : before) {
    CAPTURE(id);
    CHECK(m.store().at(id).pages == pages_before[id]);
    if (expected.count(id)) {
      std::int64_t const t = anchor[id];
      CHECK(holds_encoding(m.store(),
                           id,
                           window_tokens(updated, window_start(strategy, t), t),
                           m.store().at(id).token_ids,
                           3));
      CHECK(fact_bytes_of(m.store(), id) != bytes);
    } else {
      CHECK(fact_bytes_of(m.store(), id) == bytes);
    }
  }

  // And they equal a fresh encoding of the whole updated conversation (a new memory).
  memory fresh = make_memory();
  if (branching) {
    fresh.add_conversation(branched, embedder, 7, updated, a.facts, a.texts, o);
  } else {
    fresh.add_conversation(plain, embedder, 7, updated, a.facts, a.texts, o);
  }
  for (conversation_fact const& f : a.facts) {
    CAPTURE(f.fact_id);
    CHECK(fact_bytes_of(m.store(), f.fact_id) == fact_bytes_of(fresh.store(), f.fact_id));
  }
}

TEST_CASE("lifecycle: single_pass segments keep their windows when a turn changes",
          "[memory][lifecycle]")
{
  // With a budget the pass is cut into segments: a later fact of a segment sees every turn since
  // the segment's start. The re-encoded set follows the windows the plan recorded.
  memory m = make_memory();
  branching_model model;
  word_embedder embedder;
  user_data const a     = make_user(7, 100, 16);
  encoding_options o    = options_for(encoding_strategy::single_pass);
  o.max_sequence_tokens = 24;
  std::uint64_t const conv =
    m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o).conversation;
  encoding_plan const plan = plan_encoding(a.c, a.facts, o);
  REQUIRE(plan.jobs.size() > 2);
  std::map<std::uint64_t, std::int64_t> first;
  for (encoding_job const& job : plan.jobs) {
    for (encoding_branch const& br : job.branches) {
      first[br.fact_id] = br.first_turn;
      CHECK(m.fact(br.fact_id).first_turn == br.first_turn);
    }
  }
  conversation updated = a.c;  // the test's own copy of the conversation as it changes
  for (std::int64_t changed = 0; changed < 16; ++changed) {
    CAPTURE(changed);
    std::set<std::uint64_t> expected;
    for (auto const& [id, f] : first) {
      std::int64_t const t = static_cast<std::int64_t>(id - 100);
      if (f <= changed && changed < t) { expected.insert(id); }
    }
    std::map<std::uint64_t, std::vector<unsigned char>> before;
    for (auto const& [id, f] : first) {
      before[id] = fact_bytes_of(m.store(), id);
    }
    std::vector<std::int32_t> const tokens{static_cast<std::int32_t>(2000 + changed), 2500, 2600};
    lifecycle_report const r = m.update_turns(model, conv, {{changed, tokens}});
    updated.turns[static_cast<std::size_t>(changed)].token_ids = tokens;
    CHECK(m.conversation_of(conv).turns[static_cast<std::size_t>(changed)].token_ids == tokens);
    CHECK(std::set<std::uint64_t>(r.reencoded.begin(), r.reencoded.end()) == expected);
    for (auto const& [id, f] : first) {
      std::int64_t const t = static_cast<std::int64_t>(id - 100);
      if (expected.count(id)) {
        CHECK(holds_encoding(
          m.store(), id, window_tokens(updated, f, t), m.store().at(id).token_ids, 3));
      } else {
        CHECK(fact_bytes_of(m.store(), id) == before[id]);
      }
    }
  }
  // Two turns at once: the union of their facts, each encoded once.
  lifecycle_report const r = m.update_turns(model, conv, {{3, {1, 1, 1}}, {12, {2, 2, 2}}});
  std::set<std::uint64_t> expected;
  for (auto const& [id, f] : first) {
    std::int64_t const t = static_cast<std::int64_t>(id - 100);
    if ((f <= 3 && 3 < t) || (f <= 12 && 12 < t)) { expected.insert(id); }
  }
  CHECK(std::set<std::uint64_t>(r.reencoded.begin(), r.reencoded.end()) == expected);
  CHECK(r.reencoded.size() == expected.size());
}

TEST_CASE("lifecycle: directly added facts follow the caller's turn map", "[memory][lifecycle]")
{
  memory m = make_memory();
  branching_model model;
  word_embedder embedder;
  // The caller's own sequences: fact 1 sees turns 0 and 1, fact 2 sees turn 1, fact 3 nothing.
  std::vector<direct_fact> const facts = {
    {31, {1, 2, 101, 102, 111, 112}, {5001, 5002}, 4, {0, 1}},
    {32, {1, 2, 111, 112}, {5003, 5004, 5005, 5006, 5007}, 0, {1}},
    {33, {}, {5008}, 9, {}},
  };
  std::vector<std::string> const texts = {"likes green tea", "has a cat named tom", "born in 1990"};
  memory_add_report const added        = m.add_facts(model, embedder, 5, facts, texts);
  CHECK(added.conversation == 0);
  CHECK(added.embedded == 3);
  for (direct_fact const& f : facts) {
    CHECK(holds_encoding(m.store(), f.fact_id, f.context, f.token_ids, f.first_position));
    fact_state const s = m.fact(f.fact_id);
    CHECK_FALSE(s.conversation.has_value());
    CHECK(s.turns == f.turns);
  }
  CHECK(m.index().size(5) == 3);
  CHECK(m.retrieve(embedder, 5, texts[1], 1) == std::vector<std::uint64_t>{32});
  CHECK(m.direct_facts_seeing_turn(5, 1) == std::vector<std::uint64_t>{31, 32});
  CHECK(m.direct_facts_seeing_turn(5, 0) == std::vector<std::uint64_t>{31});
  CHECK(m.direct_facts_seeing_turn(5, 2).empty());
  CHECK(m.direct_facts_seeing_turn(6, 1).empty());
  // A conversation without facts has nothing to re-encode: nothing is kept for it.
  user_data const empty = make_user(5, 700, 4);
  CHECK(m.add_conversation(model, embedder, 5, empty.c, {}, {}).conversation == 0);
  CHECK(m.conversations(5).empty());

  // Turn 1 changed in the caller's conversation: the two facts that saw it get new contexts.
  std::vector<unsigned char> const third = fact_bytes_of(m.store(), 33);
  std::uint64_t const version            = m.index().version();
  lifecycle_report const r =
    m.reencode_facts(model,
                     {{31, {1, 2, 101, 102, 121, 122, 123}, 4, std::nullopt},
                      {32, {1, 2, 121, 122, 123}, 0, std::vector<std::int64_t>{1}}});
  CHECK(r.reencoded == std::vector<std::uint64_t>{31, 32});
  CHECK(holds_encoding(m.store(), 31, {1, 2, 101, 102, 121, 122, 123}, facts[0].token_ids, 4));
  CHECK(holds_encoding(m.store(), 32, {1, 2, 121, 122, 123}, facts[1].token_ids, 0));
  CHECK(fact_bytes_of(m.store(), 33) == third);
  CHECK(m.index().version() == version);
  CHECK(m.fact(31).turns == std::vector<std::int64_t>{0, 1});

  // A new version of a direct fact behind its kept context; and one behind a new context.
  fact_update u;
  u.fact_id   = 32;
  u.new_id    = 32;
  u.token_ids = std::vector<std::int32_t>{5100, 5101};
  u.text      = "has two cats";
  m.update_fact(model, embedder, u);
  CHECK(holds_encoding(m.store(), 32, {1, 2, 121, 122, 123}, u.token_ids, 0));
  u.fact_id = 33;
  u.new_id  = 34;
  u.text    = "born in 1991";
  u.context = std::vector<std::int32_t>{7, 8};
  u.turns   = std::vector<std::int64_t>{4};
  m.update_fact(model, embedder, u);
  CHECK(holds_encoding(m.store(), 34, {7, 8}, u.token_ids, 9));
  CHECK(m.fact(34).turns == std::vector<std::int64_t>{4});
  CHECK(m.fact(33).superseded_by == std::optional<std::uint64_t>{34});
  CHECK(m.direct_facts_seeing_turn(5, 4) == std::vector<std::uint64_t>{34});
}

TEST_CASE("lifecycle: erasing a fact or a namespace leaves nothing behind", "[memory][lifecycle]")
{
  search_algo const algo = GENERATE(search_algo::graph, search_algo::exact);
  CAPTURE(static_cast<int>(algo));
  memory m = make_memory(512, algo);
  branching_model model;
  word_embedder embedder;
  user_data const keep = make_user(8, 200, 9);
  m.add_conversation(
    model, embedder, 8, keep.c, keep.facts, keep.texts, options_for(encoding_strategy::aligned));
  std::vector<std::uint64_t> keep_ids;
  for (auto const& f : keep.facts) {
    keep_ids.push_back(f.fact_id);
  }
  std::sort(keep_ids.begin(), keep_ids.end());

  // Before namespace 9 exists.
  std::vector<unsigned char> const pool0 = m.store().pool_to_host();
  std::int64_t const free0               = m.store().free_pages();
  std::uint64_t const total0             = m.index().total_size();
  snapshot const keep0                   = snap(m, {8});

  user_data const gone     = make_user(9, 300, 14);
  std::uint64_t const conv = m.add_conversation(model,
                                                embedder,
                                                9,
                                                gone.c,
                                                gone.facts,
                                                gone.texts,
                                                options_for(encoding_strategy::single_pass))
                               .conversation;
  m.add_facts(
    model, embedder, 9, {{390, {1, 2, 3}, {4, 5, 6, 7, 8, 9}, 0, {0}}}, {"a direct fact"});
  fact_update u;
  u.fact_id   = 305;
  u.new_id    = 305;
  u.token_ids = std::vector<std::int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9};
  u.text      = "grew to three pages";
  m.update_fact(model, embedder, u);
  u.fact_id = 306;
  u.new_id  = 391;
  u.text    = "superseding six";
  m.update_fact(model, embedder, u);  // 306 stays as an audit record
  CHECK(m.store().namespace_facts(9) == 15);

  // One fact: its pages come back (zeroed), its bytes leave the accounting, the index forgets it.
  std::vector<std::int64_t> const pages = m.store().at(307).pages;
  std::int64_t const free1              = m.store().free_pages();
  std::int64_t const bytes1             = m.store().namespace_bytes(9);
  std::int64_t const pages1             = m.store().namespace_pages(9);
  std::uint32_t const size1             = m.index().size(9);
  m.erase_fact(307);
  CHECK(m.store().free_pages() == free1 + static_cast<std::int64_t>(pages.size()));
  CHECK(m.store().namespace_bytes(9) == bytes1 - kv_bytes(3));
  CHECK(m.store().namespace_pages(9) == pages1 - 1);
  CHECK(m.index().size(9) == size1 - 1);
  CHECK_FALSE(m.index().contains(307));
  {
    std::vector<unsigned char> const pool = m.store().pool_to_host();
    std::size_t const page = pool.size() / static_cast<std::size_t>(m.store().num_pages());
    CHECK(std::all_of(pool.begin() + static_cast<std::ptrdiff_t>(pages[0] * page),
                      pool.begin() + static_cast<std::ptrdiff_t>((pages[0] + 1) * page),
                      [](unsigned char x) { return x == 0; }));
  }
  for (std::string const& q : {gone.texts[6], gone.texts[5], u.text}) {
    std::vector<std::uint64_t> const got = m.retrieve(embedder, 9, q, 1000);
    CHECK(got.size() == size1 - 1);
    for (std::uint64_t bad : {std::uint64_t{307}, std::uint64_t{306}}) {
      CHECK(std::find(got.begin(), got.end(), bad) == got.end());
    }
  }
  CHECK(m.facts_seeing_turn(conv, 5).size() > 0);

  // The whole namespace: every byte and count back to what it was before namespace 9.
  CHECK(m.erase_namespace(9) == 14);
  CHECK(m.store().pool_to_host() == pool0);
  CHECK(m.store().free_pages() == free0);
  CHECK(m.store().namespace_facts(9) == 0);
  CHECK(m.store().namespace_bytes(9) == 0);
  CHECK(m.store().namespace_pages(9) == 0);
  CHECK(m.index().total_size() == total0);
  CHECK(m.index().size(9) == 0);
  CHECK_FALSE(m.index().has_namespace(9));
  CHECK(m.conversations(9).empty());
  CHECK_THROWS_WITH(m.conversation_of(conv), Catch::Contains("no conversation"));
  for (std::uint64_t id : {301, 305, 306, 313, 390, 391}) {
    CHECK_FALSE(m.tracks(static_cast<std::uint64_t>(id)));
    CHECK_FALSE(m.store().contains(static_cast<std::uint64_t>(id)));
  }
  CHECK_THROWS(m.retrieve(embedder, 9, gone.texts[0], 5));  // the namespace is gone
  snapshot keep1      = snap(m, {8});
  keep1.index_version = keep0.index_version;  // the index's version moved on, namespace 8 did not
  CHECK(keep1 == keep0);
  for (std::string const& q : {gone.texts[2], keep.texts[1]}) {
    std::vector<std::uint64_t> got = m.retrieve(embedder, 8, q, 1000);
    std::sort(got.begin(), got.end());
    CHECK(got == keep_ids);
  }

  // compact_index: the index holds no row of the erased facts at all.
  CHECK(index_access::arena_rows_in_use(m.index()) > static_cast<std::int64_t>(total0));
  m.compact_index();
  CHECK(index_access::arena_rows_in_use(m.index()) == static_cast<std::int64_t>(total0));
  std::vector<std::uint64_t> rows(index_access::id_rows(m.index(), 8),
                                  index_access::id_rows(m.index(), 8) + m.index().rows(8));
  std::sort(rows.begin(), rows.end());
  CHECK(rows == keep_ids);
  std::vector<std::uint64_t> got = m.retrieve(embedder, 8, keep.texts[3], 1000);
  std::sort(got.begin(), got.end());
  CHECK(got == keep_ids);
}

TEST_CASE("lifecycle: every operation is all or nothing", "[memory][lifecycle]")
{
  memory m = make_memory(96);
  plain_model model;
  branching_model branched;
  word_embedder embedder;
  user_data const a     = make_user(7, 100, 12);
  encoding_options o    = options_for(encoding_strategy::per_fact);
  o.max_sequence_tokens = 40;
  std::uint64_t const conv =
    m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o).conversation;
  m.add_facts(model,
              embedder,
              7,
              {{60, {1, 2}, {5, 6}, 0, {3}}, {61, {1, 2, 9}, {5, 7}, 0, {3}}},
              {"direct one", "direct two"});
  m.set_instruction_prefix(model, {11, 12}, 1, 0);
  fact_update sup;
  sup.fact_id   = 102;
  sup.new_id    = 400;
  sup.token_ids = std::vector<std::int32_t>{1, 2};
  sup.text      = "an audit record exists";
  m.update_fact(model, embedder, sup);  // 102 becomes an audit record
  snapshot const before = snap(m, {0, 7});

  auto refused = [&](auto&& call, char const* what) {
    CHECK_THROWS_WITH(call(), Catch::Contains(what));
    CHECK(snap(m, {0, 7}) == before);
  };
  fact_update u;
  u.fact_id   = 105;
  u.new_id    = 105;
  u.token_ids = std::vector<std::int32_t>{8001, 8002, 8003, 8004, 8005};
  u.text      = "a new version";
  auto with   = [&](auto change) {
    fact_update v = u;
    change(v);
    return v;
  };

  SECTION("update_fact")
  {
    for (std::uint64_t new_id : {std::uint64_t{105}, std::uint64_t{450}}) {
      CAPTURE(new_id);
      fact_update const v = with([&](fact_update& x) { x.new_id = new_id; });
      refused(
        [&] {
          plain_model failing;
          failing.fail_at = 0;
          m.update_fact(failing, embedder, v);
        },
        "fake engine failure");
      refused(
        [&] {
          branching_model failing;
          failing.fail_at = 0;
          m.update_fact(failing, embedder, v);
        },
        "fake engine failure");
      refused(
        [&] {
          word_embedder e;
          e.throw_for = v.text;
          m.update_fact(model, e, v);
        },
        "fake embedder failure");
      refused(
        [&] {
          word_embedder e;
          e.nan_for = v.text;
          m.update_fact(model, e, v);
        },
        "non-finite embedding");
      refused(
        [&] {  // the index's rule: a zero vector has no cosine
          word_embedder e;
          e.zero_for = v.text;
          m.update_fact(model, e, v);
        },
        "is zero, which has no cosine");
      refused(
        [&] {
          word_embedder e;
          e.dim = 16;
          m.update_fact(model, e, v);
        },
        "the embedder gives 16-d vectors, the index holds 32-d");
      refused(
        [&] {
          m.update_fact(model, embedder, with([&](fact_update& x) {
                          x.new_id = new_id;
                          x.token_ids.clear();
                        }));
        },
        "has no tokens");
      refused(
        [&] {
          m.update_fact(model, embedder, with([&](fact_update& x) {
                          x.new_id       = new_id;
                          x.source_turns = std::vector<std::int64_t>{12};
                        }));
        },
        "source turn 12 is not one of the 12 turns");
      refused(
        [&] {  // a window of 3 turns (9 + 2 header + 2 lead) and 30 tokens > 40
          m.update_fact(model, embedder, with([&](fact_update& x) {
                          x.new_id    = new_id;
                          x.token_ids = std::vector<std::int32_t>(30, 4242);
                        }));
        },
        "more than max_sequence_tokens = 40");
      refused(
        [&] {
          m.update_fact(model, embedder, with([&](fact_update& x) {
                          x.new_id  = new_id;
                          x.context = std::vector<std::int32_t>{1};
                        }));
        },
        "its window comes from there");
    }
    refused(
      [&] {
        m.update_fact(model, embedder, with([](fact_update& x) {
                        x.fact_id = 999;
                        x.new_id  = 999;
                      }));
      },
      "fact 999 is not a fact of this memory");
    refused(
      [&] {
        m.update_fact(model, embedder, with([](fact_update& x) {
                        x.fact_id = 1;
                        x.new_id  = 1;
                      }));
      },
      "(it is the instruction prefix)");
    refused(
      [&] {
        m.update_fact(model, embedder, with([](fact_update& x) {
                        x.fact_id = 102;
                        x.new_id  = 102;
                      }));
      },
      "is superseded by fact 400");
    refused([&] { m.update_fact(model, embedder, with([](fact_update& x) { x.new_id = 102; })); },
            "fact id 102 is already taken");
    refused([&] { m.update_fact(model, embedder, with([](fact_update& x) { x.new_id = 106; })); },
            "fact id 106 is already taken");
    refused([&] { m.update_fact(model, embedder, with([](fact_update& x) { x.new_id = 1; })); },
            "is the instruction prefix");
    refused(
      [&] {
        m.update_fact(model, embedder, with([](fact_update& x) {
                        x.fact_id      = 60;
                        x.new_id       = 60;
                        x.source_turns = {1};
                      }));
      },
      "was added directly");
    refused(
      [&] {  // more pages than are free
        m.update_fact(model, embedder, with([&](fact_update& x) {
                        x.new_id    = 451;
                        x.fact_id   = 60;
                        x.token_ids = std::vector<std::int32_t>(
                          4 * static_cast<std::size_t>(m.store().free_pages()) + 1, 3);
                      }));
      },
      "capacity exhausted");
    refused(
      [&] {
        struct other_model : plain_model {
          kv_geometry geometry() const { return kv_geometry{3, 1, 4}; }
        } wrong;
        m.update_fact(wrong, embedder, u);
      },
      "the model's KV geometry differs from the store's");
  }

  SECTION("update_turns")
  {
    refused(
      [&] {  // part-way: the third fact's forward fails after two were captured
        plain_model failing;
        failing.fail_at = 2;
        m.update_turns(failing, conv, {{4, {1, 2, 3}}});
      },
      "fake engine failure");
    refused(
      [&] {
        branching_model failing;
        failing.fail_at = 1;
        m.update_turns(failing, conv, {{4, {1, 2, 3}}});
      },
      "fake engine failure");
    refused([&] { m.update_turns(model, conv + 1, {{4, {1, 2, 3}}}); }, "no conversation");
    refused(
      [&] {
        m.update_turns(model, conv, {{12, {1}}});
      },
      "turn 12 is not one of the conversation's 12 turns");
    refused([&] { m.update_turns(model, conv, {{-1, {1}}}); }, "turn -1 is not one of");
    refused([&] { m.update_turns(model, conv, {{4, {1}}, {4, {2}}}); }, "turn 4 changes twice");
    refused([&] { m.update_turns(model, conv, {{4, {}}}); }, "turn 4 would have no tokens");
    refused(
      [&] {  // the longer turn no longer fits the windows of the facts after it
        m.update_turns(model, conv, {{4, std::vector<std::int32_t>(30, 77)}});
      },
      "more than max_sequence_tokens = 40");
  }

  SECTION("reencode_facts, add_facts, erase")
  {
    refused(
      [&] {  // part-way: the second fact's forward fails
        plain_model failing;
        failing.fail_at = 1;
        m.reencode_facts(failing, {{60, {9, 9}, 0, std::nullopt}, {61, {8, 8}, 0, std::nullopt}});
      },
      "fake engine failure");
    refused(
      [&] {
        m.reencode_facts(model, {{60, {9}, 0, std::nullopt}, {60, {8}, 0, std::nullopt}});
      },
      "fact 60 appears twice");
    refused(
      [&] {
        m.reencode_facts(model, {{60, {9}, 0, std::nullopt}, {103, {8}, 0, std::nullopt}});
      },
      "change its turns with update_turns()");
    refused([&] { m.reencode_facts(model, {{60, {9}, -2, std::nullopt}}); }, "is negative");
    refused(
      [&] {
        plain_model failing;
        failing.fail_at = 1;
        m.add_facts(
          failing, embedder, 7, {{70, {1}, {2}, 0, {}}, {71, {1}, {3}, 0, {}}}, {"x one", "x two"});
      },
      "fake engine failure");
    refused(
      [&] {  // the index refuses the second vector: nothing of the first is left either
        word_embedder e;
        e.zero_for = "x two";
        m.add_facts(
          model, e, 7, {{70, {1}, {2}, 0, {}}, {71, {1}, {3}, 0, {}}}, {"x one", "x two"});
      },
      "is zero, which has no cosine");
    refused(
      [&] {
        m.add_facts(model, embedder, 7, {{70, {}, {2}, 0, {}}, {70, {}, {3}, 0, {}}}, {"a", "b"});
      },
      "fact 70 appears twice");
    refused(
      [&] {
        m.add_facts(model, embedder, 7, {{102, {}, {2}, 0, {}}}, {"a"});
      },
      "fact id 102 is already taken");
    refused([&] { m.erase_fact(12345); }, "is not a fact of this memory");
    refused([&] { m.erase_fact(1); }, "instruction prefix");
    refused([&] { m.erase_namespace(0); }, "holds the instruction prefix");
  }

  // After all the refusals the memory still works: the same calls succeed.
  CHECK(m.update_fact(model, embedder, u).reencoded == std::vector<std::uint64_t>{105});
  CHECK(m.update_turns(model, conv, {{4, {1, 2, 3}}}).reencoded.size() == 3);
}
