// Context-window encoding (encoding.hpp): the planner's jobs are parsed back token by token in the
// test (every turn, header, lead and fact has its own token values), so "which turns does this
// fact see" and "which tokens are kept" are read from the sequences themselves, and the forward
// token counts are recounted from the conversation with the rule written out here. The executor
// runs against two small fake model adapters (one that branches, one that does not) whose K/V are
// a function of the tokens a token can see, so a fact stored from the wrong context is caught.

#include "fake_model.hpp"
#include "store_pool.hpp"

#include <inferscale/encoding.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::fake;

namespace {

constexpr std::int32_t lead_base   = 7;       // lead tokens 7, 8, 9
constexpr std::int32_t turn_base   = 100000;  // turn u, token j: 100000 + 100 u + j
constexpr std::int32_t header_base = 900000;  // session s, token j: 900000 + 10 s + j
constexpr std::int32_t fact_base   = 500000;  // fact id f, token j: 500000 + 10 f + j

std::int64_t turn_length(std::int64_t u) { return 1 + (u * 7) % 5 + (u % 3 == 0 ? 4 : 0); }
std::int64_t header_length(std::int64_t s) { return 2 + s % 2; }

/// Sessions open at these turns (turn 0 opens session 0).
std::vector<std::int64_t> const session_starts{0, 7, 19, 20, 33, 50};

conversation make_conversation(std::int64_t turns, bool headers = true)
{
  conversation c;
  c.lead               = {lead_base, lead_base + 1, lead_base + 2};
  std::int32_t session = -1;
  for (std::int64_t u = 0; u < turns; ++u) {
    for (std::int64_t s : session_starts) {
      if (s == u) { ++session; }
    }
    conversation_turn t;
    t.session = session;
    for (std::int64_t j = 0; j < turn_length(u); ++j) {
      t.token_ids.push_back(static_cast<std::int32_t>(turn_base + 100 * u + j));
    }
    c.turns.push_back(t);
  }
  if (headers) {
    for (std::int32_t s = 0; s <= session; ++s) {
      std::vector<std::int32_t> h;
      for (std::int64_t j = 0; j < header_length(s); ++j) {
        h.push_back(static_cast<std::int32_t>(header_base + 10 * s + j));
      }
      c.session_headers.push_back(h);
    }
  }
  return c;
}

std::vector<std::int32_t> fact_tokens(std::uint64_t id)
{
  std::vector<std::int32_t> out;
  for (std::uint64_t j = 0; j < 2 + id % 4; ++j) {
    out.push_back(static_cast<std::int32_t>(fact_base + 10 * id + j));
  }
  return out;
}

/// ~1.5 facts per turn with a deterministic LCG; some turns none, some several, a few facts with
/// two source turns (the earliest counts), the first and last turn included.
std::vector<conversation_fact> make_facts(std::int64_t turns)
{
  std::vector<conversation_fact> out;
  std::uint64_t state = 12345;
  auto next           = [&]() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 33;
  };
  std::uint64_t id = 1;
  for (std::int64_t u = 0; u < turns; ++u) {
    std::uint64_t const n = (u == 0 || u == turns - 1) ? 2 : next() % 4;
    for (std::uint64_t k = 0; k < n; ++k) {
      conversation_fact f;
      f.fact_id      = id;
      f.namespace_id = 3;
      f.token_ids    = fact_tokens(id);
      f.source_turns = {u};
      if (id % 9 == 0 && u + 2 < turns) { f.source_turns = {u + 2, u}; }  // earliest: u
      out.push_back(f);
      ++id;
    }
  }
  return out;
}

/// What a token sequence holds, parsed back from the token values.
struct parsed_context {
  std::int64_t first_turn{-1};  // -1: no turn
  std::int64_t end_turn{-1};
  bool ok{true};
  std::string why;
};

