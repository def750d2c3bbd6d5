// inferscale_vllm._inferscale: the library's host request path for vLLM's CPU build, over nanobind.
//
// What a connector needs and nothing else: a KV store of pre-RoPE facts (insert from any strided
// fp32 / bf16 / fp16 buffer, erase, shard by heads, save and load), vLLM's CPU paged cache
// described from the tensors `register_kv_caches` hands over (make_vllm_cpu_cache), the engine's
// own rotation table (`rotary_emb.cos_sin_cache`), and the two directions: inject (compose each
// request's facts at its first position and write them, rotated and converted, into the request's
// slots) and extract (read a token range back, de-rotated, as pre-RoPE K/V); and for retrieval the
// library's host graph index (index.hpp: one namespace per user, add / build / erase / search over
// fp32 embeddings). Tensors cross the boundary as (data pointer, shape, strides, dtype name) or,
// for embeddings, (data pointer, rows, columns) of contiguous float32: the caller keeps them alive,
// and no element passes through Python. Every refusal is the library's logic_error, raised as
// ValueError before anything is written.
//
// Built with INFERSCALE_VLLM_CUDA (CMake option; HAS_CUDA is then True) it also has the device
// path for a GPU vLLM: stores whose pool lives in device memory (Store(..., device=True),
// Store.load(..., device=True), Store.to_device()), vLLM's GPU FlashAttention cache described from
// its CUDA tensors (VllmFlashAttnCache), a Rotation over a table in device memory, and
// inject on a CUDA stream (the same entry with a stream: the injection step's checked device run,
// device_inject.cu).
#include "device_inject.hpp"
#include "memory_binding.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/extract.hpp>
#include <inferscale/index.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>
#include <inferscale/store_slice.hpp>

#ifdef INFERSCALE_VLLM_CUDA
#include <cuda_runtime_api.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <variant>
#include <vector>

namespace nb = nanobind;
using namespace inferscale;

namespace {

dtype parse_dtype(std::string const& name)
{
  // torch spells them "torch.bfloat16"; accept both forms.
  std::string n = name.rfind("torch.", 0) == 0 ? name.substr(6) : name;
  if (n == "float32" || n == "float") { return dtype::float32; }
  if (n == "float16" || n == "half") { return dtype::float16; }
  if (n == "bfloat16") { return dtype::bfloat16; }
  throw std::invalid_argument("inferscale: unsupported dtype '" + name +
                              "' (float32, float16 or bfloat16)");
}

/// A store compression by its library name (compression.hpp's to_string): "none", "fp8_e4m3" or
/// "int4"; anything else is refused naming the three.
kv_compression parse_compression(std::string const& name)
{
  for (kv_compression c : {kv_compression::none, kv_compression::fp8_e4m3, kv_compression::int4}) {
    if (name == to_string(c)) { return c; }
  }
  throw std::invalid_argument(
    "inferscale: unsupported compression '" + name + "' (" + to_string(kv_compression::none) +
    ", " + to_string(kv_compression::fp8_e4m3) + " or " + to_string(kv_compression::int4) + ")");
}

template <std::size_t N>
std::array<std::int64_t, N> to_array(std::vector<std::int64_t> const& v, char const* what)
{
  if (v.size() != N) {
    throw std::invalid_argument(std::string{"inferscale: "} + what + " must have " +
                                std::to_string(N) + " entries, got " + std::to_string(v.size()));
  }
  std::array<std::int64_t, N> a{};
  for (std::size_t i = 0; i < N; ++i) {
    a[i] = v[i];
  }
  return a;
}

/// Any array the caller hands over (numpy, torch, any DLPack producer), with any dtype, shape,
/// strides and device: each entry point checks what it needs. Holding it keeps the producer's
/// buffer alive.
using any_array = nb::ndarray<>;

/// The library's dtype of an array's elements (float32, float16 or bfloat16), else a refusal
/// naming `what`.
dtype array_dtype(any_array const& a, std::string const& what)
{
  nb::dlpack::dtype const t = a.dtype();
  if (t.lanes == 1 && t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) {
    if (t.bits == 32) { return dtype::float32; }
    if (t.bits == 16) { return dtype::float16; }
  }
  if (t.lanes == 1 && t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) &&
      t.bits == 16) {
    return dtype::bfloat16;
  }
  throw std::invalid_argument(what + ": unsupported element type (DLPack code " +
                              std::to_string(t.code) + ", " + std::to_string(t.bits) +
                              " bits; float32, float16 or bfloat16)");
}

bool on_cuda(any_array const& a) { return a.device_type() == nb::device::cuda::value; }

/// Refuses an array that is not in host memory (the host path reads and writes it on the CPU).
void expect_host_array(any_array const& a, std::string const& what)
{
  if (a.device_type() != nb::device::cpu::value) {
    throw std::invalid_argument(what + " is not in host memory (DLPack device type " +
                                std::to_string(a.device_type()) +
                                "): the host path takes CPU arrays");
  }
}

/// The array's shape and strides (in elements), `n` dimensions exactly.
template <std::size_t N>
std::pair<std::array<std::int64_t, N>, std::array<std::int64_t, N>> array_layout(
  any_array const& a, std::string const& what)
{
  if (a.ndim() != N) {
    throw std::invalid_argument(what + " must have " + std::to_string(N) + " dimensions, got " +
                                std::to_string(a.ndim()));
  }
  std::array<std::int64_t, N> shape{}, strides{};
  for (std::size_t i = 0; i < N; ++i) {
    shape[i]   = static_cast<std::int64_t>(a.shape(i));
    strides[i] = a.stride(i);
  }
  return {shape, strides};
}

#ifdef INFERSCALE_VLLM_CUDA
constexpr bool has_cuda = true;
#else
constexpr bool has_cuda = false;
#endif

void expect_cuda_build(char const* who)
{
  if (!has_cuda) {
    throw std::invalid_argument(std::string{who} +
                                ": this inferscale_vllm was built without CUDA (host path only); "
                                "rebuild it with the CMake option INFERSCALE_VLLM_CUDA=ON");
  }
}

/// Refuses `p` unless it is device (or managed) memory of the current CUDA device: the device path
/// launches there, and a host pointer handed to a kernel would fault instead of being refused.
void expect_device_memory(void const* p, std::string const& what)
{
  if (p == nullptr) { throw std::invalid_argument(what + " is null"); }
#ifndef INFERSCALE_VLLM_CUDA
  expect_cuda_build(what.c_str());  // a CPU-only build (no CUDA runtime) has no device memory
#else
  cudaPointerAttributes a{};
  cudaError_t const e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: nothing was launched
    throw std::invalid_argument(
      what + " is not CUDA memory (cudaPointerGetAttributes: " + cudaGetErrorName(e) + ")");
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
    throw std::invalid_argument(what +
                                " is not in device memory (a CPU tensor given to the device "
                                "path?)");
  }
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::invalid_argument(what + ": no current CUDA device");
  }
  if (a.device != current) {
    throw std::invalid_argument(what + " is on CUDA device " + std::to_string(a.device) +
                                ", the current device is " + std::to_string(current) +
                                " (the store and the kernel are there)");
  }
