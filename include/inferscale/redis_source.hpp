/**
 * @file redis_source.hpp
 * @brief A Redis tier shared by replicas: `redis_fact_store` keeps facts (pages, token ids,
 * embedding, a checksum) in a Redis server or a Redis Cluster, and is the fact_source
 * (fact_source.hpp) each replica's tiered_store fetches the facts it lacks from. Needs hiredis
 * (Debian's `libhiredis-dev`, 0.14): a program that includes this header links `-lhiredis`
 * (pkg-config `hiredis`). POSIX, a little-endian host.
 *
 * Keys. Every key names the model (`redis_options::model`: name and revision), its geometry, the
 * shard, the store dtype and the page size, and hash-tags the namespace, so that one user's keys
 * land on one cluster slot (and one transaction may hold them all):
 *
 *     inferscale:v1:<model>:<L>x<H>x<D>:l<first>+<count>:h<first>+<count>:<dtype>:p<page>:{u<ns>}:
 *       f:<id>        one fact: the value below (a plain string)
 *       catalogue     hash: fact id (decimal) -> the value's checksum ("0x" and 16 hex digits)
 *       generation    integer: set to a random value by the namespace's first write (so a
 *                     server that lost it shows 0, a value no replica has seen), incremented by
 *                     every erasure
 *
 * Value of a fact, little-endian, no padding: magic `89 49 53 46 41 43 54 0A` ("\x89ISFACT\n"),
 * version uint32 = 1, dtype code uint32 (the `dtype` enumerator's value), model layers, model KV
 * heads, head_dim, first_layer, num_layers, first_head, num_heads, page_size (int32 each),
 * page_bytes uint64, namespace uint64, fact id uint64, tokens T uint32, pages P uint32,
 * embedding dimensions E uint32, reserved uint32 = 0; T token ids int32; E embedding float32; P
 * pages of page_bytes bytes (the pool's bytes, token order); then the CRC-64/XZ of every byte
 * before it. A reader checks the length, the checksum, then every field against the key and
 * the layout it expects, and refuses the value otherwise (naming the key).
 *
 * Contract for writers (any number of replicas at once):
 *  - A fact is one value, written with its catalogue entry in one MULTI/EXEC: a reader sees the
 *    whole fact or none of it, and a writer that dies before EXEC leaves nothing.
 *  - put() is create-only: it WATCHes the namespace's catalogue, and commits only if the
 *    catalogue did not change meanwhile (else it retries); an id already stored with the same
 *    value is left as it is (put returns false), with another value refused. Two replicas
 *    writing the same user at once therefore lose no fact and duplicate none.
 *  - erase() / erase_namespace() delete the values and catalogue entries and increment the
 *    namespace's generation in one transaction; fetch() reads the generation atomically with the
 *    facts (MULTI/EXEC), and tiered_store::admit drops a namespace's fetched copies when it sees
 *    the generation change, so an erasure reaches a replica before it serves that user again.
 *
 * Cluster: keys are sent to the node that owns their slot (CRC-16 of the hash tag, as Redis
 * Cluster computes it), learnt from `MOVED` replies and remembered; any node can be the one in
 * `redis_options`. While a slot migrates (resharding), an `ASK` reply sends the command once to
 * the importing node after `ASKING` (every command of a transaction is then checked there as a
 * whole), and `TRYAGAIN` (a user's keys split between the two nodes) is retried for about a
 * second, then source_unavailable: a fetch never mixes the two nodes' halves. Unreachable nodes,
 * timeouts, a server still loading its data or a cluster down throw source_unavailable; the
 * connection is reopened on the next call.
 *
 * @note Not thread-safe: one redis_fact_store (it holds the connections) per thread.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/redis/connection.hpp>
#include <inferscale/detail/serialize.hpp>
#include <inferscale/error.hpp>
#include <inferscale/fact_source.hpp>
#include <inferscale/store.hpp>

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

/// @brief Where a redis_fact_store connects and how it names its keys.
struct redis_options {
  std::string host{"127.0.0.1"};  ///< a server, or any node of a cluster
  int port{6379};                 ///< its TCP port
  /// The model and its revision, named in every key (e.g. "HuggingFaceTB/SmolLM2-135M@main"):
  /// letters, digits and `/ . _ - @ +` only (no `{`, `}`, `:` or blanks).
  std::string model;
  std::int32_t timeout_ms{2000};    ///< connect and per-reply timeout
  std::int32_t write_retries{100};  ///< optimistic transactions retried before a write gives up
};

/**
 * @brief Facts of one model layout in Redis, shared by replicas: the writer's API (put, erase,
 * erase_namespace) and the fact_source a tiered_store fetches from.
 */
