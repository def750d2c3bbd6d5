/**
 * @file detail/store/pool.inl
 * @brief Definitions for store.hpp: the pool's host and device buffers — writing a fact's K/V
 * into its pages from host or device views (after the finiteness check), stream-ordered on the
 * caller's stream for a device pool, and copying the whole pool back to host memory.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/cuda_error.hpp>  // the CUDA runtime, or its CPU-only stand-in
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace inferscale {

inline std::vector<unsigned char> kv_store::pool_to_host() const
{
  std::vector<unsigned char> out(pool_bytes());
  if (config_.space == memory_space::device) {
    INFERSCALE_CUDA_TRY(cudaMemcpy(out.data(), ref_.pool, out.size(), cudaMemcpyDeviceToHost));
  } else if (!out.empty()) {
    std::memcpy(out.data(), ref_.pool, out.size());
  }
  return out;
}

inline void kv_store::scrub_pages(std::vector<std::int64_t> const& pages, cudaStream_t stream)
{
  for (std::int64_t p : pages) {
    INFERSCALE_EXPECTS(p >= 0 && p < config_.num_pages,
                       "kv_store::scrub_pages: page " + std::to_string(p) + " outside the pool's " +
                         std::to_string(config_.num_pages));
  }
  if (pages.empty()) { return; }
  std::size_t const bytes          = page_bytes();
  auto* const pool                 = static_cast<unsigned char*>(ref_.pool);
  bool const device                = config_.space == memory_space::device;
  std::vector<std::int64_t> sorted = pages;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t first = 0; first < sorted.size();) {
    std::size_t last = first + 1;  // a run of consecutive pages: one memset
    while (last < sorted.size() && sorted[last] <= sorted[last - 1] + 1) {
      ++last;
    }
    unsigned char* const at = pool + static_cast<std::size_t>(sorted[first]) * bytes;
    std::size_t const n = static_cast<std::size_t>(sorted[last - 1] - sorted[first] + 1) * bytes;
    if (device) {
      INFERSCALE_CUDA_TRY(cudaMemsetAsync(at, 0, n, stream));
    } else {
      std::memset(at, 0, n);
    }
    first = last;
  }
}

inline void kv_store::scrub_pages(std::vector<std::int64_t> const& pages)
{
  scrub_pages(pages, cudaStream_t{});
  // A later write of these pages on any stream must not be overtaken by the zeroing: wait for
  // the default stream (not the device).
  if (!pages.empty() && config_.space == memory_space::device) {
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(cudaStream_t{}));
  }
}

template <class T>
void kv_store::check_finite(std::uint64_t fact_id,
                            fact_kv_view<T const> keys,
                            fact_kv_view<T const> values,
                            std::int32_t layer_offset,
                            std::int32_t head_offset,
                            memory_space views_space,
                            cudaStream_t stream) const
{
  dispatch_dtype(config_.store_dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, half_t> ||
                  std::is_same_v<S, bfloat16_t>) {
      std::int64_t const tokens = keys.extent(1);
      std::int32_t const heads  = config_.num_heads;
      std::int32_t const d      = config_.model.head_dim;
      std::int64_t const row    = ref_.row_elements();
      bool const device         = views_space == memory_space::device;
      std::vector<T> staging(device ? static_cast<std::size_t>(tokens * row) : 0);
      for (std::int32_t l = 0; l < config_.num_layers; ++l) {
        for (std::int32_t kv = 0; kv < 2; ++kv) {
          auto const& src = kv == 0 ? keys : values;
          if (device) {  // each token's [heads, head_dim] is contiguous (checked by insert)
            // On the caller's stream, so the read follows the work that produced the views.
            INFERSCALE_CUDA_TRY(
              cudaMemcpy2DAsync(staging.data(),
                                static_cast<std::size_t>(row) * sizeof(T),
                                &src(l + layer_offset, 0, head_offset, 0),
                                static_cast<std::size_t>(src.stride(1)) * sizeof(T),
                                static_cast<std::size_t>(row) * sizeof(T),
                                static_cast<std::size_t>(tokens),
                                cudaMemcpyDeviceToHost,
                                stream));
            INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream));
          }
          for (std::int64_t t = 0; t < tokens; ++t) {
            for (std::int32_t h = 0; h < heads; ++h) {
              for (std::int32_t e = 0; e < d; ++e) {
                float const x = device
                                  ? to_float(staging[static_cast<std::size_t>(t * row + h * d + e)])
                                  : to_float(src(l + layer_offset, t, h + head_offset, e));
                if (std::isfinite(x) && std::isfinite(to_float(from_float<S>(x)))) { continue; }
                char text[48], limit[48];
                std::snprintf(text, sizeof text, "%g", static_cast<double>(x));
                std::snprintf(limit, sizeof limit, "%g", static_cast<double>(max_finite<S>()));
                INFERSCALE_FAIL(
                  "kv_store::insert: fact " + std::to_string(fact_id) + " has a " +
                  (kv == 0 ? "key" : "value") + " element " + text + " at layer " +
                  std::to_string(l + layer_offset) + ", token " + std::to_string(t) + ", head " +
                  std::to_string(h + head_offset) + ", dim " + std::to_string(e) +
                  (std::isfinite(x)
                     ? std::string{" that overflows the store dtype "} +
                         to_string(config_.store_dtype) + " (largest finite " + limit + ")"
                     : std::string{": NaN and infinities are refused"}));
              }
            }
          }
        }
      }
    }
  });
}

template <class T>
void kv_store::copy_from_host(fact_record const& record,
                              fact_kv_view<T const> keys,
                              fact_kv_view<T const> values,
                              std::int32_t layer_offset,
                              std::int32_t head_offset,
                              cudaStream_t stream)
{
  dispatch_dtype(config_.store_dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, half_t> ||
                  std::is_same_v<S, bfloat16_t>) {
      std::int64_t const row    = ref_.row_elements();
      std::int32_t const ps     = config_.page_size;
      std::int32_t const d      = config_.model.head_dim;
      std::int64_t const pe     = page_elements();
      bool const device         = config_.space == memory_space::device;
      std::size_t const n_pages = record.pages.size();
      // Host store: write pages in place. Device store: pack the whole fact into one page-locked
      // buffer (so the copies are truly asynchronous), then one copy per page on `stream`.
      device_buffer<S> staging;
      if (device) {
        staging = device_buffer<S>(
          n_pages * static_cast<std::size_t>(pe), cudaStream_t{}, pinned_host_resource());
      }
      for (std::size_t p = 0; p < n_pages; ++p) {
        S* const page = device ? staging.data() + p * static_cast<std::size_t>(pe)
                               : static_cast<S*>(ref_.pool) + record.pages[p] * pe;
        for (std::int32_t l = 0; l < config_.num_layers; ++l) {
          for (std::int32_t kv = 0; kv < 2; ++kv) {
            auto const& src = kv == 0 ? keys : values;
            for (std::int32_t t = 0; t < ps; ++t) {
              std::int64_t const token = static_cast<std::int64_t>(p) * ps + t;
              S* const dst = page + ((static_cast<std::int64_t>(l) * 2 + kv) * ps + t) * row;
              if (token >= record.length()) {
                std::fill(dst, dst + row, S{});
                continue;
              }
              for (std::int32_t h = 0; h < config_.num_heads; ++h) {
                for (std::int32_t e = 0; e < d; ++e) {
                  dst[static_cast<std::int64_t>(h) * d + e] =
                    from_float<S>(to_float(src(l + layer_offset, token, h + head_offset, e)));
                }
              }
            }
          }
        }
      }
      if (!device) { return; }
      try {
        for (std::size_t p = 0; p < n_pages; ++p) {
          INFERSCALE_CUDA_TRY(cudaMemcpyAsync(static_cast<S*>(ref_.pool) + record.pages[p] * pe,
                                              staging.data() + p * static_cast<std::size_t>(pe),
                                              static_cast<std::size_t>(pe) * sizeof(S),
                                              cudaMemcpyHostToDevice,
                                              stream));
        }
        // The staging buffer is freed on return: wait for `stream` (not the device), which also
        // makes the fact visible to work enqueued next on any stream.
        INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream));
      } catch (...) {
        (void)cudaStreamSynchronize(stream);  // copies already enqueued still read the buffer
        throw;
      }
    }
  });
}

namespace detail {
/**
 * @brief Quantizes layer rows of one page into its compressed K and V blocks (compression.hpp):
 * `at(kv, t, h, e)` is element e of head h of the page's token t (t < `tokens`, the fact's tokens
 * in this page); rows from `tokens` to page_size get code 0 and stay out of the key scales.
 */