#endif
}

/// A store's output buffer: float32 [layers, tokens, heads, head_dim], C-contiguous, on the CPU.
using float_kv_out = nb::ndarray<float, nb::ndim<4>, nb::c_contig, nb::device::cpu>;

class store_handle {
 public:
  explicit store_handle(kv_store s) : owned_{std::move(s)} {}
  /// A view of a store another object owns (Memory.store): Python keeps that owner alive.
  explicit store_handle(kv_store* borrowed) : borrowed_{borrowed} {}

  kv_store& get() { return borrowed_ != nullptr ? *borrowed_ : *owned_; }
  kv_store const& get() const { return borrowed_ != nullptr ? *borrowed_ : *owned_; }

  void insert(std::uint64_t fact_id,
              std::uint64_t namespace_id,
              std::vector<std::int32_t> token_ids,
              any_array const& keys,
              any_array const& values)
  {
    expect_host_array(keys, "Store.insert: keys");
    expect_host_array(values, "Store.insert: values");
    dtype const t = array_dtype(keys, "Store.insert: keys");
    if (array_dtype(values, "Store.insert: values") != t) {
      throw std::invalid_argument("Store.insert: keys and values have different dtypes");
    }
    auto const [ks, kt] = array_layout<4>(keys, "Store.insert: keys [layers, tokens, heads, dim]");
    auto const [vs, vt] =
      array_layout<4>(values, "Store.insert: values [layers, tokens, heads, dim]");
    auto run = [&, ks = ks, kt = kt, vs = vs, vt = vt](auto tag) {
      using T = decltype(tag);
      auto kv_ =
        make_fact_kv_view(static_cast<T const*>(keys.data()), ks[0], ks[1], ks[2], ks[3], kt);
      auto vv_ =
        make_fact_kv_view(static_cast<T const*>(values.data()), vs[0], vs[1], vs[2], vs[3], vt);
      get().insert(fact_id, namespace_id, std::move(token_ids), kv_, vv_, memory_space::host);
    };
    switch (t) {
      case dtype::float32: run(float{}); break;
      case dtype::float16: run(half_t{}); break;
      default: run(bfloat16_t{}); break;
    }
  }

  /// Copies fact `id`'s K and V (this shard's layers and heads) into float32 arrays the caller
  /// allocated as [layers, tokens, heads, head_dim], C-contiguous (shapes checked first).
  void read(std::uint64_t id, float_kv_out keys, float_kv_out values) const
  {
    if (!get().contains(id)) {
      throw std::invalid_argument("Store.read: unknown fact id " + std::to_string(id));
    }
    fact_record const& f      = get().at(id);
    kv_geometry const g       = get().geometry();
    std::size_t const want[4] = {static_cast<std::size_t>(g.num_layers),
                                 static_cast<std::size_t>(f.length()),
                                 static_cast<std::size_t>(g.num_kv_heads),
                                 static_cast<std::size_t>(g.head_dim)};
    for (auto const* out : {&keys, &values}) {
      for (std::size_t i = 0; i < 4; ++i) {
        if (out->shape(i) != want[i]) {
          throw std::invalid_argument(
            std::string{"Store.read: "} + (out == &keys ? "keys" : "values") + " are [" +
            std::to_string(out->shape(0)) + ", " + std::to_string(out->shape(1)) + ", " +
            std::to_string(out->shape(2)) + ", " + std::to_string(out->shape(3)) + "], fact " +
            std::to_string(id) + " needs [" + std::to_string(want[0]) + ", " +
            std::to_string(want[1]) + ", " + std::to_string(want[2]) + ", " +
            std::to_string(want[3]) + "]");
        }
      }
    }
    kv_store_ref r = get().ref();
    std::vector<unsigned char> host_pool;
    if (get().space() == memory_space::device) {
      host_pool = get().pool_to_host();  // waits; reading a device store is not a hot path
      r.pool    = host_pool.data();
    }
    std::int64_t const re = r.row_elements();
    float* out_k          = keys.data();
    float* out_v          = values.data();
    if (r.compression != kv_compression::none) {
      // The values injection writes: each code times its scale, rounded to the store dtype
      // (compression.hpp), widened to float32.
      auto dequantize = [&](auto tag) {
        using T        = decltype(tag);
        std::int64_t n = f.length();
        std::vector<T> row(static_cast<std::size_t>(r.head_dim));
        for (std::int32_t l = 0; l < r.num_layers; ++l) {
          for (std::int32_t j = 0; j < f.length(); ++j) {
            std::int64_t const st   = get().store_token(f, j);
            std::int64_t const page = st / r.page_size;
            auto const in_page      = static_cast<std::int32_t>(st % r.page_size);
            std::int64_t const dst  = (static_cast<std::int64_t>(l) * n + j) * re;
            for (std::int32_t kv = 0; kv < 2; ++kv) {
              auto const* block =
                static_cast<unsigned char const*>(r.pool) + r.block_offset(page, l, kv);
              float* out = (kv == 0 ? out_k : out_v) + dst;
              for (std::int32_t h = 0; h < r.num_heads; ++h) {
                detail::dequantize_run(
                  r.blocks(), block, kv, in_page, h, 0, r.head_dim, row.data());
                for (std::int32_t e = 0; e < r.head_dim; ++e) {
                  out[h * r.head_dim + e] = to_float(row[static_cast<std::size_t>(e)]);
                }
              }
            }
          }
        }
      };
      switch (get().store_dtype()) {
        case dtype::float32: dequantize(float{}); break;
        case dtype::float16: dequantize(half_t{}); break;
        default: dequantize(bfloat16_t{}); break;
      }
      return;
    }
    auto copy = [&](auto tag) {
      using T        = decltype(tag);
      T const* pool  = static_cast<T const*>(r.pool);
      std::int64_t n = f.length();
      for (std::int32_t l = 0; l < r.num_layers; ++l) {
        for (std::int32_t j = 0; j < f.length(); ++j) {
          std::int64_t const st  = get().store_token(f, j);
          std::int64_t const dst = (static_cast<std::int64_t>(l) * n + j) * re;
          T const* k             = pool + r.row_offset(st, l, 0);
          T const* v             = pool + r.row_offset(st, l, 1);
          for (std::int64_t e = 0; e < re; ++e) {
            out_k[dst + e] = to_float(k[e]);
            out_v[dst + e] = to_float(v[e]);
          }
        }
      }
    };
    switch (get().store_dtype()) {
      case dtype::float32: copy(float{}); break;
      case dtype::float16: copy(half_t{}); break;
      default: copy(bfloat16_t{}); break;
    }
  }

