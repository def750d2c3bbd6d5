/**
 * @file detail/memory/facade.inl
 * @brief Definitions for memory.hpp, the request path of the facade: the instruction prefix,
 * add_conversation, retrieve, prepare, inject, and serve / serve_step (one serving path for a step
 * of many requests and a request alone), on the host and (with a workspace and a stream) on the
 * device (and the embedding of texts they share).
 */
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

namespace detail {
/// @brief The runtime's handle of a stream given as a `cudaStream_t` ...
inline cudaStream_t raw_stream(cudaStream_t s) noexcept { return s; }
/// @brief ... or as an object with get() (`cuda::stream_ref`).
template <class S, class = decltype(std::declval<S const&>().get())>
cudaStream_t raw_stream(S const& s) noexcept
{
  return s.get();
}
}  // namespace detail

// same_cache (one step, one cache): injection_batch.hpp. memory_index_search (the device index's
// search) and the device_context carrying it: device_context.hpp.

template <class ModelAdapter>
void memory::set_instruction_prefix(ModelAdapter& model,
                                    std::vector<std::int32_t> const& tokens,
                                    std::uint64_t fact_id,
                                    std::uint64_t ns)
{
  auto const serial = locks_.serial();
  auto const commit = locks_.commit();  // one forward, once per deployment: a commit throughout
  INFERSCALE_EXPECTS(!prefix_.has_value(),
                     "memory::set_instruction_prefix: the prefix is already fact " +
                       std::to_string(prefix_.value_or(0)));
  INFERSCALE_EXPECTS(
    !index_.contains(fact_id),
    "memory::set_instruction_prefix: fact id " + std::to_string(fact_id) + " is an indexed fact");
  zeroing_.wait();  // a page freed by erase_fact(id, stream) is zeroed before it is written
  encode_facts(model, store_, tokens, 0, {{fact_id, ns, 0, tokens}});
  prefix_ = fact_id;
}

