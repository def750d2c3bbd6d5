/**
 * @file gaussian_mixture.hpp
 * @brief Realistic embedding-like test data (reference/ann.md, section 7): a mixture of Gaussian
 * clusters with anisotropic per-centre scales, L2-normalised, and queries drawn from the same
 * mixture (held-out points). Deterministic for a seed. Shared by tests, benchmarks and examples.
 */
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace inferscale::test {

struct mixture_spec {
  std::int64_t dim{384};
  std::int64_t centres{100};
  bool normalise{true};  ///< L2-normalise every point (cosine / inner-product data)
  std::uint64_t seed{1};
};

/// @brief A mixture; `draw(n)` returns n row-major points (fp32, `n * dim`).
class gaussian_mixture {
 public:
  explicit gaussian_mixture(mixture_spec const& spec) : spec_(spec), rng_(spec.seed)
  {
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> uniform(0.2f, 0.8f);
    centres_.resize(static_cast<std::size_t>(spec.centres * spec.dim));
    scales_.resize(centres_.size());
    for (auto& c : centres_) {
      c = normal(rng_);
    }
    // anisotropic: each centre has its own per-dimension spread
    for (auto& s : scales_) {
      s = uniform(rng_);
    }
  }

  std::vector<float> draw(std::int64_t n)
  {
    std::normal_distribution<float> normal;
    std::vector<float> out(static_cast<std::size_t>(n * spec_.dim));
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t const c =
        static_cast<std::int64_t>(rng_() % static_cast<std::uint64_t>(spec_.centres));
      double norm2 = 0.0;
      for (std::int64_t e = 0; e < spec_.dim; ++e) {
        std::size_t const at = static_cast<std::size_t>(c * spec_.dim + e);
        float const x        = centres_[at] + scales_[at] * normal(rng_);
        out[static_cast<std::size_t>(i * spec_.dim + e)] = x;
        norm2 += double{x} * x;
      }
      if (spec_.normalise && norm2 > 0.0) {
        float const inv = static_cast<float>(1.0 / std::sqrt(norm2));
        for (std::int64_t e = 0; e < spec_.dim; ++e) {
          out[static_cast<std::size_t>(i * spec_.dim + e)] *= inv;
        }
      }
    }
    return out;
  }

  mixture_spec const& spec() const noexcept { return spec_; }

 private:
  mixture_spec spec_;
  std::mt19937_64 rng_;
  std::vector<float> centres_;
  std::vector<float> scales_;
};

}  // namespace inferscale::test
