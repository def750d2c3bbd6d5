// Fuzzed loaders: one libFuzzer entry (LLVMFuzzerTestOneInput) for every reader of outside bytes,
// the target chosen by the environment variable INFERSCALE_FUZZ_TARGET:
//   store        a store snapshot file (load_store)
//   index        an index snapshot file (load_index)
//   tiers        a tiers directory (load_tiers): byte 0 picks the member (0 the manifest
//                tiers.istr, 1 the device tier, 2 the host tier), the rest are its bytes
//   memory       a memory facade directory (load_memory): byte 0 picks the member (0 the manifest
//                memory.ismem, 1 the store, 2 the index, 3 the lifecycle file)
//   hf_config    a Hugging Face config.json (read_hf_config, kv_geometry_from_hf_config,
//                rope_spec_from_hf_config)
//   gguf         GGUF metadata as `key=value` lines, read through a lookup over them
//                (kv_geometry_from_gguf, rope_spec_from_gguf)
//   llama_state  a llama.cpp sequence-state blob (parse_state, describe_state), in builds with
//                llama.cpp (INFERSCALE_FUZZ_LLAMA_STATE)
// A refusal (the loader's documented exception type) is the expected answer to bad bytes; any
// other exception, a crash, a sanitizer report, a leak or a hang is a finding. Where a file
// carries CRC-64 checksums, each input is loaded twice: as it is, and with its checksums
// recomputed, so that mutations reach the checks behind them. A directory member is written
// around a valid directory (the real savers' output, built at start-up) and the manifest is
// rewritten to name it by its checksums, as a save would.
//
// INFERSCALE_FUZZ_SEEDS=<dir> writes the target's seed corpus (valid inputs from the real savers)
// to <dir> and exits: tests/fuzz/corpus/<target>/ is regenerated with it.
#include "fake_model.hpp"
#include "memory_fixtures.hpp"

#include <inferscale/gguf_config.hpp>
#include <inferscale/hf_config.hpp>
#include <inferscale/index_snapshot.hpp>
#include <inferscale/memory.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/tier.hpp>

#if defined(INFERSCALE_FUZZ_LLAMA_STATE)
#include "llama_state.hpp"
#endif

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace inferscale;
using bytes = std::vector<unsigned char>;

namespace {

// ------------------------------------------------------------------------------------------------
// Plumbing: the scratch directory, files, findings.

[[noreturn]] void finding(std::string const& what)
{
  std::fprintf(stderr, "FUZZ FINDING: %s\n", what.c_str());
  std::abort();
}

std::string scratch_root;

void remove_scratch()
{
  std::error_code ignored;
  if (!scratch_root.empty()) { fs::remove_all(scratch_root, ignored); }
}

std::string make_scratch()
{
  std::string base = fs::is_directory("/dev/shm") ? "/dev/shm" : fs::temp_directory_path().string();
  std::string pattern = base + "/inferscale-fuzz-XXXXXX";
  std::vector<char> name(pattern.begin(), pattern.end());
  name.push_back('\0');
  if (::mkdtemp(name.data()) == nullptr) { finding("cannot create a scratch directory"); }
  std::atexit(remove_scratch);
  return name.data();
}

void write_file(std::string const& path, bytes const& b)
{
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) { finding("cannot write " + path); }
  if (!b.empty() && std::fwrite(b.data(), 1, b.size(), f) != b.size()) {
    finding("short write " + path);
  }
  std::fclose(f);
}

bytes read_file(std::string const& path)
{
  return detail::serial::read_whole_file(path, "fuzz harness");
}

/// Empties `dir` (creating it if needed).
void fresh_directory(std::string const& dir)
{
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  fs::create_directories(dir);
}

std::uint64_t le64(bytes const& b, std::size_t at)
{
  return detail::serial::get_le<std::uint64_t>(b.data() + at);
}
void put64(bytes& b, std::size_t at, std::uint64_t v) { detail::serial::put_le(b.data() + at, v); }

bool const verbose = std::getenv("INFERSCALE_FUZZ_VERBOSE") != nullptr;

/// Runs `load`; a logic_error is a refusal, anything else a finding. INFERSCALE_FUZZ_VERBOSE
/// prints each outcome (to check that the seeds load).
template <class Load>
bool refused_or_loaded(char const* what, Load&& load)
{
  try {
    load();
    if (verbose) { std::fprintf(stderr, "loaded: %s\n", what); }
    return true;
  } catch (logic_error const& e) {
    if (verbose) { std::fprintf(stderr, "refused: %s: %s\n", what, e.what()); }
    return false;
  } catch (std::exception const& e) {
    finding(std::string{what} + ": unexpected exception " + typeid(e).name() + ": " + e.what());
  }
}

