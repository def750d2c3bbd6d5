// Re-planning facts behind known windows (encoding.hpp: plan_encoding_at, planned_window_start)
// and encoding without storing (capture_plan), the pieces the fact lifecycle of memory.hpp is
// built on. Contexts are checked against the window rule written out here; captured K/V against
// the fake model's formula (tests/common/fake_model.hpp).

#include "fake_model.hpp"
#include "memory_fixtures.hpp"

#include <inferscale/encoding.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::fake;
using inferscale_test::memory_fixtures::window_tokens;

namespace {

/// 30 turns of 1 + u % 4 tokens (turn u, token j: 10000 + 100 u + j), a session every 6 turns
/// with header {900 + s}, the lead {1, 2, 3}; one or two facts per turn (ids 1 ..).
struct data {
  conversation c;
  std::vector<conversation_fact> facts;
};

data make_data()
{
  data d;
  d.c.lead = std::vector<std::int32_t>{1, 2, 3};
  for (int u = 0; u < 30; ++u) {
    conversation_turn t;
    t.session = u / 6;
    for (int j = 0; j <= u % 4; ++j) {
      t.token_ids.push_back(10000 + 100 * u + j);
    }
    d.c.turns.push_back(t);
  }
  for (int s = 0; s < 5; ++s) {
    d.c.session_headers.push_back({900 + s});
  }
  std::uint64_t id = 1;
  for (int u = 0; u < 30; ++u) {
    for (int k = 0; k < 1 + (u % 3 == 1 ? 1 : 0); ++k, ++id) {
      d.facts.push_back({id, 4, {static_cast<std::int32_t>(50000 + id), 60000}, {u}});
    }
  }
  return d;
}

std::vector<std::int32_t> prefix(encoding_job const& job, encoding_branch const& b)
{
  return std::vector<std::int32_t>(job.trunk.begin(), job.trunk.begin() + b.attach);
}

}  // namespace

TEST_CASE("planned_window_start: the window start of a fact planned alone", "[encode]")
{
  encoding_options o;
  o.window   = 5;
  o.strategy = encoding_strategy::per_fact;
  CHECK(planned_window_start(o, 11) == 6);
  CHECK(planned_window_start(o, 3) == 0);
  o.strategy = encoding_strategy::shared_window;
  CHECK(planned_window_start(o, 11) == 6);
  o.strategy = encoding_strategy::single_pass;
  CHECK(planned_window_start(o, 11) == 6);
  o.strategy = encoding_strategy::aligned;
  o.stride   = 4;
  CHECK(planned_window_start(o, 11) == 4);  // 6 rounded down to a multiple of 4
  o.stride = 0;                             // stride = w = 5
  CHECK(planned_window_start(o, 11) == 5);
  o.window = 0;
  CHECK(planned_window_start(o, 11) == 11);
  CHECK_THROWS_WITH(planned_window_start(o, -1), Catch::Contains("must be non-negative, got -1"));

  // It is what plan_encoding gives a lone fact, for every strategy and window.
  data const d = make_data();
  for (encoding_strategy s : {encoding_strategy::per_fact,
                              encoding_strategy::shared_window,
                              encoding_strategy::aligned,
                              encoding_strategy::single_pass}) {
    for (std::int64_t w : {0, 1, 3, 7}) {
      encoding_options p;
      p.window   = w;
      p.strategy = s;
      for (conversation_fact const& f : d.facts) {
        CAPTURE(to_string(s), w, f.fact_id);
        encoding_plan const plan = plan_encoding(d.c, {f}, p);
        CHECK(plan.jobs.at(0).branches.at(0).first_turn ==
              planned_window_start(p, f.source_turns[0]));
      }
    }
  }
}