template <class ModelAdapter, class Embedder>
memory_add_report memory::add_conversation(ModelAdapter& model,
                                           Embedder& embedder,
                                           std::uint64_t ns,
                                           conversation const& c,
                                           std::vector<conversation_fact> const& facts,
                                           std::vector<std::string> const& texts,
                                           encoding_options const& options)
{
  static_assert(is_embedder_v<Embedder>,
                "memory::add_conversation: Embedder needs dimension() and "
                "embed(std::string const&) -> std::vector<float> (see memory.hpp)");
  INFERSCALE_EXPECTS(texts.size() == facts.size(),
                     "memory::add_conversation: " +
                       detail::count_of(static_cast<std::int64_t>(facts.size()), "fact") + " but " +
                       detail::count_of(static_cast<std::int64_t>(texts.size()), "text"));
  char const* const who = "memory::add_conversation";
  auto const serial     = locks_.serial();
  std::vector<std::uint64_t> ids;
  ids.reserve(facts.size());
  std::int64_t pages = 0;
  for (conversation_fact const& f : facts) {
    std::string const which = std::string{who} + ": fact " + std::to_string(f.fact_id);
    INFERSCALE_EXPECTS(f.namespace_id == ns,
                       which + " is in namespace " + std::to_string(f.namespace_id) +
                         ", the conversation is added to namespace " + std::to_string(ns));
    INFERSCALE_EXPECTS(!index_.contains(f.fact_id), which + " is already indexed");
    INFERSCALE_EXPECTS(!prefix_ || *prefix_ != f.fact_id, which + " is the instruction prefix");
    INFERSCALE_EXPECTS(!store_.contains(f.fact_id), which + " is already stored");
    ids.push_back(f.fact_id);
    pages += store_.pages_for(static_cast<std::int64_t>(f.token_ids.size()));
  }
  check_model(model, who);
  check_pages(pages, 0, who);
  // Everything that can be refused without writing: the plan, the embeddings, the index's rules
  // for them; then the model's forwards into host buffers (reads go on meanwhile).
  encoding_plan const plan   = plan_encoding(c, facts, options);
  std::vector<float> vectors = embed_all(embedder, texts, who);
  probe(vectors, ids);
  captured_plan const captured = capture_plan(model, plan);

  // Commit: nothing below is refused (all of it was validated above).
  auto const commit = locks_.commit();
  zeroing_.wait();  // a page freed by erase_fact(id, stream) is zeroed before it is written
  for (std::size_t i = 0; i < captured.facts.size(); ++i) {
    store_.insert<float>(captured.facts[i].fact_id,
                         captured.facts[i].namespace_id,
                         captured.facts[i].token_ids,
                         captured.captures[i].keys(),
                         captured.captures[i].values());
  }
  try {
    index_.add<float>(ns,
                      make_matrix_view<float const>(
                        vectors.data(), static_cast<std::int64_t>(ids.size()), index_.dim()),
                      cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  } catch (...) {
    for (captured_fact const& f : captured.facts) {
      erase_and_scrub(f.fact_id);
    }
    throw;
  }
  memory_add_report report;
  report.plan         = plan.stats();
  report.embedded     = static_cast<std::int64_t>(texts.size());
  report.encode       = captured.report;
  report.conversation = remember_conversation(ns, c, options, plan);
  return report;
}

inline std::vector<std::uint64_t> memory::retrieve(std::uint64_t ns,
                                                   std::vector<float> const& query,
                                                   std::uint32_t k) const
{
  auto const read = locks_.read();
  INFERSCALE_EXPECTS(static_cast<std::int64_t>(query.size()) == index_.dim(),
                     "memory::retrieve: the query has " + std::to_string(query.size()) +
                       " values, the index " + std::to_string(index_.dim()));
  INFERSCALE_EXPECTS(k > 0, std::string{"memory::retrieve: k must be positive"});
  std::vector<std::uint64_t> ids(k);
  std::vector<float> distances(k);
  searches_.add();
  inferscale::search<float>(index_,
                            make_matrix_view<float const>(query.data(), 1, index_.dim()),
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

template <class Embedder>
std::vector<std::uint64_t> memory::retrieve(Embedder& embedder,
                                            std::uint64_t ns,
                                            std::string const& query,
                                            std::uint32_t k) const
{
  static_assert(is_embedder_v<Embedder>, "memory::retrieve: Embedder requirements (memory.hpp)");
  return retrieve(ns, embed_all(embedder, {query}, "memory::retrieve"), k);
}

inline composition memory::prepare(std::vector<std::uint64_t> const& fact_ids,
                                   std::int64_t first_position) const
{
  auto const read = locks_.read();
  return prepare_unlocked(fact_ids, first_position);
}

inline composition memory::prepare_unlocked(std::vector<std::uint64_t> const& fact_ids,
                                            std::int64_t first_position) const
{
  for (std::uint64_t id : fact_ids) {
    auto const it = facts_.find(id);
    INFERSCALE_EXPECTS(
      it == facts_.end() || !it->second.superseded_by,
      "memory::prepare: fact " + std::to_string(id) + " is superseded by fact " +
        std::to_string(it == facts_.end() ? 0 : it->second.superseded_by.value_or(0)) +
        " (kept for audit, not for requests)");
  }
  compose_options o;
  o.first_position     = first_position;
  o.order              = config_.order;
  o.instruction_prefix = prefix_;
  return compose(store_, fact_ids, o);
}

template <class CacheAdapter, class Rotation>
void memory::inject(composition const& plan, CacheAdapter& cache, Rotation const& rotation) const
{
  inject_plan<false>(plan, cache, rotation, nullptr);
}

template <class CacheAdapter, class Rotation>
void memory::inject(composition const& plan,
                    CacheAdapter& cache,
                    Rotation const& rotation,
                    device_context const& device) const
{
  inject_plan<true>(plan, cache, rotation, &device);
}

template <bool OnDevice, class CacheAdapter, class Rotation>
void memory::inject_plan(composition const& plan,
                         CacheAdapter& cache,
                         Rotation const& rotation,
                         device_context const* device) const
{
  static_assert(is_cache_adapter_v<CacheAdapter>,
                "memory::inject: CacheAdapter needs allocate(first_position, tokens), cache(), "
                "commit(tokens) and release(tokens) (see engine.hpp)");
  char const* const who = "memory::inject";
  // Everything that can be refused without the adapter, before it allocates: the plan, the
  // store's memory, the workspace, the model's range (run would refuse it only after).
  INFERSCALE_EXPECTS(plan.length() > 0, std::string{who} + ": the plan is empty");
  auto const read = locks_.read();
  if constexpr (OnDevice) {
    INFERSCALE_EXPECTS(device->workspace() != nullptr,
                       std::string{who} +
                         ": the device context has no injection workspace (a device store is "
                         "injected through one: device_context{workspace, stream})");
    // (the workspace's type named through Rotation: complete where inject.cuh is included)
    using workspace_t = detail::dependent_t<injection_workspace, Rotation>;
    require_device_store(
      plan.length(), static_cast<workspace_t*>(device->workspace())->capacity(), who);
  } else {
    require_host_store(who);
  }
  rope_check_positions(rotation, plan.first_position, plan.length(), who);
  injection_batch step{store_};
  step.add(plan, cache);
  if constexpr (OnDevice) {
    step.run(cache.cache(), rotation, *device);
  } else {
    step.run(cache.cache(), rotation);
  }
}

template <bool OnDevice, class Embedder, class CacheAdapter, class Rotation>
std::vector<memory_request> memory::serve_requests(
  Embedder& embedder,
  cuda::std::span<memory_step_request<CacheAdapter> const> requests,
  std::uint32_t k,
  char const* who,
  bool name_requests,
  Rotation const& rotation,
  device_context const* device) const
{
  // The device run is defined in inject.cuh (memory.cuh includes it). A unit without it may still
  // serve with a context of resources alone (a device index, a host store: injected on the host,
  // as the host tests do with a search of their own); a workspace is refused there, before any
  // adapter allocates.
  constexpr bool device_run_defined =
    OnDevice && detail::is_complete<detail::dependent_t<injection_workspace, Rotation>>::value;
  // Where each part runs: the search with the context's resources, the injection on the device
  // with its workspace; each on the host without.
  bool const context_search                 = device != nullptr && device->searches_index();
  [[maybe_unused]] bool const device_inject = device != nullptr && device->workspace() != nullptr;
  memory_space const search_space = context_search ? device->index_space() : memory_space::host;
  static_assert(is_embedder_v<Embedder>,
                "memory::serve: Embedder needs dimension() and "
                "embed(std::string const&) -> std::vector<float> (see memory.hpp)");
  static_assert(is_cache_adapter_v<CacheAdapter>,
                "memory::serve: CacheAdapter needs allocate(first_position, tokens), cache(), "
                "commit(tokens) and release(tokens) (see engine.hpp)");
  auto const read     = locks_.read();
  std::size_t const n = requests.size();
  // "memory::serve_step: request 3 (namespace 9)" in a step; the caller's name alone for serve()
  auto const where = [&](std::size_t i) {
    std::string w = who;
    if (name_requests) {
      w += ": request " + std::to_string(i) + " (namespace " + std::to_string(requests[i].ns) + ")";
    }
    return w;
  };
  // Runs `call`; in a step, a refusal of it is rethrown naming request `i` (or the step).
  auto const named = [&](std::string const& what, auto&& call) -> decltype(call()) {
    if (!name_requests) { return call(); }
    try {
      return call();
    } catch (logic_error const& e) {
      throw logic_error{what + ": " + e.what()};
    }
  };

  // 1. Everything about the requests that needs no embedding: the index's memory, k, the
  // adapters, the namespaces.
  INFERSCALE_EXPECTS(index_.space() == search_space,
                     std::string{who} + ": the index is in " + to_string(index_.space()) +
                       " memory; " +
                       (search_space == memory_space::host
                          ? "serve a device index with a device_context holding its "
                            "raft::resources, " +
                              std::string{who} +
                              "(..., rotation, device_context{res[, workspace, stream]}) "
                              "(memory_device_index.cuh)"
                          : "serve a host index with a device_context without raft::resources"));
  INFERSCALE_EXPECTS(k > 0, std::string{who} + ": k must be positive");
  if (n == 0) { return {}; }
  std::unordered_set<CacheAdapter const*> adapters;
  for (std::size_t i = 0; i < n; ++i) {
    memory_step_request<CacheAdapter> const& r = requests[i];
    INFERSCALE_EXPECTS(r.cache != nullptr, where(i) + ": no cache adapter (null)");
    INFERSCALE_EXPECTS(adapters.insert(r.cache).second,
                       where(i) +
                         ": its cache adapter is an earlier request's (one sequence "
                         "per request)");
    INFERSCALE_EXPECTS(detail::same_cache(r.cache->cache(), requests[0].cache->cache()),
                       where(i) +
                         ": its cache adapter addresses another cache than request 0's "
                         "(one step injects into one cache)");
    INFERSCALE_EXPECTS(
      index_.has_namespace(r.ns),
      where(i) + ": unknown namespace " + std::to_string(r.ns) + " (nothing of it is indexed)");
  }

  // 2. The embeddings, then one search of all of them, each in its own namespace.
  std::int64_t const dim = index_.dim();
  INFERSCALE_EXPECTS(static_cast<std::int64_t>(embedder.dimension()) == dim,
                     std::string{who} + ": the embedder gives " +
                       std::to_string(embedder.dimension()) + "-d vectors, the index holds " +
                       std::to_string(dim) + "-d");
  std::vector<float> queries;
  std::vector<std::uint64_t> namespaces(n);
  queries.reserve(n * static_cast<std::size_t>(dim));
  std::vector<std::vector<float>> embedded;  // a batch embedder's answer: one call for the step
  if constexpr (embeds_batches_v<Embedder>) {
    std::vector<std::string> texts(n);
    for (std::size_t i = 0; i < n; ++i) {
      texts[i] = requests[i].query;
    }
    embedded = embedder.embed(texts);
    INFERSCALE_EXPECTS(embedded.size() == n,
                       std::string{who} + ": the embedder returned " +
                         detail::count_of(static_cast<std::int64_t>(embedded.size()), "embedding") +
                         " for " +
                         detail::count_of(static_cast<std::int64_t>(n), "query", "queries"));
  }
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<float> const v =
      embeds_batches_v<Embedder> ? std::move(embedded[i]) : embedder.embed(requests[i].query);
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(v.size()) == dim,
                       where(i) + ": the query embedded to " + std::to_string(v.size()) +
                         " values, expected " + std::to_string(dim));
    INFERSCALE_EXPECTS(std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); }),
                       where(i) + ": the query has a non-finite embedding");
    queries.insert(queries.end(), v.begin(), v.end());
    namespaces[i] = requests[i].ns;
  }
  auto const rows = static_cast<std::int64_t>(n);
  std::vector<std::uint64_t> ids(n * k);
  std::vector<float> distances(n * k);
  named(who, [&] {
    searches_.add();
    auto const query_view = make_matrix_view<float const>(queries.data(), rows, dim);
    cuda::std::span<std::uint64_t const> const spaces{namespaces.data(), n};
    auto const id_view       = make_matrix_view<std::uint64_t>(ids.data(), rows, k);
    auto const distance_view = make_matrix_view<float>(distances.data(), rows, k);
    if (context_search) {
      device->search_index(index_, query_view, spaces, k, config_.search, id_view, distance_view);
    } else {
      inferscale::search<float>(
        index_, query_view, spaces, k, config_.search, id_view, distance_view);
    }
  });

  // 3. The plans.
  std::vector<memory_request> out(n);
  std::int64_t tokens = 0;
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < k; ++j) {
      std::uint64_t const id = ids[i * k + j];
      if (id != invalid_fact_id) { out[i].fact_ids.push_back(id); }
    }
    out[i].plan = named(
      where(i), [&] { return prepare_unlocked(out[i].fact_ids, requests[i].first_position); });
    INFERSCALE_EXPECTS(out[i].plan.length() > 0,
                       where(i) + ": the plan is empty (no instruction prefix, nothing retrieved)");
    // The model's range, before any adapter allocates.
    named(where(i), [&] {
      rope_check_positions(rotation, out[i].plan.first_position, out[i].plan.length(), who);
    });
    tokens += out[i].plan.length();
  }
  // Before any adapter allocates: the store in the memory the injection reads, the workspace
  // large enough.
  if (device_inject) {
    if constexpr (device_run_defined) {
      // (the workspace's type named through Rotation: complete only where inject.cuh is)
      using workspace_t = detail::dependent_t<injection_workspace, Rotation>;
      require_device_store(tokens, static_cast<workspace_t*>(device->workspace())->capacity(), who);
    } else {
      INFERSCALE_EXPECTS(false,
                         std::string{who} +
                           ": a device_context with a workspace injects on the device: include "
                           "<inferscale/memory.cuh> (nvcc)");
    }
  } else {
    require_host_store(who);
  }

  // 4. The slots, into one batch (a slot written twice anywhere in the step is refused here).
  // From the first allocate on, a failure (an adapter's, a refused slot, a refused or failed run)
  // gives every slot allocated so far back: release(m) of each adapter that allocated, in order.
  injection_batch batch{store_};
  batch.reserve(tokens);
  std::size_t allocated = 0;  // requests[0 .. allocated) hold staged slots
  try {
    for (std::size_t i = 0; i < n; ++i) {
      composition const& plan = out[i].plan;
      std::vector<std::int64_t> const slots =
        requests[i].cache->allocate(plan.first_position, plan.length());
      allocated = i + 1;
      INFERSCALE_EXPECTS(static_cast<std::int64_t>(slots.size()) == plan.length(),
                         where(i) + ": the cache adapter allocated " +
                           detail::count_of(static_cast<std::int64_t>(slots.size()), "slot") +
                           " for " + detail::count_of(plan.length(), "token"));
      named(where(i), [&] { batch.add(plan, slots); });
    }

    // 5. One injection (it checks the slots against the cache and the positions against the
    // rotation before it writes).
    named(who, [&] {
      paged_kv_cache const& cache = requests[0].cache->cache();
      if constexpr (device_run_defined) {
        if (device_inject) {
          batch.run(cache, rotation, *device);
          return;
        }
      }
      batch.run(cache, rotation);
    });
  } catch (...) {
    for (std::size_t i = 0; i < allocated; ++i) {
      try {
        requests[i].cache->release(out[i].plan.length());
      } catch (...) {
        // The step's own error is what the caller gets (the contract: release does not throw).
      }
    }
    throw;
  }
  // Then the commits.
  for (std::size_t i = 0; i < n; ++i) {
    requests[i].cache->commit(out[i].plan.length());
  }
  return out;
}