/// Parses `tokens` as lead, then turns in order, with a session header exactly before the first
/// turn and before every turn that opens a session, and (when the sequence holds a turn and turn
/// `next` opens a session) the header of `next`'s session at the end.
parsed_context parse(conversation const& c,
                     std::vector<std::int32_t> const& tokens,
                     std::int64_t next)
{
  parsed_context p;
  auto fail = [&](std::string why) {
    p.ok  = false;
    p.why = std::move(why);
    return p;
  };
  std::size_t i = 0;
  for (std::int32_t l : c.lead) {
    if (i >= tokens.size() || tokens[i] != l) { return fail("lead missing"); }
    ++i;
  }
  auto opens = [&](std::int64_t u) {
    return u < static_cast<std::int64_t>(c.turns.size()) &&
           (u == 0 || c.turns[static_cast<std::size_t>(u)].session !=
                        c.turns[static_cast<std::size_t>(u - 1)].session);
  };
  auto take_header = [&](std::int64_t u) -> bool {
    if (c.session_headers.empty()) { return true; }
    auto const& h =
      c.session_headers[static_cast<std::size_t>(c.turns[static_cast<std::size_t>(u)].session)];
    for (std::int32_t x : h) {
      if (i >= tokens.size() || tokens[i] != x) { return false; }
      ++i;
    }
    return true;
  };
  std::int64_t expect = -1;
  while (i < tokens.size()) {
    std::int32_t const x = tokens[i];
    if (x >= header_base) {
      // a header: must be the one before the next turn
      std::int64_t const u = expect < 0 ? -1 : expect;
      if (u < 0) {
        // the first turn's header: find the turn that follows
        std::size_t j = i;
        while (j < tokens.size() && tokens[j] >= header_base) {
          ++j;
        }
        if (j >= tokens.size()) { return fail("a header without a turn"); }
        std::int64_t const first = (tokens[j] - turn_base) / 100;
        if (!take_header(first)) { return fail("wrong first header"); }
        continue;
      }
      if (!opens(u)) {
        return fail("a header before turn " + std::to_string(u) + " which opens no session");
      }
      if (!take_header(u)) { return fail("wrong header before turn " + std::to_string(u)); }
      if (i == tokens.size()) {
        if (u != next) { return fail("a trailing header of another turn"); }
        break;
      }
      if ((tokens[i] - turn_base) / 100 != u) { return fail("header not followed by its turn"); }
      continue;
    }
    if (x < turn_base || x >= fact_base) { return fail("a token that is no turn's"); }
    std::int64_t const u = (x - turn_base) / 100;
    if (expect >= 0 && u != expect) { return fail("turns not consecutive"); }
    if (expect < 0) {
      p.first_turn = u;
      if (!c.session_headers.empty() && !(i >= 1 && tokens[i - 1] >= header_base)) {
        return fail("the first turn has no header");
      }
    } else if (opens(u) && !c.session_headers.empty() && tokens[i - 1] < header_base) {
      return fail("turn " + std::to_string(u) + " opens a session without its header");
    }
    for (std::int64_t j = 0; j < turn_length(u); ++j, ++i) {
      if (i >= tokens.size() || tokens[i] != turn_base + 100 * u + j) {
        return fail("turn " + std::to_string(u) + " is cut");
      }
    }
    expect     = u + 1;
    p.end_turn = expect;
  }
  if (p.end_turn >= 0 && p.end_turn != next) {
    return fail("the sequence ends at turn " + std::to_string(p.end_turn) + ", expected " +
                std::to_string(next));
  }
  if (p.end_turn >= 0 && opens(next) && !c.session_headers.empty() && tokens.back() < header_base) {
    return fail("turn " + std::to_string(next) + " opens a session: its header is missing");
  }
  return p;
}

/// The forward tokens of one fact's own window [a, t) plus the fact, counted from the rule
/// (lead, a header before the first turn and every session-opening turn, the header of t's
/// session at the end when t opens one and the window holds a turn).
std::int64_t window_tokens(conversation const& c, std::int64_t a, std::int64_t t)
{
  std::int64_t n = static_cast<std::int64_t>(c.lead.size());
  for (std::int64_t u = a; u < t; ++u) {
    bool const opens = u == 0 || c.turns[static_cast<std::size_t>(u)].session !=
                                   c.turns[static_cast<std::size_t>(u - 1)].session;
    if (u == a || opens) { n += header_length(c.turns[static_cast<std::size_t>(u)].session); }
    n += turn_length(u);
  }
  if (t > a && c.turns[static_cast<std::size_t>(t)].session !=
                 c.turns[static_cast<std::size_t>(t - 1)].session) {
    n += header_length(c.turns[static_cast<std::size_t>(t)].session);
  }
  return n;
}

