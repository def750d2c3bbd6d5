/**
 * @file divergence.hpp
 * @brief How far one next-token distribution is from another, from two rows of logits: the KL
 * divergence (nats) and whether the argmax agrees. Shared by the fidelity tests and benchmarks of
 * the llama.cpp examples (softmax in double, through the log-sum-exp).
 */
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

namespace inferscale::llama_cpp {

/// @brief log softmax of a row of logits, in double.
inline std::vector<double> log_softmax(std::vector<float> const& logits)
{
  double top = -1e300;
  for (float x : logits) {
    top = std::max(top, double(x));
  }
  double sum = 0;
  for (float x : logits) {
    sum += std::exp(double(x) - top);
  }
  double const lse = top + std::log(sum);
  std::vector<double> out(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) {
    out[i] = double(logits[i]) - lse;
  }
  return out;
}

/// @brief KL(p || q) in nats of the distributions of two logit rows (0 for equal rows).
inline double kl_logits(std::vector<float> const& p_logits, std::vector<float> const& q_logits)
{
  std::vector<double> const lp = log_softmax(p_logits), lq = log_softmax(q_logits);
  double kl = 0;
  for (std::size_t i = 0; i < lp.size(); ++i) {
    kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  }
  return std::max(0.0, kl);
}

/// @brief KL(p || q) of two logit rows, and whether their argmax (lowest index on ties) agrees.
inline std::pair<double, bool> kl_top1(std::vector<float> const& p_logits,
                                       std::vector<float> const& q_logits)
{
  auto const ap = std::max_element(p_logits.begin(), p_logits.end()) - p_logits.begin();
  auto const aq = std::max_element(q_logits.begin(), q_logits.end()) - q_logits.begin();
  return {kl_logits(p_logits, q_logits), ap == aq};
}

}  // namespace inferscale::llama_cpp