  /// A copy of this host store whose pool lives in device memory: every fact under its id and
  /// namespace, the same bytes (same dtype, so nothing is converted).
  store_handle to_device() const
  {
    expect_cuda_build("Store.to_device");
    if (get().space() != memory_space::host) {
      throw std::invalid_argument("Store.to_device: the store is already in device memory");
    }
    if (get().compression() != kv_compression::none) {
      throw std::invalid_argument(std::string{"Store.to_device: the store is compressed ("} +
                                  to_string(get().compression()) +
                                  "); this copy moves uncompressed rows only");
    }
    kv_store_config c = get().config();
    c.space           = memory_space::device;
    c.pinned          = false;
    kv_store device{c};
    kv_store_ref const r  = get().ref();
    kv_geometry const g   = get().geometry();
    std::int64_t const re = r.row_elements();
    auto copy             = [&](auto tag) {
      using T       = decltype(tag);
      T const* pool = static_cast<T const*>(r.pool);
      std::vector<T> k, v;
      for (std::uint64_t ns : get().namespace_ids()) {
        for (std::uint64_t id : get().namespace_fact_ids(ns)) {
          fact_record const& f = get().at(id);
          std::int64_t const n = f.length();
          k.assign(static_cast<std::size_t>(g.num_layers * n * re), T{});
          v.assign(k.size(), T{});
          for (std::int32_t l = 0; l < g.num_layers; ++l) {
            for (std::int32_t j = 0; j < f.length(); ++j) {
              std::int64_t const st  = get().store_token(f, j);
              std::int64_t const dst = (static_cast<std::int64_t>(l) * n + j) * re;
              std::copy_n(pool + r.row_offset(st, l, 0), re, k.data() + dst);
              std::copy_n(pool + r.row_offset(st, l, 1), re, v.data() + dst);
            }
          }
          auto kv = make_fact_kv_view(
            static_cast<T const*>(k.data()), g.num_layers, n, g.num_kv_heads, g.head_dim);
          auto vv = make_fact_kv_view(
            static_cast<T const*>(v.data()), g.num_layers, n, g.num_kv_heads, g.head_dim);
          device.insert(id, ns, f.token_ids, kv, vv, memory_space::host);
        }
      }
    };
    switch (get().store_dtype()) {
      case dtype::float32: copy(float{}); break;
      case dtype::float16: copy(half_t{}); break;
      default: copy(bfloat16_t{}); break;
    }
    return store_handle{std::move(device)};
  }

 private:
  std::optional<kv_store> owned_;
  kv_store* borrowed_{nullptr};
};

/// Store(num_layers, num_kv_heads, head_dim, dtype, num_pages, page_size, first_head, num_heads,
/// device): a new empty store, built in place.
void init_store(store_handle* self,
                std::int32_t layers,
                std::int32_t heads,
                std::int32_t head_dim,
                std::string const& dtype_name,
                std::int64_t num_pages,
                std::int32_t page_size,
                std::int32_t first_head,
                std::int32_t num_heads,
                bool device)
{
  if (device) { expect_cuda_build("Store(device=True)"); }
  kv_store_config c;
  c.model       = kv_geometry{layers, heads, head_dim};
  c.store_dtype = parse_dtype(dtype_name);
  c.num_pages   = num_pages;
  c.page_size   = page_size;
  c.first_head  = first_head;
  c.num_heads   = num_heads;
  c.space       = device ? memory_space::device : memory_space::host;
  new (self) store_handle(kv_store(c));
}

/// The engine's rotation: its own cos/sin table (vLLM's `rotary_emb.cos_sin_cache`).
class rotation_handle {
 public:
  /// `table`: [positions, rotary_dim] (cos in the first half of a row, sin in the second), rows
  /// of any stride, elements contiguous; on the CPU for inject, on the current CUDA device for
  /// inject's device path. Held (kept alive) by the rotation.
  rotation_handle(any_array table,
                  std::int32_t head_dim,
                  bool neox_style,
                  bool round_each_operation,
                  bool truncate_to_bfloat16)
    : array_{std::move(table)}
  {
    auto const [shape, strides] = array_layout<2>(array_, "Rotation: the cos/sin table");
    std::int64_t const rows = shape[0], rotary_dim = shape[1], row_stride = strides[0];
    if (array_.data() == nullptr || rows <= 0 || head_dim <= 0 || rotary_dim <= 0 ||
        rotary_dim > head_dim || rotary_dim % 2 != 0 || strides[1] != 1 ||
        row_stride < rotary_dim) {
      throw std::invalid_argument(
        "Rotation: the cos/sin table [" + std::to_string(rows) + ", " + std::to_string(rotary_dim) +
        "] (strides " + std::to_string(row_stride) + ", " + std::to_string(strides[1]) +
        ") needs rows > 0, an even rotary_dim <= head_dim (" + std::to_string(head_dim) +
        "), contiguous rows and row_stride >= rotary_dim");
    }
    rope_pairing const pairing = neox_style ? rope_pairing::halves : rope_pairing::interleaved;
    dtype const t              = array_dtype(array_, "Rotation: the cos/sin table");
    void const* data           = array_.data();
    auto make                  = [&](auto const* typed) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
      rope_cos_sin_table<T> table{typed,
                                  rows,
                                  row_stride,
                                  head_dim,
                                  static_cast<std::int32_t>(rotary_dim),
                                  pairing,
                                  round_each_operation};
      table.truncate_to_bfloat16 = truncate_to_bfloat16;
      table_                     = table;
    };
    if (t == dtype::float32) {
      make(static_cast<float const*>(data));
    } else if (t == dtype::bfloat16) {
      make(static_cast<bfloat16_t const*>(data));
    } else {
      make(static_cast<half_t const*>(data));
    }
  }
  template <class F>
  void visit(F&& f) const
  {
    std::visit(f, table_);
  }
  std::int64_t rows() const
  {
    return std::visit([](auto const& t) { return t.max_position; }, table_);
  }
  void const* data() const
  {
    return std::visit([](auto const& t) { return static_cast<void const*>(t.data); }, table_);
  }
  inferscale_vllm::rotation_table const& table() const { return table_; }
  /// Refuses a table the host path cannot read (one in device memory).
  void expect_host(char const* who) const
  {
    expect_host_array(array_, std::string{who} + ": the rotation's cos/sin table");
  }

 private:
  any_array array_;
  inferscale_vllm::rotation_table table_;
};