template <class Embedder, class CacheAdapter, class Rotation>
std::vector<memory_request> memory::serve_step(
  Embedder& embedder,
  std::vector<memory_step_request<CacheAdapter>> const& requests,
  std::uint32_t k,
  Rotation const& rotation) const
{
  return serve_requests<false>(
    embedder,
    cuda::std::span<memory_step_request<CacheAdapter> const>{requests.data(), requests.size()},
    k,
    "memory::serve_step",
    true,
    rotation,
    nullptr);
}

template <class Embedder, class CacheAdapter, class Rotation>
std::vector<memory_request> memory::serve_step(
  Embedder& embedder,
  std::vector<memory_step_request<CacheAdapter>> const& requests,
  std::uint32_t k,
  Rotation const& rotation,
  device_context const& device) const
{
  return serve_requests<true>(
    embedder,
    cuda::std::span<memory_step_request<CacheAdapter> const>{requests.data(), requests.size()},
    k,
    "memory::serve_step",
    true,
    rotation,
    &device);
}

template <class Embedder, class CacheAdapter, class Rotation>
memory_request memory::serve(Embedder& embedder,
                             std::uint64_t ns,
                             std::string const& query,
                             std::uint32_t k,
                             std::int64_t first_position,
                             CacheAdapter& cache,
                             Rotation const& rotation) const
{
  memory_step_request<CacheAdapter> const one{ns, query, first_position, &cache};
  return std::move(
    serve_requests<false>(embedder,
                          cuda::std::span<memory_step_request<CacheAdapter> const>{&one, 1},
                          k,
                          "memory::serve",
                          false,
                          rotation,
                          nullptr)[0]);
}

