// Host-memory simulators of serving engines' paged KV caches for the tests (setup code, not
// library API). Written only from /work/shared/reference/engines.md (sections cited per case),
// independently of the library, so that tests can check the library's layout handling against it.
//
// Notation as in engines.md: L layers, NB blocks (pages), BS tokens per block, H KV heads,
// D head dim, slot s >= 0, b = s / BS, t = s % BS. Offsets and strides are in elements of T.
//
// Storage: one allocation (256-byte aligned) holding every tensor of the cache. Each tensor is
// preceded by kGap elements of padding (the first one too) and the last one is followed by kGap,
// so that no two tensors are adjacent (K/V, layers) and stray writes land in padding; every tensor
// starts 16-byte aligned. fill_random() sets padding too, so hash() sees writes outside tensors.
//
// Tensor indexing conventions (how key_tensor()/value_tensor() are indexed to reach the element
// key(l, s, h, d) / value(l, s, h, d); kv = 0 for K, 1 for V):
//   vllm_flash_attn_nhd/_hnd  (kv, b, t, h, d)              per-layer tensor, shape (2,NB,BS,H,D)
//   vllm_flash_attn_separate  (b, t, h, d)                  K or V tensor, shape (NB,BS,H,D)
//   vllm_flashinfer_nhd/_hnd  (b, kv, t, h, d)              per-layer tensor, shape (NB,2,BS,H,D)
//   vllm_legacy               K (b, h, d / x, t, d % x)     K tensor, shape (NB,H,D/x,BS,x)
//                             V (b, h, d, t)                V tensor, shape (NB,H,D,BS)
//   sglang_token_pool         (s, h, d)                     k_buffer / v_buffer, (NB*BS+BS,H,D)
//   tensorrt_llm_pool         (b, l, kv, h*BS*D + t*D + d)  the pool, shape (NB,L,2,BS*H*D)
//   contiguous                (l, kv, s, h, d)              the whole cache, (L,2,NB*BS,H,D)
//   vllm_cpu                  K (b, h, d * BS + t)          per-layer tensor, shape (NB,H,BS,2D)
//                             V (b, h, BS * D + t * D + d)  (the last two dims flattened)
#pragma once

#include <inferscale/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace inferscale_test {

/// @brief Paged KV-cache layouts of serving engines (engines.md section in each comment).
enum class engine_layout {
  vllm_flash_attn_nhd,       ///< §1: per layer one tensor (2,NB,BS,H,D), contiguous.
  vllm_flash_attn_hnd,       ///< §1: per layer one tensor (2,NB,BS,H,D), memory [2,NB,H,BS,D].
  vllm_flash_attn_separate,  ///< §1 unbound: per layer K and V tensors (NB,BS,H,D), apart.
  vllm_flashinfer_nhd,       ///< §2: per layer one tensor (NB,2,BS,H,D), contiguous.
  vllm_flashinfer_hnd,       ///< §2: per layer one tensor (NB,2,BS,H,D), memory [NB,2,H,BS,D].
  vllm_legacy,               ///< §3: K (NB,H,D/x,BS,x), V (NB,H,D,BS), x = 16 / sizeof(T).
  sglang_token_pool,         ///< §4: per layer k_buffer, v_buffer (NB*BS+BS,H,D), loc = slot.
  tensorrt_llm_pool,         ///< §6: one pool (NB,L,2,BS*H*D), HND within a K or V block.
  contiguous,                ///< One tensor (L,2,NB*BS,H,D), contiguous, slot = token index.
  vllm_cpu,  ///< vllm-cpu.md: per layer (NB,H,BS,2D); per (b, h) K as [D, BS], then V [BS, D].
};

/// @brief Every engine_layout, in declaration order.
inline std::vector<engine_layout> all_engine_layouts()
{
  return {engine_layout::vllm_flash_attn_nhd,
          engine_layout::vllm_flash_attn_hnd,
          engine_layout::vllm_flash_attn_separate,
          engine_layout::vllm_flashinfer_nhd,
          engine_layout::vllm_flashinfer_hnd,
          engine_layout::vllm_legacy,
          engine_layout::sglang_token_pool,
          engine_layout::tensorrt_llm_pool,
          engine_layout::contiguous,
          engine_layout::vllm_cpu};
}