/// vLLM's CPU paged cache over the layer tensors of one worker (its heads, its layers).
class cache_handle {
 public:
  /// `layers`: one CPU tensor per layer, [num_blocks, num_kv_heads, block_size, 2 * head_dim],
  /// all of one shape, strides and dtype; held (kept alive) by the cache.
  cache_handle(std::vector<any_array> layers, std::string const& isa) : layers_{std::move(layers)}
  {
    if (layers_.empty()) { throw std::invalid_argument("VllmCpuCache: no layers"); }
    auto const [shape, strides] = array_layout<4>(layers_[0], "VllmCpuCache: layer 0");
    dtype const t               = array_dtype(layers_[0], "VllmCpuCache: layer 0");
    std::vector<void*> bases;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      std::string const what = "VllmCpuCache: layer " + std::to_string(l);
      expect_host_array(layers_[l], what);
      if (array_layout<4>(layers_[l], what) != std::make_pair(shape, strides) ||
          array_dtype(layers_[l], what) != t) {
        throw std::invalid_argument(what +
                                    " differs from layer 0 in shape, strides or dtype "
                                    "(one descriptor needs one layout)");
      }
      bases.push_back(layers_[l].data());
    }
    if (isa != "vec" && isa != "amx") {
      throw std::invalid_argument(
        "VllmCpuCache: vLLM's CPU attention ISA '" + isa +
        "' lays its cache out in a way InferScale does not describe (supported: vec, amx)");
    }
    cache_ = make_vllm_cpu_cache(
      t, bases, shape, strides, isa == "amx" ? vllm_cpu_isa::amx : vllm_cpu_isa::vec);
  }
  paged_kv_cache const& get() const { return cache_; }

 private:
  std::vector<any_array> layers_;
  paged_kv_cache cache_{};
};

/// One request's memory: facts in layout order, the first position, and the slots its tokens take.
using request_arg = std::tuple<std::vector<std::uint64_t>, std::int64_t, std::vector<std::int64_t>>;

/// The validated batch of `requests` against `store` (compose, then resolve every slot).
injection_batch make_batch(kv_store const& s, std::vector<request_arg> const& requests)
{
  injection_batch batch(s);
  for (auto const& [facts, first_position, slots] : requests) {
    compose_options o;
    o.first_position       = first_position;
    o.order                = fact_order::as_given;
    composition const plan = compose(s, facts, o);
    if (static_cast<std::int64_t>(slots.size()) != plan.length()) {
      throw std::invalid_argument("inject: the facts hold " + std::to_string(plan.length()) +
                                  " tokens but " + std::to_string(slots.size()) +
                                  " slots were given (nothing is truncated)");
    }
    batch.add(plan, slots);
  }
  return batch;
}

std::int64_t inject(store_handle const& store,
                    cache_handle const& cache,
                    rotation_handle const& rotation,
                    std::vector<request_arg> const& requests)
{
  kv_store const& s = store.get();
  rotation.expect_host("inject");
  injection_batch batch = make_batch(s, requests);
  {
    nb::gil_scoped_release release;
    rotation.visit([&](auto const& table) { batch.run(cache.get(), table); });
  }
  return batch.num_tokens();
}

/**
 * vLLM's GPU paged cache (FlashAttention, and the Triton / FlexAttention backends that read the
 * same tensors) over the CUDA layer tensors of one worker, with the device staging its injections
 * use. Two logical forms, by the tensors' rank:
 *  - 4-D `(num_blocks, num_kv_heads, block_size, 2 * head_dim)`, any strides: vLLM 0.32's layout
 *    (`vllm/v1/kv_cache_layout.py`, logical [B, H, N, C]); the backends read it as
 *    `kv_cache.transpose(1, 2).split(head_dim, -1)`, so a token's key is `[..., :head_dim]` and
 *    its value `[..., head_dim:]`;
 *  - 5-D `(2, num_blocks, block_size, num_kv_heads, head_dim)`, any strides: earlier vLLM's
 *    FlashAttention layout (`kv_cache.unbind(0)` gives K, V).
 */
class flash_attn_cache_handle {
 public:
  flash_attn_cache_handle(std::vector<any_array> layers) : layers_{std::move(layers)}
  {
    expect_cuda_build("VllmFlashAttnCache");
    if (layers_.empty()) { throw std::invalid_argument("VllmFlashAttnCache: no layers"); }
    std::size_t const rank = layers_[0].ndim();
    std::vector<std::int64_t> shape(rank), strides(rank);
    for (std::size_t i = 0; i < rank; ++i) {
      shape[i]   = static_cast<std::int64_t>(layers_[0].shape(i));
      strides[i] = layers_[0].stride(i);
    }
    dtype const t = array_dtype(layers_[0], "VllmFlashAttnCache: layer 0");
    std::vector<void*> bases;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      std::string const what = "VllmFlashAttnCache: layer " + std::to_string(l);
      any_array const& a     = layers_[l];
      bool same              = a.ndim() == rank && array_dtype(a, what) == t;
      for (std::size_t i = 0; same && i < rank; ++i) {
        same = static_cast<std::int64_t>(a.shape(i)) == shape[i] && a.stride(i) == strides[i];
      }
      if (!same) {
        throw std::invalid_argument(what +
                                    " differs from layer 0 in shape, strides or dtype "
                                    "(one descriptor needs one layout)");
      }
      if (!on_cuda(a)) {
        throw std::invalid_argument(what + " is not a CUDA tensor (DLPack device type " +
                                    std::to_string(a.device_type()) + ")");
      }
      expect_device_memory(a.data(), what);
      bases.push_back(a.data());
    }
    if (shape.size() == 5) {
      cache_ = make_vllm_flash_attn_cache(
        t, bases, to_array<5>(shape, "shape"), to_array<5>(strides, "strides"));
    } else if (shape.size() == 4) {
      if (shape[3] <= 0 || shape[3] % 2 != 0) {
        throw std::invalid_argument(
          "VllmFlashAttnCache: the last dimension must be 2 * head_dim (even, positive), got " +
          std::to_string(shape[3]));
      }
      std::int64_t const head_dim = shape[3] / 2;
      std::vector<void*> values;
      for (void* b : bases) {
        values.push_back(static_cast<char*>(b) +
                         head_dim * strides[3] * static_cast<std::int64_t>(size_of(t)));
      }
      // [blocks, heads, tokens, 2 * dim] -> the factory's [blocks, tokens, heads, dim]
      std::array<std::int64_t, 4> const s{strides[0], strides[2], strides[1], strides[3]};
      cache_ = make_vllm_flash_attn_cache(
        t, bases, values, {shape[0], shape[2], shape[1], head_dim}, s, s);
    } else {
      throw std::invalid_argument(
        "VllmFlashAttnCache: expected a 4-D (num_blocks, num_kv_heads, block_size, 2 * head_dim) "
        "or 5-D (2, num_blocks, block_size, num_kv_heads, head_dim) layer tensor, got " +
        std::to_string(shape.size()) + " dimensions");
    }
  }
  paged_kv_cache const& get() const { return cache_; }
#ifdef INFERSCALE_VLLM_CUDA
  inferscale_vllm::device_injector& injector() { return injector_; }