template <class Embedder, class CacheAdapter, class Rotation>
memory_request memory::serve(Embedder& embedder,
                             std::uint64_t ns,
                             std::string const& query,
                             std::uint32_t k,
                             std::int64_t first_position,
                             CacheAdapter& cache,
                             Rotation const& rotation,
                             device_context const& device) const
{
  memory_step_request<CacheAdapter> const one{ns, query, first_position, &cache};
  return std::move(
    serve_requests<true>(embedder,
                         cuda::std::span<memory_step_request<CacheAdapter> const>{&one, 1},
                         k,
                         "memory::serve",
                         false,
                         rotation,
                         &device)[0]);
}

inline void memory::require_host_store(char const* who) const
{
  INFERSCALE_EXPECTS(store_.space() == memory_space::host,
                     std::string{who} + ": the store's pool is in " + to_string(store_.space()) +
                       " memory; serve a device store with a device_context{workspace, stream} "
                       "(memory.cuh)");
}

inline void memory::require_device_store(std::int64_t tokens,
                                         std::int64_t capacity,
                                         char const* who) const
{
  INFERSCALE_EXPECTS(store_.space() == memory_space::device,
                     std::string{who} + ": the store's pool is in " + to_string(store_.space()) +
                       " memory, the device backend reads device memory (serve a host store "
                       "with a device_context without a workspace, or without one)");
  INFERSCALE_EXPECTS(tokens <= capacity,
                     std::string{who} + ": the memory segments hold " +
                       detail::count_of(tokens, "token") + ", the workspace holds " +
                       std::to_string(capacity));
}

template <class Embedder>
std::vector<float> memory::embed_all(Embedder& embedder,
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
      INFERSCALE_EXPECTS(
        std::isfinite(x),
        std::string{who} + ": text " + std::to_string(i) + " has a non-finite embedding");
    }
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

}  // namespace inferscale