/// @brief The enumerator's name (for test names and messages).
inline char const* to_string(engine_layout layout)
{
  switch (layout) {
    case engine_layout::vllm_flash_attn_nhd: return "vllm_flash_attn_nhd";
    case engine_layout::vllm_flash_attn_hnd: return "vllm_flash_attn_hnd";
    case engine_layout::vllm_flash_attn_separate: return "vllm_flash_attn_separate";
    case engine_layout::vllm_flashinfer_nhd: return "vllm_flashinfer_nhd";
    case engine_layout::vllm_flashinfer_hnd: return "vllm_flashinfer_hnd";
    case engine_layout::vllm_legacy: return "vllm_legacy";
    case engine_layout::sglang_token_pool: return "sglang_token_pool";
    case engine_layout::tensorrt_llm_pool: return "tensorrt_llm_pool";
    case engine_layout::contiguous: return "contiguous";
    case engine_layout::vllm_cpu: return "vllm_cpu";
  }
  return "unknown";
}

/**
 * @brief One tensor as the engine hands it: byte offset of its first element from the start of
 * the simulator's storage, logical shape and strides in elements (torch order and convention).
 */
struct tensor_desc {
  std::size_t byte_offset;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
};

namespace engine_caches_detail {

/// @brief Allocator with 256-byte alignment (like cudaMalloc), so storage() is vector-aligned.
template <class T>
struct aligned_allocator {
  using value_type                       = T;
  static constexpr std::size_t alignment = 256;

  aligned_allocator() noexcept = default;
  template <class U>
  aligned_allocator(aligned_allocator<U> const&) noexcept
  {
  }

  T* allocate(std::size_t n)
  {
    if (n > static_cast<std::size_t>(-1) / sizeof(T)) { throw std::bad_alloc{}; }
    return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{alignment}));
  }
  void deallocate(T* p, std::size_t) noexcept
  {
    ::operator delete (p, std::align_val_t{alignment});
  }

  template <class U>
  bool operator==(aligned_allocator<U> const&) const noexcept
  {
    return true;
  }
  template <class U>
  bool operator!=(aligned_allocator<U> const&) const noexcept
  {
    return false;
  }
};

}  // namespace engine_caches_detail

/**
 * @brief A whole multi-layer paged KV cache in host memory, laid out as `layout` documents.
 *
 * Slots are `0 <= slot < num_slots() = NB*BS` for every layout. For sglang_token_pool the
 * buffers have NB*BS + BS rows (engines.md §4: `size + page_size`); slot s is buffer row s
 * (loc = slot, row 0 / the first page being SGLang's dummy page is the test's business), and
 * rows [NB*BS, NB*BS + BS) exist in memory but are not reachable through key()/value().
 * For vllm_legacy, D must be a multiple of x = 16 / sizeof(T); in vLLM K and V are the two halves
 * of one (2, NB, BS*H*D) tensor, here they are separate allocations (padding between them).
 */
template <class T>
class engine_cache {
 public:
  /// @brief Padding (elements) before each tensor and after the last one.
  static constexpr std::int64_t kGap = 64;

