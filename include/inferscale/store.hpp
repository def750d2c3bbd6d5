/**
 * @file store.hpp
 * @brief The KV store: pre-RoPE keys and values of memory facts in a page pool (device memory, or
 * host memory for the host backend), keyed by 64-bit fact ids and grouped by namespace.
 *
 * Pool layout: `[num_pages][layers][2 (K, V)][page_size][heads][head_dim]` of the store dtype, so
 * a token's key (or value) row of one layer is `heads * head_dim` contiguous elements (16-byte
 * vector reads) and a fact of `c` tokens takes `ceil(c / page_size)` pages, not necessarily
 * adjacent. A store may hold a layer range and a head range of the model (a pipeline- or
 * tensor-parallel rank's shard).
 *
 * The catalogue (ids, namespaces, token ids, page lists) lives in host memory; only the pool lives
 * where `memory_space` says. The device pool needs the CUDA runtime (libcudart); a host store never
 * calls it. The views a fact is given in (fact_kv_view) are in views.hpp; the copies between those
 * views and the pool's host or device buffer are defined in detail/store/pool.inl, the checks of a
 * configuration in detail/store/config.inl.
 */
#pragma once

#include <inferscale/compression.hpp>
#include <inferscale/config.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/host_memory.hpp>
#include <inferscale/detail/math.hpp>
#include <inferscale/device_buffer.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/memory_resource.hpp>
#include <inferscale/memory_space.hpp>
#include <inferscale/views.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace inferscale {

/// @brief How to build a kv_store.
struct kv_store_config {
  kv_geometry model{};  ///< the whole model's KV geometry
  std::int32_t first_layer{0};
  std::int32_t num_layers{0};  ///< layers held from first_layer; 0 = through the last layer
  std::int32_t first_head{0};
  std::int32_t num_heads{0};           ///< KV heads held from first_head; 0 = through the last head
  dtype store_dtype{dtype::bfloat16};  ///< float32, float16 or bfloat16
  /// none: elements of store_dtype; fp8_e4m3 or int4: codes with scales (compression.hpp), which
  /// injection dequantizes to store_dtype. A compressed store takes host views and device views
  /// (quantized on the host) and is injected on both backends; extraction and the device capture
  /// write uncompressed stores only.
  kv_compression compression{kv_compression::none};
  std::int32_t page_size{16};  ///< tokens per page
  std::int64_t num_pages{0};   ///< capacity, allocated once
  memory_space space{memory_space::device};
  /// Host pools only: allocate the pool page-locked (`cudaMallocHost`), so copies between it and
  /// the device are truly asynchronous (the host tier of tier.hpp). Needs a CUDA device.
  bool pinned{false};
  /// Where a device pool (or a pinned host pool) is allocated, on the null stream; null: cudaMalloc
  /// (cudaMallocHost when pinned). Not owned: it must outlive the store. A plain host pool
  /// (huge-page host memory) takes none.
  memory_resource* resource{nullptr};
};

/**
 * @brief Trivially copyable view of a store's pool for kernels and the host backend.
 */
struct kv_store_ref {
  void* pool{};
  dtype store_dtype{dtype::bfloat16};
  std::int32_t num_layers{};
  std::int32_t num_heads{};
  std::int32_t head_dim{};
  std::int32_t page_size{};
  std::int64_t num_pages{};
  kv_compression compression{kv_compression::none};

  /// @brief Layout of a compressed page's blocks (meaningful when `compression != none`).
  INFERSCALE_HOST_DEVICE constexpr compressed_block_layout blocks() const noexcept
  {
    return compressed_block_layout{page_size, num_heads, head_dim, compression};
  }

  /// @brief Bytes of one layer of one page (K and V, with a compressed page's scales).
  INFERSCALE_HOST_DEVICE constexpr std::int64_t layer_bytes() const noexcept
  {
    return compression == kv_compression::none
             ? 2 * static_cast<std::int64_t>(page_size) * row_elements() *
                 static_cast<std::int64_t>(size_of(store_dtype))
             : blocks().layer_bytes();
  }

  /// @brief Byte offset of the K (`kv == 0`) or V block of `layer` of page `page` (compressed).
  INFERSCALE_HOST_DEVICE constexpr std::int64_t block_offset(std::int64_t page,
                                                             std::int32_t layer,
                                                             std::int32_t kv) const noexcept
  {
    return (page * num_layers + layer) * layer_bytes() + (kv == 0 ? 0 : blocks().block_bytes(0));
  }