std::int64_t anchor(conversation_fact const& f)
{
  std::int64_t a = f.source_turns[0];
  for (std::int64_t t : f.source_turns) {
    a = std::min(a, t);
  }
  return a;
}

/// Checks every job of a plan: every fact once, its tokens kept exactly, its prefix a valid
/// context ending right before its source turn and holding the w turns before it (exactly those
/// when `exact`).
void check_plan(conversation const& c,
                std::vector<conversation_fact> const& facts,
                encoding_plan const& plan,
                std::int64_t w,
                bool exact)
{
  std::map<std::uint64_t, conversation_fact const*> by_id;
  for (auto const& f : facts) {
    by_id[f.fact_id] = &f;
  }
  std::set<std::uint64_t> seen;
  for (encoding_job const& job : plan.jobs) {
    REQUIRE_FALSE(job.branches.empty());
    std::int64_t longest_attach = 0;
    for (encoding_branch const& b : job.branches) {
      INFO("fact " << b.fact_id);
      REQUIRE(by_id.count(b.fact_id) == 1);
      REQUIRE(seen.insert(b.fact_id).second);
      conversation_fact const& f = *by_id[b.fact_id];
      CHECK(b.token_ids == f.token_ids);
      CHECK(b.namespace_id == f.namespace_id);
      std::int64_t const t = anchor(f);
      CHECK(b.source_turn == t);
      REQUIRE(b.attach <= static_cast<std::int64_t>(job.trunk.size()));
      CHECK(b.position == job.first_position + b.attach);
      std::vector<std::int32_t> prefix(job.trunk.begin(), job.trunk.begin() + b.attach);
      parsed_context const p = parse(c, prefix, t);
      INFO(p.why);
      REQUIRE(p.ok);
      std::int64_t const want_first = std::max<std::int64_t>(0, t - w);
      if (w == 0 || t == 0) {
        if (exact) { CHECK(p.first_turn == -1); }  // the lead only
      } else {
        REQUIRE(p.first_turn >= 0);
        CHECK(p.first_turn <= want_first);  // a superset of the w turns before t
        if (exact) { CHECK(p.first_turn == want_first); }
        CHECK(p.end_turn == t);
      }
      longest_attach = std::max(longest_attach, b.attach);
    }
    // The trunk ends at the last attach point and is itself a valid context.
    CHECK(static_cast<std::int64_t>(job.trunk.size()) == longest_attach);
  }
  CHECK(seen.size() == facts.size());
}

std::int64_t fact_total(std::vector<conversation_fact> const& facts)
{
  std::int64_t n = 0;
  for (auto const& f : facts) {
    n += static_cast<std::int64_t>(f.token_ids.size());
  }
  return n;
}

}  // namespace

TEST_CASE("planner: every strategy keeps each fact once, behind the w turns before it", "[encode]")
{
  conversation const c                       = make_conversation(64);
  std::vector<conversation_fact> const facts = make_facts(64);
  REQUIRE(facts.size() > 60);
  for (std::int64_t w : {0, 1, 5, 20, 70}) {
    for (auto s : {encoding_strategy::per_fact,
                   encoding_strategy::shared_window,
                   encoding_strategy::aligned,
                   encoding_strategy::single_pass}) {
      INFO("w = " << w << ", " << to_string(s));
      encoding_options o;
      o.window                 = w;
      o.strategy               = s;
      encoding_plan const plan = plan_encoding(c, facts, o);
      bool const exact = s == encoding_strategy::per_fact || s == encoding_strategy::shared_window;
      check_plan(c, facts, plan, w, exact);
      encoding_stats const st = plan.stats();
      CHECK(st.facts == static_cast<std::int64_t>(facts.size()));
      CHECK(st.fact_tokens == fact_total(facts));
    }
  }
}

