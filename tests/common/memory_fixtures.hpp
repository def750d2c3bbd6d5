// Test-side fixtures of the memory facade tests (memory, lifecycle, snapshot): a bag-of-words
// embedder with switches for bad output, and a synthetic conversation with one fact per turn.
// Free of Catch macros.
#pragma once

#include "fake_model.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/encoding.hpp>
#include <inferscale/memory_types.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace inferscale_test::memory_fixtures {

/// The facade tests' deployment: the fake model's geometry (fake::tiny), pages of 4 tokens, a
/// 32-d cosine index; the store's dtype and pages, and where the store and the index live, vary.
inline inferscale::memory_config tiny_memory_config(
  inferscale::dtype store_dtype,
  std::int64_t pages,
  inferscale::memory_space store_space = inferscale::memory_space::host,
  inferscale::memory_space index_space = inferscale::memory_space::host)
{
  inferscale::memory_config c;
  c.store.model       = inferscale_test::fake::tiny;
  c.store.store_dtype = store_dtype;
  c.store.page_size   = 4;
  c.store.num_pages   = pages;
  c.store.space       = store_space;
  c.index.dim         = 32;
  c.index.metric      = inferscale::distance_metric::cosine;
  c.index.space       = index_space;
  return c;
}

/// Bag of words hashed into `dim` buckets, L2-normalised; counts its calls. One text can be made
/// to give NaN (`nan_for`), zeros (`zero_for`) or to throw (`throw_for`).
struct word_embedder {
  std::int64_t dim{32};
  std::string nan_for;
  std::string zero_for;
  std::string throw_for;
  std::int64_t calls{0};
  std::int64_t dimension() const { return dim; }
  std::vector<float> embed(std::string const& text)
  {
    ++calls;
    if (text == throw_for) { throw std::runtime_error("fake embedder failure"); }
    std::vector<float> v(static_cast<std::size_t>(dim), 0.0f);
    if (text == zero_for) { return v; }
    std::istringstream in{text};
    std::string w;
    while (in >> w) {
      v[std::hash<std::string>{}(w) % static_cast<std::size_t>(dim)] += 1.0f;
    }
    double n = 0;
    for (float x : v) {
      n += double(x) * x;
    }
    for (float& x : v) {
      x = static_cast<float>(x / std::sqrt(n));
    }
    if (text == nan_for) { v[0] = std::numeric_limits<float>::quiet_NaN(); }
    return v;
  }
};

/// A conversation, its facts and their texts.
struct user_data {
  inferscale::conversation c;
  std::vector<inferscale::conversation_fact> facts;
  std::vector<std::string> texts;
};

/// A conversation of `n` turns (turn u: tokens 1000 + 10 u + j, session u / 4, header 900 + s)
/// behind the lead {1, 2}, and one fact per turn u >= 1 (id base + u, namespace `ns`, tokens
/// 5000 + u, 6000 + u, .. — `fact_tokens` of them — and its own words).
inline user_data make_user(std::uint64_t ns, std::uint64_t base, int n, int fact_tokens = 3)
{
  user_data d;
  d.c.lead = std::vector<std::int32_t>{1, 2};
  for (int u = 0; u < n; ++u) {
    d.c.turns.push_back({{1000 + 10 * u, 1001 + 10 * u, 1002 + 10 * u}, u / 4});
  }
  for (int s = 0; s <= (n - 1) / 4; ++s) {
    d.c.session_headers.push_back({900 + s});
  }
  for (int u = 1; u < n; ++u) {
    inferscale::conversation_fact f;
    f.fact_id      = base + static_cast<std::uint64_t>(u);
    f.namespace_id = ns;
    for (int j = 0; j < fact_tokens; ++j) {
      f.token_ids.push_back(5000 + 1000 * j + u);
    }
    f.source_turns = std::vector<std::int64_t>{u};
    d.facts.push_back(f);
    d.texts.push_back("topic" + std::to_string(u) + " alpha" + std::to_string(u * 7) + " beta" +
                      std::to_string(u * 13));
  }
  return d;
}

/// The context a fact at turn t sees behind a window starting at turn a, written out from the
/// rule in encoding_plan.hpp's file comment (independently of the planner's code): the lead;
/// nothing more when t == a; otherwise the header of a's session, turns a .. t-1 with the header of
/// every session that opens among them, and the header of t's session when t opens a session.
inline std::vector<std::int32_t> window_tokens(inferscale::conversation const& c,
                                               std::int64_t a,
                                               std::int64_t t)
{
  std::vector<std::int32_t> out = c.lead;
  if (t == a) { return out; }
  auto session = [&](std::int64_t u) { return c.turns[static_cast<std::size_t>(u)].session; };
  auto header  = [&](std::int64_t u) {
    auto const& h = c.session_headers[static_cast<std::size_t>(session(u))];
    out.insert(out.end(), h.begin(), h.end());
  };
  for (std::int64_t u = a; u < t; ++u) {
    if (!c.session_headers.empty() && (u == a || session(u) != session(u - 1))) { header(u); }
    auto const& tok = c.turns[static_cast<std::size_t>(u)].token_ids;
    out.insert(out.end(), tok.begin(), tok.end());
  }
  if (!c.session_headers.empty() && session(t) != session(t - 1)) { header(t); }
  return out;
}