  /// @brief Elements of one token's key (or value) row in one layer.
  INFERSCALE_HOST_DEVICE constexpr std::int64_t row_elements() const noexcept
  {
    return static_cast<std::int64_t>(num_heads) * head_dim;
  }

  /**
   * @brief Offset in elements of the K (`kv == 0`) or V (`kv == 1`) row of layer `layer` of store
   * token `store_token` (= page * page_size + offset in page). Uncompressed pools only.
   */
  INFERSCALE_HOST_DEVICE constexpr std::int64_t row_offset(std::int64_t store_token,
                                                           std::int32_t layer,
                                                           std::int32_t kv) const noexcept
  {
    detail::index_quotient const d = detail::index_divmod(store_token, page_size);
    return (((d.quotient * num_layers + layer) * 2 + kv) * page_size + d.remainder) *
           row_elements();
  }
};

/// @brief What the store knows of one fact.
struct fact_record {
  std::uint64_t fact_id{};
  std::uint64_t namespace_id{};
  std::vector<std::int32_t> token_ids;  ///< the fact's prompt tokens
  std::vector<std::int64_t> pages;      ///< pool pages, in token order

  std::int32_t length() const noexcept { return static_cast<std::int32_t>(token_ids.size()); }
};

namespace detail {
struct store_access;  // snapshot.hpp: save_store / load_store
}  // namespace detail

/**
 * @brief Move-only owner of a page pool and its catalogue.
 *
 * Every mutating call validates everything first and either completes or throws leaving the store
 * unchanged (catalogue and pool). `version()` changes on every successful mutation, so plans built
 * against an older state are refused at injection.
 */
class kv_store {
 public:
  /**
   * @brief Allocates the pool (`num_pages` pages) once.
   * @throw logic_error if the configuration is invalid; cuda_error if device allocation fails.
   */
  explicit kv_store(kv_store_config const& config) : config_{resolve(config)}
  {
    ref_                    = ref_layout();
    std::size_t const bytes = pool_bytes();
    if (config_.space == memory_space::device) {
      cuda_pool_ = device_buffer<unsigned char>(bytes, nullptr, config_.resource);
      // Zeroed like the host pool, so snapshots of either are repeatable and equal.
      INFERSCALE_CUDA_TRY(cudaMemset(cuda_pool_.data(), 0, std::max<std::size_t>(bytes, 1)));
      // The zeroing runs on the legacy default stream: wait for it (not the device), so a later
      // insert on a non-blocking stream cannot be overtaken by it.
      INFERSCALE_CUDA_TRY(cudaStreamSynchronize(cudaStream_t{}));
      ref_.pool = cuda_pool_.data();
    } else if (config_.pinned) {
      cuda_pool_ = device_buffer<unsigned char>(
        bytes, nullptr, config_.resource != nullptr ? config_.resource : pinned_host_resource());
      std::memset(cuda_pool_.data(), 0, std::max<std::size_t>(bytes, 1));
      ref_.pool = cuda_pool_.data();
    } else {
      host_pool_ = detail::host_allocation{bytes};  // zeroed; huge pages where the system allows
      ref_.pool  = host_pool_.data();
    }
    free_pages_.reserve(static_cast<std::size_t>(config_.num_pages));
    // Lowest page on top of the stack, so fresh stores fill pages in order.
    for (std::int64_t p = config_.num_pages; p-- > 0;) {
      free_pages_.push_back(p);
    }
  }

  kv_store(kv_store&& other) noexcept { swap(other); }
  kv_store& operator=(kv_store&& other) noexcept
  {
    if (this != &other) {
      kv_store tmp{std::move(other)};
      swap(tmp);
    }
    return *this;
  }
  kv_store(kv_store const&)            = delete;
  kv_store& operator=(kv_store const&) = delete;