TEST_CASE("planner: forward-token counts match a recount from the conversation", "[encode]")
{
  conversation const c                       = make_conversation(64);
  std::vector<conversation_fact> const facts = make_facts(64);
  std::int64_t const w                       = 5;
  encoding_options o;
  o.window = w;

  // One forward per fact: the window of each fact, counted by the rule, plus the fact.
  std::int64_t per_fact = 0;
  for (auto const& f : facts) {
    std::int64_t const t = anchor(f);
    per_fact += window_tokens(c, std::max<std::int64_t>(0, t - w), t) +
                static_cast<std::int64_t>(f.token_ids.size());
  }
  o.strategy             = encoding_strategy::per_fact;
  encoding_stats const a = plan_encoding(c, facts, o).stats();
  CHECK(a.forward_tokens == per_fact);
  CHECK(a.unbranched_tokens == per_fact);
  CHECK(a.jobs == static_cast<std::int64_t>(facts.size()));

  // Shared windows: one window per distinct source turn.
  std::set<std::int64_t> anchors;
  for (auto const& f : facts) {
    anchors.insert(anchor(f));
  }
  std::int64_t shared = fact_total(facts);
  for (std::int64_t t : anchors) {
    shared += window_tokens(c, std::max<std::int64_t>(0, t - w), t);
  }
  o.strategy             = encoding_strategy::shared_window;
  encoding_stats const b = plan_encoding(c, facts, o).stats();
  CHECK(b.forward_tokens == shared);
  CHECK(b.jobs == static_cast<std::int64_t>(anchors.size()));
  CHECK(b.unbranched_tokens == per_fact);  // unbranched, sharing buys nothing

  // Aligned: groups by window start rounded down to the stride, trunk to the group's last turn.
  for (std::int64_t stride : {1, 5, 12}) {
    INFO("stride " << stride);
    std::map<std::int64_t, std::int64_t> last;
    for (auto const& f : facts) {
      std::int64_t const t  = anchor(f);
      std::int64_t const st = std::max<std::int64_t>(0, t - w) / stride * stride;
      last[st]              = std::max(last.count(st) ? last[st] : 0, t);
    }
    std::int64_t aligned = fact_total(facts);
    for (auto const& [st, t] : last) {
      aligned += window_tokens(c, st, t);
    }
    o.strategy             = encoding_strategy::aligned;
    o.stride               = stride;
    encoding_stats const s = plan_encoding(c, facts, o).stats();
    CHECK(s.forward_tokens == aligned);
    CHECK(s.jobs == static_cast<std::int64_t>(last.size()));
  }
  o.stride = 0;

  // One pass, unbounded: lead + every turn up to the last source turn once, plus the facts.
  std::int64_t last_anchor = 0;
  for (auto const& f : facts) {
    last_anchor = std::max(last_anchor, anchor(f));
  }
  o.strategy              = encoding_strategy::single_pass;
  encoding_plan const one = plan_encoding(c, facts, o);
  REQUIRE(one.jobs.size() == 1);
  CHECK(one.stats().forward_tokens == window_tokens(c, 0, last_anchor) + fact_total(facts));
  CHECK(one.stats().forward_tokens < b.forward_tokens);
}

TEST_CASE("planner: a single pass cut to a context budget", "[encode]")
{
  conversation const c                       = make_conversation(64);
  std::vector<conversation_fact> const facts = make_facts(64);
  for (std::int64_t w : {2, 6}) {
    for (std::int64_t budget : {70, 110, 160}) {
      INFO("w = " << w << ", budget " << budget);
      encoding_options o;
      o.window                 = w;
      o.strategy               = encoding_strategy::single_pass;
      o.max_sequence_tokens    = budget;
      encoding_plan const plan = plan_encoding(c, facts, o);
      check_plan(c, facts, plan, w, false);
      CHECK(plan.stats().longest_sequence <= budget);
      CHECK(plan.jobs.size() > 1);
      // Consecutive segments: the next starts w turns before the first fact it serves.
      for (std::size_t j = 1; j < plan.jobs.size(); ++j) {
        std::int64_t const t = plan.jobs[j].branches.front().source_turn;
        CHECK(plan.jobs[j].first_turn == std::max<std::int64_t>(0, t - w));
        CHECK(plan.jobs[j - 1].end_turn <= t);
      }
    }
  }
  // A fact whose own window does not fit is refused with the numbers.
  encoding_options o;
  o.window              = 20;
  o.max_sequence_tokens = 30;
  for (auto s :
       {encoding_strategy::per_fact, encoding_strategy::single_pass, encoding_strategy::aligned}) {
    o.strategy = s;
    CHECK_THROWS_WITH(plan_encoding(c, facts, o),
                      Catch::Contains("more than max_sequence_tokens = 30"));
  }
}

