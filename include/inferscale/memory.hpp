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
 * `prepare` and `inject` are the same steps one at a time. Per scheduler step: `serve_step` serves
 * many users' requests at once — one batched search, one injection batch, one injection — and
 * `serve` is a step of one. A GPU engine (a device store, a cache in device memory) makes the same
 * calls with a device context added (device_context.hpp: `serve_step(..., device)`,
 * `serve(..., device)`, `inject(..., device)`; include memory.cuh).
 * Over time (the fact lifecycle): `update_fact` re-encodes and re-embeds a changed fact, in place
 * or under a superseding id that keeps the old version for audit; `update_turns` re-encodes exactly
 * the facts whose encoding window held a changed conversation turn (the memory keeps each added
 * conversation and every fact's window for it); `add_facts` / `reencode_facts` do the same for
 * facts encoded without the planner, from the caller's fact -> turns map; `erase_fact` and
 * `erase_namespace` leave no K/V behind in the store.
 *
 * The library holds no model: an embedder adapter `E` provides
 *  - `std::int64_t E::dimension() const` (any integer type) and
 *  - `std::vector<float> E::embed(std::string const& text)` — one embedding of `dimension()`
 *    values (normalised or not: the index's metric decides how they compare).
 *
 * C++17, host only (the store and the index may still live in device memory). `serve_step` /
 * `serve` / `inject` run on the host; the same calls with a `device_context` last (its workspace
 * and stream) inject a device store on the device (injection_batch::run, inject.cuh: they compile
 * where memory.cuh is included, with nvcc, and this header does not need the CUDA toolkit), as
 * `erase_fact` / `erase_namespace` with a stream zero a device store's pages on it. The search of
 * `serve_step` / `serve` runs on the host for a host-memory index; for a device-memory index
 * (`memory_config::index.space`) a device context holding a `raft::resources` runs the device
 * `search` (index.cuh: this compiles where memory_device_index.cuh is included, with nvcc and
 * RAFT), the rest of the step unchanged. Every mutation works on either index (the index keeps
 * a host mirror and copies each changed namespace to the device).
 *
 * The parts: the value types (memory_types.hpp); save_memory / load_memory (memory_snapshot.hpp,
 * included at the end); the definitions in detail/memory/ — the facade's request path
 * (facade.inl), the fact lifecycle and its catalogue (lifecycle.inl), the snapshot's binary
 * format (snapshot_format.inl) and the save and load (snapshot.inl).
 */
#pragma once

#include <inferscale/compose.hpp>
#include <inferscale/detail/memory/facade_state.hpp>
#include <inferscale/device_context.hpp>
#include <inferscale/encoding.hpp>
#include <inferscale/engine.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.hpp>
#include <inferscale/index_snapshot.hpp>
#include <inferscale/memory_types.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

/**
 * @brief Store + index for many users' memories (see the file comment).
 *
 * Every mutating call validates its input first and leaves the store and the index unchanged when
 * it throws (adapter failures included: facts stored by a failed call are erased again).
 *
 * **Concurrency.** One memory may be called from many threads at once:
 *  - *Reads* — retrieve, prepare, inject, serve, serve_step, tracks, fact, conversations,
 *    conversation_of, facts_seeing_turn, direct_facts_seeing_turn, instruction_prefix — run
 *    concurrently with each other, any number at once (a shared lock).
 *  - *Mutations* — set_instruction_prefix, add_conversation, add_facts, update_fact, update_turns,
 *    reencode_facts, erase_fact, erase_namespace, compact_index — run one at a time. Each
 *    validates, embeds and runs the model's forwards while reads go on, and excludes reads only
 *    while it commits (copies the captured K/V into the store, adds to or erases from the index,
 *    updates the catalogue); set_instruction_prefix, the erasures and compact_index are commits
 *    throughout. A read sees every mutation that returned before it began, and never half of one:
 *    no fact after its erase returned, no fact without its K/V, no K/V of two versions.
 *  - *Saves* (save_memory, save) run one at a time with the mutations, concurrently with reads: a
 *    snapshot is the state between two mutations.
 * The caller keeps the rest: every thread brings its own cache adapter (a request's adapter, or a
 * step's adapters, belong to that call while it runs) and an embedder safe to call from several
 * threads at once (or one per thread); adapters and embedders must not call back into this
 * memory (deadlock). A waiting mutation holds back reads that arrive after it (no starvation).
 * `store()` and `index()` hand out the parts themselves, outside this contract (use them only while
 * no other thread calls the memory). On a device store a serve's injection is enqueued, not done,
 * when the call returns: a mutation's device writes are made on the default stream (erase_fact(id,
 * stream) documents the order). Moving a memory that other threads use is a race. kv_store and
 * graph_index alone follow the standard library's rule (any number of concurrent const calls; a
 * non-const call needs exclusive access).
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
  std::optional<std::uint64_t> instruction_prefix() const
  {
    auto const read = locks_.read();
    return prefix_;
  }

  /**
   * @brief Encodes the instruction prefix every request's memory segment starts with (one forward
   * at position 0) and stores it under `fact_id` in namespace `ns` (not indexed: never retrieved).
   * @throw logic_error if a prefix is already set, the id is taken, or as encode_facts.
   */
  template <class ModelAdapter>
  void set_instruction_prefix(ModelAdapter& model,
                              std::vector<std::int32_t> const& tokens,
                              std::uint64_t fact_id,
                              std::uint64_t ns);

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
                                     encoding_options const& options = {});

  /**
   * @brief The `k` facts of namespace `ns` nearest to `query` (an embedding), most relevant first
   * (fewer when the namespace holds fewer).
   * @throw logic_error as inferscale::search (unknown namespace, wrong dimension, NaN, k == 0).
   */
  std::vector<std::uint64_t> retrieve(std::uint64_t ns,
                                      std::vector<float> const& query,
                                      std::uint32_t k) const;

  /// @brief retrieve() for a query text embedded by `embedder`.
  template <class Embedder>
  std::vector<std::uint64_t> retrieve(Embedder& embedder,
                                      std::uint64_t ns,
                                      std::string const& query,
                                      std::uint32_t k) const;

  /**
   * @brief The request's memory segment: the instruction prefix (if set) and `fact_ids` (most
   * relevant first; laid out in `config().order`) at positions `first_position ..`.
   * @throw logic_error as compose(), and for a superseded fact (an audit record, see fact_state).
   */
  composition prepare(std::vector<std::uint64_t> const& fact_ids,
                      std::int64_t first_position) const;

  /**
   * @brief Injects a prepared segment through a paged-cache adapter (host backend): a one-request
   * injection step (injection_batch::add(plan, cache), run(cache.cache(), rotation)) under the
   * read lock.
   * @throw logic_error for an empty plan, a store in device memory, positions beyond the
   *        rotation's range (rope_check_positions), all before the adapter allocates; as
   *        injection_batch::add and run (nothing written or committed then, and the slots the
   *        adapter allocated released).
   */
  template <class CacheAdapter, class Rotation>
  void inject(composition const& plan, CacheAdapter& cache, Rotation const& rotation) const;

  /**
   * @brief inject() from a device store into an adapter's cache in device memory: the step run on
   * the device, on `device.stream()` through `device.workspace()`.
   * @throw logic_error as inject(), for a context without a workspace, a store in host memory or
   *        a plan longer than the workspace holds (before the adapter allocates).
   * @note Needs <inferscale/memory.cuh> (nvcc). Never synchronises the device.
   */
  template <class CacheAdapter, class Rotation>
  void inject(composition const& plan,
              CacheAdapter& cache,
              Rotation const& rotation,
              device_context const& device) const;

  /**
   * @brief One scheduler step: every request's memory, retrieved with one batched search and
   * injected with one injection batch. Request `i`'s query is embedded, the top `k` facts of its
   * namespace are found (one `search` of all the queries, each in its own namespace), composed
   * behind the prefix at its `first_position ..` (prepare), and given slots by its cache adapter
   * (`allocate(p0, m)`); all the plans with their slots form one injection_batch, injected with
   * one run; then every adapter commits its tokens, in request order.
   *
   * Without a device context, the store, the index and the cache are in host memory and all of
   * it runs on the host. With one (device_context.hpp), what it holds says where each part runs:
   *  - `device_context{workspace, stream}`: a store in device memory, injected into a cache in
   *    device memory with one checked device run on `stream` (one launch, never a device-wide
   *    synchronisation; staging may wait for the workspace's previous staging copy). The engine
   *    prefills the step's queries on `stream` (or after an event recorded on it). Needs
   *    <inferscale/memory.cuh> (nvcc).
   *  - `device_context{res}` (a `raft::resources` or a type derived from it): an index in device
   *    memory (`config().index.space`), searched by `search(res, index(), ...)` (index.cuh): the
   *    queries copied to the device, the ids back, on `res`'s stream (waited for once), under the
   *    read lock; the ids, plans and cache bytes equal a host index's with the same content. The
   *    store and the cache are in host memory. Needs <inferscale/memory_device_index.cuh> (nvcc,
   *    RAFT).
   *  - `device_context{res, workspace, stream}`: both (a GPU engine's step).
   *
   * Every request's result equals what serve() gives it alone (the same ids, plan and cache
   * bytes), with one exception: under `search_params::ctas_per_query = 0` (automatic) a graph
   * search's split depends on the batch's size (auto_ctas_per_query).
   *
   * All checks come before anything is written or committed: a refused step names the request
   * ("memory::serve_step: request 3 (namespace 9): ...") and leaves the store, the index, the
   * cache and every adapter's sequence unchanged: none commits, and each adapter that allocated
   * slots for the step gets them back (`release(m)`, engine.hpp) before the error reaches the
   * caller.
   * @param requests one per sequence of the step; their adapters are distinct and address one
   *                 cache (the engine's: equal cache() descriptors); none null
   * @param k        facts per request (one search: one `k` for the step)
   * @return one memory_request per request, in order; none for an empty step (nothing runs)
   * @throw logic_error for k == 0, a null or repeated adapter, adapters of different caches, an
   *        unknown namespace, the embedder's dimension or an embedding (wrong size, non-finite)
   *        refused, as graph_index search, prepare (a superseded fact), an empty plan (no prefix
   *        and nothing retrieved), an adapter handing other than `m` slots, injection_batch::add
   *        (a slot written twice in the step) and the injection (a slot beyond the cache, a
   *        position beyond the table); before anything is embedded, an index in the other memory
   *        than the context says; before any adapter allocates, a store in the other memory than
   *        the context says, or more tokens than the workspace holds. Whatever an adapter or the
   *        embedder throws (nothing committed then). A commit that throws leaves the requests
   *        before it committed (their tokens are in the cache) and the rest not. cuda_error on a
   *        CUDA failure.
   */
  template <class Embedder, class CacheAdapter, class Rotation>
  std::vector<memory_request> serve_step(
    Embedder& embedder,
    std::vector<memory_step_request<CacheAdapter>> const& requests,
    std::uint32_t k,
    Rotation const& rotation) const;

  /// @brief serve_step() with a device context: the device index searched, the device store
  /// injected, as the context says (see serve_step above). @throw logic_error as serve_step
  template <class Embedder, class CacheAdapter, class Rotation>
  std::vector<memory_request> serve_step(
    Embedder& embedder,
    std::vector<memory_step_request<CacheAdapter>> const& requests,
    std::uint32_t k,
    Rotation const& rotation,
    device_context const& device) const;

  /**
   * @brief One request: embed `query`, retrieve the top `k` of namespace `ns`, compose them behind
   * the prefix at `first_position ..`, inject through `cache`. The engine then prefills the query
   * at `first_position + result.plan.length()`. A serve_step() of this one request (on the host;
   * the overload with a device_context as serve_step's).
   * @throw logic_error as retrieve, prepare and inject (nothing committed then); as serve_step.
   */
  template <class Embedder, class CacheAdapter, class Rotation>
  memory_request serve(Embedder& embedder,
                       std::uint64_t ns,
                       std::string const& query,
                       std::uint32_t k,
                       std::int64_t first_position,
                       CacheAdapter& cache,
                       Rotation const& rotation) const;

  /// @brief serve() with a device context (see serve_step). @throw logic_error as serve_step
  template <class Embedder, class CacheAdapter, class Rotation>
  memory_request serve(Embedder& embedder,
                       std::uint64_t ns,
                       std::string const& query,
                       std::uint32_t k,
                       std::int64_t first_position,
                       CacheAdapter& cache,
                       Rotation const& rotation,
                       device_context const& device) const;

  // ==============================================================================================
  // Fact lifecycle (update, re-encode after a turn changed, erase). Every call validates first,
  // then embeds and runs the model into host buffers (capture_plan), and only then changes the
  // store and the index: a refusal, or a model, embedder or index failure, leaves both unchanged.
  // The commit itself (erase + insert of validated K/V, index erase/add of validated vectors) is
  // refused by nothing; on a device store or index only a CUDA error can interrupt it (then it
  // propagates as cuda_error and a fact may be half updated). Pages a fact gives up are zeroed,
  // so an erased fact's K/V is not left in the pool.
  //
  // What is kept for this (host memory): per add_conversation(), a copy of the conversation (4
  // bytes per token of lead, headers and turns) and its encoding_options; per fact, its window
  // (two turn indices and its source turns) and links, and for a direct fact its context (4 bytes
  // per token) and turn map. The K/V of a fact is far larger (2·L·h·d·b per token).

  /// @brief True when the memory tracks fact `id` (added by add_conversation/add_facts or an
  /// update, not erased since; the instruction prefix is not tracked).
  bool tracks(std::uint64_t id) const
  {
    auto const read = locks_.read();
    return facts_.count(id) != 0;
  }

  /// @brief The lifecycle state of a tracked fact. @throw logic_error for an untracked id.
  fact_state fact(std::uint64_t id) const;

  /// @brief Handles of the conversations kept for namespace `ns`, in the order they were added.
  std::vector<std::uint64_t> conversations(std::uint64_t ns) const;

  /// @brief A copy of the conversation as kept (with every update_turns() applied).
  /// @throw logic_error for an unknown handle (never added, or all its facts erased).
  conversation conversation_of(std::uint64_t handle) const;

  /**
   * @brief The retrievable facts of conversation `handle` whose K/V saw turn `turn` (window
   * `[first_turn, source_turn)` holds it), in plan order: what update_turns() re-encodes.
   * @throw logic_error for an unknown handle or a turn outside the conversation.
   */
  std::vector<std::uint64_t> facts_seeing_turn(std::uint64_t handle, std::int64_t turn) const;

  /// @brief The retrievable directly added facts of namespace `ns` whose caller-given turn map
  /// holds `turn` (ascending ids): the ones to pass to reencode_facts() when that turn changed.
  std::vector<std::uint64_t> direct_facts_seeing_turn(std::uint64_t ns, std::int64_t turn) const;

  /**
   * @brief Adds facts encoded by the caller's own sequences (no planner): fact `i` is one forward
   * of `facts[i].context + facts[i].token_ids` at `first_position ..` (through encode_branches
   * when the adapter has it), its text `texts[i]` is embedded and indexed. The caller's turn map
   * (`direct_fact::turns`) is kept for direct_facts_seeing_turn().
   * @throw logic_error (store and index unchanged) if lengths differ, an id is taken (stored,
   *        indexed, tracked, the prefix) or repeated, a fact has no tokens, a position is
   *        negative, capacity is short, the model's geometry is not the store's, or an embedding
   *        is refused by the index's rules; whatever the adapters throw (nothing changed then).
   */
  template <class ModelAdapter, class Embedder>
  memory_add_report add_facts(ModelAdapter& model,
                              Embedder& embedder,
                              std::uint64_t ns,
                              std::vector<direct_fact> const& facts,
                              std::vector<std::string> const& texts);

  /**
   * @brief A new version of a fact (see fact_update): its tokens re-encoded — a planned fact
   * behind its window of the kept conversation (the same window when its earliest source turn is
   * unchanged, planned_window_start()'s otherwise), a direct fact behind its (new) context — and
   * its text re-embedded. In place, the store and index entries of `fact_id` are replaced;
   * superseding, `new_id` is stored and indexed, and `fact_id` leaves the index but stays in the
   * store for audit until erase_fact().
   * @return the re-encoded id (`new_id`) and what the adapters ran.
   * @throw logic_error (store and index unchanged) if `fact_id` is not tracked or is superseded,
   *        `new_id` is taken, the tokens are empty, a source turn is outside the conversation,
   *        the window and tokens exceed max_sequence_tokens, capacity is short, the model's
   *        geometry differs, the embedding is refused by the index's rules (wrong dimension,
   *        non-finite, zero under cosine); whatever the adapters throw (nothing changed then).
   */
  template <class ModelAdapter, class Embedder>
  lifecycle_report update_fact(ModelAdapter& model, Embedder& embedder, fact_update const& u);

  /**
   * @brief Changes turns of a kept conversation and re-encodes exactly the retrievable facts
   * whose window held a changed turn (facts_seeing_turn), each behind the window it was planned
   * with, over the updated conversation (plan_encoding_at): their K/V then equal a fresh encoding
   * of the updated conversation with those windows. Every other fact keeps its bytes; superseded
   * facts are audit records and keep theirs too. Texts and the index are unchanged (a fact's text
   * is its own), so nothing is embedded.
   * @throw logic_error (store, index and kept conversation unchanged) for an unknown handle, a
   *        turn outside the conversation or given twice, an empty turn, a window that no longer
   *        fits max_sequence_tokens, a model geometry other than the store's; whatever the model
   *        adapter throws (nothing changed then).
   */
  template <class ModelAdapter>
  lifecycle_report update_turns(ModelAdapter& model,
                                std::uint64_t handle,
                                std::vector<turn_change> const& changes);

  /**
   * @brief Re-encodes directly added facts behind new contexts (after a turn of the caller's
   * conversation changed: direct_facts_seeing_turn() names them), keeping their tokens, texts and
   * index entries. All or nothing over the whole list.
   * @throw logic_error (nothing changed) if an id is not a tracked, retrievable, directly added
   *        fact or repeats, a position is negative, the model's geometry differs; whatever the
   *        model adapter throws.
   */
  template <class ModelAdapter>
  lifecycle_report reencode_facts(ModelAdapter& model, std::vector<fact_context> const& contexts);

  /**
   * @brief Erases one tracked fact — retrievable or superseded (an audit record) — from the store
   * (its pages zeroed and returned) and the index, and forgets its lifecycle record; a
   * conversation left without facts is forgotten too. Its index row stays flagged deleted (never
   * returned) until compact_index().
   * @throw logic_error (nothing changed) if the id is not tracked (the prefix is not).
   */
  void erase_fact(std::uint64_t id);

  /**
   * @brief erase_fact() zeroing a device store's pages on `stream` (cudaMemsetAsync) without
   * waiting: the pages are free in the catalogue at return, zeroed for the work enqueued after
   * this call on `stream`. The facade's own later writes of the store (add, update, re-encode,
   * on the default stream) first wait for this zeroing (an event, not the device); a caller
   * writing the pages itself orders the write after it (on `stream`, or after an event recorded
   * on it). Work still reading the fact must be ordered before the call. erase_fact(id) zeroes on
   * the default stream and waits for that stream. A host store is zeroed on the host (`stream`
   * unused).
   * @param stream a `cudaStream_t` or a `cuda::stream_ref`
   * @throw logic_error as erase_fact(id); cuda_error if a zeroing cannot be enqueued.
   */
  template <class Stream>
  void erase_fact(std::uint64_t id, Stream stream);

  /**
   * @brief Forgets a user: every fact of namespace `ns` leaves the store (pages zeroed and
   * returned) and the index, with the namespace's kept conversations and lifecycle records. The
   * index keeps the namespace's old rows as a hole until compact_index().
   * @return facts removed from the store (superseded audit records included).
   * @throw logic_error (nothing changed) if the namespace holds the instruction prefix.
   */
  std::int64_t erase_namespace(std::uint64_t ns);

  /// @brief erase_namespace() zeroing a device store's pages on `stream` without waiting, as
  /// erase_fact(id, stream). @throw logic_error as erase_namespace(ns)
  template <class Stream>
  std::int64_t erase_namespace(std::uint64_t ns, Stream stream);

  /// @brief Index searches this memory has run: one per retrieve(), serve() and serve_step().
  std::uint64_t searches() const noexcept { return searches_.get(); }

  /// @brief Reclaims the index rows of erased and superseded facts and of erased namespaces
  /// (graph_index::compact): afterwards the index holds no vector of them at all.
  void compact_index()
  {
    auto const serial = locks_.serial();
    auto const commit = locks_.commit();
    index_.compact();
  }

  // ---- snapshots: restart a deployment without re-encoding ------------------------------------

  /// @brief Same as `save_memory(*this, directory)` (a thin wrapper kept for existing callers).
  /// @throw logic_error as save_memory
  void save(std::string const& directory) const;

  /// @brief Same as `load_memory(directory, config)` (a thin wrapper kept for existing callers).
  /// @throw logic_error as load_memory
  static memory load(std::string const& directory, memory_config const& config);
  // ---- end of snapshots -----------------------------------------------------------------------

 private:
  /// The one serving path of serve() and serve_step(), host and device: checks, one batched
  /// search, the plans (each checked against `rotation`'s position range), the slots and one
  /// batch; the store check before any adapter allocates, the injection, then the commits. The
  /// search runs on the device when `device` holds resources, the injection when it holds a
  /// workspace (`OnDevice`: a device serve, compiled where memory.cuh is included). A step
  /// (`name_requests`) names the request in a refusal; serve() keeps the messages of the calls it
  /// makes. An index in the other memory than the search's is refused before anything is
  /// embedded.
  template <bool OnDevice, class Embedder, class CacheAdapter, class Rotation>
  std::vector<memory_request> serve_requests(
    Embedder& embedder,
    cuda::std::span<memory_step_request<CacheAdapter> const> requests,
    std::uint32_t k,
    char const* who,
    bool name_requests,
    Rotation const& rotation,
    device_context const* device) const;

  /// inject() and its device twin (`OnDevice`, with `device`): checks, one step, its run.
  template <bool OnDevice, class CacheAdapter, class Rotation>
  void inject_plan(composition const& plan,
                   CacheAdapter& cache,
                   Rotation const& rotation,
                   device_context const* device) const;

  /// prepare() without taking the read lock (the caller holds a lock).
  composition prepare_unlocked(std::vector<std::uint64_t> const& fact_ids,
                               std::int64_t first_position) const;

  /// Refuses a device store on the host path, before any adapter allocates.
  void require_host_store(char const* who) const;

  /// Refuses a host store on the device path, or more tokens than the workspace holds.
  void require_device_store(std::int64_t tokens, std::int64_t capacity, char const* who) const;

  template <class Embedder>
  std::vector<float> embed_all(Embedder& embedder,
                               std::vector<std::string> const& texts,
                               char const* who) const;

  // ==============================================================================================
  // Fact lifecycle: private state and helpers

  /// What the memory keeps of a fact (see fact_state; the tokens live in the store's record).
  struct fact_entry {
    std::uint64_t ns{};
    std::optional<std::uint64_t> conversation;  ///< set: planned from it
    std::vector<std::int64_t> source_turns;     ///< planned
    std::int64_t first_turn{0};                 ///< planned: window start
    std::vector<std::int32_t> context;          ///< direct: what it sees before itself
    std::int64_t first_position{0};             ///< direct: position of context[0]
    std::vector<std::int64_t> turns;            ///< direct: the caller's map
    std::optional<std::uint64_t> supersedes;
    std::optional<std::uint64_t> superseded_by;
  };

  /// What the memory keeps of an added conversation, to re-encode its facts.
  struct conversation_entry {
    std::uint64_t ns{};
    conversation c;
    encoding_options options;
    std::vector<std::uint64_t> facts;  ///< tracked facts planned from it, in plan order
  };

  static std::int64_t anchor(std::vector<std::int64_t> const& source_turns);

  fact_entry const& entry(std::uint64_t id, char const* who) const;

  fact_entry const& retrievable_entry(std::uint64_t id, char const* who) const;

  conversation_entry const& conversation_entry_of(std::uint64_t handle, char const* who) const;
  conversation_entry& conversation_entry_of(std::uint64_t handle, char const* who);

  template <class ModelAdapter>
  void check_model(ModelAdapter const& model, char const* who) const;

  /// Refuses an id a new fact cannot take: stored (audit records too), indexed, tracked, the
  /// prefix, or the index's reserved id.
  void check_new_id(std::uint64_t id, char const* who) const;

  /// Refuses `pages` new pages when fewer are free (`released` pages are given back first).
  void check_pages(std::int64_t pages, std::int64_t released, char const* who) const;

  /// A one-branch job: `context` as the trunk, the fact attached after all of it.
  static encoding_job direct_job(std::uint64_t id,
                                 std::uint64_t ns,
                                 std::vector<std::int32_t> const& context,
                                 std::vector<std::int32_t> const& tokens,
                                 std::int64_t first_position,
                                 char const* who);

  matrix_view<float const> matrix_of(std::vector<float> const& vectors, std::size_t rows) const;

  /// Applies the index's own checks (dimension, finite, non-zero under cosine, norm, fp16 range)
  /// to vectors before anything changes, by adding them to a scratch host index.
  void probe(std::vector<float> const& vectors, std::vector<std::uint64_t> const& ids) const;

  void erase_and_scrub(std::uint64_t id);

  /// erase_fact / erase_namespace without their zeroing: the pages the erased facts held.
  std::vector<std::int64_t> erase_fact_keeping_pages(std::uint64_t id);
  std::pair<std::int64_t, std::vector<std::int64_t>> erase_namespace_keeping_pages(
    std::uint64_t ns);

  /// Replaces a stored fact's K/V (validated: the capture is complete and the pages fit). The
  /// pages it gives back are taken again first, so a fact of the same length keeps its pages.
  void replace_stored(std::uint64_t id,
                      std::uint64_t ns,
                      std::vector<std::int32_t> const& tokens,
                      kv_capture const& capture);

  /// Records an added conversation and its facts' windows; returns its handle.
  std::uint64_t remember_conversation(std::uint64_t ns,
                                      conversation const& c,
                                      encoding_options const& options,
                                      encoding_plan const& plan);

  std::unordered_map<std::uint64_t, fact_entry> facts_;
  std::unordered_map<std::uint64_t, conversation_entry> conversation_entries_;
  std::uint64_t next_conversation_{1};

  // ---- snapshots (see save_memory / load_memory) -----------------------------------------------
  friend void save_memory(memory const& mem,
                          std::string const& directory,
                          std::optional<std::string> const& application);
  friend memory load_memory(std::string const& directory,
                            memory_config const& config,
                            std::optional<std::string>* application,
                            memory const* previous);
  friend std::optional<std::string> load_memory_application(std::string const& directory);

  static constexpr char const* manifest_name = "memory.ismem";
  /// Version 1 (no application data) and version 2 (with it): 72 and 80 bytes.
  static constexpr std::size_t manifest_bytes    = 72;
  static constexpr std::size_t manifest_v2_bytes = 80;

  struct snapshot_manifest;

  memory(memory_config const& config,
         kv_store&& store,
         graph_index&& index,
         std::optional<std::uint64_t> prefix)
    : config_{config}, store_{std::move(store)}, index_{std::move(index)}, prefix_{prefix}
  {
  }

  static std::string store_file_name(snapshot_manifest const& m);
  static std::string index_file_name(snapshot_manifest const& m);

  static std::string lifecycle_file_name(snapshot_manifest const& m);
  static std::string application_file_name(snapshot_manifest const& m);
  static std::string decode_application(std::vector<unsigned char> const& b,
                                        std::string const& what);

  static void encode_manifest(snapshot_manifest const& m, unsigned char* bytes);

  static snapshot_manifest parse_manifest(std::vector<unsigned char> const& b,
                                          std::string const& where);

  static constexpr unsigned char manifest_magic[8]    = {0x89, 'I', 'S', 'M', 'E', 'M', 0x0D, 0x0A};
  static constexpr unsigned char lifecycle_magic[8]   = {0x89, 'I', 'S', 'L', 'C', 'Y', 0x0D, 0x0A};
  static constexpr unsigned char application_magic[8] = {0x89, 'I', 'S', 'A', 'P', 'P', 0x0D, 0x0A};

  struct lifecycle_out;

  struct lifecycle_in;

  std::vector<unsigned char> encode_lifecycle() const;

  /// Rebuilds the lifecycle state of a freshly loaded memory (store and index already checked);
  /// everything is parsed and checked into locals first, then moved in.
  void decode_lifecycle(std::vector<unsigned char> const& b, std::string const& what);
  // ---- end of snapshots -----------------------------------------------------------------------

  memory_config config_;
  kv_store store_;
  graph_index index_;
  std::optional<std::uint64_t> prefix_;
  detail::call_counter searches_;
  detail::pending_zeroing zeroing_;  ///< erase_fact/erase_namespace(.., stream) not yet waited for
  detail::facade_locks locks_;       ///< the concurrency contract (class comment)
};

}  // namespace inferscale

#include <inferscale/detail/memory/facade.inl>
#include <inferscale/detail/memory/lifecycle.inl>
#include <inferscale/memory_snapshot.hpp>  // save_memory / load_memory