#endif

 private:
  std::vector<any_array> layers_;
  paged_kv_cache cache_{};
#ifdef INFERSCALE_VLLM_CUDA
  inferscale_vllm::device_injector injector_;
#endif
};

/// The device path of inject (its overload for a VllmFlashAttnCache): on `stream` (a cudaStream_t
/// as an integer), never waiting for it.
std::int64_t inject_device(store_handle const& store,
                           flash_attn_cache_handle& cache,
                           rotation_handle const& rotation,
                           std::vector<request_arg> const& requests,
                           std::uintptr_t stream)
{
  expect_cuda_build("inject (device cache)");
  kv_store const& s = store.get();
  if (s.space() != memory_space::device) {
    throw std::invalid_argument(
      "inject (device cache): the store's pool is in host memory; the device path reads a device "
      "store "
      "(Store.to_device(), or Store.load(path, device=True))");
  }
  expect_device_memory(rotation.data(), "inject (device cache): the rotation's cos/sin table");
  injection_batch batch = make_batch(s, requests);
#ifdef INFERSCALE_VLLM_CUDA
  {
    nb::gil_scoped_release release;
    cache.injector().inject(batch, cache.get(), rotation.table(), stream);
  }
#else
  (void)cache;
  (void)stream;
#endif
  return batch.num_tokens();
}

std::vector<std::int32_t> composed_tokens(store_handle const& store,
                                          std::vector<std::uint64_t> const& facts)
{
  compose_options o;
  o.order = fact_order::as_given;
  return compose(store.get(), facts, o).token_ids;
}

void extract(store_handle& store,
             cache_handle const& cache,
             rotation_handle const& rotation,
             std::vector<std::int64_t> const& slots,
             std::int64_t first_position,
             std::uint64_t fact_id,
             std::uint64_t namespace_id,
             std::vector<std::int32_t> token_ids)
{
  rotation.expect_host("extract");
  rotation.visit([&](auto const& table) {
    extract_host(cache.get(),
                 slots,
                 first_position,
                 table,
                 store.get(),
                 fact_id,
                 namespace_id,
                 std::move(token_ids));
  });
}

/// Rows of float32 vectors (C-contiguous, on the CPU) and a search's output arrays.
using index_rows       = nb::ndarray<float const, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using search_ids       = nb::ndarray<std::uint64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using search_distances = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

/// The library's host graph index over float32 embeddings (rows of `dim` contiguous floats).
class index_handle {
 public:
  index_handle(std::int64_t dim,
               std::string const& metric,
               std::uint32_t graph_degree,
               std::uint32_t intermediate_graph_degree,
               std::int64_t exact_search_threshold,
               std::uint32_t build_threads)
    : index_{make_index_config(dim,
                               metric,
                               graph_degree,
                               intermediate_graph_degree,
                               exact_search_threshold,
                               build_threads)}
  {
  }

  graph_index& get() { return index_; }
  graph_index const& get() const { return index_; }

  void add(std::uint64_t ns,
           index_rows vectors,
           std::vector<std::uint64_t> const& ids,
           bool replace)
  {
    auto const rows = static_cast<std::int64_t>(vectors.shape(0));
    auto const cols = static_cast<std::int64_t>(vectors.shape(1));
    check_matrix(rows, cols, "Index.add: vectors");
    if (static_cast<std::int64_t>(ids.size()) != rows) {
      throw std::invalid_argument("Index.add: " + std::to_string(rows) + " vectors but " +
                                  std::to_string(ids.size()) + " ids");
    }
    auto const view = make_matrix_view<float const>(vectors.data(), rows, cols);
    cuda::std::span<std::uint64_t const> const span{ids.data(), ids.size()};
    nb::gil_scoped_release release;
    if (replace) {
      index_.build<float>(ns, view, span);
    } else {
      index_.add<float>(ns, view, span);
    }
  }

  void erase(std::vector<std::uint64_t> const& ids)
  {
    index_.erase(cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  }

  /// Writes the k nearest live facts of namespace `ns` for each of the nq queries into the
  /// caller's [nq, k] arrays (ids; distances, 1 - cosine under the cosine metric), best first;
  /// slots beyond the namespace's live facts get the invalid id (2^64 - 1) and +infinity.
  void search(std::uint64_t ns,
              index_rows queries,
              std::uint32_t k,
              search_ids out_ids,
              search_distances out_distances,
              std::string const& algo,
              std::uint32_t itopk_size) const
  {
    auto const nq   = static_cast<std::int64_t>(queries.shape(0));
    auto const cols = static_cast<std::int64_t>(queries.shape(1));
    check_matrix(nq, cols, "Index.search: queries");
    for (auto const [rows, columns, what] :
         {std::make_tuple(out_ids.shape(0), out_ids.shape(1), "out_ids"),
          std::make_tuple(out_distances.shape(0), out_distances.shape(1), "out_distances")}) {
      if (static_cast<std::int64_t>(rows) != nq || columns != k) {
        throw std::invalid_argument(std::string{"Index.search: "} + what + " is [" +
                                    std::to_string(rows) + ", " + std::to_string(columns) +
                                    "], the search writes [" + std::to_string(nq) + ", " +
                                    std::to_string(k) + "]");
      }
    }
    search_params p;
    p.itopk_size = itopk_size;
    p.threads    = 1;
    if (algo == "automatic") {
      p.algo = search_algo::automatic;
    } else if (algo == "graph") {
      p.algo = search_algo::graph;
    } else if (algo == "exact") {
      p.algo = search_algo::exact;
    } else {
      throw std::invalid_argument("Index.search: algo is 'automatic', 'graph' or 'exact', got '" +
                                  algo + "'");
    }
    std::uint64_t const namespaces[1] = {ns};
    auto const q                      = make_matrix_view<float const>(queries.data(), nq, cols);
    auto const ids                    = make_matrix_view<std::uint64_t>(out_ids.data(), nq, k);
    auto const dist                   = make_matrix_view<float>(out_distances.data(), nq, k);
    nb::gil_scoped_release release;
    inferscale::search<float>(
      index_, q, cuda::std::span<std::uint64_t const>{namespaces, 1}, k, p, ids, dist);
  }

 private:
  static index_config make_index_config(std::int64_t dim,
                                        std::string const& metric,
                                        std::uint32_t graph_degree,
                                        std::uint32_t intermediate_graph_degree,
                                        std::int64_t exact_search_threshold,
                                        std::uint32_t build_threads)
  {
    index_config c;
    c.dim = dim;
    if (metric == "cosine") {
      c.metric = distance_metric::cosine;
    } else if (metric == "inner_product") {
      c.metric = distance_metric::inner_product;
    } else if (metric == "squared_l2") {
      c.metric = distance_metric::squared_l2;
    } else {
      throw std::invalid_argument(
        "Index: metric is 'cosine', 'inner_product' or 'squared_l2', got '" + metric + "'");
    }
    c.vector_dtype              = dtype::float32;
    c.graph_degree              = graph_degree;
    c.intermediate_graph_degree = intermediate_graph_degree;
    c.exact_search_threshold    = exact_search_threshold;
    c.space                     = memory_space::host;
    c.build_threads             = build_threads;
    return c;
  }

  void check_matrix(std::int64_t rows, std::int64_t cols, char const* what) const
  {
    if (rows < 0 || cols != index_.dim()) {
      throw std::invalid_argument(std::string{what} + " are [" + std::to_string(rows) + ", " +
                                  std::to_string(cols) + "], the index's dimension is " +
                                  std::to_string(index_.dim()));
    }
  }

  graph_index index_;
};

}  // namespace

