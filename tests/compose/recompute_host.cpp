// Host tests of the recompute plan (inferscale/recompute.hpp): which tokens of an injected memory
// segment an engine recomputes in context, and the K/V deviation that ranks them.
//
// Expectations are computed here, independently of the code under test: the boundary set from the
// test's own segment lengths, the selective part by a brute-force selection (repeatedly the
// largest remaining deviation, lower index on ties; O(n^2), not a sort), the count as
// floor(rho * E + 0.5), the runs by a scan; the deviations from values written into the store
// that are exact in its dtype, with the squared differences summed here.
#include <inferscale/compose.hpp>
#include <inferscale/error.hpp>
#include <inferscale/recompute.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <vector>

using namespace inferscale;
using Catch::Matchers::Contains;

namespace {

// A composition of segments of the given lengths, ids 1, 2, .. in layout order (no store needed:
// the plan reads only the layout).
composition layout(std::vector<std::int32_t> const& lengths, std::int64_t p0 = 0)
{
  composition c;
  c.first_position   = p0;
  std::int64_t begin = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    c.segments.push_back({i + 1, begin, lengths[i]});
    for (std::int32_t j = 0; j < lengths[i]; ++j) {
      c.token_ids.push_back(static_cast<std::int32_t>(100 * (i + 1) + j));
      c.sources.push_back({i + 1, j});
    }
    begin += lengths[i];
  }
  return c;
}

struct expected_plan {
  std::vector<std::int64_t> tokens;
  std::vector<std::pair<std::int64_t, std::int64_t>> runs;
  std::int64_t eligible{0};
};

expected_plan brute_force(std::vector<std::int32_t> const& lengths,
                          std::optional<std::uint64_t> exact,
                          std::int32_t r,
                          double rho,
                          std::vector<float> const& dev)
{
  expected_plan e;
  std::int64_t m = 0;
  for (auto l : lengths) {
    m += l;
  }
  std::vector<bool> eligible(static_cast<std::size_t>(m), false), chosen(eligible);
  std::int64_t begin = 0, boundary = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    bool const skip = exact && *exact == i + 1;
    for (std::int32_t j = 0; j < lengths[i]; ++j) {
      if (skip) { continue; }
      eligible[static_cast<std::size_t>(begin + j)] = true;
      ++e.eligible;
      if (j < r) {
        chosen[static_cast<std::size_t>(begin + j)] = true;
        ++boundary;
      }
    }
    begin += lengths[i];
  }
  auto const total = static_cast<std::int64_t>(std::floor(rho * double(e.eligible) + 0.5));
  for (std::int64_t picked = boundary; picked < total; ++picked) {
    std::int64_t best = -1;
    for (std::int64_t j = 0; j < m; ++j) {
      auto const u = static_cast<std::size_t>(j);
      if (!eligible[u] || chosen[u]) { continue; }
      if (best < 0 || dev[u] > dev[static_cast<std::size_t>(best)]) { best = j; }
    }
    if (best < 0) { break; }
    chosen[static_cast<std::size_t>(best)] = true;
  }
  for (std::int64_t j = 0; j < m; ++j) {
    if (!chosen[static_cast<std::size_t>(j)]) { continue; }
    e.tokens.push_back(j);
    if (j > 0 && chosen[static_cast<std::size_t>(j - 1)]) {
      ++e.runs.back().second;
    } else {
      e.runs.push_back({j, 1});
    }
  }
  return e;
}

void check_against(recompute_plan const& p, expected_plan const& e)
{
  REQUIRE(p.eligible == e.eligible);
  REQUIRE(p.tokens == e.tokens);
  REQUIRE(p.runs.size() == e.runs.size());
  for (std::size_t i = 0; i < e.runs.size(); ++i) {
    REQUIRE(p.runs[i].begin == e.runs[i].first);
    REQUIRE(p.runs[i].length == e.runs[i].second);
  }
}

}  // namespace

TEST_CASE("plan_recompute: boundary tokens, written out", "[recompute]")
{
  // Prefix (id 1, 4 tokens) exact; facts of 3, 1 and 5 tokens at 4, 7, 8.
  composition const c = layout({4, 3, 1, 5});
  recompute_options o;
  o.exact                = 1;
  o.boundary_tokens      = 2;
  recompute_plan const p = plan_recompute(c, o);
  REQUIRE(p.eligible == 9);
  REQUIRE(p.tokens == std::vector<std::int64_t>{4, 5, 7, 8, 9});
  REQUIRE(p.runs.size() == 2);  // 4-5, then 7-9 (fact 3's only token joins fact 4's first two)
  REQUIRE(p.runs[0].begin == 4);
  REQUIRE(p.runs[0].length == 2);
  REQUIRE(p.runs[1].begin == 7);
  REQUIRE(p.runs[1].length == 3);
  REQUIRE(p.fraction() == Approx(5.0 / 9.0));

  o.boundary_tokens = 0;
  REQUIRE(plan_recompute(c, o).empty());
  o.exact.reset();
  o.boundary_tokens = 1;
  REQUIRE(plan_recompute(c, o).tokens == std::vector<std::int64_t>{0, 4, 7, 8});
}

