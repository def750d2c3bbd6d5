/**
 * @file memory.hpp
 * @brief The memory facade: one object per deployment holding the KV store and the fact index,
 * with one namespace per user, tying the pipeline together for an engine integrator.
 *
 * Offline, per conversation: `add_conversation` plans the context-window encoding
 * (encoding.hpp), runs it through the model adapter into the store, and adds each fact's text
 * embedding (from an *embedder adapter*) to the index under the same fact id.
 * Online, per request: `serve` embeds the query, searches the user's namespace for the top k,
 * composes the instruction prefix and those facts at positions `p0 ..` (chunked RoPE) and injects
 * them through the paged-cache adapter; the engine then prefills only the query. `retrieve`,
 * `prepare` and `inject` are the same steps one at a time (a GPU engine calls `prepare` and
 * inject.cuh's `inject_async` itself).
 *
 * The library holds no model: an embedder adapter `E` provides
 *  - `std::int64_t E::dimension() const` (any integer type) and
 *  - `std::vector<float> E::embed(std::string const& text)` — one embedding of `dimension()`
 *    values (normalised or not: the index's metric decides how they compare).
 *
 * C++17, host only (the store and the index may still live in device memory; `serve`/`inject`
 * use the host injection path and need a host store).
 */
#pragma once

#include <inferscale/compose.hpp>
#include <inferscale/encoding.hpp>
#include <inferscale/engine.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

namespace detail {
template <class, class = void>
struct is_embedder : std::false_type {
};
template <class E>
struct is_embedder<E,
                   std::void_t<decltype(std::declval<E const&>().dimension()),
                               decltype(std::declval<E&>().embed(std::declval<std::string const&>()))>>
  : std::conjunction<
      std::is_integral<decltype(std::declval<E const&>().dimension())>,
      std::is_convertible<decltype(std::declval<E&>().embed(std::declval<std::string const&>())),
                          std::vector<float>>> {
};
}  // namespace detail

/// @brief True when E provides `dimension()` and `embed(text) -> std::vector<float>`.
template <class E>
inline constexpr bool is_embedder_v = detail::is_embedder<E>::value;

/// @brief How a memory is built.
struct memory_config {
  kv_store_config store{};  ///< geometry, dtype, capacity and placement of the fact KV
  index_config index{};     ///< dim must be the embedder's dimension
  search_params search{};   ///< used by retrieve() and serve()
  fact_order order{fact_order::best_last};  ///< layout of retrieved facts in the segment
};

/// @brief What add_conversation() did.
struct memory_add_report {
  encoding_stats plan{};    ///< the encoding plan's token counts
  encode_report encode{};   ///< what the model adapter ran
  std::int64_t embedded{0};  ///< fact texts embedded
};

/// @brief What serve() did for one request.
struct memory_request {
  std::vector<std::uint64_t> fact_ids;  ///< retrieved, most relevant first
  composition plan;                     ///< what was injected (prefix first)
};

/**
 * @brief Store + index for many users' memories (see the file comment).
 *
 * Every mutating call validates its input first and leaves the store and the index unchanged when
 * it throws (adapter failures included: facts stored by a failed call are erased again).
 */
class memory {
 public:
  explicit memory(memory_config const& config)
    : config_{config}, store_{config.store}, index_{config.index}
  {
  }

  kv_store& store() noexcept { return store_; }
  kv_store const& store() const noexcept { return store_; }
  graph_index& index() noexcept { return index_; }
  graph_index const& index() const noexcept { return index_; }
  memory_config const& config() const noexcept { return config_; }
  std::optional<std::uint64_t> instruction_prefix() const noexcept { return prefix_; }

  /**
   * @brief Encodes the instruction prefix every request's memory segment starts with (one forward
   * at position 0) and stores it under `fact_id` in namespace `ns` (not indexed: never retrieved).
   * @throw logic_error if a prefix is already set, the id is taken, or as encode_facts.
   */
  template <class ModelAdapter>
  void set_instruction_prefix(ModelAdapter& model,
                              std::vector<std::int32_t> const& tokens,
                              std::uint64_t fact_id,
                              std::uint64_t ns)
  {
    INFERSCALE_EXPECTS(!prefix_.has_value(),
                       "memory::set_instruction_prefix: the prefix is already fact " +
                         std::to_string(prefix_.value_or(0)));
    INFERSCALE_EXPECTS(!index_.contains(fact_id),
                       "memory::set_instruction_prefix: fact id " + std::to_string(fact_id) +
                         " is an indexed fact");
    encode_facts(model, store_, tokens, 0, {{fact_id, ns, 0, tokens}});
    prefix_ = fact_id;
  }