TEST_CASE("plan_encoding_at: facts re-planned behind their windows attach as first planned",
          "[encode]")
{
  data const d = make_data();
  for (encoding_strategy s : {encoding_strategy::per_fact,
                              encoding_strategy::shared_window,
                              encoding_strategy::aligned,
                              encoding_strategy::single_pass}) {
    for (std::int64_t budget : {0, 30}) {
      encoding_options o;
      o.window              = 3;
      o.strategy            = s;
      o.max_sequence_tokens = budget;
      o.first_position      = 2;
      CAPTURE(to_string(s), budget);
      encoding_plan const plan = plan_encoding(d.c, d.facts, o);
      std::vector<conversation_fact> facts;
      std::vector<std::int64_t> first;
      std::vector<encoding_branch> original;
      std::vector<std::vector<std::int32_t>> original_prefix;
      for (encoding_job const& job : plan.jobs) {
        for (encoding_branch const& b : job.branches) {
          auto const it =
            std::find_if(d.facts.begin(), d.facts.end(), [&](conversation_fact const& f) {
              return f.fact_id == b.fact_id;
            });
          facts.push_back(*it);
          first.push_back(b.first_turn);
          original.push_back(b);
          original_prefix.push_back(prefix(job, b));
        }
      }
      // All at once, and one at a time: same context, attach point and position as first planned,
      // and the context is the window rule's.
      encoding_plan const again = plan_encoding_at(d.c, facts, first, o);
      std::size_t n             = 0;
      for (encoding_job const& job : again.jobs) {
        CHECK(job.first_position == 2);
        for (encoding_branch const& b : job.branches) {
          ++n;
          std::size_t const i = static_cast<std::size_t>(
            std::find_if(original.begin(),
                         original.end(),
                         [&](encoding_branch const& x) { return x.fact_id == b.fact_id; }) -
            original.begin());
          REQUIRE(i < original.size());
          CHECK(prefix(job, b) == original_prefix[i]);
          CHECK(prefix(job, b) == window_tokens(d.c, b.first_turn, b.source_turn));
          CHECK(b.attach == original[i].attach);
          CHECK(b.position == original[i].position);
          CHECK(b.first_turn == original[i].first_turn);
          CHECK(b.source_turn == original[i].source_turn);
          CHECK(b.token_ids == original[i].token_ids);
        }
      }
      CHECK(n == d.facts.size());
      for (std::size_t i = 0; i < facts.size(); i += 7) {
        encoding_plan const one = plan_encoding_at(d.c, {facts[i]}, {first[i]}, o);
        REQUIRE(one.jobs.size() == 1);
        REQUIRE(one.jobs[0].branches.size() == 1);
        CHECK(prefix(one.jobs[0], one.jobs[0].branches[0]) == original_prefix[i]);
        CHECK(one.jobs[0].branches[0].position == original[i].position);
      }
    }
  }

  encoding_options o;
  o.window                  = 3;
  conversation_fact const f = d.facts[10];  // anchored at turn 7
  REQUIRE(f.source_turns[0] == 7);
  CHECK_THROWS_WITH(plan_encoding_at(d.c, {f}, {}, o),
                    Catch::Contains("1 facts but 0 first turns"));
  CHECK_THROWS_WITH(plan_encoding_at(d.c, {f}, {8}, o),
                    Catch::Contains("window starts at turn 8, outside [0, 7]"));
  CHECK_THROWS_WITH(plan_encoding_at(d.c, {f}, {-1}, o), Catch::Contains("outside [0, 7]"));
  o.max_sequence_tokens = 8;  // lead 3 + 2 headers + turns 4..6 (1 + 2 + 3) + 2 fact tokens > 8
  CHECK_THROWS_WITH(plan_encoding_at(d.c, {f}, {4}, o),
                    Catch::Contains("more than max_sequence_tokens = 8"));
  CHECK_NOTHROW(plan_encoding_at(d.c, {f}, {7}, o));  // an empty window fits
}

