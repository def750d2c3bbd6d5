/**
 * @file detail/memory/lifecycle.inl
 * @brief Definitions for memory.hpp, the fact lifecycle: the catalogue of tracked facts and kept
 * conversations (fact, conversations, facts_seeing_turn, ...), add_facts, update_fact,
 * update_turns, reencode_facts, erase_fact, erase_namespace, and the checks and page scrubbing
 * they share.
 */
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace inferscale {

inline fact_state memory::fact(std::uint64_t id) const
{
  auto const read     = locks_.read();
  fact_entry const& e = entry(id, "memory::fact");
  fact_state s;
  s.fact_id       = id;
  s.namespace_id  = e.ns;
  s.conversation  = e.conversation;
  s.supersedes    = e.supersedes;
  s.superseded_by = e.superseded_by;
  if (e.conversation) {
    s.first_turn  = e.first_turn;
    s.source_turn = anchor(e.source_turns);
    for (std::int64_t u = s.first_turn; u < s.source_turn; ++u) {
      s.turns.push_back(u);
    }
  } else {
    s.turns = e.turns;
  }
  return s;
}

inline std::vector<std::uint64_t> memory::conversations(std::uint64_t ns) const
{
  auto const read = locks_.read();
  std::vector<std::uint64_t> out;
  for (auto const& [id, c] : conversation_entries_) {
    if (c.ns == ns) { out.push_back(id); }
  }
  std::sort(out.begin(), out.end());  // handles increase with every add
  return out;
}

inline conversation memory::conversation_of(std::uint64_t handle) const
{
  auto const read = locks_.read();
  return conversation_entry_of(handle, "memory::conversation_of").c;
}

inline std::vector<std::uint64_t> memory::facts_seeing_turn(std::uint64_t handle,
                                                            std::int64_t turn) const
{
  auto const read              = locks_.read();
  conversation_entry const& ce = conversation_entry_of(handle, "memory::facts_seeing_turn");
  INFERSCALE_EXPECTS(turn >= 0 && turn < static_cast<std::int64_t>(ce.c.turns.size()),
                     "memory::facts_seeing_turn: turn " + std::to_string(turn) +
                       " is not one of the conversation's " + std::to_string(ce.c.turns.size()) +
                       " turns");
  std::vector<std::uint64_t> out;
  for (std::uint64_t id : ce.facts) {
    fact_entry const& e = facts_.at(id);
    if (!e.superseded_by && e.first_turn <= turn && turn < anchor(e.source_turns)) {
      out.push_back(id);
    }
  }
  return out;
}

inline std::vector<std::uint64_t> memory::direct_facts_seeing_turn(std::uint64_t ns,
                                                                   std::int64_t turn) const
{
  auto const read = locks_.read();
  std::vector<std::uint64_t> out;
  for (auto const& [id, e] : facts_) {
    if (e.ns == ns && !e.conversation && !e.superseded_by &&
        std::find(e.turns.begin(), e.turns.end(), turn) != e.turns.end()) {
      out.push_back(id);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

template <class ModelAdapter, class Embedder>
memory_add_report memory::add_facts(ModelAdapter& model,
                                    Embedder& embedder,
                                    std::uint64_t ns,
                                    std::vector<direct_fact> const& facts,
                                    std::vector<std::string> const& texts)
{
  static_assert(is_embedder_v<Embedder>, "memory::add_facts: Embedder requirements (memory.hpp)");
  char const* const who = "memory::add_facts";
  auto const serial     = locks_.serial();
  INFERSCALE_EXPECTS(texts.size() == facts.size(),
                     std::string{who} + ": " + std::to_string(facts.size()) + " facts but " +
                       std::to_string(texts.size()) + " texts");
  check_model(model, who);
  encoding_plan plan;
  std::vector<std::uint64_t> ids;
  std::int64_t pages = 0;
  for (direct_fact const& f : facts) {
    check_new_id(f.fact_id, who);
    INFERSCALE_EXPECTS(std::find(ids.begin(), ids.end(), f.fact_id) == ids.end(),
                       std::string{who} + ": fact " + std::to_string(f.fact_id) + " appears twice");
    plan.jobs.push_back(direct_job(f.fact_id, ns, f.context, f.token_ids, f.first_position, who));
    ids.push_back(f.fact_id);
    pages += store_.pages_for(static_cast<std::int64_t>(f.token_ids.size()));
  }
  check_pages(pages, 0, who);
  std::vector<float> vectors = embed_all(embedder, texts, who);
  probe(vectors, ids);
  captured_plan const captured = capture_plan(model, plan);

  auto const commit = locks_.commit();  // reads wait from here to the end
  zeroing_.wait();  // a page freed by erase_fact(id, stream) is zeroed before it is written
  for (std::size_t i = 0; i < ids.size(); ++i) {
    store_.insert<float>(ids[i],
                         ns,
                         captured.facts[i].token_ids,
                         captured.captures[i].keys(),
                         captured.captures[i].values());
  }
  try {
    index_.add<float>(ns,
                      matrix_of(vectors, ids.size()),
                      cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  } catch (...) {
    for (std::uint64_t id : ids) {
      erase_and_scrub(id);
    }
    throw;
  }
  for (direct_fact const& f : facts) {
    fact_entry e;
    e.ns              = ns;
    e.context         = f.context;
    e.first_position  = f.first_position;
    e.turns           = f.turns;
    facts_[f.fact_id] = std::move(e);
  }
  memory_add_report report;
  report.plan     = plan.stats();
  report.encode   = captured.report;
  report.embedded = static_cast<std::int64_t>(texts.size());
  return report;
}

template <class ModelAdapter, class Embedder>
lifecycle_report memory::update_fact(ModelAdapter& model, Embedder& embedder, fact_update const& u)
{
  static_assert(is_embedder_v<Embedder>, "memory::update_fact: Embedder requirements (memory.hpp)");
  char const* const who = "memory::update_fact";
  auto const serial     = locks_.serial();
  fact_entry const& old = retrievable_entry(u.fact_id, who);
  bool const in_place   = u.new_id == u.fact_id;
  if (!in_place) { check_new_id(u.new_id, who); }
  check_model(model, who);
  INFERSCALE_EXPECTS(
    !u.token_ids.empty(),
    std::string{who} + ": the new version of fact " + std::to_string(u.fact_id) + " has no tokens");
  fact_entry next    = old;
  next.supersedes    = in_place ? old.supersedes : std::optional<std::uint64_t>{u.fact_id};
  next.superseded_by = std::nullopt;
  encoding_plan plan;
  if (old.conversation) {
    INFERSCALE_EXPECTS(!u.context && !u.turns,
                       std::string{who} + ": fact " + std::to_string(u.fact_id) +
                         " was planned from conversation " + std::to_string(*old.conversation) +
                         ": its window comes from there, not from a context or turn map");
    conversation_entry const& ce = conversation_entries_.at(*old.conversation);
    if (!u.source_turns.empty()) {
      std::int64_t const t = anchor(u.source_turns);
      INFERSCALE_EXPECTS(t >= 0,
                         std::string{who} + ": source turn " + std::to_string(t) + " is negative");
      if (t != anchor(old.source_turns)) { next.first_turn = planned_window_start(ce.options, t); }
      next.source_turns = u.source_turns;
    }
    conversation_fact const f{u.new_id, old.ns, u.token_ids, next.source_turns};
    plan = plan_encoding_at(ce.c, {f}, {next.first_turn}, ce.options);
  } else {
    INFERSCALE_EXPECTS(u.source_turns.empty(),
                       std::string{who} + ": fact " + std::to_string(u.fact_id) +
                         " was added directly: source turns mean nothing without a conversation "
                         "(give a context and a turn map)");
    if (u.context) { next.context = *u.context; }
    if (u.turns) { next.turns = *u.turns; }
    plan.jobs.push_back(
      direct_job(u.new_id, old.ns, next.context, u.token_ids, next.first_position, who));
  }
  std::int64_t const pages = store_.pages_for(static_cast<std::int64_t>(u.token_ids.size()));
  check_pages(
    pages, in_place ? static_cast<std::int64_t>(store_.at(u.fact_id).pages.size()) : 0, who);
  std::vector<float> const vector = embed_all(embedder, {u.text}, who);
  probe(vector, {u.new_id});
  captured_plan const captured = capture_plan(model, plan);

  // Commit: nothing below is refused (all of it was validated above).
  auto const commit = locks_.commit();
  zeroing_.wait();
  std::uint64_t const ns                  = old.ns;
  std::optional<std::uint64_t> const conv = old.conversation;
  if (in_place) {
    replace_stored(u.fact_id, ns, captured.facts[0].token_ids, captured.captures[0]);
    index_.erase(cuda::std::span<std::uint64_t const>{&u.fact_id, 1});
    index_.add<float>(ns, matrix_of(vector, 1), cuda::std::span<std::uint64_t const>{&u.new_id, 1});
    facts_[u.fact_id] = std::move(next);
  } else {
    store_.insert<float>(u.new_id,
                         ns,
                         captured.facts[0].token_ids,
                         captured.captures[0].keys(),
                         captured.captures[0].values());
    try {
      index_.add<float>(
        ns, matrix_of(vector, 1), cuda::std::span<std::uint64_t const>{&u.new_id, 1});
    } catch (...) {
      erase_and_scrub(u.new_id);
      throw;
    }
    index_.erase(cuda::std::span<std::uint64_t const>{&u.fact_id, 1});
    facts_[u.fact_id].superseded_by = u.new_id;
    facts_[u.new_id]                = std::move(next);
    if (conv) { conversation_entries_.at(*conv).facts.push_back(u.new_id); }
  }
  lifecycle_report r;
  r.reencoded = {u.new_id};
  r.encode    = captured.report;
  r.embedded  = 1;
  return r;
}

template <class ModelAdapter>
lifecycle_report memory::update_turns(ModelAdapter& model,
                                      std::uint64_t handle,
                                      std::vector<turn_change> const& changes)
{
  char const* const who  = "memory::update_turns";
  auto const serial      = locks_.serial();
  conversation_entry& ce = conversation_entry_of(handle, who);
  check_model(model, who);
  conversation updated = ce.c;
  std::vector<std::int64_t> turns;
  for (turn_change const& ch : changes) {
    INFERSCALE_EXPECTS(ch.turn >= 0 && ch.turn < static_cast<std::int64_t>(updated.turns.size()),
                       std::string{who} + ": turn " + std::to_string(ch.turn) +
                         " is not one of the conversation's " +
                         std::to_string(updated.turns.size()) + " turns");
    INFERSCALE_EXPECTS(std::find(turns.begin(), turns.end(), ch.turn) == turns.end(),
                       std::string{who} + ": turn " + std::to_string(ch.turn) + " changes twice");
    INFERSCALE_EXPECTS(
      !ch.token_ids.empty(),
      std::string{who} + ": turn " + std::to_string(ch.turn) + " would have no tokens");
    turns.push_back(ch.turn);
    updated.turns[static_cast<std::size_t>(ch.turn)].token_ids = ch.token_ids;
  }
  std::vector<conversation_fact> facts;
  std::vector<std::int64_t> first_turns;
  for (std::uint64_t id : ce.facts) {
    fact_entry const& e = facts_.at(id);
    if (e.superseded_by) { continue; }
    std::int64_t const t = anchor(e.source_turns);
    bool const saw       = std::any_of(
      turns.begin(), turns.end(), [&](std::int64_t u) { return e.first_turn <= u && u < t; });
    if (!saw) { continue; }
    facts.push_back({id, e.ns, store_.at(id).token_ids, e.source_turns});
    first_turns.push_back(e.first_turn);
  }
  std::optional<captured_plan> captured;
  if (!facts.empty()) {
    captured = capture_plan(model, plan_encoding_at(updated, facts, first_turns, ce.options));
  }
  auto const commit = locks_.commit();
  lifecycle_report r;
  if (captured) {
    for (std::size_t i = 0; i < captured->facts.size(); ++i) {
      replace_stored(captured->facts[i].fact_id,
                     captured->facts[i].namespace_id,
                     captured->facts[i].token_ids,
                     captured->captures[i]);
      r.reencoded.push_back(captured->facts[i].fact_id);
    }
    r.encode = captured->report;
  }
  ce.c = std::move(updated);
  return r;
}

template <class ModelAdapter>
lifecycle_report memory::reencode_facts(ModelAdapter& model,
                                        std::vector<fact_context> const& contexts)
{
  char const* const who = "memory::reencode_facts";
  auto const serial     = locks_.serial();
  check_model(model, who);
  encoding_plan plan;
  std::vector<std::uint64_t> ids;
  for (fact_context const& fc : contexts) {
    fact_entry const& e = retrievable_entry(fc.fact_id, who);
    INFERSCALE_EXPECTS(!e.conversation,
                       std::string{who} + ": fact " + std::to_string(fc.fact_id) +
                         " was planned from conversation " + std::to_string(*e.conversation) +
                         ": change its turns with update_turns()");
    INFERSCALE_EXPECTS(
      std::find(ids.begin(), ids.end(), fc.fact_id) == ids.end(),
      std::string{who} + ": fact " + std::to_string(fc.fact_id) + " appears twice");
    ids.push_back(fc.fact_id);
    plan.jobs.push_back(direct_job(
      fc.fact_id, e.ns, fc.context, store_.at(fc.fact_id).token_ids, fc.first_position, who));
  }
  captured_plan const captured = capture_plan(model, plan);
  auto const commit            = locks_.commit();
  lifecycle_report r;
  for (std::size_t i = 0; i < captured.facts.size(); ++i) {
    replace_stored(captured.facts[i].fact_id,
                   captured.facts[i].namespace_id,
                   captured.facts[i].token_ids,
                   captured.captures[i]);
    fact_entry& e    = facts_.at(captured.facts[i].fact_id);
    e.context        = contexts[i].context;
    e.first_position = contexts[i].first_position;
    if (contexts[i].turns) { e.turns = *contexts[i].turns; }
    r.reencoded.push_back(captured.facts[i].fact_id);
  }
  r.encode = captured.report;
  return r;
}

inline std::vector<std::int64_t> memory::erase_fact_keeping_pages(std::uint64_t id)
{
  fact_entry const& e                     = entry(id, "memory::erase_fact");
  std::optional<std::uint64_t> const conv = e.conversation;
  if (index_.contains(id)) { index_.erase(cuda::std::span<std::uint64_t const>{&id, 1}); }
  std::vector<std::int64_t> pages = store_.at(id).pages;
  store_.erase(id);
  facts_.erase(id);
  if (conv) {
    auto const it = conversation_entries_.find(*conv);
    auto& ids     = it->second.facts;
    ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
    if (ids.empty()) { conversation_entries_.erase(it); }
  }
  return pages;
}

inline void memory::erase_fact(std::uint64_t id)
{
  auto const serial = locks_.serial();
  auto const commit = locks_.commit();
  store_.scrub_pages(erase_fact_keeping_pages(id));
}

template <class Stream>
void memory::erase_fact(std::uint64_t id, Stream stream)
{
  auto const serial                     = locks_.serial();
  auto const commit                     = locks_.commit();
  std::vector<std::int64_t> const pages = erase_fact_keeping_pages(id);
  store_.scrub_pages(pages, detail::raw_stream(stream));
  if (!pages.empty() && store_.space() == memory_space::device) {
    zeroing_.record(detail::raw_stream(stream));
  }
}

inline std::pair<std::int64_t, std::vector<std::int64_t>> memory::erase_namespace_keeping_pages(
  std::uint64_t ns)
{
  INFERSCALE_EXPECTS(
    !prefix_ || store_.at(*prefix_).namespace_id != ns,
    "memory::erase_namespace: namespace " + std::to_string(ns) + " holds the instruction prefix");
  std::vector<std::int64_t> pages;
  for (std::uint64_t id : store_.namespace_fact_ids(ns)) {
    auto const& p = store_.at(id).pages;
    pages.insert(pages.end(), p.begin(), p.end());
  }
  index_.erase_namespace(ns);
  std::int64_t const n = store_.erase_namespace(ns);
  for (auto it = facts_.begin(); it != facts_.end();) {
    it = it->second.ns == ns ? facts_.erase(it) : std::next(it);
  }
  for (auto it = conversation_entries_.begin(); it != conversation_entries_.end();) {
    it = it->second.ns == ns ? conversation_entries_.erase(it) : std::next(it);
  }
  return {n, std::move(pages)};
}

inline std::int64_t memory::erase_namespace(std::uint64_t ns)
{
  auto const serial     = locks_.serial();
  auto const commit     = locks_.commit();
  auto const [n, pages] = erase_namespace_keeping_pages(ns);
  store_.scrub_pages(pages);
  return n;
}

template <class Stream>
std::int64_t memory::erase_namespace(std::uint64_t ns, Stream stream)
{
  auto const serial     = locks_.serial();
  auto const commit     = locks_.commit();
  auto const [n, pages] = erase_namespace_keeping_pages(ns);
  store_.scrub_pages(pages, detail::raw_stream(stream));
  if (!pages.empty() && store_.space() == memory_space::device) {
    zeroing_.record(detail::raw_stream(stream));
  }
  return n;
}

inline std::int64_t memory::anchor(std::vector<std::int64_t> const& source_turns)
{
  return *std::min_element(source_turns.begin(), source_turns.end());
}

inline memory::fact_entry const& memory::entry(std::uint64_t id, char const* who) const
{
  auto const it = facts_.find(id);
  INFERSCALE_EXPECTS(it != facts_.end(),
                     std::string{who} + ": fact " + std::to_string(id) +
                       " is not a fact of "
                       "this memory" +
                       (prefix_ && *prefix_ == id ? " (it is the instruction prefix)" : ""));
  return it->second;
}

inline memory::fact_entry const& memory::retrievable_entry(std::uint64_t id, char const* who) const
{
  fact_entry const& e = entry(id, who);
  INFERSCALE_EXPECTS(!e.superseded_by,
                     std::string{who} + ": fact " + std::to_string(id) + " is superseded by fact " +
                       std::to_string(e.superseded_by.value_or(0)) +
                       " (an audit record: update the newer version)");
  return e;
}

inline memory::conversation_entry const& memory::conversation_entry_of(std::uint64_t handle,
                                                                       char const* who) const
{
  auto const it = conversation_entries_.find(handle);
  INFERSCALE_EXPECTS(it != conversation_entries_.end(),
                     std::string{who} + ": no conversation " + std::to_string(handle) +
                       " is kept (never added, or its facts were all erased)");
  return it->second;
}

inline memory::conversation_entry& memory::conversation_entry_of(std::uint64_t handle,
                                                                 char const* who)
{
  return const_cast<conversation_entry&>(std::as_const(*this).conversation_entry_of(handle, who));
}

template <class ModelAdapter>
void memory::check_model(ModelAdapter const& model, char const* who) const
{
  static_assert(is_model_adapter_v<ModelAdapter>,
                "memory: ModelAdapter needs geometry(), rotation() and "
                "encode(tokens, first_position, kv_capture&) (see engine.hpp)");
  INFERSCALE_EXPECTS(model.geometry() == store_.geometry(),
                     std::string{who} + ": the model's KV geometry differs from the store's");
}

inline void memory::check_new_id(std::uint64_t id, char const* who) const
{
  std::string const which = std::string{who} + ": fact id " + std::to_string(id);
  INFERSCALE_EXPECTS(id != invalid_fact_id, which + " is reserved (invalid_fact_id)");
  INFERSCALE_EXPECTS(!prefix_ || *prefix_ != id, which + " is the instruction prefix");
  INFERSCALE_EXPECTS(!store_.contains(id) && !index_.contains(id) && facts_.count(id) == 0,
                     which + " is already taken");
}

inline void memory::check_pages(std::int64_t pages, std::int64_t released, char const* who) const
{
  INFERSCALE_EXPECTS(pages <= store_.free_pages() + released,
                     std::string{who} + ": the facts need " + std::to_string(pages) + " pages, " +
                       std::to_string(store_.free_pages() + released) +
                       " free (capacity exhausted)");
}

inline encoding_job memory::direct_job(std::uint64_t id,
                                       std::uint64_t ns,
                                       std::vector<std::int32_t> const& context,
                                       std::vector<std::int32_t> const& tokens,
                                       std::int64_t first_position,
                                       char const* who)
{
  INFERSCALE_EXPECTS(!tokens.empty(),
                     std::string{who} + ": fact " + std::to_string(id) + " has no tokens");
  INFERSCALE_EXPECTS(first_position >= 0,
                     std::string{who} + ": fact " + std::to_string(id) + "'s first position " +
                       std::to_string(first_position) + " is negative");
  encoding_job job;
  job.first_position = first_position;
  job.trunk          = context;
  encoding_branch b;
  b.fact_id      = id;
  b.namespace_id = ns;
  b.token_ids    = tokens;
  b.attach       = static_cast<std::int64_t>(context.size());
  b.position     = first_position + b.attach;
  job.branches.push_back(std::move(b));
  return job;
}

inline matrix_view<float const> memory::matrix_of(std::vector<float> const& vectors,
                                                  std::size_t rows) const
{
  return make_matrix_view<float const>(
    vectors.data(), static_cast<std::int64_t>(rows), index_.dim());
}

inline void memory::probe(std::vector<float> const& vectors,
                          std::vector<std::uint64_t> const& ids) const
{
  index_config c = index_.config();
  c.space        = memory_space::host;
  graph_index scratch{c};
  scratch.add<float>(0,
                     matrix_of(vectors, ids.size()),
                     cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
}

inline void memory::erase_and_scrub(std::uint64_t id)
{
  std::vector<std::int64_t> const pages = store_.at(id).pages;
  store_.erase(id);
  store_.scrub_pages(pages);
}

inline void memory::replace_stored(std::uint64_t id,
                                   std::uint64_t ns,
                                   std::vector<std::int32_t> const& tokens,
                                   kv_capture const& capture)
{
  std::vector<std::int64_t> const old = store_.at(id).pages;
  zeroing_.wait();
  store_.erase(id);
  store_.insert<float>(id, ns, tokens, capture.keys(), capture.values());
  std::vector<std::int64_t> const& now = store_.at(id).pages;
  std::vector<std::int64_t> freed;
  for (std::int64_t p : old) {
    if (std::find(now.begin(), now.end(), p) == now.end()) { freed.push_back(p); }
  }
  store_.scrub_pages(freed);
}

inline std::uint64_t memory::remember_conversation(std::uint64_t ns,
                                                   conversation const& c,
                                                   encoding_options const& options,
                                                   encoding_plan const& plan)
{
  if (plan.stats().facts == 0) { return 0; }  // nothing to re-encode: keep nothing
  std::uint64_t const handle = next_conversation_++;
  conversation_entry ce{ns, c, options, {}};
  for (encoding_job const& job : plan.jobs) {
    for (encoding_branch const& b : job.branches) {
      fact_entry e;
      e.ns              = b.namespace_id;
      e.conversation    = handle;
      e.first_turn      = b.first_turn;
      e.source_turns    = std::vector<std::int64_t>{b.source_turn};
      facts_[b.fact_id] = std::move(e);
      ce.facts.push_back(b.fact_id);
    }
  }
  conversation_entries_.emplace(handle, std::move(ce));
  return handle;
}

}  // namespace inferscale