  /**
   * @brief Adds a conversation's facts to namespace `ns`: embeds `texts[i]` (the text of
   * `facts[i]`), plans the context-window encoding with `options`, encodes the facts through the
   * model adapter into the store, and indexes the embeddings under the facts' ids.
   *
   * @throw logic_error (store and index unchanged) if `texts` and `facts` differ in length, a
   *        fact's namespace is not `ns`, an id is already stored or indexed, an embedding has the
   *        wrong dimension or a non-finite value, or as plan_encoding / encode_plan /
   *        graph_index::add; whatever the adapters throw (the store is then restored too).
   */
  template <class ModelAdapter, class Embedder>
  memory_add_report add_conversation(ModelAdapter& model,
                                     Embedder& embedder,
                                     std::uint64_t ns,
                                     conversation const& c,
                                     std::vector<conversation_fact> const& facts,
                                     std::vector<std::string> const& texts,
                                     encoding_options const& options = {})
  {
    static_assert(is_embedder_v<Embedder>,
                  "memory::add_conversation: Embedder needs dimension() and "
                  "embed(std::string const&) -> std::vector<float> (see memory.hpp)");
    INFERSCALE_EXPECTS(texts.size() == facts.size(),
                       "memory::add_conversation: " + std::to_string(facts.size()) +
                         " facts but " + std::to_string(texts.size()) + " texts");
    std::vector<std::uint64_t> ids;
    ids.reserve(facts.size());
    for (conversation_fact const& f : facts) {
      std::string const which = "memory::add_conversation: fact " + std::to_string(f.fact_id);
      INFERSCALE_EXPECTS(f.namespace_id == ns,
                         which + " is in namespace " + std::to_string(f.namespace_id) +
                           ", the conversation is added to namespace " + std::to_string(ns));
      INFERSCALE_EXPECTS(!index_.contains(f.fact_id), which + " is already indexed");
      INFERSCALE_EXPECTS(!prefix_ || *prefix_ != f.fact_id, which + " is the instruction prefix");
      ids.push_back(f.fact_id);
    }
    // Everything that can be refused without writing: the plan, then the embeddings.
    encoding_plan const plan = plan_encoding(c, facts, options);
    std::vector<float> vectors = embed_all(embedder, texts, "memory::add_conversation");

    memory_add_report report;
    report.plan     = plan.stats();
    report.embedded = static_cast<std::int64_t>(texts.size());
    report.encode   = encode_plan(model, store_, plan);  // all or nothing
    try {
      index_.add<float>(ns,
                        make_matrix_view<float const>(vectors.data(),
                                                      static_cast<std::int64_t>(ids.size()),
                                                      index_.dim()),
                        cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
    } catch (...) {
      for (std::uint64_t id : ids) {
        store_.erase(id);
      }
      throw;
    }
    return report;
  }

  /**
   * @brief The `k` facts of namespace `ns` nearest to `query` (an embedding), most relevant first
   * (fewer when the namespace holds fewer).
   * @throw logic_error as graph_index::search (unknown namespace, wrong dimension, NaN, k == 0).
   */
  std::vector<std::uint64_t> retrieve(std::uint64_t ns,
                                      std::vector<float> const& query,
                                      std::uint32_t k) const
  {
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(query.size()) == index_.dim(),
                       "memory::retrieve: the query has " + std::to_string(query.size()) +
                         " values, the index " + std::to_string(index_.dim()));
    INFERSCALE_EXPECTS(k > 0, std::string{"memory::retrieve: k must be positive"});
    std::vector<std::uint64_t> ids(k);
    std::vector<float> distances(k);
    index_.search<float>(make_matrix_view<float const>(query.data(), 1, index_.dim()),
                         cuda::std::span<std::uint64_t const>{&ns, 1},
                         k,
                         config_.search,
                         make_matrix_view<std::uint64_t>(ids.data(), 1, k),
                         make_matrix_view<float>(distances.data(), 1, k));
    std::vector<std::uint64_t> out;
    for (std::uint64_t id : ids) {
      if (id != invalid_fact_id) { out.push_back(id); }
    }
    return out;
  }