/// The Memory class (memory_binding.hpp): the facade, its snapshot, and a view of its store.
void bind_memory(nb::module_& m)
{
  using inferscale_vllm::memory_handle;
  auto config = [](std::int32_t layers,
                   std::int32_t heads,
                   std::int32_t head_dim,
                   std::string const& store_dtype,
                   std::int64_t num_pages,
                   std::int32_t page_size,
                   std::int64_t embedding_dim,
                   std::string const& compression) {
    return inferscale_vllm::make_memory_config(layers,
                                               heads,
                                               head_dim,
                                               parse_dtype(store_dtype),
                                               num_pages,
                                               page_size,
                                               embedding_dim,
                                               parse_compression(compression));
  };
  nb::class_<memory_handle>(m, "Memory")
    .def(
      "__init__",
      [config](memory_handle* self,
               std::int32_t layers,
               std::int32_t heads,
               std::int32_t head_dim,
               std::string const& store_dtype,
               std::int64_t num_pages,
               std::int32_t page_size,
               std::int64_t embedding_dim,
               std::string const& compression) {
        new (self) memory_handle(memory{config(
          layers, heads, head_dim, store_dtype, num_pages, page_size, embedding_dim, compression)});
      },
      nb::arg("num_layers"),
      nb::arg("num_kv_heads"),
      nb::arg("head_dim"),
      nb::arg("dtype"),
      nb::arg("num_pages"),
      nb::arg("page_size"),
      nb::arg("embedding_dim"),
      nb::arg("compression") = "none",
      "`compression`: the store's (none; fp8_e4m3 or int4: codes with scales, dequantized to "
      "`dtype` by injection); another value is refused (ValueError)")
    .def_static(
      "load",
      [config](std::string const& directory,
               std::int32_t layers,
               std::int32_t heads,
               std::int32_t head_dim,
               std::string const& store_dtype,
               std::int64_t num_pages,
               std::int32_t page_size,
               std::int64_t embedding_dim,
               memory_handle const* previous,
               std::string const& compression) {
        memory_config const c = config(
          layers, heads, head_dim, store_dtype, num_pages, page_size, embedding_dim, compression);
        std::optional<std::string> application;
        auto* handle = [&] {
          nb::gil_scoped_release release;
          return new memory_handle(load_memory(
            directory, c, &application, previous != nullptr ? &previous->get() : nullptr));
        }();
        nb::object data = application
                            ? nb::object(nb::bytes(application->data(), application->size()))
                            : nb::none();
        return nb::make_tuple(nb::cast(handle, nb::rv_policy::take_ownership), data);
      },
      nb::arg("directory"),
      nb::arg("num_layers"),
      nb::arg("num_kv_heads"),
      nb::arg("head_dim"),
      nb::arg("dtype"),
      nb::arg("num_pages"),
      nb::arg("page_size"),
      nb::arg("embedding_dim"),
      nb::arg("previous").none() = nb::none(),
      nb::arg("compression")     = "none",
      "(Memory, application data: bytes or None) from a snapshot save() wrote; every check of "
      "the library's load_memory (manifest, checksums of every file, geometry). `previous` (a "
      "Memory, e.g. the generation a reader serves): the incremental load_memory, which takes "
      "from it every fact it holds with the file's bytes (checked against the store's fact "
      "checksums) and reads only the others' pages; the result is the full load's")
    .def_static(
      "application",
      [](std::string const& directory) -> nb::object {
        std::optional<std::string> data;
        {
          nb::gil_scoped_release release;
          data = load_memory_application(directory);
        }
        if (!data) { return nb::none(); }
        return nb::bytes(data->data(), data->size());
      },
      nb::arg("directory"),
      "The snapshot's application data (bytes, or None for a snapshot without), checked against "
      "the manifest, without loading the store or the index")
    .def("save",
         &memory_handle::save,
         nb::arg("directory"),
         nb::arg("application"),
         "The library's crash-safe save_memory, with `application` (bytes) in the same "
         "transaction")
    .def("add_facts",
         &memory_handle::add_facts,
         nb::arg("namespace"),
         nb::arg("ids"),
         nb::arg("contexts"),
         nb::arg("tokens"),
         nb::arg("first_positions"),
         nb::arg("keys"),
         nb::arg("values"),
         nb::arg("texts"),
         nb::arg("embeddings"))
    .def("set_instruction_prefix",
         &memory_handle::set_instruction_prefix,
         nb::arg("tokens"),
         nb::arg("fact_id"),
         nb::arg("namespace"),
         nb::arg("keys"),
         nb::arg("values"))
    .def(
      "erase_fact",
      [](memory_handle& h, std::uint64_t id) { h.get().erase_fact(id); },
      nb::arg("fact_id"))
    .def(
      "erase_namespace",
      [](memory_handle& h, std::uint64_t ns) { return h.get().erase_namespace(ns); },
      nb::arg("namespace"))
    .def("retrieve", &memory_handle::retrieve, nb::arg("namespace"), nb::arg("query"), nb::arg("k"))
    .def("prepare", &memory_handle::prepare, nb::arg("fact_ids"), nb::arg("first_position") = 0)
    .def("tracks", [](memory_handle const& h, std::uint64_t id) { return h.get().tracks(id); })
    .def(
      "facts",
      [](memory_handle const& h, std::uint64_t ns) {
        return h.get().store().namespace_fact_ids(ns);
      },
      nb::arg("namespace"))
    .def("has_namespace",
         [](memory_handle const& h, std::uint64_t ns) { return h.get().index().has_namespace(ns); })
    .def_prop_ro("instruction_prefix",
                 [](memory_handle const& h) { return h.get().instruction_prefix(); })
    .def_prop_ro("embedding_dim", [](memory_handle const& h) { return h.get().config().index.dim; })
    .def_prop_ro(
      "compression",
      [](memory_handle const& h) { return std::string{to_string(h.get().store().compression())}; })
    .def_prop_ro(
      "store",
      [](memory_handle& h) { return store_handle{&h.get().store()}; },
      nb::keep_alive<0, 1>(),
      "A view of the memory's store (Store: read, composed_tokens, inject); valid while the "
      "Memory lives (the view keeps it alive)");
}