  engine_cache(engine_layout layout,
               int num_layers,
               std::int64_t num_blocks,
               int block_size,
               int num_heads,
               int head_dim)
    : layout_{layout}, L_{num_layers}, NB_{num_blocks}, BS_{block_size}, H_{num_heads}, D_{head_dim}
  {
    if (num_layers <= 0 || num_blocks <= 0 || block_size <= 0 || num_heads <= 0 || head_dim <= 0) {
      throw std::invalid_argument("engine_cache: every dimension must be positive");
    }
    if (layout == engine_layout::vllm_legacy && D_ % x() != 0) {
      throw std::invalid_argument(
        "engine_cache: vllm_legacy needs head_dim % (16 / sizeof(T)) == 0");
    }
    std::int64_t const per_kv = NB_ * BS_ * H_ * D_;  // elements of one layer's K (or V)
    std::int64_t end          = 0;
    auto place                = [&end](std::int64_t count) {
      std::int64_t const align = static_cast<std::int64_t>(16 / sizeof(T));
      std::int64_t start       = end + kGap;
      start                    = (start + align - 1) / align * align;
      end                      = start + count;
      return start;
    };
    k_off_.resize(static_cast<std::size_t>(L_));
    v_off_.resize(static_cast<std::size_t>(L_));
    switch (layout_) {
      case engine_layout::vllm_flash_attn_nhd:
      case engine_layout::vllm_flash_attn_hnd:
      case engine_layout::vllm_flashinfer_nhd:
      case engine_layout::vllm_flashinfer_hnd:
      case engine_layout::vllm_cpu:
        for (int l = 0; l < L_; ++l) {
          k_off_[l] = v_off_[l] = place(2 * per_kv);
        }
        break;
      case engine_layout::vllm_flash_attn_separate:
      case engine_layout::vllm_legacy:
        for (int l = 0; l < L_; ++l) {
          k_off_[l] = place(per_kv);
          v_off_[l] = place(per_kv);
        }
        break;
      case engine_layout::sglang_token_pool:
        for (int l = 0; l < L_; ++l) {
          k_off_[l] = place((NB_ * BS_ + BS_) * H_ * D_);
          v_off_[l] = place((NB_ * BS_ + BS_) * H_ * D_);
        }
        break;
      case engine_layout::tensorrt_llm_pool:
      case engine_layout::contiguous: {
        std::int64_t const base = place(static_cast<std::int64_t>(L_) * 2 * per_kv);
        for (int l = 0; l < L_; ++l) {
          k_off_[l] = v_off_[l] = base;
        }
        break;
      }
      default: throw std::invalid_argument("engine_cache: unknown layout");
    }
    storage_.resize(static_cast<std::size_t>(end + kGap));
  }

  engine_layout layout() const noexcept { return layout_; }
  int num_layers() const noexcept { return L_; }
  std::int64_t num_blocks() const noexcept { return NB_; }
  int block_size() const noexcept { return BS_; }
  int num_heads() const noexcept { return H_; }
  int head_dim() const noexcept { return D_; }
  /// @brief Slots addressable by key()/value(): NB*BS for every layout.
  std::int64_t num_slots() const noexcept { return NB_ * BS_; }

  /**
   * @brief Layer `layer`'s K tensor as the engine hands it. Single-tensor layouts return the whole
   * per-layer tensor (same as value_tensor()); tensorrt_llm_pool the pool and contiguous the whole
   * cache (same for every layer).
   */
  tensor_desc key_tensor(int layer) const { return describe(layer, false); }
  /// @brief Layer `layer`'s V tensor as the engine hands it (see key_tensor()).
  tensor_desc value_tensor(int layer) const { return describe(layer, true); }

  /// @brief K element (layer, slot, head, dim), located by the documented formula.
  T& key(int layer, std::int64_t slot, int head, int dim)
  {
    return storage_[index(false, layer, slot, head, dim)];
  }
  T const& key(int layer, std::int64_t slot, int head, int dim) const
  {
    return storage_[index(false, layer, slot, head, dim)];
  }
  /// @brief V element (layer, slot, head, dim), located by the documented formula.
  T& value(int layer, std::int64_t slot, int head, int dim)
  {
    return storage_[index(true, layer, slot, head, dim)];
  }
  T const& value(int layer, std::int64_t slot, int head, int dim) const
  {
    return storage_[index(true, layer, slot, head, dim)];
  }

  std::byte* storage() noexcept { return reinterpret_cast<std::byte*>(storage_.data()); }
  std::byte const* storage() const noexcept
  {
    return reinterpret_cast<std::byte const*>(storage_.data());
  }
  std::size_t storage_bytes() const noexcept { return storage_.size() * sizeof(T); }