  /// @brief retrieve() for a query text embedded by `embedder`.
  template <class Embedder>
  std::vector<std::uint64_t> retrieve(Embedder& embedder,
                                      std::uint64_t ns,
                                      std::string const& query,
                                      std::uint32_t k) const
  {
    static_assert(is_embedder_v<Embedder>, "memory::retrieve: Embedder requirements (memory.hpp)");
    return retrieve(ns, embed_all(embedder, {query}, "memory::retrieve"), k);
  }

  /**
   * @brief The request's memory segment: the instruction prefix (if set) and `fact_ids` (most
   * relevant first; laid out in `config().order`) at positions `first_position ..`.
   * @throw logic_error as compose().
   */
  composition prepare(std::vector<std::uint64_t> const& fact_ids, std::int64_t first_position) const
  {
    compose_options o;
    o.first_position     = first_position;
    o.order              = config_.order;
    o.instruction_prefix = prefix_;
    return compose(store_, fact_ids, o);
  }

  /// @brief Injects a prepared segment through a paged-cache adapter (host backend).
  template <class CacheAdapter, class Rotation>
  void inject(composition const& plan, CacheAdapter& cache, Rotation const& rotation) const
  {
    inject_memory_host(store_, plan, cache, rotation);
  }

  /**
   * @brief One request: embed `query`, retrieve the top `k` of namespace `ns`, compose them behind
   * the prefix at `first_position ..`, inject through `cache`. The engine then prefills the query
   * at `first_position + result.plan.length()`.
   * @throw logic_error as retrieve, prepare and inject_memory_host (nothing committed then).
   */
  template <class Embedder, class CacheAdapter, class Rotation>
  memory_request serve(Embedder& embedder,
                       std::uint64_t ns,
                       std::string const& query,
                       std::uint32_t k,
                       std::int64_t first_position,
                       CacheAdapter& cache,
                       Rotation const& rotation) const
  {
    memory_request r;
    r.fact_ids = retrieve(embedder, ns, query, k);
    r.plan     = prepare(r.fact_ids, first_position);
    inject(r.plan, cache, rotation);
    return r;
  }

  /// @brief Forgets a user: every fact of namespace `ns` leaves the store and the index.
  /// @return facts removed from the store.
  std::int64_t erase_namespace(std::uint64_t ns)
  {
    INFERSCALE_EXPECTS(!prefix_ || store_.at(*prefix_).namespace_id != ns,
                       "memory::erase_namespace: namespace " + std::to_string(ns) +
                         " holds the instruction prefix");
    index_.erase_namespace(ns);
    return store_.erase_namespace(ns);
  }

  // ---- snapshots: restart a deployment without re-encoding ------------------------------------