// ------------------------------------------------------------------------------------------------
// Checksum repair, per file kind (the layouts of snapshot.hpp, detail/index/serialize.hpp,
// memory.hpp and detail/tier/snapshot.inl).

/// Store file: the header checksum at 96, the catalogue checksum after the catalogue (its length
/// 16 N + 16 F + 4 T + 8 P from the header, + 8 F for the fact table of version 2), the file
/// checksum at the end over everything but those two. The fact table is not repaired: a v2 input
/// with changed pages stops at its fact checksums (the committed v1 inputs reach the pool checks).
bytes repaired_store(bytes b)
{
  namespace fmt = detail::store_format;
  if (b.size() < fmt::minimum_bytes) { return b; }
  put64(b, 96, detail::serial::crc64_of(b.data(), 96));
  std::uint64_t const n = le64(b, 64), f = le64(b, 72), t = le64(b, 80);
  std::uint64_t const p   = le64(b, 48);
  std::uint64_t catalogue = 0;
  bool const sized = n < (1ull << 56) && f < (1ull << 56) && t < (1ull << 58) && p < (1ull << 58) &&
                     (catalogue = 16 * n + 16 * f + 4 * t + 8 * p +
                                  (b[8] >= 2 && (b[9] | b[10] | b[11]) == 0 ? 8 * f : 0)) <=
                       b.size() - fmt::minimum_bytes;
  detail::serial::crc64 file;
  file.update(b.data(), 96);
  if (sized) {
    std::size_t const c = static_cast<std::size_t>(catalogue);
    put64(b, 104 + c, detail::serial::crc64_of(b.data() + 104, c));
    file.update(b.data() + 104, c);
    file.update(b.data() + 112 + c, b.size() - 120 - c);
  } else {
    file.update(b.data() + 104, b.size() - 112);
  }
  put64(b, b.size() - 8, file.value());
  return b;
}

/// Index file: the header checksum at 72 over [0, 72), the file checksum at the end over
/// everything before it.
bytes repaired_index(bytes b)
{
  if (b.size() < 88) { return b; }
  put64(b, 72, detail::serial::crc64_of(b.data(), 72));
  put64(b, b.size() - 8, detail::serial::crc64_of(b.data(), b.size() - 8));
  return b;
}

/// Files whose last 8 bytes are the CRC-64 of everything before them (tiers manifest, lifecycle).
bytes repaired_tail(bytes b)
{
  if (b.size() < 8) { return b; }
  put64(b, b.size() - 8, detail::serial::crc64_of(b.data(), b.size() - 8));
  return b;
}

/// Memory manifest: 72 bytes, the CRC-64 of [0, 64) at 64.
bytes repaired_memory_manifest(bytes b)
{
  if (b.size() < 72) { return b; }
  put64(b, 64, detail::serial::crc64_of(b.data(), 64));
  return b;
}

/// The checksum a file carries at `offset` (negative: from the end), 0 when too short.
std::uint64_t carried(bytes const& b, std::ptrdiff_t offset)
{
  std::size_t const at =
    offset < 0 ? b.size() - static_cast<std::size_t>(-offset) : static_cast<std::size_t>(offset);
  if (b.size() < 8 || (offset < 0 && b.size() < static_cast<std::size_t>(-offset)) ||
      (offset >= 0 && at + 8 > b.size())) {
    return 0;
  }
  return le64(b, at);
}

std::string digits(std::uint64_t v) { return detail::serial::checksum_digits(v); }

// ------------------------------------------------------------------------------------------------
// Valid inputs, from the real savers (the seed corpus and the directories the members go into).

kv_geometry const store_model{2, 2, 4};

kv_store_config store_config(dtype t, std::int64_t pages)
{
  kv_store_config c;
  c.model       = store_model;
  c.store_dtype = t;
  c.page_size   = 4;
  c.num_pages   = pages;
  c.space       = memory_space::host;
  return c;
}

/// K and V of fact `id` with `tokens` tokens over `layers` x `heads` x `head_dim`: small
/// multiples of 1/64 (exact in every store dtype).
struct fact_kv {
  std::int64_t layers, tokens, heads, head_dim;
  std::vector<float> k, v;
  fact_kv(std::uint64_t id, std::int64_t l, std::int64_t t, std::int64_t h, std::int64_t d)
    : layers{l}, tokens{t}, heads{h}, head_dim{d}
  {
    std::size_t const n = static_cast<std::size_t>(l * t * h * d);
    for (std::size_t i = 0; i < n; ++i) {
      k.push_back(static_cast<float>(static_cast<std::int64_t>((id * 131 + i * 7) % 256) - 128) /
                  64);
      v.push_back(static_cast<float>(static_cast<std::int64_t>((id * 17 + i * 13) % 256) - 128) /
                  64);
    }
  }
  fact_kv_view<float const> keys() const
  {
    return make_fact_kv_view<float const>(k.data(), layers, tokens, heads, head_dim);
  }
  fact_kv_view<float const> values() const
  {
    return make_fact_kv_view<float const>(v.data(), layers, tokens, heads, head_dim);
  }
};