TEST_CASE("planner: without session headers, and bad input refused", "[encode]")
{
  conversation const bare                    = make_conversation(30, /*headers*/ false);
  std::vector<conversation_fact> const facts = make_facts(30);
  encoding_options o;
  o.window = 4;
  for (auto s :
       {encoding_strategy::per_fact, encoding_strategy::aligned, encoding_strategy::single_pass}) {
    o.strategy = s;
    check_plan(bare, facts, plan_encoding(bare, facts, o), 4, s == encoding_strategy::per_fact);
  }

  conversation c = make_conversation(30);
  auto refuse    = [&](conversation const& cc,
                    std::vector<conversation_fact> const& ff,
                    encoding_options const& oo,
                    char const* what) {
    CHECK_THROWS_WITH(plan_encoding(cc, ff, oo), Catch::Contains(what));
  };
  refuse(c, facts, encoding_options{-1}, "window w must be non-negative");
  {
    auto bad            = facts;
    bad[3].source_turns = {30};
    refuse(c, bad, o, "source turn 30 is not one of the 30 turns");
    bad[3].source_turns = {};
    refuse(c, bad, o, "names no source turn");
    bad = facts;
    bad[4].token_ids.clear();
    refuse(c, bad, o, "has no tokens");
    bad            = facts;
    bad[5].fact_id = bad[6].fact_id;
    refuse(c, bad, o, "appears twice");
  }
  {
    auto bad             = c;
    bad.turns[8].session = 0;  // after session 1
    refuse(bad, facts, o, "sessions must not decrease");
    bad = c;
    bad.session_headers.pop_back();
    refuse(bad, facts, o, "session headers are given");
    bad = c;
    bad.turns[2].token_ids.clear();
    refuse(bad, facts, o, "turn 2 has no tokens");
  }
}

// ------------------------------------------------------------------------------------------------
// The executor against fake adapters

