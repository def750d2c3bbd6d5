// Host tests of composition (inferscale/compose.hpp): the plan laying an instruction prefix and
// retrieved facts out as one memory segment at positions p0 .. p0 + m - 1.
//
// Expectations come from the test's own table of facts (id -> token ids), never from the store or
// the code under test: the expected layout order is written out literally for the fixed cases and
// built with std::reverse for the randomised ones, and begins, token ids, sources and positions
// are accumulated here.
#include <inferscale/compose.hpp>
#include <inferscale/error.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace inferscale;
using Catch::Matchers::Contains;

namespace {

// The facts of the tests: id -> token ids (lengths 1 .. 8, including a page-size multiple).
std::map<std::uint64_t, std::vector<std::int32_t>> const& fact_table()
{
  static std::map<std::uint64_t, std::vector<std::int32_t>> const table{
    {11, {101, 102, 103}},
    {22, {201}},
    {33, {301, 302, 303, 304, 305}},
    {44, {401, 402, 403, 404, 405, 406, 407, 408}},
    {55, {501, 502}},
    {900, {9, 8, 7, 6}},  // the instruction prefix of the fixed cases
    {0xfffffffffffffff0ull, {-1, 0}},
    {66, {601, 602, 603, 604, 605, 606, 607}},
  };
  return table;
}

// A host store holding every fact of the table (namespaces vary; KV zeros).
kv_store make_store()
{
  kv_store_config cfg;
  cfg.model       = kv_geometry{1, 1, 2};
  cfg.store_dtype = dtype::float32;
  cfg.page_size   = 4;
  cfg.num_pages   = 64;
  cfg.space       = memory_space::host;
  kv_store store{cfg};
  for (auto const& [id, tokens] : fact_table()) {
    std::int64_t const c = static_cast<std::int64_t>(tokens.size());
    std::vector<float> const zeros(static_cast<std::size_t>(c * 2), 0.0f);
    auto const view = make_fact_kv_view(zeros.data(), 1, c, 1, 2);
    store.insert(id, id % 3, tokens, view, view);
  }
  return store;
}

// Checks a plan against the layout `order` (ids in layout order) and p0.
void check_plan(composition const& plan, std::vector<std::uint64_t> const& order, std::int64_t p0)
{
  REQUIRE(plan.first_position == p0);
  REQUIRE(plan.segments.size() == order.size());
  std::int64_t begin = 0;
  std::vector<std::int32_t> tokens;
  for (std::size_t i = 0; i < order.size(); ++i) {
    CAPTURE(i, order[i]);
    auto const& ids = fact_table().at(order[i]);
    REQUIRE(plan.segments[i].fact_id == order[i]);
    REQUIRE(plan.segments[i].begin == begin);
    REQUIRE(plan.segments[i].length == static_cast<std::int32_t>(ids.size()));
    for (std::size_t j = 0; j < ids.size(); ++j) {
      std::size_t const k = static_cast<std::size_t>(begin) + j;
      CAPTURE(j, k);
      REQUIRE(k < plan.sources.size());
      REQUIRE(plan.sources[k].fact_id == order[i]);
      REQUIRE(plan.sources[k].offset == static_cast<std::int32_t>(j));
    }
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    begin += static_cast<std::int64_t>(ids.size());
  }
  REQUIRE(plan.length() == begin);
  REQUIRE(plan.token_ids == tokens);
  REQUIRE(plan.sources.size() == tokens.size());
  for (std::int64_t j = 0; j < plan.length(); ++j) {
    REQUIRE(plan.position(j) == p0 + j);
  }
}

}  // namespace