std::vector<std::int32_t> tokens_of(std::uint64_t id, std::int64_t n)
{
  std::vector<std::int32_t> t;
  for (std::int64_t j = 0; j < n; ++j) {
    t.push_back(static_cast<std::int32_t>(id * 100 + static_cast<std::uint64_t>(j)));
  }
  return t;
}

/// A store with two namespaces, an erased fact (a free stack out of order) and partial pages.
kv_store make_store(dtype t)
{
  kv_store s{store_config(t, 12)};
  std::int64_t const lengths[] = {3, 6, 1, 9, 4};
  for (std::uint64_t i = 0; i < 5; ++i) {
    fact_kv const kv(i + 1, 2, lengths[i], 2, 4);
    s.insert(i + 1, 10 + i % 2, tokens_of(i + 1, lengths[i]), kv.keys(), kv.values());
  }
  s.erase(2);
  return s;
}

std::vector<bytes> store_seeds(std::string const& dir)
{
  std::vector<bytes> out;
  for (dtype t : {dtype::float32, dtype::float16, dtype::bfloat16}) {
    std::string const path = dir + "/seed.iskv";
    save_store(make_store(t), path);
    out.push_back(read_file(path));
  }
  kv_store empty{store_config(dtype::float16, 3)};
  save_store(empty, dir + "/seed.iskv");
  out.push_back(read_file(dir + "/seed.iskv"));
  return out;
}

graph_index make_index(distance_metric metric, dtype vectors)
{
  index_config c;
  c.dim                       = 8;
  c.metric                    = metric;
  c.vector_dtype              = vectors;
  c.graph_degree              = 4;
  c.intermediate_graph_degree = 8;
  c.space                     = memory_space::host;
  graph_index index{c};
  for (std::uint64_t ns : {5, 9}) {
    std::int64_t const rows = ns == 5 ? 24 : 7;
    std::vector<float> v;
    std::vector<std::uint64_t> ids;
    for (std::int64_t r = 0; r < rows; ++r) {
      ids.push_back(ns * 1000 + static_cast<std::uint64_t>(r));
      for (int d = 0; d < 8; ++d) {
        v.push_back(
          static_cast<float>(((r + 1) * (d + 3) * 7919 + static_cast<std::int64_t>(ns)) % 97) / 32 -
          1.5f);
      }
    }
    index.add(ns,
              make_matrix_view<float const>(v.data(), rows, 8),
              cuda::std::span<std::uint64_t const>(ids.data(), ids.size()));
  }
  std::vector<std::uint64_t> const erased{5003, 5010};
  index.erase(cuda::std::span<std::uint64_t const>(erased.data(), erased.size()));
  return index;
}

std::vector<bytes> index_seeds(std::string const& dir)
{
  std::vector<bytes> out;
  std::string const path = dir + "/seed.isx";
  save_index(make_index(distance_metric::cosine, dtype::float32), path);
  out.push_back(read_file(path));
  save_index(make_index(distance_metric::squared_l2, dtype::float16), path);
  out.push_back(read_file(path));
  index_config c;
  c.dim = 3;
  save_index(graph_index{c}, path);
  out.push_back(read_file(path));
  return out;
}

tiered_store_config tier_config()
{
  tiered_store_config c;
  c.device     = store_config(dtype::bfloat16, 8);
  c.host_pages = 10;
  return c;
}

/// Tiers with facts on the device only, the host only, both (in the LRU), and one pinned.
tiered_store make_tiers()
{
  tiered_store s{tier_config()};
  auto add = [&](std::uint64_t id, std::uint64_t ns, std::int64_t n, fact_residency where) {
    fact_kv const kv(id, 2, n, 2, 4);
    s.insert(id, ns, tokens_of(id, n), kv.keys(), kv.values(), where);
  };
  add(1, 10, 3, fact_residency::host);
  add(2, 10, 5, fact_residency::host);
  add(3, 11, 2, fact_residency::device);
  add(4, 11, 4, fact_residency::host);
  add(5, 12, 1, fact_residency::host);
  (void)s.admit({1, 2});
  (void)s.admit({4});
  s.pin(2);
  return s;
}

memory_config memory_config_of()
{
  return inferscale_test::memory_fixtures::tiny_memory_config(dtype::bfloat16, 64);
}