  /// @brief Sets every element of storage (padding included) to from_float<T>(uniform [-4, 4)),
  /// drawn from splitmix64 seeded with `seed`.
  void fill_random(std::uint64_t seed)
  {
    std::uint64_t state = seed;
    for (auto& e : storage_) {
      state += 0x9E3779B97F4A7C15ull;
      std::uint64_t z = state;
      z               = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z               = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      float const u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
      e             = inferscale::from_float<T>(-4.0f + 8.0f * u);
    }
  }

  /// @brief FNV-1a (64-bit) over all storage bytes.
  std::uint64_t hash() const noexcept
  {
    std::uint64_t h     = 0xCBF29CE484222325ull;
    std::byte const* p  = storage();
    std::size_t const n = storage_bytes();
    for (std::size_t i = 0; i < n; ++i) {
      h ^= static_cast<std::uint64_t>(std::to_integer<unsigned char>(p[i]));
      h *= 0x100000001B3ull;
    }
    return h;
  }

 private:
  /// @brief vllm_legacy split: elements per 16-byte chunk (§3).
  static constexpr std::int64_t x() noexcept { return static_cast<std::int64_t>(16 / sizeof(T)); }

  void check_layer(int layer) const
  {
    if (layer < 0 || layer >= L_) { throw std::out_of_range("engine_cache: layer out of range"); }
  }

  /// @brief Element index into storage_ of K (is_v false) or V, straight from engines.md.
  std::size_t index(bool is_v, int layer, std::int64_t slot, int head, int dim) const
  {
    check_layer(layer);
    if (slot < 0 || slot >= num_slots() || head < 0 || head >= H_ || dim < 0 || dim >= D_) {
      throw std::out_of_range("engine_cache: slot, head or dim out of range");
    }
    std::int64_t const NB = NB_, BS = BS_, H = H_, D = D_, L = L_;
    std::int64_t const b = slot / BS, t = slot % BS, h = head, d = dim, l = layer;
    std::int64_t const kv   = is_v ? 1 : 0;
    std::int64_t const base = is_v ? v_off_[layer] : k_off_[layer];
    std::int64_t off        = 0;
    switch (layout_) {
      case engine_layout::vllm_flash_attn_nhd:  // §1 NHD; V adds S_kv = NB*BS*H*D
        off = kv * NB * BS * H * D + b * BS * H * D + t * H * D + h * D + d;
        break;
      case engine_layout::vllm_flash_attn_hnd:  // §1 HND, memory [2, NB, H, BS, D]
        off = kv * NB * H * BS * D + b * H * BS * D + h * BS * D + t * D + d;
        break;
      case engine_layout::vllm_flash_attn_separate:  // §1, K and V of unbind(0), own bases
        off = b * BS * H * D + t * H * D + h * D + d;
        break;
      case engine_layout::vllm_flashinfer_nhd:  // §2 NHD: S_blk = 2*BS*H*D, S_kv = BS*H*D
        off = b * 2 * BS * H * D + kv * BS * H * D + t * H * D + h * D + d;
        break;
      case engine_layout::vllm_flashinfer_hnd:  // §2 HND, memory [NB, 2, H, BS, D]
        off = b * 2 * H * BS * D + kv * H * BS * D + h * BS * D + t * D + d;
        break;
      case engine_layout::vllm_legacy:  // §3
        off = is_v ? b * H * D * BS + h * D * BS + d * BS + t
                   : b * H * D * BS + h * D * BS + (d / x()) * BS * x() + t * x() + (d % x());
        break;
      case engine_layout::sglang_token_pool:  // §4: loc = slot
        off = slot * H * D + h * D + d;
        break;
      case engine_layout::tensorrt_llm_pool:  // §6 pool, HND view
        off = ((b * L + l) * 2 + kv) * BS * H * D + h * BS * D + t * D + d;
        break;
      case engine_layout::contiguous:  // (L, 2, NB*BS, H, D)
        off = ((l * 2 + kv) * NB * BS + slot) * H * D + h * D + d;
        break;
      case engine_layout::vllm_cpu:  // (NB, H, BS, 2D): per (b, h) K^T [D, BS], then V [BS, D]
        off = (b * H + h) * 2 * BS * D + (is_v ? BS * D + t * D + d : d * BS + t);
        break;
    }
    return static_cast<std::size_t>(base + off);
  }