  kv_store_config const& config() const noexcept { return config_; }
  /// @brief The shard's geometry: held layers, held heads, head_dim.
  kv_geometry geometry() const noexcept
  {
    return kv_geometry{config_.num_layers, config_.num_heads, config_.model.head_dim};
  }
  dtype store_dtype() const noexcept { return config_.store_dtype; }
  kv_compression compression() const noexcept { return config_.compression; }
  memory_space space() const noexcept { return config_.space; }
  std::int32_t page_size() const noexcept { return config_.page_size; }
  std::int64_t num_pages() const noexcept { return config_.num_pages; }
  std::int64_t free_pages() const noexcept { return static_cast<std::int64_t>(free_pages_.size()); }
  std::int64_t num_facts() const noexcept { return static_cast<std::int64_t>(facts_.size()); }
  std::uint64_t version() const noexcept { return version_; }
  /// @brief Identifies this store object across moves (plans record it).
  std::uint64_t identity() const noexcept { return identity_; }

  /// @brief Trivially copyable view of the pool.
  kv_store_ref ref() const noexcept { return ref_; }

  /// @brief Bytes of the whole pool.
  std::size_t pool_bytes() const noexcept
  {
    return static_cast<std::size_t>(config_.num_pages) * page_bytes();
  }

  /// @brief Bytes of one pool page (all held layers, K and V, `page_size` tokens; a compressed
  /// page's codes and scales).
  std::size_t page_bytes() const noexcept
  {
    return static_cast<std::size_t>(config_.num_layers) *
           static_cast<std::size_t>(ref_layout().layer_bytes());
  }

  /// @brief Pages a fact of `tokens` tokens takes.
  std::int64_t pages_for(std::int64_t tokens) const noexcept
  {
    return detail::ceil_div(tokens, config_.page_size);
  }

  bool contains(std::uint64_t fact_id) const { return facts_.count(fact_id) != 0; }

  /// @brief The record of a fact. @throw logic_error if the id is unknown.
  fact_record const& at(std::uint64_t fact_id) const
  {
    auto const it = facts_.find(fact_id);
    INFERSCALE_EXPECTS(it != facts_.end(), "kv_store: unknown fact id " + std::to_string(fact_id));
    return it->second;
  }

  /// @brief Store token index (page * page_size + offset) of token `offset` of `fact`.
  std::int64_t store_token(fact_record const& fact, std::int32_t offset) const noexcept
  {
    return fact.pages[static_cast<std::size_t>(offset / config_.page_size)] * config_.page_size +
           offset % config_.page_size;
  }

  /// @brief Bytes of K and V a fact of `tokens` tokens holds in this shard: `2·L·c·h·d·b`; for a
  /// compressed store, the bytes of its pages (codes and scales, whole pages).
  std::int64_t fact_bytes(std::int64_t tokens) const
  {
    if (config_.compression != kv_compression::none) {
      return pages_for(tokens) * static_cast<std::int64_t>(page_bytes());
    }
    return geometry().bytes(tokens, config_.store_dtype);
  }

  /// @brief Facts held in namespace `ns`.
  std::int64_t namespace_facts(std::uint64_t ns) const
  {
    auto const it = namespaces_.find(ns);
    return it == namespaces_.end() ? 0 : static_cast<std::int64_t>(it->second.facts.size());
  }

  /// @brief Bytes of K and V held for namespace `ns`: the sum of `2·L·c·h·d·b` over its facts (a
  /// compressed store: of its pages).
  std::int64_t namespace_bytes(std::uint64_t ns) const
  {
    auto const it = namespaces_.find(ns);
    if (it == namespaces_.end()) { return 0; }
    if (config_.compression != kv_compression::none) {
      return it->second.pages * static_cast<std::int64_t>(page_bytes());
    }
    return fact_bytes(it->second.tokens);
  }

  /// @brief Pages held by namespace `ns` (what erasing it would return to the pool).
  std::int64_t namespace_pages(std::uint64_t ns) const
  {
    auto const it = namespaces_.find(ns);
    return it == namespaces_.end() ? 0 : it->second.pages;
  }