/// A deployment with a prefix, two conversations, an erased fact and a superseded one.
memory make_memory()
{
  using namespace inferscale_test::memory_fixtures;
  memory m{memory_config_of()};
  inferscale_test::fake::branching_model model;
  word_embedder embedder;
  m.set_instruction_prefix(model, {11, 12, 13}, 1, 0);
  user_data const a = make_user(7, 100, 6, 3);
  user_data const b = make_user(8, 200, 4, 2);
  encoding_options o;
  o.window = 2;
  m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o);
  m.add_conversation(model, embedder, 8, b.c, b.facts, b.texts, o);
  m.erase_fact(102);
  fact_update change;
  change.fact_id   = 104;
  change.new_id    = 500;
  change.token_ids = std::vector<std::int32_t>{4242, 4343};
  change.text      = "moved to lisbon";
  m.update_fact(model, embedder, change);
  return m;
}

// ------------------------------------------------------------------------------------------------
// Directory snapshots: members around a valid directory.

/// One member file of a directory snapshot: how it is named from the manifest and how its
/// checksums are repaired.
struct member {
  std::string name;  ///< file name in the valid directory
  bytes data;
};

/// A valid directory (its files by role, role 0 the manifest) and how to name and repair them.
struct directory_kind {
  std::vector<member> members;
  std::function<bytes(std::size_t, bytes)> repair;
  /// The manifest naming `files` (roles 1..) by their checksums, and the file names it implies.
  std::function<void(bytes& manifest, std::vector<member>& files)> rename;
  std::function<void(std::string const& dir)> load;
};

directory_kind tiers_kind;
directory_kind memory_kind;

directory_kind read_directory(std::string const& dir, std::vector<std::string> const& order)
{
  directory_kind k;
  for (std::string const& prefix : order) {
    for (auto const& entry : fs::directory_iterator(dir)) {
      std::string const name = entry.path().filename().string();
      if (name.rfind(prefix, 0) == 0) {
        k.members.push_back({name, read_file(entry.path().string())});
      }
    }
  }
  if (k.members.size() != order.size()) {
    finding("unexpected files in the valid directory " + dir);
  }
  return k;
}

void setup_tiers(std::string const& dir)
{
  fresh_directory(dir);
  save_tiers(make_tiers(), dir);
  tiers_kind        = read_directory(dir, {"tiers.istr", "device-", "host-"});
  tiers_kind.repair = [](std::size_t role, bytes b) {
    return role == 0 ? repaired_tail(std::move(b)) : repaired_store(std::move(b));
  };
  tiers_kind.rename = [](bytes& manifest, std::vector<member>& files) {
    // device checksum at 16, host checksum at 24, the CRC-64 of the rest at the end
    std::uint64_t const device = carried(files[1].data, -8), host = carried(files[2].data, -8);
    if (manifest.size() >= 40) {
      put64(manifest, 16, device);
      put64(manifest, 24, host);
      manifest = repaired_tail(std::move(manifest));
    }
    files[1].name = "device-" + digits(device) + ".iskv";
    files[2].name = "host-" + digits(host) + ".iskv";
  };
  tiers_kind.load = [](std::string const& d) {
    tiered_store const t = load_tiers(d, tier_config());
    (void)t.usage();
  };
}

void setup_memory(std::string const& dir)
{
  fresh_directory(dir);
  save_memory(make_memory(), dir);
  memory_kind        = read_directory(dir, {"memory.ismem", "store-", "index-", "lifecycle-"});
  memory_kind.repair = [](std::size_t role, bytes b) {
    switch (role) {
      case 0: return repaired_memory_manifest(std::move(b));
      case 1: return repaired_store(std::move(b));
      case 2: return repaired_index(std::move(b));
      default: return repaired_tail(std::move(b));
    }
  };
  memory_kind.rename = [](bytes& manifest, std::vector<member>& files) {
    // store at 32, index header at 40, index file at 48, lifecycle at 56, CRC of [0, 64) at 64
    std::uint64_t const store        = carried(files[1].data, -8);
    std::uint64_t const index_header = carried(files[2].data, 72);
    std::uint64_t const index_file   = carried(files[2].data, -8);
    std::uint64_t const lifecycle    = carried(files[3].data, -8);
    if (manifest.size() >= 72) {
      put64(manifest, 32, store);
      put64(manifest, 40, index_header);
      put64(manifest, 48, index_file);
      put64(manifest, 56, lifecycle);
      manifest = repaired_memory_manifest(std::move(manifest));
    }
    files[1].name = "store-" + digits(store) + ".iskv";
    files[2].name = "index-" + digits(index_header) + "-" + digits(index_file) + ".isx";
    files[3].name = "lifecycle-" + digits(lifecycle) + ".islc";
  };
  memory_kind.load = [](std::string const& d) {
    memory const m = load_memory(d, memory_config_of());
    (void)m.instruction_prefix();
  };
}