  /**
   * @brief Saves the deployment to `directory` (which must exist): the store (save_store), the
   * index (save_index) and a manifest `memory.ismem` naming them and the instruction prefix.
   *
   * The store and index files are named after their checksums (`store-<file crc>.iskv`,
   * `index-<header crc>-<file crc>.isx`: the index's file checksum does not cover its header,
   * whose own checksum does); each is written atomically, then the manifest (atomically, last), and
   * only then the files of the previous snapshot in the directory are removed. A crash or a
   * failure at any point leaves the previous snapshot loadable (its manifest and files are
   * untouched until the new manifest has replaced it), or the new one whole.
   *
   * Manifest `memory.ismem`, 64 bytes, little-endian:
   *
   * | offset | bytes | field                                                             |
   * |-------:|------:|-------------------------------------------------------------------|
   * |      0 |     8 | magic `89 49 53 4D 45 4D 0D 0A` ("\x89ISMEM\r\n")              |
   * |      8 |     4 | format version, uint32 = 1                                        |
   * |     12 |     4 | byte-order mark, uint32 0x01020304                                |
   * |     16 |     1 | 1 if an instruction prefix is set, else 0                         |
   * |     17 |     7 | reserved, 0                                                       |
   * |     24 |     8 | the prefix's fact id, uint64 (0 without a prefix)                 |
   * |     32 |     8 | the store file's checksum (its last 8 bytes)                      |
   * |     40 |     8 | the index file's header checksum (its bytes 72 .. 80)             |
   * |     48 |     8 | the index file's checksum (its last 8 bytes)                      |
   * |     56 |     8 | CRC-64 of bytes [0, 56)                                           |
   *
   * @throw logic_error as save_store and save_index, naming the file and the system's reason
   * @note Serialise saves to one directory.
   */
  void save(std::string const& directory) const
  {
    std::string const who = "memory::save('" + directory + "')";
    std::string const manifest_path = directory + "/" + manifest_name;
    std::optional<snapshot_manifest> const previous = try_read_manifest(manifest_path);

    // The store and the index, each atomically, then renamed after their checksums.
    std::string const store_pending = directory + "/store.pending.iskv";
    std::string const index_pending = directory + "/index.pending.isx";
    snapshot_manifest m;
    m.prefix = prefix_;
    try {
      save_store(store_, store_pending);
      m.store_checksum = checksum_at(store_pending, -8, who);
      save_index(index_, index_pending);
      m.index_header_checksum = checksum_at(index_pending, 72, who);
      m.index_checksum        = checksum_at(index_pending, -8, who);
      rename_into(store_pending, directory + "/" + store_file_name(m), who);
      rename_into(index_pending, directory + "/" + index_file_name(m), who);
    } catch (...) {
      (void)std::remove(store_pending.c_str());
      (void)std::remove(index_pending.c_str());
      throw;
    }
    detail::serial::sync_directory_of(manifest_path, who);

    unsigned char bytes[manifest_bytes];
    encode_manifest(m, bytes);
    (void)detail::serial::write_file_atomically(
      manifest_path, who, true, [&](detail::serial::checksummed_writer& out) {
        out.write(bytes, sizeof bytes);
      });

    // The previous snapshot's files, unless the new one reuses them (same contents, same name).
    if (previous) {
      if (store_file_name(*previous) != store_file_name(m)) {
        (void)std::remove((directory + "/" + store_file_name(*previous)).c_str());
      }
      if (index_file_name(*previous) != index_file_name(m)) {
        (void)std::remove((directory + "/" + index_file_name(*previous)).c_str());
      }
    }
  }

  /**
   * @brief Restarts a deployment from a snapshot written by save(): the store and the index are
   * loaded (every check of load_store and load_index), nothing is re-encoded or re-embedded.
   *
   * `config` is the deployment's configuration, as given to the constructor: the store file must
   * match `config.store` (geometry, shard, page size, capacity; the dtype is converted as
   * load_store does, the memory kind is `config.store.memory`); the index file must have
   * `config.index`'s dim, metric and vector dtype (its graph degrees and exact-search threshold
   * are the file's; the memory kind is `config.index.memory`); search parameters and fact order
   * are `config`'s.
   *
   * @throw logic_error when the manifest is missing, corrupted, of another version, or names
   * files that are missing or do not carry its checksums (a store and an index of different
   * saves are never paired); as load_store / load_index; when the configuration differs as said;
   * or when the snapshot is inconsistent (an indexed fact missing from the store or in another
   * namespace there, a prefix missing from the store or indexed)
   */
  static memory load(std::string const& directory, memory_config const& config)
  {
    std::string const who = "memory::load('" + directory + "')";
    std::string const where = who + ": ";
    snapshot_manifest const m =
      parse_manifest(detail::serial::read_whole_file(directory + "/" + manifest_name, who), where);
    std::string const store_path = directory + "/" + store_file_name(m);
    std::string const index_path = directory + "/" + index_file_name(m);
    INFERSCALE_EXPECTS(checksum_at(store_path, -8, who) == m.store_checksum &&
                         checksum_at(index_path, 72, who) == m.index_header_checksum &&
                         checksum_at(index_path, -8, who) == m.index_checksum,
                       where + "the store or index file does not carry the manifest's checksum "
                               "(files of different saves are never paired)");

    kv_store store    = load_store(store_path, config.store);
    graph_index index = load_index(index_path, config.index.memory);
    index_config const& ic = index.config();
    INFERSCALE_EXPECTS(ic.dim == config.index.dim && ic.metric == config.index.metric &&
                         ic.vector_dtype == config.index.vector_dtype,
                       where + "the index holds " + std::to_string(ic.dim) + "-d " +
                         to_string(ic.vector_dtype) + " vectors (metric " +
                         std::to_string(static_cast<int>(ic.metric)) + "), the configuration " +
                         std::to_string(config.index.dim) + "-d " +
                         to_string(config.index.vector_dtype) + " (metric " +
                         std::to_string(static_cast<int>(config.index.metric)) + ")");
    for (std::uint64_t ns : index.namespaces()) {
      for (std::uint64_t id : index.ids(ns)) {
        INFERSCALE_EXPECTS(store.contains(id) && store.at(id).namespace_id == ns,
                           where + "indexed fact " + std::to_string(id) + " of namespace " +
                             std::to_string(ns) + " is not in the store's namespace " +
                             std::to_string(ns));
      }
    }
    if (m.prefix) {
      INFERSCALE_EXPECTS(store.contains(*m.prefix) && !index.contains(*m.prefix),
                         where + "the instruction prefix, fact " + std::to_string(*m.prefix) +
                           ", is missing from the store or indexed");
    }
    memory_config resolved = config;
    resolved.store         = store.config();
    resolved.index         = ic;
    return memory{resolved, std::move(store), std::move(index), m.prefix};
  }
  // ---- end of snapshots -----------------------------------------------------------------------