  /**
   * @brief Stores a fact's pre-RoPE keys and values.
   *
   * The views are `[layers, tokens, heads, head_dim]`; their layer count and their head count are
   * each either the whole model's (the shard's range is then taken from them) or this shard's.
   * Unused token rows of a fact's last page are zeroed, so the pool's bytes depend only on what
   * was inserted.
   *  - host views (`views_space == host`): any strides, element type float, half_t or bfloat16_t
   *    (converted to the store dtype);
   *  - device views: element type equal to the store dtype and each token's `[heads, head_dim]`
   *    contiguous (`strides[2] == head_dim`, `strides[3] == 1`); copied with cudaMemcpy2DAsync.
   *
   * Device stores are written on `stream` (stream-ordered; the device is never synchronised):
   *  - host views are converted into one page-locked staging buffer for the whole fact, copied
   *    with one cudaMemcpyAsync per page on `stream`, and `stream` is waited for
   *    (cudaStreamSynchronize) so the staging buffer outlives the copies: the fact is in the pool
   *    when insert returns, for work on any stream;
   *  - device views are copied device to device (cudaMemcpy2DAsync, and cudaMemsetAsync for the
   *    unused rows of the last page) on `stream` and **not waited for**: work enqueued later on
   *    `stream` sees the fact; work on any other stream must be ordered after it by the caller
   *    (an event recorded on `stream`, or a cudaStreamSynchronize). The views must stay valid
   *    until the copies have run. With the default `stream` (the legacy default stream, 0) that
   *    means: blocking streams are ordered after it by the legacy stream's implicit
   *    synchronisation, streams created with cudaStreamNonBlocking (and per-thread default
   *    streams) are not, and the host must synchronise before reading the pool itself.
   * The finiteness check of device views reads them on `stream` (after the work already enqueued
   * there, e.g. the forward that produced them) and waits for that read. A host store ignores
   * `stream`.
   *
   * @throw logic_error if the id is already present, the views' shape matches neither the model nor
   *        the shard, keys and values disagree, `token_ids.size()` differs from the views' tokens,
   *        the fact is empty, the element type is not allowed, a view's data is null or a stride
   *        negative, an element is NaN or infinite or overflows the store dtype when converted
   *        (e.g. 1e6 into float16, whose largest finite value is 65504), or too few pages are
   *        free; nothing is changed then. cuda_error if a copy fails (the pages are then returned
   *        and nothing is recorded).
   * @note Non-finite KV is refused as the index refuses non-finite embeddings: a NaN or an
   *       infinity stored here would be injected into every request that retrieves the fact and
   *       poison the engine's attention. Device views are copied to the host once for this check.
   * @note Synchronisation: host views: waits for `stream` (not the device); device views: waits
   *       only for the finiteness check's read, the copies into the pool are left in flight on
   *       `stream` (see above).
   * @param stream the stream the device pool is written on (default: the legacy default stream)
   */
  template <class T>
  void insert(std::uint64_t fact_id,
              std::uint64_t namespace_id,
              std::vector<std::int32_t> token_ids,
              fact_kv_view<T const> keys,
              fact_kv_view<T const> values,
              memory_space views_space = memory_space::host,
              cudaStream_t stream      = cudaStream_t{})
  {
    static_assert(
      std::is_same_v<T, float> || std::is_same_v<T, half_t> || std::is_same_v<T, bfloat16_t>,
      "kv_store::insert: views hold float, half_t or bfloat16_t");
    INFERSCALE_EXPECTS(!contains(fact_id),
                       "kv_store::insert: fact id " + std::to_string(fact_id) + " already stored");
    std::int64_t const tokens = keys.extent(1);
    INFERSCALE_EXPECTS(tokens > 0,
                       "kv_store::insert: fact " + std::to_string(fact_id) + " has no tokens");
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(token_ids.size()) == tokens,
                       "kv_store::insert: " +
                         detail::count_of(static_cast<std::int64_t>(token_ids.size()), "token id") +
                         " for " + detail::count_of(tokens, "token") + " of KV");
    for (int r = 0; r < 4; ++r) {
      INFERSCALE_EXPECTS(keys.extent(r) == values.extent(r),
                         "kv_store::insert: keys and values have different shapes (dimension " +
                           std::to_string(r) + ")");
    }
    std::int32_t const layer_offset = shard_offset(
      keys.extent(0), config_.model.num_layers, config_.first_layer, config_.num_layers, "layer");
    std::int32_t const head_offset = shard_offset(
      keys.extent(2), config_.model.num_kv_heads, config_.first_head, config_.num_heads, "head");
    INFERSCALE_EXPECTS(keys.extent(3) == config_.model.head_dim,
                       "kv_store::insert: head_dim " + std::to_string(keys.extent(3)) +
                         " does not match the model's " + std::to_string(config_.model.head_dim));
    INFERSCALE_EXPECTS(
      keys.data_handle() != nullptr && values.data_handle() != nullptr,
      "kv_store::insert: fact " + std::to_string(fact_id) + " has null key or value data");
    for (auto const* v : {&keys, &values}) {
      for (int r = 0; r < 4; ++r) {
        INFERSCALE_EXPECTS(v->stride(r) >= 0,
                           "kv_store::insert: view stride " + std::to_string(r) + " is negative (" +
                             std::to_string(v->stride(r)) + ")");
      }
    }
    if (views_space == memory_space::device) {
      INFERSCALE_EXPECTS(dtype_of_v<T> == config_.store_dtype,
                         std::string{"kv_store::insert: device views must hold the store dtype "} +
                           to_string(config_.store_dtype) + ", got " + to_string(dtype_of_v<T>));
      INFERSCALE_EXPECTS(config_.space == memory_space::device,
                         "kv_store::insert: device views need a device store");
      for (auto const* v : {&keys, &values}) {
        INFERSCALE_EXPECTS(v->stride(3) == 1 && v->stride(2) == config_.model.head_dim,
                           "kv_store::insert: device views need each token's [heads, head_dim] "
                           "contiguous");
        INFERSCALE_EXPECTS(v->stride(1) >= v->extent(2) * v->extent(3),
                           "kv_store::insert: device views need a token stride of at least one "
                           "token's heads * head_dim elements, got " +
                             std::to_string(v->stride(1)));
      }
    }
    std::int64_t const pages_needed = pages_for(tokens);
    INFERSCALE_EXPECTS(pages_needed <= free_pages(),
                       "kv_store::insert: fact " + std::to_string(fact_id) + " needs " +
                         detail::count_of(pages_needed, "page") + ", " +
                         std::to_string(free_pages()) + " free (capacity exhausted)");
    check_finite(fact_id, keys, values, layer_offset, head_offset, views_space, stream);

