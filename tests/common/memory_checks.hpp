/**
 * @file memory_checks.hpp
 * @brief Catch2 checks over the memory facade's test fixtures (memory_fixtures.hpp, which stays
 * free of Catch): one step served two ways gave the same results.
 */
#pragma once

#include <inferscale/memory.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace inferscale_test::memory_fixtures {

/**
 * @brief `got` (a step served one way) equals `expected` (the same step served another way):
 * request by request the same fact ids, first position, token ids and commits of its sequence
 * (`got_commits[i]`, `expected_commits[i]`), and the same cache bytes, which the step wrote (not
 * every element is still the -1 the fixtures' caches start with).
 */
template <class Sequence, class ExpectedSequence>
void check_same_step(std::vector<inferscale::memory_request> const& got,
                     std::vector<inferscale::memory_request> const& expected,
                     std::vector<Sequence> const& got_sequences,
                     std::vector<ExpectedSequence> const& expected_sequences,
                     std::vector<float> const& got_cache,
                     std::vector<float> const& expected_cache)
{
  REQUIRE(got.size() == expected.size());
  REQUIRE(got_sequences.size() >= got.size());
  REQUIRE(expected_sequences.size() >= got.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].fact_ids == expected[i].fact_ids);
    CHECK(got[i].plan.first_position == expected[i].plan.first_position);
    CHECK(got[i].plan.token_ids == expected[i].plan.token_ids);
    CHECK(got_sequences[i].committed == expected_sequences[i].committed);
  }
  REQUIRE(got_cache.size() == expected_cache.size());
  CHECK(got_cache != std::vector<float>(got_cache.size(), -1.0f));
  CHECK(std::memcmp(got_cache.data(), expected_cache.data(), got_cache.size() * sizeof(float)) ==
        0);
}

}  // namespace inferscale_test::memory_fixtures