 private:
  template <class Embedder>
  std::vector<float> embed_all(Embedder& embedder,
                               std::vector<std::string> const& texts,
                               char const* who) const
  {
    std::int64_t const dim = index_.dim();
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(embedder.dimension()) == dim,
                       std::string{who} + ": the embedder gives " +
                         std::to_string(embedder.dimension()) + "-d vectors, the index holds " +
                         std::to_string(dim) + "-d");
    std::vector<float> out;
    out.reserve(texts.size() * static_cast<std::size_t>(dim));
    for (std::size_t i = 0; i < texts.size(); ++i) {
      std::vector<float> const v = embedder.embed(texts[i]);
      INFERSCALE_EXPECTS(static_cast<std::int64_t>(v.size()) == dim,
                         std::string{who} + ": text " + std::to_string(i) + " embedded to " +
                           std::to_string(v.size()) + " values, expected " + std::to_string(dim));
      for (float x : v) {
        INFERSCALE_EXPECTS(std::isfinite(x), std::string{who} + ": text " + std::to_string(i) +
                                               " has a non-finite embedding");
      }
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }

  // ---- snapshots (see save / load) -------------------------------------------------------------
  static constexpr char const* manifest_name  = "memory.ismem";
  static constexpr std::size_t manifest_bytes = 64;

  struct snapshot_manifest {
    std::optional<std::uint64_t> prefix;
    std::uint64_t store_checksum{};
    std::uint64_t index_header_checksum{};
    std::uint64_t index_checksum{};
  };

  memory(memory_config const& config,
         kv_store&& store,
         graph_index&& index,
         std::optional<std::uint64_t> prefix)
    : config_{config}, store_{std::move(store)}, index_{std::move(index)}, prefix_{prefix}
  {
  }

  static std::string checksum_text(std::uint64_t v)
  {
    char text[20];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
    return text;
  }
  static std::string store_file_name(snapshot_manifest const& m)
  {
    return "store-" + checksum_text(m.store_checksum) + ".iskv";
  }
  static std::string index_file_name(snapshot_manifest const& m)
  {
    return "index-" + checksum_text(m.index_header_checksum) + "-" +
           checksum_text(m.index_checksum) + ".isx";
  }

  /// The checksum stored in a saved file at `offset` (negative: from the end).
  static std::uint64_t checksum_at(std::string const& path, long offset, std::string const& who)
  {
    std::FILE* file = std::fopen(path.c_str(), "rb");
    int const error = errno;
    INFERSCALE_EXPECTS(file != nullptr, who + ": cannot open '" + path + "': " +
                                          detail::serial::errno_text(error));
    unsigned char bytes[8] = {};
    bool const read = std::fseek(file, offset, offset < 0 ? SEEK_END : SEEK_SET) == 0 &&
                      std::fread(bytes, 1, 8, file) == 8;
    (void)std::fclose(file);
    INFERSCALE_EXPECTS(read, who + ": cannot read the checksum at byte " + std::to_string(offset) +
                               " of '" + path + "'");
    return detail::serial::get_le<std::uint64_t>(bytes);
  }