TEST_CASE("compose lays facts out as given, or reversed for best_last", "[compose]")
{
  auto const store = make_store();
  auto const p0    = GENERATE(as<std::int64_t>{}, 0, 1, 7, std::int64_t(1) << 40);
  CAPTURE(p0);
  std::vector<std::uint64_t> const ranked{33, 11, 44};

  SECTION("as_given keeps the list's order")
  {
    compose_options opt;
    opt.first_position = p0;
    opt.order          = fact_order::as_given;
    auto const plan    = compose(store, ranked, opt);
    check_plan(plan, {33, 11, 44}, p0);
    // Written out: segments at 0 (5 tokens), 5 (3), 8 (8); m = 16.
    REQUIRE(plan.length() == 16);
    REQUIRE(plan.segments[1].begin == 5);
    REQUIRE(plan.segments[2].begin == 8);
    REQUIRE(plan.position(15) == p0 + 15);
    REQUIRE(plan.token_ids[5] == 101);
  }
  SECTION("best_last reverses the ranked list: the most relevant fact is last")
  {
    compose_options opt;
    opt.first_position = p0;
    opt.order          = fact_order::best_last;
    auto const plan    = compose(store, ranked, opt);
    check_plan(plan, {44, 11, 33}, p0);
    REQUIRE(plan.segments.back().fact_id == 33);  // ranked first
    REQUIRE(plan.segments[1].begin == 8);
    REQUIRE(plan.segments[2].begin == 11);
    REQUIRE(plan.token_ids.back() == 305);
  }
  SECTION("the instruction prefix comes first, as given")
  {
    compose_options opt;
    opt.first_position     = p0;
    opt.order              = fact_order::as_given;
    opt.instruction_prefix = 900;
    check_plan(compose(store, ranked, opt), {900, 33, 11, 44}, p0);
  }
  SECTION("the instruction prefix comes first, best_last")
  {
    compose_options opt;
    opt.first_position     = p0;
    opt.order              = fact_order::best_last;
    opt.instruction_prefix = 900;
    auto const plan        = compose(store, ranked, opt);
    check_plan(plan, {900, 44, 11, 33}, p0);
    REQUIRE(plan.segments[1].begin == 4);
    REQUIRE(plan.token_ids.front() == 9);
  }
}

TEST_CASE("compose with default options: p0 = 0, best_last, no prefix", "[compose]")
{
  // One default for the library: compose_options and memory_config both lay the ranked list out
  // reversed (the most relevant fact next to the query).
  REQUIRE(compose_options{}.order == fact_order::best_last);
  REQUIRE_FALSE(compose_options{}.instruction_prefix.has_value());
  auto const store = make_store();
  auto const plan  = compose(store, {55, 0xfffffffffffffff0ull, 22});
  check_plan(plan, {22, 0xfffffffffffffff0ull, 55}, 0);
  REQUIRE(plan.token_ids == (std::vector<std::int32_t>{201, -1, 0, 501, 502}));
}

TEST_CASE("compose of a single fact or of no fact", "[compose]")
{
  auto const store = make_store();
  auto const order = GENERATE(fact_order::as_given, fact_order::best_last);
  auto const p0    = GENERATE(as<std::int64_t>{}, 0, 3);
  CAPTURE(static_cast<int>(order), p0);
  compose_options opt;
  opt.first_position = p0;
  opt.order          = order;

  SECTION("one fact: the same in both orders") { check_plan(compose(store, {22}, opt), {22}, p0); }
  SECTION("no fact, no prefix: m = 0")
  {
    auto const plan = compose(store, {}, opt);
    REQUIRE(plan.length() == 0);
    REQUIRE(plan.segments.empty());
    REQUIRE(plan.token_ids.empty());
    REQUIRE(plan.sources.empty());
    REQUIRE(plan.first_position == p0);
  }
  SECTION("no fact, a prefix: the prefix alone")
  {
    opt.instruction_prefix = 900;
    auto const plan        = compose(store, {}, opt);
    check_plan(plan, {900}, p0);
    REQUIRE(plan.length() == 4);
  }
}

TEST_CASE("compose matches a layout built from the fact table (randomised)", "[compose]")
{
  auto const store = make_store();
  auto const seed  = GENERATE(as<std::uint64_t>{}, 1, 2, 3, 4, 5, 6, 7, 8);
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  std::vector<std::uint64_t> ids;
  for (auto const& kv : fact_table()) {
    ids.push_back(kv.first);
  }
  std::shuffle(ids.begin(), ids.end(), rng);
  std::uniform_int_distribution<std::size_t> count(0, ids.size() - 1);
  std::size_t const n = count(rng);
  std::vector<std::uint64_t> const list(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n));
  bool const with_prefix = seed % 2 == 0;
  bool const best_last   = seed % 4 >= 2;
  std::uniform_int_distribution<std::int64_t> position(0, 1000000);
  compose_options opt;
  opt.first_position = position(rng);
  opt.order          = best_last ? fact_order::best_last : fact_order::as_given;
  if (with_prefix) { opt.instruction_prefix = ids.back(); }  // never in the list (n < size)
  CAPTURE(n, with_prefix, best_last, opt.first_position);

  std::vector<std::uint64_t> expected = list;
  if (best_last) { std::reverse(expected.begin(), expected.end()); }
  if (with_prefix) { expected.insert(expected.begin(), ids.back()); }
  auto const version = store.version();
  check_plan(compose(store, list, opt), expected, opt.first_position);
  REQUIRE(store.version() == version);  // planning changes nothing
}

