/**
 * @file detail/memory/facade.inl
 * @brief Definitions for memory.hpp, the request path of the facade: the instruction prefix,
 * add_conversation, retrieve, prepare, inject and serve, on the host and (with a workspace and a
 * stream) on the device (and the embedding of texts they share).
 */
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace inferscale {

template <class ModelAdapter>
void memory::set_instruction_prefix(ModelAdapter& model,
                                    std::vector<std::int32_t> const& tokens,
                                    std::uint64_t fact_id,
                                    std::uint64_t ns)
{
  INFERSCALE_EXPECTS(!prefix_.has_value(),
                     "memory::set_instruction_prefix: the prefix is already fact " +
                       std::to_string(prefix_.value_or(0)));
  INFERSCALE_EXPECTS(
    !index_.contains(fact_id),
    "memory::set_instruction_prefix: fact id " + std::to_string(fact_id) + " is an indexed fact");
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
  encoding_plan const plan   = plan_encoding(c, facts, options);
  std::vector<float> vectors = embed_all(embedder, texts, "memory::add_conversation");

  memory_add_report report;
  report.plan     = plan.stats();
  report.embedded = static_cast<std::int64_t>(texts.size());
  report.encode   = encode_plan(model, store_, plan);  // all or nothing
  try {
    index_.add<float>(ns,
                      make_matrix_view<float const>(
                        vectors.data(), static_cast<std::int64_t>(ids.size()), index_.dim()),
                      cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  } catch (...) {
    for (std::uint64_t id : ids) {
      erase_and_scrub(id);
    }
    throw;
  }
  report.conversation = remember_conversation(ns, c, options, plan);
  return report;
}

inline std::vector<std::uint64_t> memory::retrieve(std::uint64_t ns,
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
  static_assert(is_cache_adapter_v<CacheAdapter>,
                "memory::inject: CacheAdapter needs allocate(first_position, tokens), cache() and "
                "commit(tokens) (see engine.hpp)");
  injection_batch step{store_};
  step.add(plan, cache);
  step.run(cache.cache(), rotation);
}

template <class CacheAdapter, class Rotation, class Stream>
void memory::inject(composition const& plan,
                    CacheAdapter& cache,
                    Rotation const& rotation,
                    injection_workspace& workspace,
                    Stream stream) const
{
  // Found where memory.cuh (engine.cuh) is included: the call depends on the template arguments,
  // so this header compiles without the CUDA toolkit. inject_memory_async is the one-request
  // injection step run on the device (add(plan, cache), run(..., workspace, stream)), with its
  // store-space and workspace checks made before the adapter allocates (the workspace's type is
  // incomplete here).
  inject_memory_async(store_, plan, cache, rotation, workspace, stream);
}

template <class Embedder, class CacheAdapter, class Rotation, class Stream>
memory_request memory::serve(Embedder& embedder,
                             std::uint64_t ns,
                             std::string const& query,
                             std::uint32_t k,
                             std::int64_t first_position,
                             CacheAdapter& cache,
                             Rotation const& rotation,
                             injection_workspace& workspace,
                             Stream stream) const
{
  memory_request r;
  r.fact_ids = retrieve(embedder, ns, query, k);
  r.plan     = prepare(r.fact_ids, first_position);
  inject(r.plan, cache, rotation, workspace, stream);
  return r;
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
  memory_request r;
  r.fact_ids = retrieve(embedder, ns, query, k);
  r.plan     = prepare(r.fact_ids, first_position);
  inject(r.plan, cache, rotation);
  return r;
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