  static void rename_into(std::string const& from, std::string const& to, std::string const& who)
  {
    if (std::rename(from.c_str(), to.c_str()) != 0) {
      int const error = errno;
      (void)std::remove(from.c_str());
      INFERSCALE_FAIL(who + ": cannot rename '" + from + "' to '" + to +
                      "': " + detail::serial::errno_text(error));
    }
  }

  static void encode_manifest(snapshot_manifest const& m, unsigned char* bytes)
  {
    namespace s = detail::serial;
    std::memset(bytes, 0, manifest_bytes);
    std::memcpy(bytes, manifest_magic, 8);
    s::put_le(bytes + 8, std::uint32_t{1});
    s::put_le(bytes + 12, std::uint32_t{0x01020304u});
    bytes[16] = m.prefix ? 1 : 0;
    s::put_le(bytes + 24, m.prefix.value_or(0));
    s::put_le(bytes + 32, m.store_checksum);
    s::put_le(bytes + 40, m.index_header_checksum);
    s::put_le(bytes + 48, m.index_checksum);
    s::put_le(bytes + 56, s::crc64_of(bytes, 56));
  }

  static snapshot_manifest parse_manifest(std::vector<unsigned char> const& b,
                                          std::string const& where)
  {
    namespace s = detail::serial;
    std::string const what = where + "manifest " + manifest_name + ": ";
    INFERSCALE_EXPECTS(b.size() == manifest_bytes,
                       what + std::to_string(b.size()) + " bytes, expected " +
                         std::to_string(manifest_bytes));
    INFERSCALE_EXPECTS(std::memcmp(b.data(), manifest_magic, 8) == 0,
                       what + "not an InferScale memory manifest (wrong magic bytes)");
    std::uint32_t const version = s::get_le<std::uint32_t>(b.data() + 8);
    INFERSCALE_EXPECTS(version == 1, what + "format version " + std::to_string(version) +
                                       " is not supported (this build reads 1)");
    INFERSCALE_EXPECTS(s::get_le<std::uint32_t>(b.data() + 12) == 0x01020304u,
                       what + "bad byte-order mark");
    INFERSCALE_EXPECTS(s::get_le<std::uint64_t>(b.data() + 56) == s::crc64_of(b.data(), 56),
                       what + "checksum mismatch (the manifest is corrupted)");
    bool reserved_zero = true;
    for (std::size_t i = 17; i < 24; ++i) {
      reserved_zero = reserved_zero && b[i] == 0;
    }
    std::uint64_t const prefix = s::get_le<std::uint64_t>(b.data() + 24);
    INFERSCALE_EXPECTS(reserved_zero && b[16] <= 1 && (b[16] == 1 || prefix == 0),
                       what + "bad prefix flag or reserved bytes");
    snapshot_manifest m;
    if (b[16] == 1) { m.prefix = prefix; }
    m.store_checksum        = s::get_le<std::uint64_t>(b.data() + 32);
    m.index_header_checksum = s::get_le<std::uint64_t>(b.data() + 40);
    m.index_checksum        = s::get_le<std::uint64_t>(b.data() + 48);
    return m;
  }

  /// The manifest at `path` if there is a valid one (what a save replaces), else nothing.
  static std::optional<snapshot_manifest> try_read_manifest(std::string const& path)
  {
    std::FILE* file = std::fopen(path.c_str(), "rb");
    if (file == nullptr) { return std::nullopt; }
    (void)std::fclose(file);
    try {
      return parse_manifest(detail::serial::read_whole_file(path, "memory::save"), "");
    } catch (logic_error const&) {
      return std::nullopt;
    }
  }

  static constexpr unsigned char manifest_magic[8] = {0x89, 'I', 'S', 'M', 'E', 'M', 0x0D, 0x0A};
  // ---- end of snapshots -----------------------------------------------------------------------

  memory_config config_;
  kv_store store_;
  graph_index index_;
  std::optional<std::uint64_t> prefix_;
};

}  // namespace inferscale