template <class At>
void quantize_page_layer(compressed_block_layout const& b,
                         unsigned char* kblock,
                         unsigned char* vblock,
                         std::int32_t tokens,
                         At const& at)
{
  std::int32_t const d = b.head_dim;
  bool const int4      = b.compression == kv_compression::int4;
  for (std::int32_t kv = 0; kv < 2; ++kv) {
    unsigned char* const block = kv == 0 ? kblock : vblock;
    std::memset(block, 0, static_cast<std::size_t>(b.block_bytes(kv)));
    unsigned char* const scales = block + b.scales_offset();
    kv_compression const c      = b.compression;
    if (kv == 0) {  // per channel over the page's tokens
      for (std::int32_t h = 0; h < b.num_heads; ++h) {
        for (std::int32_t e = 0; e < d; ++e) {
          float amax = 0.0f;
          for (std::int32_t t = 0; t < tokens; ++t) {
            amax = std::max(amax, std::fabs(at(0, t, h, e)));
          }
          set_scale(scales, static_cast<std::int64_t>(h) * d + e, group_scale(amax, c), c);
        }
      }
    } else {  // per token and head
      for (std::int32_t t = 0; t < tokens; ++t) {
        for (std::int32_t h = 0; h < b.num_heads; ++h) {
          float amax = 0.0f;
          for (std::int32_t e = 0; e < d; ++e) {
            amax = std::max(amax, std::fabs(at(1, t, h, e)));
          }
          set_scale(
            scales, static_cast<std::int64_t>(t) * b.num_heads + h, group_scale(amax, c), c);
        }
      }
    }
    for (std::int32_t t = 0; t < tokens; ++t) {
      for (std::int32_t h = 0; h < b.num_heads; ++h) {
        unsigned char* const codes =
          block + static_cast<std::int64_t>(t) * b.row_code_bytes() + h * b.head_code_bytes();
        for (std::int32_t e = 0; e < d; ++e) {
          float const scale       = scale_at(scales,
                                       kv == 0 ? static_cast<std::int64_t>(h) * d + e
                                                     : static_cast<std::int64_t>(t) * b.num_heads + h,
                                       c);
          std::uint8_t const code = encode(at(kv, t, h, e), scale, c);
          if (int4) {
            codes[e / 2] = static_cast<unsigned char>(codes[e / 2] | (code << ((e % 2) * 4)));
          } else {
            codes[e] = code;
          }
        }
      }
    }
  }
}
}  // namespace detail