TEST_CASE("plan_recompute: selective tokens, written out", "[recompute]")
{
  composition const c = layout({2, 4, 4});
  std::vector<float> const dev{9, 9, 0.5f, 3, 3, 1, 0, 7, 2, 3};
  recompute_options o;
  o.exact              = 1;    // tokens 0, 1 are the prefix: their 9s never count
  o.selective_fraction = 0.5;  // E = 8: 4 tokens
  // 7 (index 7), then the three 3s (indices 3, 4, 9), lower index first on ties: 3, 4; then 9.
  recompute_plan p = plan_recompute(c, o, dev);
  REQUIRE(p.tokens == std::vector<std::int64_t>{3, 4, 7, 9});
  REQUIRE(p.runs.size() == 3);
  // With the boundary token of each fact (indices 2 and 6) first, two more by deviation: 7, 3.
  o.boundary_tokens = 1;
  p                 = plan_recompute(c, o, dev);
  REQUIRE(p.tokens == std::vector<std::int64_t>{2, 3, 6, 7});
  // rho * E = 0.3125 * 8 = 2.5 rounds half away from zero: 3 tokens.
  o.boundary_tokens    = 0;
  o.selective_fraction = 0.3125;
  REQUIRE(plan_recompute(c, o, dev).tokens == std::vector<std::int64_t>{3, 4, 7});
  // Boundary tokens beyond rho's count stay (rho is a share in all, never a cut).
  o.boundary_tokens    = 2;
  o.selective_fraction = 0.25;
  REQUIRE(plan_recompute(c, o, dev).tokens == std::vector<std::int64_t>{2, 3, 6, 7});
  o.selective_fraction = 1.0;
  REQUIRE(plan_recompute(c, o, dev).tokens.size() == 8);
}

TEST_CASE("plan_recompute matches a brute-force selection on random layouts", "[recompute]")
{
  std::mt19937_64 rng{20261205};
  for (int trial = 0; trial < 400; ++trial) {
    CAPTURE(trial);
    std::vector<std::int32_t> lengths(1 + rng() % 12);
    for (auto& l : lengths) {
      l = static_cast<std::int32_t>(1 + rng() % 20);
    }
    composition const c = layout(lengths, static_cast<std::int64_t>(rng() % 1000));
    std::vector<float> dev(static_cast<std::size_t>(c.length()));
    for (auto& d : dev) {
      d = static_cast<float>(rng() % 8) * 0.25f;  // few distinct values: many ties
    }
    recompute_options o;
    if (rng() % 2) { o.exact = 1 + rng() % lengths.size(); }
    o.boundary_tokens    = static_cast<std::int32_t>(rng() % 5);
    o.selective_fraction = double(rng() % 101) / 100.0;
    CAPTURE(lengths, o.boundary_tokens, o.selective_fraction);
    recompute_plan const p = plan_recompute(c, o, dev);
    check_against(p, brute_force(lengths, o.exact, o.boundary_tokens, o.selective_fraction, dev));
  }
}