/// A paged-cache adapter over a contiguous float32 host cache of 256 slots (the fake model's 2
/// layers, 1 head, head_dim 4), every element -1 at first; allocate(p0, n) hands out slots
/// `slot_offset + slot_stride * j`.
struct host_cache {
  explicit host_cache(std::int64_t slot_stride = 1, std::int64_t slot_offset = 0)
    : stride{slot_stride},
      offset{slot_offset},
      data(static_cast<std::size_t>(2 * 2 * 256 * 4), -1.0f)
  {
    cache_ = inferscale::make_contiguous_cache(
      inferscale::dtype::float32, data.data(), {2, 2, 256, 1, 4}, {2 * 256 * 4, 256 * 4, 4, 4, 1});
  }
  std::vector<std::int64_t> allocate(std::int64_t p0, std::int64_t n)
  {
    first = p0;
    std::vector<std::int64_t> s;
    for (std::int64_t j = 0; j < n; ++j) {
      s.push_back(offset + stride * j);
    }
    return s;
  }
  inferscale::paged_kv_cache const& cache() const { return cache_; }
  void commit(std::int64_t n) { committed.push_back(n); }
  void release(std::int64_t n) noexcept { released.push_back(n); }
  /// V element `d` of slot `slot` in layer `layer`.
  float value(std::int64_t layer, std::int64_t slot, std::int64_t d) const
  {
    return data[static_cast<std::size_t>(((layer * 2 + 1) * 256 + slot) * 4 + d)];
  }

  std::int64_t stride{1};
  std::int64_t offset{0};
  std::vector<float> data;
  inferscale::paged_kv_cache cache_{};
  std::int64_t first{-1};
  std::vector<std::int64_t> committed;
  std::vector<std::int64_t> released;  ///< release(n) calls: a failed step's slots given back
};

/// One sequence of a step, over a cache shared by the step's sequences (`shared`'s):
/// allocate(p0, n) hands out the first n of `slots` (fewer when it has fewer), or throws when
/// `fail` is set; what it was asked, committed and released is recorded.
struct sequence_adapter {
  host_cache* shared{};
  std::vector<std::int64_t> slots;
  bool fail{false};
  std::int64_t allocated_at{-1};
  std::vector<std::int64_t> allocated;  ///< n of each allocate(p0, n) that returned slots
  std::vector<std::int64_t> committed;
  std::vector<std::int64_t> released;

  std::vector<std::int64_t> allocate(std::int64_t p0, std::int64_t n)
  {
    allocated_at = p0;
    if (fail) { throw std::runtime_error("fake adapter failure"); }
    allocated.push_back(n);
    auto const given = std::min<std::size_t>(static_cast<std::size_t>(n), slots.size());
    return {slots.begin(), slots.begin() + static_cast<std::ptrdiff_t>(given)};
  }
  inferscale::paged_kv_cache const& cache() const { return shared->cache(); }
  void commit(std::int64_t n) { committed.push_back(n); }
  void release(std::int64_t n) noexcept { released.push_back(n); }
};

/// A paged-cache adapter over any cache descriptor (a device cache too): allocate(p0, n) hands
/// out the first n - short_by of `slots`; what it was asked, committed and released is recorded.
struct slot_adapter {
  slot_adapter(inferscale::paged_kv_cache const& cache, std::vector<std::int64_t> given)
    : desc{cache}, slots{std::move(given)}
  {
  }

  inferscale::paged_kv_cache desc;
  std::vector<std::int64_t> slots;
  std::int64_t short_by{0};
  std::int64_t allocated_at{-1};
  std::vector<std::int64_t> committed;
  std::vector<std::int64_t> released;

  std::vector<std::int64_t> allocate(std::int64_t first_position, std::int64_t tokens)
  {
    allocated_at = first_position;
    return {slots.begin(), slots.begin() + static_cast<std::ptrdiff_t>(tokens - short_by)};
  }
  inferscale::paged_kv_cache const& cache() const { return desc; }
  void commit(std::int64_t tokens) { committed.push_back(tokens); }
  void release(std::int64_t tokens) noexcept { released.push_back(tokens); }
};

/// One request of a test's serve step: the user's namespace, the query text, the first position.
struct step_ask {
  std::uint64_t ns;
  std::string query;
  std::int64_t p0;
};

/// A step's requests over `cache`, one fresh sequence each in `sequences`: request i's tokens go
/// to slots i, i + n, i + 2n, .. (40 of them; the n requests interleave in the cache, as paged
/// sequences do).
inline std::vector<inferscale::memory_step_request<sequence_adapter>> interleaved_step(
  std::vector<step_ask> const& asks, host_cache& cache, std::vector<sequence_adapter>& sequences)
{
  auto const n = static_cast<std::int64_t>(asks.size());
  sequences.assign(asks.size(), sequence_adapter{});
  std::vector<inferscale::memory_step_request<sequence_adapter>> requests;
  for (std::int64_t i = 0; i < n; ++i) {
    sequence_adapter& s = sequences[static_cast<std::size_t>(i)];
    s.shared            = &cache;
    for (std::int64_t j = 0; j < 40; ++j) {
      s.slots.push_back(i + n * j);
    }
    step_ask const& q = asks[static_cast<std::size_t>(i)];
    requests.push_back({q.ns, q.query, q.p0, &s});
  }
  return requests;
}

}  // namespace inferscale_test::memory_fixtures