  /// @brief Shape and strides torch would report for the tensor the engine hands out.
  tensor_desc describe(int layer, bool is_v) const
  {
    check_layer(layer);
    std::int64_t const NB = NB_, BS = BS_, H = H_, D = D_, L = L_;
    tensor_desc td{};
    td.byte_offset = static_cast<std::size_t>(is_v ? v_off_[layer] : k_off_[layer]) * sizeof(T);
    switch (layout_) {
      case engine_layout::vllm_flash_attn_nhd:  // §1 NHD, stride order identity
        td.shape   = {2, NB, BS, H, D};
        td.strides = {NB * BS * H * D, BS * H * D, H * D, D, 1};
        break;
      case engine_layout::vllm_flash_attn_hnd:  // §1 HND, stride order (0,1,3,2,4)
        td.shape   = {2, NB, BS, H, D};
        td.strides = {NB * H * BS * D, H * BS * D, D, BS * D, 1};
        break;
      case engine_layout::vllm_flash_attn_separate:  // §1 unbind(0) -> [NB, BS, H, D]
        td.shape   = {NB, BS, H, D};
        td.strides = {BS * H * D, H * D, D, 1};
        break;
      case engine_layout::vllm_flashinfer_nhd:  // §2 NHD
        td.shape   = {NB, 2, BS, H, D};
        td.strides = {2 * BS * H * D, BS * H * D, H * D, D, 1};
        break;
      case engine_layout::vllm_flashinfer_hnd:  // §2 HND, stride order (0,1,3,2,4)
        td.shape   = {NB, 2, BS, H, D};
        td.strides = {2 * H * BS * D, H * BS * D, D, BS * D, 1};
        break;
      case engine_layout::vllm_legacy:  // §3
        if (is_v) {
          td.shape   = {NB, H, D, BS};
          td.strides = {H * D * BS, D * BS, BS, 1};
        } else {
          td.shape   = {NB, H, D / x(), BS, x()};
          td.strides = {H * (D / x()) * BS * x(), (D / x()) * BS * x(), BS * x(), x(), 1};
        }
        break;
      case engine_layout::sglang_token_pool:  // §4: [size + page_size, H, D]
        td.shape   = {NB * BS + BS, H, D};
        td.strides = {H * D, D, 1};
        break;
      case engine_layout::tensorrt_llm_pool:  // §6: [max_pages, L, 2, page*H*D]
        td.shape   = {NB, L, 2, BS * H * D};
        td.strides = {L * 2 * BS * H * D, 2 * BS * H * D, BS * H * D, 1};
        break;
      case engine_layout::contiguous:  // (L, 2, NB*BS, H, D)
        td.shape   = {L, 2, NB * BS, H, D};
        td.strides = {2 * NB * BS * H * D, NB * BS * H * D, H * D, D, 1};
        break;
      case engine_layout::vllm_cpu:  // (NB, H, BS, 2D), contiguous
        td.shape   = {NB, H, BS, 2 * D};
        td.strides = {H * BS * 2 * D, BS * 2 * D, 2 * D, 1};
        break;
    }
    return td;
  }

  engine_layout layout_;
  int L_;
  std::int64_t NB_;
  int BS_;
  int H_;
  int D_;
  std::vector<std::int64_t> k_off_;  // element offset of each layer's K tensor (base)
  std::vector<std::int64_t> v_off_;  // element offset of each layer's V tensor (base)
  std::vector<T, engine_caches_detail::aligned_allocator<T>> storage_;
};

}  // namespace inferscale_test