std::vector<bytes> directory_seeds(directory_kind const& k)
{
  std::vector<bytes> out;
  for (std::size_t role = 0; role < k.members.size(); ++role) {
    bytes b{static_cast<unsigned char>(role)};
    b.insert(b.end(), k.members[role].data.begin(), k.members[role].data.end());
    out.push_back(std::move(b));
  }
  return out;
}

/// Writes the valid directory with member `role` replaced by `data` (the manifest renaming the
/// others as a save would, unless the manifest itself is the fuzzed member) and loads it.
void load_directory(directory_kind const& k, std::size_t role, bytes data, char const* what)
{
  std::vector<member> files = k.members;
  files[role].data          = std::move(data);
  if (role != 0) { k.rename(files[0].data, files); }
  std::string const dir = scratch_root + "/dir";
  fresh_directory(dir);
  for (member const& m : files) {
    write_file(dir + "/" + m.name, m.data);
  }
  refused_or_loaded(what, [&] { k.load(dir); });
}

void fuzz_directory(directory_kind const& k,
                    std::uint8_t const* data,
                    std::size_t size,
                    char const* what)
{
  if (size == 0) { return; }
  std::size_t const role = data[0] % k.members.size();
  bytes const raw(data + 1, data + size);
  load_directory(k, role, raw, what);
  bytes repaired = k.repair(role, raw);
  if (repaired != raw) { load_directory(k, role, std::move(repaired), what); }
}

// ------------------------------------------------------------------------------------------------
// Single files.

/// The pool bytes a store file's header claims (its capacity: num_pages pages), saturating.
std::uint64_t claimed_pool_bytes(bytes const& b)
{
  if (b.size() < 64) { return 0; }
  auto const field = [&](std::size_t at) {
    return static_cast<std::uint64_t>(detail::serial::get_le<std::uint32_t>(b.data() + at));
  };
  std::uint64_t const factors[] = {
    2, field(32), field(44), field(40), field(24), b[56] == 0 ? 4u : 2u, le64(b, 48)};
  std::uint64_t total = 1;
  for (std::uint64_t f : factors) {
    if (!detail::serial::multiply_add(total, f, 0, total)) { return ~std::uint64_t{0}; }
  }
  return total;
}

void fuzz_store(std::uint8_t const* data, std::size_t size)
{
  bytes const raw(data, data + size);
  std::string const path = scratch_root + "/fuzz.iskv";
  auto const one         = [&](bytes const& b) {
    write_file(path, b);
    // load_store(path) allocates the capacity the file claims (snapshot.hpp): a capacity between
    // 64 MiB and 2^48 bytes (one the host may really commit, under the sanitizers' limits) is
    // loaded against the seeds' configuration instead, which refuses it before allocating. A
    // larger claim cannot be mapped and is refused by load_store(path) itself.
    std::uint64_t const claim = claimed_pool_bytes(b);
    if (claim > (std::uint64_t{64} << 20) && claim < (std::uint64_t{1} << 48)) {
      refused_or_loaded("load_store (target)", [&] {
        kv_store const s = load_store(path, store_config(dtype::float32, 12));
        (void)s;
      });
      return;
    }
    std::optional<kv_store> loaded;
    if (!refused_or_loaded("load_store", [&] { loaded.emplace(load_store(path)); })) { return; }
    // A save of a loaded store gives the same bytes (snapshot.hpp); a version-1 file is saved as
    // version 2 (8 bytes more per fact), whose own round trip keeps its bytes.
    std::string const again = scratch_root + "/again.iskv";
    save_store(*loaded, again);
    bytes const saved = read_file(again);
    if (le64(b, 8) % (std::uint64_t{1} << 32) == 1) {
      if (saved.size() != b.size() + 8 * le64(b, 72)) {
        finding("a version-1 file re-saved is not 8 bytes per fact longer");
      }
      save_store(load_store(again), again);
      if (read_file(again) != saved) { finding("a version-2 re-save of a version-1 file changed"); }
    } else if (saved != b) {
      finding("load_store then save_store changed the bytes");
    }
    // The incremental load gives the full load's store: every fact taken from `previous` (the
    // loaded store itself), or every fact read from the file (an empty previous).
    kv_store const empty{loaded->config()};
    for (kv_store const* previous : {static_cast<kv_store const*>(&*loaded), &empty}) {
      std::optional<kv_store> incremental;
      if (!refused_or_loaded("load_store (incremental)", [&] {
            incremental.emplace(load_store(path, loaded->config(), *previous));
          })) {
        finding("the incremental load refused a file the full load took");
      }
      save_store(*incremental, again);
      if (read_file(again) != saved) { finding("the incremental load differs from the full load"); }
    }
    // Converting loads: refused (an element overflows the target) or loaded.
    for (dtype t : {dtype::float32, dtype::float16, dtype::bfloat16}) {
      store_load_options o;
      o.store_dtype = t;
      refused_or_loaded("load_store (converting)", [&] { (void)load_store(path, o); });
    }
  };
  one(raw);
  bytes const repaired = repaired_store(raw);
  if (repaired != raw) { one(repaired); }
}