TEST_CASE("compose positions up to rope_position_limit (2^53), refused at it and near INT64_MAX",
          "[compose][positions]")
{
  auto const store = make_store();
  compose_options opt;
  std::int64_t const limit = std::int64_t{1} << 53;  // 9007199254740992, written out
  // m = 3 + 1 = 4; p0 = limit - 4 puts the last token at limit - 1: the last one accepted.
  opt.first_position = limit - 4;
  check_plan(compose(store, {11, 22}, opt), {22, 11}, opt.first_position);  // best_last default
  // m = 0 at the largest p0.
  opt.first_position = limit - 1;
  REQUIRE(compose(store, {}, opt).length() == 0);
  // The last position would be the limit: refused, naming p0 and m - 1.
  opt.first_position = limit - 3;
  REQUIRE_THROWS_AS(compose(store, {11, 22}, opt), inferscale::logic_error);
  REQUIRE_THROWS_WITH(compose(store, {11, 22}, opt),
                      Contains("p0 + m - 1 = 9007199254740989 + 3 reaches rope_position_limit"));
  // p0 at the limit, or near INT64_MAX (where p0 + m - 1 would overflow): refused, even with m = 0.
  for (std::int64_t p0 : {limit,
                          std::numeric_limits<std::int64_t>::max() - 2,
                          std::numeric_limits<std::int64_t>::max()}) {
    opt.first_position = p0;
    CAPTURE(p0);
    REQUIRE_THROWS_WITH(compose(store, {11, 22}, opt),
                        Contains("below rope_position_limit") && Contains(std::to_string(p0)));
    REQUIRE_THROWS_WITH(compose(store, {}, opt), Contains("below rope_position_limit"));
  }
}

TEST_CASE("compose refuses bad requests with a clear logic_error", "[compose]")
{
  auto const store   = make_store();
  auto const order   = GENERATE(fact_order::as_given, fact_order::best_last);
  auto const version = store.version();
  CAPTURE(static_cast<int>(order));
  compose_options opt;
  opt.order = order;

  SECTION("unknown fact id")
  {
    REQUIRE_THROWS_AS(compose(store, {11, 12345, 22}, opt), inferscale::logic_error);
    REQUIRE_THROWS_WITH(compose(store, {11, 12345, 22}, opt), Contains("unknown fact"));
    REQUIRE_THROWS_WITH(compose(store, {11, 12345, 22}, opt), Contains("12345"));
  }
  SECTION("unknown instruction prefix")
  {
    opt.instruction_prefix = 777;
    REQUIRE_THROWS_AS(compose(store, {11}, opt), inferscale::logic_error);
    REQUIRE_THROWS_WITH(compose(store, {11}, opt), Contains("instruction prefix"));
    REQUIRE_THROWS_WITH(compose(store, {}, opt), Contains("777"));
  }
  SECTION("a fact listed twice")
  {
    REQUIRE_THROWS_AS(compose(store, {11, 22, 11}, opt), inferscale::logic_error);
    REQUIRE_THROWS_WITH(compose(store, {11, 22, 11}, opt), Contains("twice"));
    REQUIRE_THROWS_WITH(compose(store, {33, 33}, opt), Contains("33"));
  }
  SECTION("the prefix also in the list")
  {
    opt.instruction_prefix = 900;
    REQUIRE_THROWS_AS(compose(store, {11, 900}, opt), inferscale::logic_error);
    REQUIRE_THROWS_WITH(compose(store, {900}, opt), Contains("twice"));
    REQUIRE_THROWS_WITH(compose(store, {900}, opt), Contains("900"));
  }
  REQUIRE(store.version() == version);
}

TEST_CASE("compose refuses a negative p0", "[compose]")
{
  auto const store = make_store();
  compose_options opt;
  opt.order          = GENERATE(fact_order::as_given, fact_order::best_last);
  opt.first_position = GENERATE(as<std::int64_t>{}, -1, std::numeric_limits<std::int64_t>::min());
  CAPTURE(static_cast<int>(opt.order), opt.first_position);
  REQUIRE_THROWS_AS(compose(store, {11}, opt), inferscale::logic_error);
  REQUIRE_THROWS_WITH(compose(store, {11}, opt), Contains("non-negative"));
  REQUIRE_THROWS_WITH(compose(store, {}, opt), Contains("non-negative"));
}