TEST_CASE("plan_recompute refuses bad options and deviations", "[recompute]")
{
  composition const c = layout({3, 5});
  std::vector<float> const dev(8, 1.0f);
  recompute_options o;
  o.boundary_tokens = -1;
  REQUIRE_THROWS_WITH(plan_recompute(c, o), Contains("boundary_tokens must be >= 0"));
  o.boundary_tokens = 0;
  for (double rho : {-0.01, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    o.selective_fraction = rho;
    REQUIRE_THROWS_WITH(plan_recompute(c, o, dev),
                        Contains("selective_fraction must be in [0, 1]"));
  }
  o.selective_fraction = 0.5;
  o.exact              = 7;
  REQUIRE_THROWS_WITH(plan_recompute(c, o, dev),
                      Contains("exact fact 7 is not in the composition"));
  o.exact.reset();
  REQUIRE_THROWS_WITH(plan_recompute(c, o),
                      Contains("needs one deviation per segment token (8), got 0"));
  REQUIRE_THROWS_WITH(plan_recompute(c, o, std::vector<float>(7, 1.0f)), Contains("got 7"));
  std::vector<float> bad = dev;
  bad[5]                 = -1.0f;
  REQUIRE_THROWS_WITH(plan_recompute(c, o, bad), Contains("segment token 5"));
  bad[5] = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_WITH(plan_recompute(c, o, bad), Contains("must be finite"));
  // Deviations are not needed when the boundary already meets rho's count.
  o.boundary_tokens = 3;
  REQUIRE(plan_recompute(c, o).tokens == std::vector<std::int64_t>{0, 1, 2, 3, 4, 5});
}

TEST_CASE("kv_deviation sums the squared K and V differences of one layer", "[recompute]")
{
  // Geometry: 2 layers, 2 heads, head_dim 2. Stored values are small multiples of 1/4 (exact in
  // fp32, fp16 and bf16); the in-context rows add a known offset per token.
  kv_geometry const g{2, 2, 2};
  auto const store_dtype = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(store_dtype);
  kv_store_config cfg;
  cfg.model       = g;
  cfg.store_dtype = store_dtype;
  cfg.page_size   = 2;
  cfg.num_pages   = 16;
  cfg.space       = memory_space::host;
  kv_store store{cfg};
  auto stored = [](std::uint64_t id, int kv, int l, std::int64_t t, int h, int d) {
    return 0.25f *
           static_cast<float>(
             (static_cast<int>(id) * 7 + kv * 5 + l * 3 + static_cast<int>(t) + h * 2 + d) % 13);
  };
  std::vector<std::int32_t> const lengths{3, 2};
  for (std::uint64_t id : {1u, 2u}) {
    std::int64_t const n = lengths[id - 1];
    std::vector<float> k(static_cast<std::size_t>(2 * n * 4)), v(k.size());
    for (int l = 0; l < 2; ++l) {
      for (std::int64_t t = 0; t < n; ++t) {
        for (int h = 0; h < 2; ++h) {
          for (int d = 0; d < 2; ++d) {
            std::size_t const i = static_cast<std::size_t>(((l * n + t) * 2 + h) * 2 + d);
            k[i]                = stored(id, 0, l, t, h, d);
            v[i]                = stored(id, 1, l, t, h, d);
          }
        }
      }
    }
    store.insert(id,
                 0,
                 std::vector<std::int32_t>(static_cast<std::size_t>(n), 5),
                 make_fact_kv_view<float const>(k.data(), 2, n, 2, 2),
                 make_fact_kv_view<float const>(v.data(), 2, n, 2, 2));
  }
  compose_options co;
  co.order                 = fact_order::as_given;
  composition const c      = compose(store, {2, 1}, co);  // fact 2 (2 tokens), then fact 1 (3)
  std::int32_t const layer = 1;
  // In context: token j's K differs by j/2 in every element, its V by 1 in element (0, 0) only.
  std::vector<float> kc(5 * 4), vc(5 * 4);
  for (std::int64_t j = 0; j < 5; ++j) {
    std::uint64_t const id = j < 2 ? 2 : 1;
    std::int64_t const t   = j < 2 ? j : j - 2;
    for (int h = 0; h < 2; ++h) {
      for (int d = 0; d < 2; ++d) {
        std::size_t const i = static_cast<std::size_t>((j * 2 + h) * 2 + d);
        kc[i]               = stored(id, 0, layer, t, h, d) + 0.5f * static_cast<float>(j);
        vc[i]               = stored(id, 1, layer, t, h, d) + ((h == 0 && d == 0) ? 1.0f : 0.0f);
      }
    }
  }
  auto const kv                = make_token_head_view<float const>(kc.data(), 5, 2, 2);
  auto const vv                = make_token_head_view<float const>(vc.data(), 5, 2, 2);
  std::vector<float> const dev = kv_deviation(store, c, layer, kv, vv);
  REQUIRE(dev.size() == 5);
  for (std::int64_t j = 0; j < 5; ++j) {
    CAPTURE(j);
    double const dk = 0.5 * double(j);
    REQUIRE(dev[static_cast<std::size_t>(j)] == Approx(4 * dk * dk + 1.0).margin(1e-6));
  }
  // Layer 0 (the in-context rows are layer 1's): differs, so the layer is really read.
  REQUIRE(kv_deviation(store, c, 0, kv, vv) != dev);

  REQUIRE_THROWS_WITH(kv_deviation(store, c, 2, kv, vv), Contains("layer 2 outside"));
  auto const short_k = make_token_head_view<float const>(kc.data(), 4, 2, 2);
  REQUIRE_THROWS_WITH(kv_deviation(store, c, 1, short_k, vv), Contains("expected [5, 2, 2]"));
  composition stale        = c;
  stale.segments[0].length = 3;
  REQUIRE_THROWS_WITH(kv_deviation(store, stale, 1, kv, vv),
                      Contains("fact 2 is not in the store"));
}