void fuzz_index(std::uint8_t const* data, std::size_t size)
{
  bytes const raw(data, data + size);
  std::string const path = scratch_root + "/fuzz.isx";
  auto const one         = [&](bytes const& b) {
    write_file(path, b);
    std::optional<graph_index> loaded;
    if (!refused_or_loaded("load_index", [&] { loaded.emplace(load_index(path)); })) { return; }
    // A save of a loaded index gives the same bytes (its arena is packed as the file's is).
    std::string const again = scratch_root + "/again.isx";
    save_index(*loaded, again);
    if (read_file(again) != b) { finding("load_index then save_index changed the bytes"); }
    // Every search mode of the loaded index over every namespace, with k beyond the sizes.
    std::int64_t const dim = loaded->config().dim;
    if (dim > 4096) { return; }
    std::vector<std::uint64_t> namespaces = loaded->namespaces();
    if (namespaces.empty()) { return; }
    std::vector<float> query(static_cast<std::size_t>(dim * 2));
    for (std::size_t i = 0; i < query.size(); ++i) {
      query[i] = static_cast<float>(i % 5) - 1.75f;
    }
    std::vector<std::uint64_t> ns_of_query{namespaces.front(), namespaces.back()};
    std::uint32_t const k = 5;
    std::vector<std::uint64_t> ids(2 * k);
    std::vector<float> distances(2 * k);
    for (search_algo algo : {search_algo::automatic, search_algo::graph, search_algo::exact}) {
      search_params p;
      p.algo = algo;
      refused_or_loaded("search of a loaded index", [&] {
        search(*loaded,
               make_matrix_view<float const>(query.data(), 2, dim),
               cuda::std::span<std::uint64_t const>(ns_of_query.data(), 2),
               k,
               p,
               make_matrix_view<std::uint64_t>(ids.data(), 2, k),
               make_matrix_view<float>(distances.data(), 2, k));
      });
    }
  };
  one(raw);
  bytes const repaired = repaired_index(raw);
  if (repaired != raw) { one(repaired); }
}

void fuzz_hf_config(std::uint8_t const* data, std::size_t size)
{
  std::string const path = scratch_root + "/config.json";
  write_file(path, bytes(data, data + size));
  nlohmann::json config;
  if (!refused_or_loaded("read_hf_config", [&] { config = read_hf_config(path); })) { return; }
  refused_or_loaded("kv_geometry_from_hf_config",
                    [&] { (void)kv_geometry_from_hf_config(config); });
  for (rope_pairing pairing : {rope_pairing::halves, rope_pairing::interleaved}) {
    refused_or_loaded("rope_spec_from_hf_config", [&] {
      rope_spec const spec = rope_spec_from_hf_config(config, pairing);
      (void)make_rope_params(spec);
    });
  }
}

/// GGUF metadata as text: one `key=value` per line (the value is the rest of the line).
void fuzz_gguf(std::uint8_t const* data, std::size_t size)
{
  std::map<std::string, std::string> metadata;
  std::string const text(reinterpret_cast<char const*>(data), size);
  std::size_t at = 0;
  while (at < text.size()) {
    std::size_t end = text.find('\n', at);
    if (end == std::string::npos) { end = text.size(); }
    std::string const line = text.substr(at, end - at);
    std::size_t const eq   = line.find('=');
    if (eq != std::string::npos) { metadata[line.substr(0, eq)] = line.substr(eq + 1); }
    at = end + 1;
  }
  auto const lookup = [&](std::string const& key) -> std::optional<std::string> {
    auto const it = metadata.find(key);
    if (it == metadata.end()) { return std::nullopt; }
    return it->second;
  };
  refused_or_loaded("kv_geometry_from_gguf", [&] { (void)kv_geometry_from_gguf(lookup); });
  for (rope_pairing pairing : {rope_pairing::halves, rope_pairing::interleaved}) {
    refused_or_loaded("rope_spec_from_gguf", [&] {
      rope_spec const spec = rope_spec_from_gguf(lookup, pairing);
      (void)make_rope_params(spec);
    });
  }
}

#if defined(INFERSCALE_FUZZ_LLAMA_STATE)
kv_geometry const state_geometry{2, 2, 4};
unsigned volatile sink = 0;