class redis_fact_store final : public fact_source {
 public:
  /// @brief The value format's version.
  static constexpr std::uint32_t value_version = 1;

  /**
   * @brief Names the keys of facts of `layout`'s page layout for `options.model`; connects on
   * the first call.
   * @throw logic_error if the model name is empty or holds a character outside letters, digits
   *        and `/ . _ - @ +`, or the layout is invalid (as kv_store's constructor)
   */
  redis_fact_store(redis_options options, kv_store_config const& layout)
    : options_{std::move(options)}, layout_{fact_layout::of(layout)}
  {
    INFERSCALE_EXPECTS(
      !options_.model.empty(),
      "redis_fact_store: name the model (and its revision) in redis_options::model");
    for (char ch : options_.model) {
      bool const ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                      (ch >= '0' && ch <= '9') || std::strchr("/._-@+", ch) != nullptr;
      INFERSCALE_EXPECTS(ok && ch != '\0',
                         "redis_fact_store: the model name '" + options_.model + "' holds '" +
                           std::string(1, ch) + "'; letters, digits and / . _ - @ + only");
    }
    INFERSCALE_EXPECTS(options_.write_retries > 0 && options_.timeout_ms > 0,
                       "redis_fact_store: write_retries and timeout_ms must be positive");
    fact_layout const& l = layout_;
    prefix_ =
      "inferscale:v1:" + options_.model + ":" + std::to_string(l.model.num_layers) + "x" +
      std::to_string(l.model.num_kv_heads) + "x" + std::to_string(l.model.head_dim) + ":l" +
      std::to_string(l.first_layer) + "+" + std::to_string(l.num_layers) + ":h" +
      std::to_string(l.first_head) + "+" + std::to_string(l.num_heads) + ":" +
      to_string(l.store_dtype) +
      (l.compression == kv_compression::none ? std::string{}
                                             : std::string{"+"} + to_string(l.compression)) +
      ":p" + std::to_string(l.page_size) + ":";
    seed_ = options_.host + ":" + std::to_string(options_.port);
  }

  redis_fact_store(redis_fact_store const&)            = delete;
  redis_fact_store& operator=(redis_fact_store const&) = delete;

  /// @brief The page layout of the facts stored.
  fact_layout const& layout() const override { return layout_; }

  /// @brief "redis <host>:<port> (<model>)".
  std::string name() const override { return "redis " + seed_ + " (" + options_.model + ")"; }

  /// @brief The key of fact `id` of namespace `ns`.
  std::string fact_key_name(std::uint64_t ns, std::uint64_t id) const
  {
    return namespace_prefix(ns) + "f:" + std::to_string(id);
  }
  /// @brief The catalogue hash of namespace `ns`.
  std::string catalogue_key(std::uint64_t ns) const { return namespace_prefix(ns) + "catalogue"; }
  /// @brief The generation counter of namespace `ns`.
  std::string generation_key(std::uint64_t ns) const { return namespace_prefix(ns) + "generation"; }