NB_MODULE(_inferscale, m)
{
  m.doc() = "InferScale's host request path for vLLM (CPU build): store, cache, inject, extract";
  nb::register_exception_translator([](std::exception_ptr const& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (inferscale::logic_error const& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  bind_memory(m);

  nb::class_<store_handle>(m, "Store")
    .def("__init__",
         &init_store,
         nb::arg("num_layers"),
         nb::arg("num_kv_heads"),
         nb::arg("head_dim"),
         nb::arg("dtype"),
         nb::arg("num_pages"),
         nb::arg("page_size")  = 16,
         nb::arg("first_head") = 0,
         nb::arg("num_heads")  = 0,
         nb::arg("device")     = false)
    .def_static(
      "load",
      [](std::string const& path, std::optional<std::string> const& as_dtype, bool device) {
        if (device) { expect_cuda_build("Store.load(device=True)"); }
        store_load_options o;
        o.space = device ? memory_space::device : memory_space::host;
        if (as_dtype) { o.store_dtype = parse_dtype(*as_dtype); }
        return new store_handle(load_store(path, o));
      },
      nb::arg("path"),
      nb::arg("dtype")  = nb::none(),
      nb::arg("device") = false)
    .def(
      "slice",
      [](store_handle const& s,
         std::vector<std::uint64_t> const& fact_ids,
         std::int32_t first_head,
         std::int32_t num_heads,
         std::int32_t first_layer,
         std::int32_t num_layers) {
        return new store_handle(slice_store(
          s.get(), store_slice{first_layer, num_layers, first_head, num_heads}, fact_ids));
      },
      nb::arg("fact_ids"),
      nb::arg("first_head")  = 0,
      nb::arg("num_heads")   = 0,
      nb::arg("first_layer") = 0,
      nb::arg("num_layers")  = 0,
      "A new host Store of the KV heads [first_head, first_head + num_heads) of the layers "
      "[first_layer, first_layer + num_layers) (model coordinates; 0 counts: to the last one "
      "held) of the facts fact_ids, byte for byte (slice_store.hpp); the slice's layer 0 is the "
      "model's first_layer. Uncompressed host stores.")
    .def("to_device",
         &store_handle::to_device,
         "A copy of this host store in device memory (same ids, namespaces and bytes).")
    .def_prop_ro("device",
                 [](store_handle const& s) { return s.get().space() == memory_space::device; })
    .def("save", [](store_handle const& s, std::string const& path) { save_store(s.get(), path); })
    .def("insert",
         &store_handle::insert,
         nb::arg("fact_id"),
         nb::arg("namespace"),
         nb::arg("token_ids"),
         nb::arg("keys"),
         nb::arg("values"),
         "Adds a fact from its K and V: CPU arrays [layers, tokens, heads, head_dim] (this "
         "shard's layers and heads), float32, float16 or bfloat16, any strides (numpy, torch, any "
         "DLPack producer).")
    .def("read",
         &store_handle::read,
         nb::arg("fact_id"),
         nb::arg("keys").noconvert(),
         nb::arg("values").noconvert(),
         "Copies a fact's K and V into float32 CPU arrays [layers, tokens, heads, head_dim], "
         "C-contiguous (shapes checked first; never a converted copy: another dtype or layout is "
         "a TypeError).")
    .def("erase", [](store_handle& s, std::uint64_t id) { s.get().erase(id); })
    .def("contains", [](store_handle const& s, std::uint64_t id) { return s.get().contains(id); })
    .def("length",
         [](store_handle const& s, std::uint64_t id) {
           if (!s.get().contains(id)) {
             throw std::invalid_argument("Store.length: unknown fact id " + std::to_string(id));
           }
           return s.get().at(id).length();
         })
    .def("token_ids",
         [](store_handle const& s, std::uint64_t id) {
           if (!s.get().contains(id)) {
             throw std::invalid_argument("Store.token_ids: unknown fact id " + std::to_string(id));
           }
           return s.get().at(id).token_ids;
         })
    .def(
      "namespace_of",
      [](store_handle const& s, std::uint64_t id) {
        if (!s.get().contains(id)) {
          throw std::invalid_argument("Store.namespace_of: unknown fact id " + std::to_string(id));
        }
        return s.get().at(id).namespace_id;
      })
    .def("facts",
         [](store_handle const& s, std::uint64_t ns) { return s.get().namespace_fact_ids(ns); })
    .def("composed_tokens", &composed_tokens, nb::arg("facts"))
    .def_prop_ro("geometry",
                 [](store_handle const& s) {
                   kv_geometry const g = s.get().geometry();
                   return std::make_tuple(g.num_layers, g.num_kv_heads, g.head_dim);
                 })
    .def_prop_ro("model_geometry",
                 [](store_handle const& s) {
                   kv_geometry const g = s.get().config().model;
                   return std::make_tuple(g.num_layers, g.num_kv_heads, g.head_dim);
                 })
    .def_prop_ro("first_head", [](store_handle const& s) { return s.get().config().first_head; })
    .def_prop_ro(
      "dtype", [](store_handle const& s) { return std::string{to_string(s.get().store_dtype())}; })
    .def_prop_ro(
      "compression",
      [](store_handle const& s) { return std::string{to_string(s.get().compression())}; })
    .def_prop_ro("version", [](store_handle const& s) { return s.get().version(); })
    .def_prop_ro("num_facts", [](store_handle const& s) { return s.get().num_facts(); })
    .def_prop_ro("free_pages", [](store_handle const& s) { return s.get().free_pages(); });

  nb::class_<rotation_handle>(m, "Rotation")
    .def(
      nb::init<any_array, std::int32_t, bool, bool, bool>(),
      nb::arg("table"),
      nb::arg("head_dim"),
      nb::arg("neox_style")           = true,
      nb::arg("round_each_operation") = false,
      nb::arg("truncate_to_bfloat16") = false,
      "The engine's cos/sin table [positions, rotary_dim] (vLLM's rotary_emb.cos_sin_cache; "
      "the rotation keeps it alive). round_each_operation: round each product and the sum to the "
      "key dtype (vLLM's CUDA kernel and its torch path); truncate_to_bfloat16: compute in fp32 "
      "and truncate to bf16 (vLLM's AVX2 CPU kernel); neither: fp32, rounded once to nearest.")
    .def_prop_ro("rows", &rotation_handle::rows);

  nb::class_<cache_handle>(m, "VllmCpuCache")
    .def(nb::init<std::vector<any_array>, std::string const&>(),
         nb::arg("layers"),
         nb::arg("isa") = "vec",
         "vLLM's CPU paged cache from its layer tensors (one shape, strides and dtype; the cache "
         "keeps them alive); isa: the kernels vLLM's CPU attention picked for the layers "
         "(cpu_attn._get_attn_isa: 'vec' or 'amx'; others are refused), which decide the layout.")
    .def_prop_ro("num_slots", [](cache_handle const& c) { return c.get().num_slots(); })
    .def_prop_ro("block_size", [](cache_handle const& c) { return c.get().key_layout.block_size; })
    .def_prop_ro("num_layers", [](cache_handle const& c) { return c.get().num_layers; })
    .def_prop_ro("num_heads", [](cache_handle const& c) { return c.get().num_heads(); })
    .def_prop_ro("head_dim", [](cache_handle const& c) { return c.get().head_dim(); })
    .def(
      "key_offset",
      [](cache_handle const& c, std::int64_t slot, std::int32_t head, std::int32_t dim) {
        return c.get().key_layout.slot_offset(slot, head, dim);
      },
      "Element offset of a key from its layer's base (for tests).")
    .def(
      "value_offset",
      [](cache_handle const& c, std::int64_t slot, std::int32_t head, std::int32_t dim) {
        return static_cast<std::int64_t>(
                 (static_cast<char const*>(c.get().value_base[0]) -
                  static_cast<char const*>(c.get().key_base[0])) /
                 static_cast<std::ptrdiff_t>(size_of(c.get().cache_dtype))) +
               c.get().value_layout.slot_offset(slot, head, dim);
      },
      "Element offset of a value from its layer's base (for tests).");

  nb::class_<flash_attn_cache_handle>(m, "VllmFlashAttnCache")
    .def(nb::init<std::vector<any_array>>(),
         nb::arg("layers"),
         "vLLM's GPU paged cache from its CUDA layer tensors (one shape, strides and dtype; the "
         "cache keeps them alive): "
         "4-D (num_blocks, kv_heads, block_size, 2 * head_dim) as vLLM 0.32 hands them over, or "
         "5-D (2, num_blocks, block_size, kv_heads, head_dim) as earlier FlashAttention. Needs a "
         "CUDA build.")
    .def_prop_ro("num_slots", [](flash_attn_cache_handle const& c) { return c.get().num_slots(); })
    .def_prop_ro("block_size",
                 [](flash_attn_cache_handle const& c) { return c.get().key_layout.block_size; })
    .def_prop_ro("num_layers", [](flash_attn_cache_handle const& c) { return c.get().num_layers; })
    .def_prop_ro("num_heads", [](flash_attn_cache_handle const& c) { return c.get().num_heads(); })
    .def_prop_ro("head_dim", [](flash_attn_cache_handle const& c) { return c.get().head_dim(); });

  m.attr("HAS_CUDA") = has_cuda;
  // One entry, one overload per backend (as injection_batch::run and its device_context twin):
  // a host cache (VllmCpuCache, ...) without a stream, a VllmFlashAttnCache with one.
  m.def("inject",
        &inject_device,
        nb::arg("store"),
        nb::arg("cache"),
        nb::arg("rotation"),
        nb::arg("requests"),
        nb::arg("stream"),
        "The device path of inject: a device store, a VllmFlashAttnCache and a Rotation whose "
        "table is in device memory; the kernel is enqueued on `stream` (an integer cudaStream_t, "
        "e.g. torch.cuda.current_stream().cuda_stream) and not waited for. Everything is checked "
        "before anything is staged or launched; returns the tokens written.");

  nb::class_<index_handle>(m, "Index")
    .def(nb::init<std::int64_t,
                  std::string const&,
                  std::uint32_t,
                  std::uint32_t,
                  std::int64_t,
                  std::uint32_t>(),
         nb::arg("dim"),
         nb::arg("metric")                    = "cosine",
         nb::arg("graph_degree")              = 32,
         nb::arg("intermediate_graph_degree") = 64,
         nb::arg("exact_search_threshold")    = -1,
         nb::arg("build_threads")             = 1,
         "The library's host graph index (CAGRA-style graph, one namespace per tenant) over "
         "float32 embeddings. exact_search_threshold: namespaces with at most this many live "
         "facts are searched exactly (-1: the library's automatic choice).")
    .def("add",
         &index_handle::add,
         nb::arg("namespace"),
         nb::arg("vectors").noconvert(),
         nb::arg("ids"),
         nb::arg("replace") = false,
         "Adds the rows of `vectors` (float32 [rows, dim], C-contiguous, on the CPU; else a "
         "TypeError) under new "
         "fact ids (replace: the namespace's facts become exactly these).")
    .def("erase", &index_handle::erase, nb::arg("ids"))
    .def(
      "erase_namespace",
      [](index_handle& i, std::uint64_t ns) { return i.get().erase_namespace(ns); },
      nb::arg("namespace"))
    .def("search",
         &index_handle::search,
         nb::arg("namespace"),
         nb::arg("queries").noconvert(),
         nb::arg("k"),
         nb::arg("out_ids").noconvert(),
         nb::arg("out_distances").noconvert(),
         nb::arg("algo")       = "automatic",
         nb::arg("itopk_size") = 0,
         "queries: float32 [nq, dim]; out_ids: uint64 [nq, k]; out_distances: float32 [nq, k] "
         "(C-contiguous CPU arrays, shapes checked first; another dtype or layout is a "
         "TypeError, never a converted copy).")
    .def("contains", [](index_handle const& i, std::uint64_t id) { return i.get().contains(id); })
    .def("has_namespace",
         [](index_handle const& i, std::uint64_t ns) { return i.get().has_namespace(ns); })
    .def(
      "size",
      [](index_handle const& i, std::uint64_t ns) { return i.get().size(ns); },
      "Live facts of a namespace (0 if unknown).")
    .def("ids", [](index_handle const& i, std::uint64_t ns) { return i.get().ids(ns); })
    .def("namespaces", [](index_handle const& i) { return i.get().namespaces(); })
    .def_prop_ro("dim", [](index_handle const& i) { return i.get().dim(); })
    .def_prop_ro("total_size", [](index_handle const& i) { return i.get().total_size(); })
    .def_prop_ro("version", [](index_handle const& i) { return i.get().version(); });

  m.def(
    "inject",
    &inject,
    nb::arg("store"),
    nb::arg("cache"),
    nb::arg("rotation"),
    nb::arg("requests"),
    "Composes each request's facts (in the order given) at its first position and writes them "
    "into its slots; returns the tokens written. Everything is checked before the first write.");
  m.def("extract",
        &extract,
        nb::arg("store"),
        nb::arg("cache"),
        nb::arg("rotation"),
        nb::arg("slots"),
        nb::arg("first_position"),
        nb::arg("fact_id"),
        nb::arg("namespace"),
        nb::arg("token_ids"),
        "Reads the tokens in `slots` (positions first_position ..) back from the cache, de-rotates "
        "the keys and stores them as a new fact.");
}