void fuzz_llama_state(std::uint8_t const* data, std::size_t size)
{
  // An exactly sized heap copy, so that a read past the blob is a sanitizer report.
  std::vector<std::uint8_t> blob(data, data + size);
  llama_cpp::state_layout layout;
  try {
    layout = llama_cpp::parse_state(blob.data(), blob.size(), state_geometry);
  } catch (llama_cpp::engine_error const& e) {
    if (verbose) { std::fprintf(stderr, "refused: parse_state: %s\n", e.what()); }
    return;
  } catch (std::exception const& e) {
    finding(std::string{"parse_state: unexpected exception "} + e.what());
  }
  // Every row the layout names lies inside the blob: read all of them.
  std::uint64_t const cells   = layout.cell_count;
  std::uint64_t const v_bytes = layout.format.v_trans
                                  ? std::uint64_t{layout.format.v_el_bytes} * layout.format.n_embd_v
                                  : layout.format.v_row_bytes;
  if (layout.key_rows.size() != layout.format.n_layer ||
      layout.value_rows.size() != layout.format.n_layer || layout.positions.size() != cells) {
    finding("parse_state: a layout of the wrong shape");
  }
  unsigned sum = 0;  // kept in `sink`, so that the reads stay
  for (std::size_t l = 0; l < layout.key_rows.size(); ++l) {
    for (auto [begin, length] : {std::pair{layout.key_rows[l], layout.format.k_row_bytes * cells},
                                 std::pair{layout.value_rows[l], v_bytes * cells}}) {
      if (begin > blob.size() || length > blob.size() - begin) {
        finding("parse_state: rows outside the blob");
      }
      for (std::uint64_t i = 0; i < length; ++i) {
        sum += blob[begin + i];
      }
    }
  }
  try {
    paged_kv_cache const cache = llama_cpp::describe_state(blob.data(), layout, state_geometry);
    (void)cache;
    if (verbose) { std::fprintf(stderr, "loaded: parse_state, describe_state\n"); }
  } catch (llama_cpp::engine_error const&) {
  } catch (logic_error const&) {
  } catch (std::exception const& e) {
    finding(std::string{"describe_state: unexpected exception "} + e.what());
  }
  sink = sum;
}

std::vector<bytes> llama_state_seeds()
{
  std::vector<bytes> out;
  auto const add =
    [&](std::int32_t type, std::uint32_t v_trans, std::uint32_t streams, std::int32_t v_type) {
      std::size_t const k_el = type == GGML_TYPE_F32 ? 4 : 2,
                        v_el = v_type == GGML_TYPE_F32 ? 4 : 2;
      llama_cpp::state_format f;
      f.n_stream    = streams;
      f.v_trans     = v_trans;
      f.n_layer     = 2;
      f.k_type      = type;
      f.v_type      = v_type;
      f.k_row_bytes = 8 * k_el;
      f.v_row_bytes = v_trans ? 0 : 8 * v_el;
      f.v_el_bytes  = v_trans ? static_cast<std::uint32_t>(v_el) : 0;
      f.n_embd_v    = v_trans ? 8 : 0;
      llama_cpp::state_layout layout;
      std::vector<std::uint8_t> blob;
      llama_cpp::make_state(f, state_geometry, 0, {5, 6, 7}, layout, blob);
      out.emplace_back(blob.begin(), blob.end());
    };
  add(GGML_TYPE_F16, 0, 1, GGML_TYPE_F16);
  add(GGML_TYPE_F16, 1, 1, GGML_TYPE_F16);
  add(GGML_TYPE_F32, 0, 2, GGML_TYPE_F32);
  add(GGML_TYPE_BF16, 1, 1, GGML_TYPE_BF16);
  add(GGML_TYPE_F16, 0, 1, GGML_TYPE_F32);
  return out;
}
#endif

std::vector<bytes> text_seeds(std::vector<std::string> const& texts)
{
  std::vector<bytes> out;
  for (std::string const& t : texts) {
    out.emplace_back(t.begin(), t.end());
  }
  return out;
}

std::vector<bytes> hf_config_seeds()
{
  return text_seeds({
    R"({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
 "hidden_size": 576, "rope_theta": 100000, "max_position_embeddings": 8192})",
    R"({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
 "head_dim": 128, "rope_theta": 500000.0, "max_position_embeddings": 131072,
 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})",
    R"({"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
 "hidden_size": 3584, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
 "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
 "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "truncate": false}})",
    R"({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 3072,
 "partial_rotary_factor": 0.5, "max_position_embeddings": 131072,
 "original_max_position_embeddings": 4096, "rope_scaling": {"type": "longrope",
 "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5,
 2.6, 2.7, 2.8, 2.9, 3.0, 3.1, 3.2, 3.3],
 "long_factor": [2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 2.7, 2.8, 2.9, 3.0, 3.1, 3.2, 3.3, 3.4, 3.5,
 3.6, 3.7, 3.8, 3.9, 4.0, 4.1, 4.2, 4.3], "factor": 32.0}})",
    R"({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
 "max_position_embeddings": 4096,
 "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000}})",
    R"({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
 "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "max_position_embeddings": null})",
  });
}