namespace {
/// Delivers every layer but the last for the second branch: an incomplete capture.
struct forgetful_model : plain_model {
  void encode_branches(std::vector<std::int32_t> const& trunk,
                       std::int64_t,
                       std::vector<encoding_branch> const& branches,
                       kv_capture& out)
  {
    std::int64_t row = 0;
    for (std::size_t i = 0; i < branches.size(); ++i) {
      encoding_branch const& b = branches[i];
      std::vector<std::int32_t> seen(trunk.begin(), trunk.begin() + b.attach);
      for (std::size_t j = 0; j < b.token_ids.size(); ++j, ++row) {
        seen.push_back(b.token_ids[j]);
        for (std::int32_t l = 0; l < (i == 1 ? 1 : 2); ++l) {
          float k[4], v[4];
          fake_row(seen, b.position + static_cast<std::int64_t>(j), l, k, v);
          out.write_keys(l, row, make_token_head_view<float const>(k, 1, 1, 4));
          out.write_values(l, row, make_token_head_view<float const>(v, 1, 1, 4));
        }
      }
    }
  }
};
}  // namespace

TEMPLATE_TEST_CASE("capture_plan: the facts' K/V in host buffers, nothing stored",
                   "[encode]",
                   plain_model,
                   branching_model)
{
  data const d = make_data();
  encoding_options o;
  o.window                 = 4;
  o.strategy               = encoding_strategy::aligned;
  o.first_position         = 5;
  encoding_plan const plan = plan_encoding(d.c, d.facts, o);
  TestType model;
  captured_plan const got = capture_plan(model, plan);
  REQUIRE(got.facts.size() == d.facts.size());
  REQUIRE(got.captures.size() == d.facts.size());
  CHECK(got.report.facts == static_cast<std::int64_t>(d.facts.size()));
  CHECK(got.report.jobs == static_cast<std::int64_t>(plan.jobs.size()));
  CHECK(got.report.branched == has_encode_branches_v<TestType>);
  CHECK(got.report.forward_tokens ==
        (has_encode_branches_v<TestType> ? plan.stats().forward_tokens
                                         : plan.stats().unbranched_tokens));

  std::size_t i = 0;
  for (encoding_job const& job : plan.jobs) {
    for (encoding_branch const& b : job.branches) {
      CAPTURE(b.fact_id);
      captured_fact const& f = got.facts[i];
      kv_capture const& cap  = got.captures[i++];
      CHECK(f.fact_id == b.fact_id);
      CHECK(f.namespace_id == 4);
      CHECK(f.begin == 0);
      CHECK(f.token_ids == b.token_ids);
      REQUIRE(cap.num_tokens() == static_cast<std::int64_t>(b.token_ids.size()));
      CHECK(cap.complete());
      std::vector<std::int32_t> seen = window_tokens(d.c, b.first_turn, b.source_turn);
      std::int64_t const p0          = 5 + static_cast<std::int64_t>(seen.size());
      for (std::size_t j = 0; j < b.token_ids.size(); ++j) {
        seen.push_back(b.token_ids[j]);
        for (std::int32_t l = 0; l < 2; ++l) {
          float k[4], v[4];
          fake_row(seen, p0 + static_cast<std::int64_t>(j), l, k, v);
          for (int e = 0; e < 4; ++e) {
            CHECK(cap.keys()(l, static_cast<std::int64_t>(j), 0, e) == k[e]);
            CHECK(cap.values()(l, static_cast<std::int64_t>(j), 0, e) == v[e]);
          }
        }
      }
    }
  }

  TestType failing;
  failing.fail_at = has_encode_branches_v<TestType> ? 2 : 5;
  CHECK_THROWS_WITH(capture_plan(failing, plan), Catch::Contains("fake engine failure"));
  encoding_plan twice = plan;
  twice.jobs.push_back(plan.jobs[0]);
  CHECK_THROWS_WITH(capture_plan(model, twice), Catch::Contains("appears twice in the plan"));
  encoding_plan moved = plan;
  moved.jobs[0].branches[0].position += 1;
  CHECK_THROWS_WITH(capture_plan(model, moved), Catch::Contains("its attach point is position"));
}

TEST_CASE("capture_plan: an incomplete capture is refused", "[encode]")
{
  data const d = make_data();
  encoding_options o;
  o.window   = 2;
  o.strategy = encoding_strategy::single_pass;
  forgetful_model model;
  CHECK_THROWS_WITH(
    capture_plan(model, plan_encoding(d.c, d.facts, o)),
    Catch::Contains("fact 2: the model adapter did not deliver K and V of every layer"));
}