    // Everything checked: take pages, write, then record.
    fact_record record{fact_id, namespace_id, std::move(token_ids), take_pages(pages_needed)};
    try {
      if (config_.compression != kv_compression::none) {
        copy_compressed(record, keys, values, layer_offset, head_offset, views_space, stream);
      } else if (views_space == memory_space::device) {
        copy_from_device(record, keys, values, layer_offset, head_offset, stream);
      } else {
        copy_from_host(record, keys, values, layer_offset, head_offset, stream);
      }
    } catch (...) {
      // Copies enqueued before the failure must not land in pages handed out again.
      if (config_.space == memory_space::device) { (void)cudaStreamSynchronize(stream); }
      return_pages(record.pages);
      throw;
    }
    add_record(std::move(record));
  }

  /**
   * @brief Reserves pages for a fact whose contents the caller writes next (extraction does).
   * @throw logic_error on a duplicate id, an empty fact or exhausted capacity (nothing changed).
   * @note The fact is visible at once; its KV is whatever the pages held until written.
   */
  fact_record const& reserve(std::uint64_t fact_id,
                             std::uint64_t namespace_id,
                             std::vector<std::int32_t> token_ids)
  {
    INFERSCALE_EXPECTS(!contains(fact_id),
                       "kv_store::reserve: fact id " + std::to_string(fact_id) + " already stored");
    std::int64_t const tokens = static_cast<std::int64_t>(token_ids.size());
    INFERSCALE_EXPECTS(tokens > 0,
                       "kv_store::reserve: fact " + std::to_string(fact_id) + " has no tokens");
    std::int64_t const pages_needed = pages_for(tokens);
    INFERSCALE_EXPECTS(pages_needed <= free_pages(),
                       "kv_store::reserve: fact " + std::to_string(fact_id) + " needs " +
                         detail::count_of(pages_needed, "page") + ", " +
                         std::to_string(free_pages()) + " free (capacity exhausted)");
    fact_record record{fact_id, namespace_id, std::move(token_ids), take_pages(pages_needed)};
    return add_record(std::move(record));
  }

  /// @brief Removes a fact; its pages return to the pool. @throw logic_error if unknown.
  void erase(std::uint64_t fact_id)
  {
    auto const it = facts_.find(fact_id);
    INFERSCALE_EXPECTS(it != facts_.end(),
                       "kv_store::erase: unknown fact id " + std::to_string(fact_id));
    remove(it);
  }

  /// @brief Removes every fact of namespace `ns`; returns how many were removed (0 if none).
  std::int64_t erase_namespace(std::uint64_t ns)
  {
    auto const nit = namespaces_.find(ns);
    if (nit == namespaces_.end()) { return 0; }
    std::vector<std::uint64_t> const ids = nit->second.facts;
    for (std::uint64_t id : ids) {
      remove(facts_.find(id));
    }
    return static_cast<std::int64_t>(ids.size());
  }

  /// @brief The namespaces holding at least one fact, ascending.
  std::vector<std::uint64_t> namespace_ids() const
  {
    std::vector<std::uint64_t> out;
    out.reserve(namespaces_.size());
    for (auto const& [ns, state] : namespaces_) {
      out.push_back(ns);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  /// @brief Ids of the facts of namespace `ns`, in insertion order.
  std::vector<std::uint64_t> namespace_fact_ids(std::uint64_t ns) const
  {
    auto const it = namespaces_.find(ns);
    return it == namespaces_.end() ? std::vector<std::uint64_t>{} : it->second.facts;
  }

  /**
   * @brief Copies the whole pool to host memory (for checks and snapshots).
   * @note Waits for the copy.
   */
  std::vector<unsigned char> pool_to_host() const;

  /**
   * @brief Zeroes whole pool pages, so K/V of an erased fact is not left behind in memory that
   * is free (the memory facade and the tiers call it on an erased fact's pages). The pages are
   * the caller's to name: ones no fact holds, or the pages of a fact about to be erased.
   * @throw logic_error if a page lies outside `[0, num_pages())` (nothing is zeroed then);
   *        cuda_error if a device memset fails.
   * @note A device pool is zeroed on the default stream (one memset per run of consecutive pages)
   *       and waited for (that stream, not the device).
   */
  void scrub_pages(std::vector<std::int64_t> const& pages);

  /**
   * @brief As scrub_pages(pages), a device pool zeroed on `stream` with cudaMemsetAsync and not
   * waited for: a later write of these pages on another stream must be ordered after it (the
   * facade records an event). A host pool is zeroed at once.
   */
  void scrub_pages(std::vector<std::int64_t> const& pages, cudaStream_t stream);

 private:
  struct namespace_state {
    std::vector<std::uint64_t> facts;
    std::int64_t tokens{};
    std::int64_t pages{};
  };

  /// Checks a configuration and resolves its 0 counts (detail/store/config.inl).
  static kv_store_config resolve(kv_store_config c);

  static std::int32_t shard_offset(std::int64_t extent,
                                   std::int32_t model_count,
                                   std::int32_t first,
                                   std::int32_t count,
                                   char const* what)
  {
    if (extent == count) { return 0; }
    INFERSCALE_EXPECTS(extent == model_count,
                       std::string{"kv_store::insert: views have "} +
                         detail::count_of(extent, what) + ", expected the model's " +
                         std::to_string(model_count) + " or this shard's " + std::to_string(count));
    return first;
  }

  /// @brief The pool's layout from the configuration: everything of ref() but the pool pointer.
  kv_store_ref ref_layout() const noexcept
  {
    kv_store_ref r;
    r.num_pages   = config_.num_pages;
    r.store_dtype = config_.store_dtype;
    r.num_layers  = config_.num_layers;
    r.num_heads   = config_.num_heads;
    r.head_dim    = config_.model.head_dim;
    r.page_size   = config_.page_size;
    r.compression = config_.compression;
    return r;
  }

  std::int64_t page_elements() const noexcept
  {
    return 2 * static_cast<std::int64_t>(config_.num_layers) * config_.page_size *
           config_.num_heads * config_.model.head_dim;
  }

  std::vector<std::int64_t> take_pages(std::int64_t n)
  {
    std::vector<std::int64_t> pages;
    pages.reserve(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      pages.push_back(free_pages_.back());
      free_pages_.pop_back();
    }
    return pages;
  }

  void return_pages(std::vector<std::int64_t> const& pages)
  {
    for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
      free_pages_.push_back(*it);
    }
  }

  fact_record const& add_record(fact_record record)
  {
    auto& ns = namespaces_[record.namespace_id];
    ns.facts.push_back(record.fact_id);
    ns.tokens += record.length();
    ns.pages += static_cast<std::int64_t>(record.pages.size());
    ++version_;
    return facts_.emplace(record.fact_id, std::move(record)).first->second;
  }

  void remove(std::unordered_map<std::uint64_t, fact_record>::iterator it)
  {
    fact_record& record = it->second;
    auto nit            = namespaces_.find(record.namespace_id);
    auto& ids           = nit->second.facts;
    ids.erase(std::find(ids.begin(), ids.end(), record.fact_id));
    nit->second.tokens -= record.length();
    nit->second.pages -= static_cast<std::int64_t>(record.pages.size());
    if (ids.empty()) { namespaces_.erase(nit); }
    return_pages(record.pages);
    facts_.erase(it);
    ++version_;
  }

  /// @brief Refuses NaN, infinities and values that overflow the store dtype, before any write.
  template <class T>
  void check_finite(std::uint64_t fact_id,
                    fact_kv_view<T const> keys,
                    fact_kv_view<T const> values,
                    std::int32_t layer_offset,
                    std::int32_t head_offset,
                    memory_space views_space,
                    cudaStream_t stream) const;

  /// Host views: in place (host pool), or staged in one pinned buffer and copied on `stream`,
  /// then `stream` waited for (device pool).
  template <class T>
  void copy_from_host(fact_record const& record,
                      fact_kv_view<T const> keys,
                      fact_kv_view<T const> values,
                      std::int32_t layer_offset,
                      std::int32_t head_offset,
                      cudaStream_t stream);

  /// Compressed pool: the fact quantized on the host (device views copied to the host first),
  /// written in place (host pool) or staged and copied on `stream`, waited for (device pool).
  template <class T>
  void copy_compressed(fact_record const& record,
                       fact_kv_view<T const> keys,
                       fact_kv_view<T const> values,
                       std::int32_t layer_offset,
                       std::int32_t head_offset,
                       memory_space views_space,
                       cudaStream_t stream);

  /// Device views: enqueued on `stream`, not waited for.
  template <class T>
  void copy_from_device(fact_record const& record,
                        fact_kv_view<T const> keys,
                        fact_kv_view<T const> values,
                        std::int32_t layer_offset,
                        std::int32_t head_offset,
                        cudaStream_t stream);

  void swap(kv_store& other) noexcept
  {
    std::swap(config_, other.config_);
    std::swap(ref_, other.ref_);
    host_pool_.swap(other.host_pool_);
    cuda_pool_.swap(other.cuda_pool_);
    std::swap(free_pages_, other.free_pages_);
    std::swap(facts_, other.facts_);
    std::swap(namespaces_, other.namespaces_);
    std::swap(version_, other.version_);
    std::swap(identity_, other.identity_);
  }

  // ---- snapshot restore (snapshot.hpp) ------------------------------------------------------
  friend struct detail::store_access;

  /**
   * @brief Rebuilds the catalogue of a freshly constructed, empty store from a snapshot: `records`
   * in the order they are to be recorded (per namespace, insertion order), `free_pages` the free
   * stack bottom first (the next insert takes the last). The snapshot loader has checked that
   * the pages of the records and the free stack are every page exactly once.
   */
  void restore_catalogue(std::vector<fact_record> records, std::vector<std::int64_t> free_pages)
  {
    INFERSCALE_EXPECTS(facts_.empty(), "kv_store: a catalogue is restored into an empty store");
    free_pages_ = std::move(free_pages);
    facts_.reserve(records.size());
    for (fact_record& r : records) {
      add_record(std::move(r));
    }
  }
  // ---- end of snapshot restore ---------------------------------------------------------------

  static std::uint64_t next_identity() noexcept
  {
    static std::atomic<std::uint64_t> counter{0};  // distinguishes stores in one process
    return ++counter;
  }

  kv_store_config config_{};
  kv_store_ref ref_{};
  detail::host_allocation host_pool_;
  device_buffer<unsigned char> cuda_pool_;  ///< the pool of a device or pinned store
  std::vector<std::int64_t> free_pages_;
  std::unordered_map<std::uint64_t, fact_record> facts_;
  std::unordered_map<std::uint64_t, namespace_state> namespaces_;
  std::uint64_t version_{0};
  std::uint64_t identity_{next_identity()};
};

}  // namespace inferscale

#include <inferscale/detail/store/config.inl>
#include <inferscale/detail/store/pool.inl>