template <class T>
void kv_store::copy_compressed(fact_record const& record,
                               fact_kv_view<T const> keys,
                               fact_kv_view<T const> values,
                               std::int32_t layer_offset,
                               std::int32_t head_offset,
                               memory_space views_space,
                               cudaStream_t stream)
{
  std::int32_t const ps = config_.page_size;
  std::int32_t const d  = config_.model.head_dim;
  std::int32_t const H  = config_.num_heads;
  std::int64_t const c  = record.length();
  // Device views: the shard's rows copied to the host once ([L][c][H][D]), then as host views.
  std::vector<T> host_rows;
  if (views_space == memory_space::device) {
    std::int64_t const row = static_cast<std::int64_t>(H) * d;
    host_rows.resize(static_cast<std::size_t>(2 * config_.num_layers * c * row));
    for (std::int32_t l = 0; l < config_.num_layers; ++l) {
      for (std::int32_t kv = 0; kv < 2; ++kv) {
        auto const& src = kv == 0 ? keys : values;
        INFERSCALE_CUDA_TRY(
          cudaMemcpy2DAsync(host_rows.data() + ((kv * config_.num_layers + l) * c) * row,
                            static_cast<std::size_t>(row) * sizeof(T),
                            &src(l + layer_offset, 0, head_offset, 0),
                            static_cast<std::size_t>(src.stride(1)) * sizeof(T),
                            static_cast<std::size_t>(row) * sizeof(T),
                            static_cast<std::size_t>(c),
                            cudaMemcpyDeviceToHost,
                            stream));
      }
    }
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream));
  }
  auto const element = [&](std::int32_t kv,
                           std::int32_t l,
                           std::int64_t token,
                           std::int32_t h,
                           std::int32_t e) -> float {
    if (!host_rows.empty()) {
      return to_float(host_rows[static_cast<std::size_t>(
        (((kv * config_.num_layers + l) * c + token) * H + h) * d + e)]);
    }
    auto const& src = kv == 0 ? keys : values;
    return to_float(src(l + layer_offset, token, h + head_offset, e));
  };
  compressed_block_layout const b = ref_.blocks();
  std::size_t const pb            = page_bytes();
  std::size_t const n_pages       = record.pages.size();
  bool const device               = config_.space == memory_space::device;
  device_buffer<unsigned char> staging;
  if (device) {
    staging = device_buffer<unsigned char>(n_pages * pb, cudaStream_t{}, pinned_host_resource());
  }
  for (std::size_t p = 0; p < n_pages; ++p) {
    unsigned char* const page = device ? staging.data() + p * pb
                                       : static_cast<unsigned char*>(ref_.pool) +
                                           static_cast<std::size_t>(record.pages[p]) * pb;
    std::int64_t const first  = static_cast<std::int64_t>(p) * ps;
    auto const tokens         = static_cast<std::int32_t>(std::min<std::int64_t>(ps, c - first));
    for (std::int32_t l = 0; l < config_.num_layers; ++l) {
      unsigned char* const kblock = page + static_cast<std::size_t>(l * b.layer_bytes());
      detail::quantize_page_layer(
        b,
        kblock,
        kblock + b.block_bytes(0),
        tokens,
        [&](std::int32_t kv, std::int32_t t, std::int32_t h, std::int32_t e) {
          return element(kv, l, first + t, h, e);
        });
    }
  }
  if (!device) { return; }
  try {
    for (std::size_t p = 0; p < n_pages; ++p) {
      INFERSCALE_CUDA_TRY(cudaMemcpyAsync(
        static_cast<unsigned char*>(ref_.pool) + static_cast<std::size_t>(record.pages[p]) * pb,
        staging.data() + p * pb,
        pb,
        cudaMemcpyHostToDevice,
        stream));
    }
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream));  // the staging buffer is freed on return
  } catch (...) {
    (void)cudaStreamSynchronize(stream);
    throw;
  }
}

