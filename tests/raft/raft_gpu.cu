/**
 * @file raft_gpu.cu
 * @brief Checks the RAFT pieces InferScale builds on (select_k, gemm) on the device against
 * brute-force host loops written out here (raft_host.cpp: the checks that need no device).
 */
#include <raft/core/device_mdarray.hpp>
#include <raft/core/device_resources.hpp>
#include <raft/core/host_mdspan.hpp>
#include <raft/core/resource/cuda_stream.hpp>
#include <raft/core/resources.hpp>
#include <raft/linalg/gemm.cuh>
#include <raft/matrix/select_k.cuh>

// select_k<float, int64> from the build's one compiled instance (cmake/device_instances.cu).
#include <inferscale/detail/index/select_k_instance.hpp>

#include <raft/util/cudart_utils.hpp>
#include <raft/version_config.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

static_assert(RAFT_VERSION_MAJOR == 26 && RAFT_VERSION_MINOR == 10,
              "InferScale is pinned to RAFT 26.10 (the libraft-cu13==26.10.* wheel)");

namespace {

template <class T>
std::vector<T> to_host(raft::resources const& res, T const* device, std::size_t n)
{
  std::vector<T> host(n);
  raft::copy(host.data(), device, n, raft::resource::get_cuda_stream(res));
  raft::resource::sync_stream(res);
  return host;
}

template <class T>
void to_device(raft::resources const& res, T* device, std::vector<T> const& host)
{
  raft::copy(device, host.data(), host.size(), raft::resource::get_cuda_stream(res));
}

}  // namespace

TEST_CASE("raft::matrix::select_k matches a host sort", "[raft][gpu]")
{
  raft::device_resources res;

  std::int64_t const rows = 4;
  auto const len          = GENERATE(as<std::int64_t>{}, 1000, 33333);
  auto const k            = GENERATE(as<std::int64_t>{}, 1, 10, 128);
  bool const select_min   = GENERATE(true, false);
  CAPTURE(rows, len, k, select_min);

  // Distinct keys (a shuffled ramp per row), so the k selected indices are unique.
  std::mt19937 rng{20240917u};
  std::vector<float> keys(static_cast<std::size_t>(rows * len));
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<std::int64_t> perm(static_cast<std::size_t>(len));
    std::iota(perm.begin(), perm.end(), std::int64_t{0});
    std::shuffle(perm.begin(), perm.end(), rng);
    for (std::int64_t c = 0; c < len; ++c) {
      keys[static_cast<std::size_t>(r * len + c)] =
        0.25f * static_cast<float>(perm[static_cast<std::size_t>(c)]) - 100.0f;
    }
  }

  auto in_val  = raft::make_device_matrix<float, std::int64_t>(res, rows, len);
  auto out_val = raft::make_device_matrix<float, std::int64_t>(res, rows, k);
  auto out_idx = raft::make_device_matrix<std::int64_t, std::int64_t>(res, rows, k);
  to_device(res, in_val.data_handle(), keys);

  raft::matrix::select_k<float, std::int64_t>(res,
                                              raft::make_const_mdspan(in_val.view()),
                                              std::nullopt,
                                              out_val.view(),
                                              out_idx.view(),
                                              select_min,
                                              /*sorted=*/true);

  auto const got_val = to_host(res, out_val.data_handle(), static_cast<std::size_t>(rows * k));
  auto const got_idx = to_host(res, out_idx.data_handle(), static_cast<std::size_t>(rows * k));

  for (std::int64_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    std::vector<std::int64_t> order(static_cast<std::size_t>(len));
    std::iota(order.begin(), order.end(), std::int64_t{0});
    auto const key = [&](std::int64_t c) { return keys[static_cast<std::size_t>(r * len + c)]; };
    std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      return select_min ? key(a) < key(b) : key(a) > key(b);
    });
    for (std::int64_t j = 0; j < k; ++j) {
      CAPTURE(j);
      auto const at = static_cast<std::size_t>(r * k + j);
      REQUIRE(got_idx[at] == order[static_cast<std::size_t>(j)]);
      REQUIRE(got_val[at] == key(order[static_cast<std::size_t>(j)]));
    }
  }
}