  /**
   * @brief Stores fact `id` of `store` (its namespace, token ids and pages, as bytes) with its
   * embedding, atomically (the contract in the file comment).
   * @return true if written; false if the same fact (the same value) was already stored
   * @throw logic_error if `store` has another page layout, the id is unknown there, the
   *        embedding holds a non-finite value, another value is stored under the id, or the
   *        write kept conflicting with others for write_retries attempts; source_unavailable if
   *        Redis cannot be reached (nothing written then, or the whole fact)
   * @note A device store's pages are copied to the host (cudaMemcpy, waits).
   */
  bool put(kv_store const& store, std::uint64_t id, std::vector<float> const& embedding = {})
  {
    fact_layout const theirs = fact_layout::of(store);
    INFERSCALE_EXPECTS(theirs == layout_,
                       "redis_fact_store::put: the store holds pages of " + theirs.describe() +
                         "; " + name() + " stores pages of " + layout_.describe());
    fact_record const& r = store.at(id);
    fetched_fact f;
    f.fact_id                    = id;
    f.namespace_id               = r.namespace_id;
    f.token_ids                  = r.token_ids;
    f.embedding                  = embedding;
    std::size_t const page_bytes = store.page_bytes();
    f.pages.resize(r.pages.size() * page_bytes);
    auto const* pool = static_cast<unsigned char const*>(store.ref().pool);
    for (std::size_t j = 0; j < r.pages.size(); ++j) {
      unsigned char const* from = pool + static_cast<std::size_t>(r.pages[j]) * page_bytes;
      if (store.space() == memory_space::device) {
        INFERSCALE_CUDA_TRY(
          cudaMemcpy(f.pages.data() + j * page_bytes, from, page_bytes, cudaMemcpyDeviceToHost));
      } else {
        std::memcpy(f.pages.data() + j * page_bytes, from, page_bytes);
      }
    }
    return put(f);
  }

  /**
   * @brief Stores a fact given as a source hands it out (pages as bytes of this layout).
   * @throw logic_error / source_unavailable as put(store, id, embedding); also when the fact has
   *        no tokens or its pages' size disagrees with its tokens
   */
  bool put(fetched_fact const& fact)
  {
    std::int64_t const tokens = static_cast<std::int64_t>(fact.token_ids.size());
    std::string const key     = fact_key_name(fact.namespace_id, fact.fact_id);
    INFERSCALE_EXPECTS(
      tokens > 0 && fact.pages.size() ==
                      static_cast<std::size_t>(layout_.pages_for(tokens)) * layout_.page_bytes,
      "redis_fact_store::put('" + key + "'): " + detail::count_of(tokens, "token") + " and " +
        std::to_string(fact.pages.size()) + " bytes of pages; expected at least one token and " +
        std::to_string(layout_.pages_for(tokens)) + " pages of " +
        std::to_string(layout_.page_bytes) + " bytes");
    for (float x : fact.embedding) {
      INFERSCALE_EXPECTS(std::isfinite(x),
                         "redis_fact_store::put('" + key + "'): the embedding is not finite");
    }
    std::string const value = encode(fact);
    // The value's own checksum (the CRC of every byte before its last 8): a CRC over a range
    // followed by its own CRC would be the same constant for every value.
    std::string const checksum =
      detail::serial::hex(detail::serial::crc64_of(value.data(), value.size() - 8), 16);
    std::string const catalogue = catalogue_key(fact.namespace_id);
    std::string const field     = std::to_string(fact.fact_id);
    for (std::int32_t attempt = 0; attempt < options_.write_retries; ++attempt) {
      bool const committed =
        on_slot(catalogue, [&](detail::redis::connection& c) -> int {
          auto watched = c.pipeline({{"WATCH", catalogue}, {"HGET", catalogue, field}});
          detail::redis::check_reply(watched[0].get(), "WATCH " + catalogue, c);
          detail::redis::check_reply(watched[1].get(), "HGET " + catalogue, c);
          if (watched[1]->type == REDIS_REPLY_STRING) {
            (void)c.pipeline({{"UNWATCH"}});
            std::string const stored{watched[1]->str, watched[1]->len};
            INFERSCALE_EXPECTS(stored == checksum,
                               "redis_fact_store::put: fact " + field + " is already stored in '" +
                                 fact_key_name(fact.namespace_id, fact.fact_id) +
                                 "' with other contents (value checksum " + stored + ", this " +
                                 checksum + "); erase it first");
            return 2;  // already there, the same value
          }
          auto done =
            c.pipeline({{"MULTI"},
                        {"SET", key, value},
                        {"HSET", catalogue, field, checksum},
                        {"SET", generation_key(fact.namespace_id), first_generation(), "NX"},
                        {"EXEC"}});
          for (std::size_t i = 0; i + 1 < done.size(); ++i) {
            detail::redis::check_reply(done[i].get(), "MULTI/SET/HSET " + key, c);
          }
          detail::redis::check_reply(done.back().get(), "EXEC (put " + key + ")", c);
          return done.back()->type == REDIS_REPLY_ARRAY ? 1 : 0;  // nil: the catalogue changed
        }) != 0;
      if (committed) { return last_result_ == 1; }
    }
    INFERSCALE_FAIL("redis_fact_store::put('" + key + "'): the catalogue '" + catalogue +
                    "' kept changing during " + std::to_string(options_.write_retries) +
                    " attempts (other writers); nothing written");
  }

