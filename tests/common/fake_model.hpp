// Small fake model adapters for the encoding and memory tests: K and V of a token are a function
// of every token it sees (itself included) and its position, so a fact stored from the wrong
// context, or at the wrong position, is caught. Free of Catch macros.
#pragma once

#include <inferscale/encoding.hpp>

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace inferscale_test::fake {

using namespace inferscale;

inline kv_geometry const tiny{2, 1, 4};

/// K and V of a token are a function of every token it sees (itself included) and its position:
/// K[l][d] = (sum of tokens seen * (l + 1) * (d + 1)) mod 997 + position / 8, V = K + 0.5.
/// Small integers and eighths: exact in fp32.
inline void fake_row(
  std::vector<std::int32_t> const& seen, std::int64_t position, std::int32_t l, float* k, float* v)
{
  std::int64_t sum = 0;
  for (std::int32_t t : seen) {
    sum += t % 1000;
  }
  for (int d = 0; d < 4; ++d) {
    k[d] = static_cast<float>((sum * (l + 1) * (d + 1)) % 997) + static_cast<float>(position) / 8;
    v[d] = k[d] + 0.5f;
  }
}

inline void write_row(kv_capture& out,
                      std::int64_t row,
                      std::vector<std::int32_t> const& seen,
                      std::int64_t position)
{
  for (std::int32_t l = 0; l < tiny.num_layers; ++l) {
    float k[4], v[4];
    fake_row(seen, position, l, k, v);
    out.write_keys(l, row, make_token_head_view<float const>(k, 1, 1, 4));
    out.write_values(l, row, make_token_head_view<float const>(v, 1, 1, 4));
  }
}

struct plain_model {
  std::int64_t forwards{0};
  std::int64_t fail_at{-1};  // throw on this forward
  kv_geometry geometry() const { return tiny; }
  rope_params rotation() const
  {
    rope_spec spec;
    spec.head_dim = 4;
    return make_rope_params(spec);
  }
  void encode(std::vector<std::int32_t> const& tokens, std::int64_t p0, kv_capture& out)
  {
    if (forwards++ == fail_at) { throw std::runtime_error("fake engine failure"); }
    std::vector<std::int32_t> seen;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      seen.push_back(tokens[i]);
      write_row(out, static_cast<std::int64_t>(i), seen, p0 + static_cast<std::int64_t>(i));
    }
  }
};

struct branching_model : plain_model {
  std::int64_t trunks{0};
  void encode_branches(std::vector<std::int32_t> const& trunk,
                       std::int64_t p0,
                       std::vector<encoding_branch> const& branches,
                       kv_capture& out)
  {
    if (forwards++ == fail_at) { throw std::runtime_error("fake engine failure"); }
    ++trunks;
    (void)p0;
    std::int64_t row = 0;
    for (encoding_branch const& b : branches) {
      std::vector<std::int32_t> seen(trunk.begin(), trunk.begin() + b.attach);
      for (std::size_t j = 0; j < b.token_ids.size(); ++j) {
        seen.push_back(b.token_ids[j]);
        write_row(out, row++, seen, b.position + static_cast<std::int64_t>(j));
      }
    }
  }
};

}  // namespace inferscale_test::fake