namespace {

kv_store tiny_store(std::int64_t pages = 4096)
{
  kv_store_config cfg;
  cfg.model       = tiny;
  cfg.store_dtype = dtype::float32;
  cfg.page_size   = 4;
  cfg.num_pages   = pages;
  cfg.space       = memory_space::host;
  return kv_store{cfg};
}

float stored(
  kv_store const& s, std::uint64_t id, std::int64_t l, int kv, std::int64_t t, std::int64_t d)
{
  std::vector<unsigned char> const pool = s.pool_to_host();
  inferscale_test::pool_shape const shape{2, 1, 4, 4, dtype::float32};
  std::uint32_t const bits =
    inferscale_test::read_pool(pool, shape, s.at(id).pages, l, kv, t, 0, d);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

TEST_CASE("encode_plan: branched and unbranched runs store each fact as seen behind its window",
          "[encode]")
{
  conversation const c                       = make_conversation(40);
  std::vector<conversation_fact> const facts = make_facts(40);
  encoding_options o;
  o.window                 = 6;
  o.strategy               = encoding_strategy::single_pass;
  o.max_sequence_tokens    = 120;
  o.first_position         = 3;
  encoding_plan const plan = plan_encoding(c, facts, o);

  kv_store a = tiny_store();
  kv_store b = tiny_store();
  branching_model bm;
  plain_model pm;
  encode_report const ra = encode_plan(bm, a, plan);
  encode_report const rb = encode_plan(pm, b, plan);
  CHECK(ra.branched);
  CHECK_FALSE(rb.branched);
  CHECK(ra.forward_tokens == plan.stats().forward_tokens);
  CHECK(rb.forward_tokens == plan.stats().unbranched_tokens);
  CHECK(bm.trunks == static_cast<std::int64_t>(plan.jobs.size()));
  CHECK(pm.forwards == static_cast<std::int64_t>(facts.size()));
  CHECK(a.num_facts() == static_cast<std::int64_t>(facts.size()));
  CHECK(a.namespace_facts(3) == static_cast<std::int64_t>(facts.size()));

  // Expected: the fact's tokens at their positions, seeing the lead, the headers and the turns
  // [first_turn, t) as parsed back from the plan's own trunk, recomputed here from the formula.
  for (encoding_job const& job : plan.jobs) {
    for (encoding_branch const& br : job.branches) {
      std::vector<std::int32_t> seen(job.trunk.begin(), job.trunk.begin() + br.attach);
      REQUIRE(parse(c, seen, br.source_turn).ok);
      REQUIRE(a.at(br.fact_id).token_ids == br.token_ids);
      for (std::size_t j = 0; j < br.token_ids.size(); ++j) {
        seen.push_back(br.token_ids[j]);
        for (std::int32_t l = 0; l < 2; ++l) {
          float k[4], v[4];
          fake_row(seen, o.first_position + br.attach + static_cast<std::int64_t>(j), l, k, v);
          for (int d = 0; d < 4; ++d) {
            INFO("fact " << br.fact_id << " token " << j << " layer " << l << " dim " << d);
            REQUIRE(stored(a, br.fact_id, l, 0, static_cast<std::int64_t>(j), d) == k[d]);
            REQUIRE(stored(a, br.fact_id, l, 1, static_cast<std::int64_t>(j), d) == v[d]);
            REQUIRE(stored(b, br.fact_id, l, 0, static_cast<std::int64_t>(j), d) == k[d]);
          }
        }
      }
    }
  }
}

TEST_CASE("encode_plan: refusals and an engine failure leave the store unchanged", "[encode]")
{
  conversation const c                       = make_conversation(40);
  std::vector<conversation_fact> const facts = make_facts(40);
  encoding_options o;
  o.window                 = 4;
  o.strategy               = encoding_strategy::aligned;
  encoding_plan const plan = plan_encoding(c, facts, o);
  REQUIRE(plan.jobs.size() > 3);

  {  // a fact already stored
    kv_store s = tiny_store();
    std::vector<float> kv(2 * 2 * 4, 1.0f);
    auto const view = make_fact_kv_view<float const>(kv.data(), 2, 2, 1, 4);
    s.insert<float>(facts[10].fact_id, 3, {1, 2}, view, view);
    branching_model m;
    CHECK_THROWS_WITH(encode_plan(m, s, plan), Catch::Contains("is already stored"));
    CHECK(m.forwards == 0);
    CHECK(s.num_facts() == 1);
  }
  {  // capacity
    kv_store s = tiny_store(8);
    branching_model m;
    CHECK_THROWS_WITH(encode_plan(m, s, plan), Catch::Contains("capacity exhausted"));
    CHECK(m.forwards == 0);
    CHECK(s.num_facts() == 0);
  }
  {  // a corrupted plan
    encoding_plan bad              = plan;
    bad.jobs[1].branches[0].attach = static_cast<std::int64_t>(bad.jobs[1].trunk.size()) + 1;
    kv_store s                     = tiny_store();
    branching_model m;
    CHECK_THROWS_WITH(encode_plan(m, s, bad), Catch::Contains("outside its trunk"));
    bad = plan;
    bad.jobs[1].branches[0].position += 1;
    CHECK_THROWS_WITH(encode_plan(m, s, bad), Catch::Contains("its attach point is position"));
    CHECK(m.forwards == 0);
  }
  {  // the engine fails on the third forward: the facts of the first two are erased again
    for (int branched = 0; branched < 2; ++branched) {
      kv_store s                     = tiny_store();
      std::int64_t const free_before = s.free_pages();
      if (branched) {
        branching_model m;
        m.fail_at = 2;
        CHECK_THROWS_WITH(encode_plan(m, s, plan), Catch::Contains("fake engine failure"));
      } else {
        plain_model m;
        m.fail_at = 2;
        CHECK_THROWS_WITH(encode_plan(m, s, plan), Catch::Contains("fake engine failure"));
      }
      CHECK(s.num_facts() == 0);
      CHECK(s.free_pages() == free_before);
    }
  }
}