  /**
   * @brief Erases fact `id` of namespace `ns` and increments the namespace's generation, in one
   * transaction.
   * @return whether the fact was stored
   * @throw source_unavailable if Redis cannot be reached (nothing erased then)
   */
  bool erase(std::uint64_t ns, std::uint64_t id)
  {
    std::string const key = fact_key_name(ns, id);
    on_slot(key, [&](detail::redis::connection& c) -> int {
      auto done = c.pipeline({{"MULTI"},
                              {"DEL", key},
                              {"HDEL", catalogue_key(ns), std::to_string(id)},
                              {"INCR", generation_key(ns)},
                              {"EXEC"}});
      for (auto const& r : done) {
        detail::redis::check_reply(r.get(), "erase " + key, c);
      }
      INFERSCALE_EXPECTS(done.back()->type == REDIS_REPLY_ARRAY && done.back()->elements == 3,
                         "redis_fact_store::erase('" + key + "'): the transaction was not run");
      return done.back()->element[0]->integer != 0 ? 1 : 0;
    });
    return last_result_ == 1;
  }

  /**
   * @brief Erases every fact of namespace `ns` and its catalogue, and increments its generation,
   * in one transaction (retried while a writer changes the catalogue meanwhile).
   * @return how many facts were erased
   * @throw logic_error after write_retries conflicting attempts; source_unavailable if Redis
   *        cannot be reached
   */
  std::int64_t erase_namespace(std::uint64_t ns)
  {
    std::string const catalogue = catalogue_key(ns);
    for (std::int32_t attempt = 0; attempt < options_.write_retries; ++attempt) {
      std::int64_t erased = -1;
      on_slot(catalogue, [&](detail::redis::connection& c) -> int {
        auto watched = c.pipeline({{"WATCH", catalogue}, {"HKEYS", catalogue}});
        detail::redis::check_reply(watched[0].get(), "WATCH " + catalogue, c);
        detail::redis::check_reply(watched[1].get(), "HKEYS " + catalogue, c);
        std::vector<std::vector<std::string>> commands{{"MULTI"}};
        for (std::size_t i = 0; i < watched[1]->elements; ++i) {
          redisReply const* e = watched[1]->element[i];
          commands.push_back({"DEL", namespace_prefix(ns) + "f:" + std::string{e->str, e->len}});
        }
        commands.push_back({"DEL", catalogue});
        commands.push_back({"INCR", generation_key(ns)});
        commands.push_back({"EXEC"});
        auto done = c.pipeline(commands);
        for (auto const& r : done) {
          detail::redis::check_reply(r.get(), "erase_namespace " + catalogue, c);
        }
        if (done.back()->type == REDIS_REPLY_ARRAY) {
          erased = static_cast<std::int64_t>(watched[1]->elements);
        }
        return 0;
      });
      if (erased >= 0) { return erased; }
    }
    INFERSCALE_FAIL("redis_fact_store::erase_namespace(" + std::to_string(ns) + "): '" + catalogue +
                    "' kept changing during " + std::to_string(options_.write_retries) +
                    " attempts; nothing erased");
  }

  /// @brief The generation of namespace `ns` (0 before its first erasure).
  /// @throw source_unavailable if Redis cannot be reached
  std::uint64_t generation(std::uint64_t ns) { return fetch(ns, {}).generation; }