template <class T>
void kv_store::copy_from_device(fact_record const& record,
                                fact_kv_view<T const> keys,
                                fact_kv_view<T const> values,
                                std::int32_t layer_offset,
                                std::int32_t head_offset,
                                cudaStream_t stream)
{
  std::int64_t const row = ref_.row_elements();
  std::int32_t const ps  = config_.page_size;
  for (std::size_t p = 0; p < record.pages.size(); ++p) {
    std::int64_t const first = static_cast<std::int64_t>(p) * ps;
    std::int64_t const n     = std::min<std::int64_t>(ps, record.length() - first);
    for (std::int32_t l = 0; l < config_.num_layers; ++l) {
      for (std::int32_t kv = 0; kv < 2; ++kv) {
        auto const& src = kv == 0 ? keys : values;
        T* const dst    = static_cast<T*>(ref_.pool) + ref_.row_offset(record.pages[p] * ps, l, kv);
        T const* const from = &src(l + layer_offset, first, head_offset, 0);
        INFERSCALE_CUDA_TRY(cudaMemcpy2DAsync(dst,
                                              static_cast<std::size_t>(row) * sizeof(T),
                                              from,
                                              static_cast<std::size_t>(src.stride(1)) * sizeof(T),
                                              static_cast<std::size_t>(row) * sizeof(T),
                                              static_cast<std::size_t>(n),
                                              cudaMemcpyDeviceToDevice,
                                              stream));
        if (n < ps) {  // zero the unused rows, as the host path does
          INFERSCALE_CUDA_TRY(cudaMemsetAsync(
            dst + n * row, 0, static_cast<std::size_t>((ps - n) * row) * sizeof(T), stream));
        }
      }
    }
  }
  // Not waited for: the caller orders later work after `stream` (store.hpp, insert).
}

}  // namespace inferscale