std::vector<bytes> gguf_seeds()
{
  return text_seeds({
    "general.architecture=llama\nllama.block_count=30\nllama.attention.head_count=9\n"
    "llama.attention.head_count_kv=3\nllama.embedding_length=576\nllama.rope.freq_base=100000\n"
    "llama.context_length=8192\n",
    "general.architecture=qwen2\nqwen2.block_count=28\nqwen2.attention.head_count=28\n"
    "qwen2.attention.head_count_kv=4\nqwen2.attention.key_length=128\n"
    "qwen2.attention.value_length=128\nqwen2.rope.freq_base=1000000\n"
    "qwen2.rope.dimension_count=64\nqwen2.context_length=131072\nqwen2.rope.scaling.type=yarn\n"
    "qwen2.rope.scaling.factor=4\nqwen2.rope.scaling.original_context_length=32768\n"
    "qwen2.rope.scaling.yarn_beta_fast=32\nqwen2.rope.scaling.yarn_beta_slow=1\n",
    "general.architecture=phi2\nphi2.block_count=2\nphi2.attention.head_count=4\n"
    "phi2.embedding_length=64\nphi2.rope.scale_linear=2.0\n",
    "general.architecture=gemma\ngemma.block_count=2\ngemma.attention.head_count=2\n"
    "gemma.embedding_length=32\ngemma.rope.scaling.type=linear\ngemma.rope.scaling.factor=1.5\n",
  });
}

// ------------------------------------------------------------------------------------------------
// Target selection.

enum class target { store, index, tiers, memory, hf_config, gguf, llama_state };
target chosen = target::store;

std::vector<bytes> seeds_of(target t, std::string const& dir)
{
  switch (t) {
    case target::store: return store_seeds(dir);
    case target::index: return index_seeds(dir);
    case target::tiers: return directory_seeds(tiers_kind);
    case target::memory: return directory_seeds(memory_kind);
    case target::hf_config: return hf_config_seeds();
    case target::gguf: return gguf_seeds();
    case target::llama_state:
#if defined(INFERSCALE_FUZZ_LLAMA_STATE)
      return llama_state_seeds();
#else
      break;
#endif
  }
  return {};
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***)
{
  char const* name = std::getenv("INFERSCALE_FUZZ_TARGET");
  std::map<std::string, target> const targets
  {
    {"store", target::store}, {"index", target::index}, {"tiers", target::tiers},
      {"memory", target::memory}, {"hf_config", target::hf_config}, {"gguf", target::gguf},
#if defined(INFERSCALE_FUZZ_LLAMA_STATE)
      {"llama_state", target::llama_state},
#endif
  };
  if (name == nullptr || targets.count(name) == 0) {
    std::fprintf(stderr, "INFERSCALE_FUZZ_TARGET must name a target:");
    for (auto const& [n, t] : targets) {
      std::fprintf(stderr, " %s", n.c_str());
    }
    std::fprintf(stderr, "\n");
    std::exit(2);
  }
  chosen       = targets.at(name);
  scratch_root = make_scratch();
  if (chosen == target::tiers) { setup_tiers(scratch_root + "/valid"); }
  if (chosen == target::memory) { setup_memory(scratch_root + "/valid"); }
  if (char const* seeds = std::getenv("INFERSCALE_FUZZ_SEEDS")) {
    fs::create_directories(seeds);
    std::vector<bytes> const all = seeds_of(chosen, scratch_root);
    for (std::size_t i = 0; i < all.size(); ++i) {
      write_file(std::string{seeds} + "/seed-" + std::to_string(i), all[i]);
    }
    std::printf("%zu seeds of %s written to %s\n", all.size(), name, seeds);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size)
{
  switch (chosen) {
    case target::store: fuzz_store(data, size); break;
    case target::index: fuzz_index(data, size); break;
    case target::tiers: fuzz_directory(tiers_kind, data, size, "load_tiers"); break;
    case target::memory: fuzz_directory(memory_kind, data, size, "load_memory"); break;
    case target::hf_config: fuzz_hf_config(data, size); break;
    case target::gguf: fuzz_gguf(data, size); break;
    case target::llama_state:
#if defined(INFERSCALE_FUZZ_LLAMA_STATE)
      fuzz_llama_state(data, size);
#endif
      break;
  }
  return 0;
}