  /// @brief The ids in namespace `ns`'s catalogue, ascending.
  /// @throw source_unavailable if Redis cannot be reached
  std::vector<std::uint64_t> namespace_fact_ids(std::uint64_t ns)
  {
    std::string const catalogue = catalogue_key(ns);
    std::vector<std::uint64_t> ids;
    on_slot(catalogue, [&](detail::redis::connection& c) -> int {
      auto r = c.pipeline({{"HKEYS", catalogue}});
      detail::redis::check_reply(r[0].get(), "HKEYS " + catalogue, c);
      ids.clear();
      for (std::size_t i = 0; i < r[0]->elements; ++i) {
        ids.push_back(std::stoull(std::string{r[0]->element[i]->str, r[0]->element[i]->len}));
      }
      return 0;
    });
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  /**
   * @brief Reads the facts `ids` of namespace `ns` and the namespace's generation in one
   * MULTI/EXEC, and checks every value (length, checksum, fields against the key and the layout).
   * @throw logic_error naming the key when a fact is absent or its value is refused, or an id is
   *        listed twice; source_unavailable if Redis cannot be reached. Nothing is returned then.
   */
  fetched_namespace fetch(std::uint64_t ns, std::vector<std::uint64_t> const& ids) override
  {
    std::unordered_set<std::uint64_t> seen;
    std::vector<std::vector<std::string>> commands{{"MULTI"}, {"GET", generation_key(ns)}};
    for (std::uint64_t id : ids) {
      INFERSCALE_EXPECTS(
        seen.insert(id).second,
        "redis_fact_store::fetch: fact " + std::to_string(id) + " is asked for twice");
      commands.push_back({"GET", fact_key_name(ns, id)});
    }
    commands.push_back({"EXEC"});
    fetched_namespace out;
    on_slot(generation_key(ns), [&](detail::redis::connection& c) -> int {
      auto replies = c.pipeline(commands);
      for (auto const& r : replies) {
        detail::redis::check_reply(r.get(), "fetch from namespace " + std::to_string(ns), c);
      }
      redisReply const* exec = replies.back().get();
      INFERSCALE_EXPECTS(exec->type == REDIS_REPLY_ARRAY && exec->elements == ids.size() + 1,
                         "redis_fact_store::fetch: the transaction was not run");
      redisReply const* g = exec->element[0];
      out.generation = g->type == REDIS_REPLY_STRING ? std::stoull(std::string{g->str, g->len}) : 0;
      out.facts.clear();
      for (std::size_t i = 0; i < ids.size(); ++i) {
        redisReply const* v   = exec->element[i + 1];
        std::string const key = fact_key_name(ns, ids[i]);
        INFERSCALE_EXPECTS(v->type == REDIS_REPLY_STRING,
                           "redis_fact_store::fetch: fact " + std::to_string(ids[i]) +
                             " is not stored ('" + key + "' is absent in " + name() + ")");
        out.facts.push_back(
          decode(reinterpret_cast<unsigned char const*>(v->str), v->len, ns, ids[i], key));
      }
      return 0;
    });
    return out;
  }

 private:
  static constexpr unsigned char magic[8]   = {0x89, 'I', 'S', 'F', 'A', 'C', 'T', 0x0A};
  static constexpr std::size_t header_bytes = 88;

  /// A random starting generation for a namespace's first write (SET NX): a server that loses
  /// the namespace's keys (no persistence, a flush) shows generation 0, never one a replica has
  /// seen, so its copies are dropped. Below 2^62, so INCR never overflows.
  static std::string first_generation()
  {
    static std::mt19937_64 random{std::random_device{}()};
    return std::to_string((random() >> 2) | 1u);
  }

  std::string namespace_prefix(std::uint64_t ns) const
  {
    return prefix_ + "{u" + std::to_string(ns) + "}:";
  }

  std::string encode(fetched_fact const& f) const
  {
    std::size_t const tokens = f.token_ids.size();
    std::size_t const dims   = f.embedding.size();
    std::size_t const pages  = f.pages.size() / static_cast<std::size_t>(layout_.page_bytes);
    std::vector<unsigned char> b(header_bytes + 4 * tokens + 4 * dims + f.pages.size() + 8);
    namespace s = detail::serial;
    std::memcpy(b.data(), magic, 8);
    s::put_le<std::uint32_t>(b.data() + 8, value_version);
    // the store dtype (low byte) and the compression (next byte)
    s::put_le<std::uint32_t>(b.data() + 12,
                             static_cast<std::uint32_t>(layout_.store_dtype) |
                               static_cast<std::uint32_t>(layout_.compression) << 8);
    std::int32_t const fields[8] = {layout_.model.num_layers,
                                    layout_.model.num_kv_heads,
                                    layout_.model.head_dim,
                                    layout_.first_layer,
                                    layout_.num_layers,
                                    layout_.first_head,
                                    layout_.num_heads,
                                    layout_.page_size};
    for (int i = 0; i < 8; ++i) {
      s::put_le<std::int32_t>(b.data() + 16 + 4 * i, fields[i]);
    }
    s::put_le<std::uint64_t>(b.data() + 48, layout_.page_bytes);
    s::put_le<std::uint64_t>(b.data() + 56, f.namespace_id);
    s::put_le<std::uint64_t>(b.data() + 64, f.fact_id);
    s::put_le<std::uint32_t>(b.data() + 72, static_cast<std::uint32_t>(tokens));
    s::put_le<std::uint32_t>(b.data() + 76, static_cast<std::uint32_t>(pages));
    s::put_le<std::uint32_t>(b.data() + 80, static_cast<std::uint32_t>(dims));
    s::put_le<std::uint32_t>(b.data() + 84, 0);
    unsigned char* p = b.data() + header_bytes;
    s::copy_little_endian(p, f.token_ids.data(), tokens, 4);
    p += 4 * tokens;
    s::copy_little_endian(p, f.embedding.data(), dims, 4);
    p += 4 * dims;
    if (!f.pages.empty()) { std::memcpy(p, f.pages.data(), f.pages.size()); }
    p += f.pages.size();
    s::put_le<std::uint64_t>(p, s::crc64_of(b.data(), b.size() - 8));
    return std::string{reinterpret_cast<char const*>(b.data()), b.size()};
  }

  fetched_fact decode(unsigned char const* b,
                      std::size_t size,
                      std::uint64_t ns,
                      std::uint64_t id,
                      std::string const& key) const
  {
    namespace s             = detail::serial;
    std::string const where = "redis_fact_store::fetch('" + key + "'): ";
    INFERSCALE_EXPECTS(size >= header_bytes + 8,
                       where + "the value has " + std::to_string(size) +
                         " bytes, fewer than a fact's header and checksum (" +
                         std::to_string(header_bytes + 8) + ")");
    std::uint64_t const stored = s::get_le<std::uint64_t>(b + size - 8);
    std::uint64_t const actual = s::crc64_of(b, size - 8);
    INFERSCALE_EXPECTS(stored == actual,
                       where + "checksum mismatch: stored " + s::hex(stored) + ", computed " +
                         s::hex(actual) + " (the value is corrupted)");
    INFERSCALE_EXPECTS(std::memcmp(b, magic, 8) == 0, where + "not an InferScale fact value");
    std::uint32_t const version = s::get_le<std::uint32_t>(b + 8);
    INFERSCALE_EXPECTS(version == value_version,
                       where + "value version " + std::to_string(version) +
                         " is not supported (this build reads " + std::to_string(value_version) +
                         ")");
    fact_layout l;
    l.store_dtype = static_cast<dtype>(s::get_le<std::uint32_t>(b + 12) & 0xFFu);
    l.compression = static_cast<kv_compression>((s::get_le<std::uint32_t>(b + 12) >> 8) & 0xFFu);
    bool const dtype_known = s::get_le<std::uint32_t>(b + 12) < 65536;
    l.model.num_layers     = s::get_le<std::int32_t>(b + 16);
    l.model.num_kv_heads   = s::get_le<std::int32_t>(b + 20);
    l.model.head_dim       = s::get_le<std::int32_t>(b + 24);
    l.first_layer          = s::get_le<std::int32_t>(b + 28);
    l.num_layers           = s::get_le<std::int32_t>(b + 32);
    l.first_head           = s::get_le<std::int32_t>(b + 36);
    l.num_heads            = s::get_le<std::int32_t>(b + 40);
    l.page_size            = s::get_le<std::int32_t>(b + 44);
    l.page_bytes           = s::get_le<std::uint64_t>(b + 48);
    INFERSCALE_EXPECTS(
      dtype_known && l == layout_,
      where + "the value holds pages of another layout than " + layout_.describe());
    fetched_fact f;
    f.namespace_id = s::get_le<std::uint64_t>(b + 56);
    f.fact_id      = s::get_le<std::uint64_t>(b + 64);
    INFERSCALE_EXPECTS(f.namespace_id == ns && f.fact_id == id,
                       where + "the value is fact " + std::to_string(f.fact_id) + " of namespace " +
                         std::to_string(f.namespace_id));
    std::uint64_t const tokens = s::get_le<std::uint32_t>(b + 72);
    std::uint64_t const pages  = s::get_le<std::uint32_t>(b + 76);
    std::uint64_t const dims   = s::get_le<std::uint32_t>(b + 80);
    INFERSCALE_EXPECTS(
      tokens >= 1 &&
        pages == static_cast<std::uint64_t>(layout_.pages_for(static_cast<std::int64_t>(tokens))) &&
        s::get_le<std::uint32_t>(b + 84) == 0,
      where + std::to_string(pages) + " pages for " + std::to_string(tokens) +
        " tokens (or reserved bytes not zero)");
    std::uint64_t const expected =
      header_bytes + 4 * tokens + 4 * dims + pages * layout_.page_bytes + 8;
    INFERSCALE_EXPECTS(size == expected,
                       where + "the value has " + std::to_string(size) + " bytes, expected " +
                         std::to_string(expected));
    unsigned char const* p = b + header_bytes;
    f.token_ids.resize(static_cast<std::size_t>(tokens));
    s::copy_little_endian(f.token_ids.data(), p, f.token_ids.size(), 4);
    p += 4 * tokens;
    f.embedding.resize(static_cast<std::size_t>(dims));
    s::copy_little_endian(f.embedding.data(), p, f.embedding.size(), 4);
    p += 4 * dims;
    f.pages.assign(p, p + pages * layout_.page_bytes);
    return f;
  }

  /// Runs `attempt` on the node owning `key`'s slot, following MOVED redirections (remembered
  /// per slot) and, while the slot migrates, ASK redirections (the importing node asked once,
  /// after ASKING; the owner not changed) and TRYAGAIN (the keys split between the two nodes:
  /// retried after 2, 4, ... ms); its result is kept in last_result_.
  template <class Attempt>
  int on_slot(std::string const& key, Attempt&& attempt)
  {
    int const slot = detail::redis::hash_slot(key);
    std::string last;
    for (int hop = 0; hop < max_hops; ++hop) {
      auto const owner           = slot_owner_.find(slot);
      std::string const endpoint = owner == slot_owner_.end() ? seed_ : owner->second;
      try {
        try {
          last_result_ = attempt(connection_to(endpoint));
          return last_result_;
        } catch (detail::redis::asked const& a) {
          last                                 = "ASK " + std::to_string(a.slot) + " " + a.endpoint;
          detail::redis::connection& importing = connection_to(a.endpoint);
          importing.set_asking(true);
          try {
            last_result_ = attempt(importing);
          } catch (...) {
            importing.set_asking(false);
            throw;
          }
          importing.set_asking(false);
          return last_result_;
        }
      } catch (detail::redis::moved const& m) {
        last                = "MOVED " + std::to_string(m.slot) + " " + m.endpoint;
        slot_owner_[m.slot] = m.endpoint;
      } catch (detail::redis::asked const& a) {  // the importing node sent it back: start again
        last = "ASK " + std::to_string(a.slot) + " " + a.endpoint + " (from the importing node)";
      } catch (detail::redis::try_again const& t) {
        last = t.text;
        std::this_thread::sleep_for(std::chrono::milliseconds(2 << std::min(hop, 6)));
      }
    }
    throw source_unavailable{"redis " + seed_ + ": '" + key + "' is still redirected after " +
                             std::to_string(max_hops) +
                             " attempts (the cluster is resharding its slot?); last: " + last};
  }

  static constexpr int max_hops = 12;  // TRYAGAIN throughout: about 0.9 s of waits in all

  detail::redis::connection& connection_to(std::string const& endpoint)
  {
    auto it = connections_.find(endpoint);
    if (it == connections_.end()) {
      std::size_t const colon = endpoint.rfind(':');
      std::string const host  = endpoint.substr(0, colon);
      int const port          = std::atoi(endpoint.c_str() + colon + 1);
      it                      = connections_
             .emplace(endpoint,
                      std::make_unique<detail::redis::connection>(host, port, options_.timeout_ms))
             .first;
    }
    return *it->second;
  }

  redis_options options_;
  fact_layout layout_;
  std::string prefix_;
  std::string seed_;
  std::map<int, std::string> slot_owner_;
  std::map<std::string, std::unique_ptr<detail::redis::connection>> connections_;
  int last_result_{0};
};

}  // namespace inferscale