TEST_CASE("raft::linalg::gemm matches a host triple loop", "[raft][gpu]")
{
  raft::device_resources res;

  // Odd sizes; small integer entries so that every product and sum is exact in fp32 (and TF32).
  std::int64_t const m = 33, n = 17, kk = 37;
  float alpha = 1.5f, beta = 0.5f;
  std::mt19937 rng{7u};
  std::uniform_int_distribution<int> small{-4, 4};
  auto fill = [&](std::size_t size) {
    std::vector<float> v(size);
    for (auto& x : v) {
      x = static_cast<float>(small(rng));
    }
    return v;
  };
  auto const x_host  = fill(static_cast<std::size_t>(m * kk));  // m x kk
  auto const y_host  = fill(static_cast<std::size_t>(kk * n));  // kk x n
  auto const z0_host = fill(static_cast<std::size_t>(m * n));   // m x n, scaled by beta

  // Reference with every operand row-major: z = alpha * x y + beta * z0.
  std::vector<double> expected(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (std::int64_t p = 0; p < kk; ++p) {
        acc += double(x_host[static_cast<std::size_t>(i * kk + p)]) *
               double(y_host[static_cast<std::size_t>(p * n + j)]);
      }
      expected[static_cast<std::size_t>(i * n + j)] =
        alpha * acc + beta * double(z0_host[static_cast<std::size_t>(i * n + j)]);
    }
  }

  SECTION("row-major operands")
  {
    auto x = raft::make_device_matrix<float, std::int64_t>(res, m, kk);
    auto y = raft::make_device_matrix<float, std::int64_t>(res, kk, n);
    auto z = raft::make_device_matrix<float, std::int64_t>(res, m, n);
    to_device(res, x.data_handle(), x_host);
    to_device(res, y.data_handle(), y_host);
    to_device(res, z.data_handle(), z0_host);
    raft::linalg::gemm(res,
                       x.view(),
                       y.view(),
                       z.view(),
                       std::make_optional(raft::make_host_scalar_view(&alpha)),
                       std::make_optional(raft::make_host_scalar_view(&beta)));
    auto const got = to_host(res, z.data_handle(), static_cast<std::size_t>(m * n));
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        CAPTURE(i, j);
        REQUIRE(got[static_cast<std::size_t>(i * n + j)] ==
                Approx(expected[static_cast<std::size_t>(i * n + j)]).margin(1e-4));
      }
    }
  }

  SECTION("column-major output, mixed inputs")
  {
    // y and z column-major: transpose the host copies.
    std::vector<float> y_col(y_host.size()), z0_col(z0_host.size());
    for (std::int64_t p = 0; p < kk; ++p) {
      for (std::int64_t j = 0; j < n; ++j) {
        y_col[static_cast<std::size_t>(j * kk + p)] = y_host[static_cast<std::size_t>(p * n + j)];
      }
    }
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        z0_col[static_cast<std::size_t>(j * m + i)] = z0_host[static_cast<std::size_t>(i * n + j)];
      }
    }
    auto x = raft::make_device_matrix<float, std::int64_t>(res, m, kk);
    auto y = raft::make_device_matrix<float, std::int64_t, raft::col_major>(res, kk, n);
    auto z = raft::make_device_matrix<float, std::int64_t, raft::col_major>(res, m, n);
    to_device(res, x.data_handle(), x_host);
    to_device(res, y.data_handle(), y_col);
    to_device(res, z.data_handle(), z0_col);
    raft::linalg::gemm(res,
                       x.view(),
                       y.view(),
                       z.view(),
                       std::make_optional(raft::make_host_scalar_view(&alpha)),
                       std::make_optional(raft::make_host_scalar_view(&beta)));
    auto const got = to_host(res, z.data_handle(), static_cast<std::size_t>(m * n));
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        CAPTURE(i, j);
        REQUIRE(got[static_cast<std::size_t>(j * m + i)] ==
                Approx(expected[static_cast<std::size_t>(i * n + j)]).margin(1e-4));
      }
    }
  }
}
