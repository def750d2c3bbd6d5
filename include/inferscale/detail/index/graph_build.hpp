/**
 * @file graph_build.hpp
 * @brief CAGRA graph construction on the host: the exact kNN graph, rank-based pruning by detour
 * counts, reverse edges, the merge to a fixed out-degree, and a reachability repair.
 *
 * `prune_node` is `__host__ __device__`: the device build runs the same function per node. The
 * reverse/merge steps are linear in `n * degree` and deterministic here (reverse lists ordered by
 * forward rank, then source id), unlike CAGRA's atomic appends.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/index/distance_simd.hpp>
#include <inferscale/detail/index/math.hpp>
#include <inferscale/detail/index/parallel.hpp>
#include <inferscale/dtype.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace inferscale::detail::index {

/**
 * @brief Degrees actually used for a set of `n` vectors (CAGRA's small-N guard): the
 * intermediate degree is at most `n - 1`, the final degree at most the intermediate one.
 */
struct effective_degrees {
  std::uint32_t intermediate{0};
  std::uint32_t final{0};
};

inline effective_degrees degrees_for(std::uint32_t intermediate,
                                     std::uint32_t final_degree,
                                     std::uint64_t n) noexcept
{
  effective_degrees e{};
  std::uint64_t const most = n == 0 ? 0 : n - 1;
  e.intermediate = static_cast<std::uint32_t>(std::min<std::uint64_t>(intermediate, most));
  e.final        = std::min(final_degree, e.intermediate);
  return e;
}

/**
 * @brief Exact kNN graph on the host: for each of the `n` padded rows the `k` nearest other rows,
 * sorted by (distance, id). Distances are computed in fp32 with sixteen interleaved partial sums
 * (vectorisable without reassociation), so they may differ from the search's team distance in
 * the last bits; only the ranking matters here. Runs on at most `threads` threads
 * (`parallel_ranges`; 0 = one per hardware thread); the result does not depend on it.
 */
template <class T>
void exact_knn_host(T const* rows,
                    std::int64_t row_elements,
                    std::int64_t n,
                    distance_metric metric,
                    std::uint32_t k,
                    std::uint32_t* out,
                    unsigned threads = 0)
{
  if (n == 0 || k == 0) { return; }
  // fp32 copy so the inner loop is a plain float loop for both element types
  std::vector<float> data(static_cast<std::size_t>(n * row_elements));
  for (std::int64_t i = 0; i < n * row_elements; ++i) {
    data[static_cast<std::size_t>(i)] = to_float(rows[i]);
  }
  bool const l2               = metric == distance_metric::squared_l2;
  std::int64_t const lanes    = 16;
  std::int64_t const blocks16 = row_elements / lanes;
  auto distance               = [&](float const* a, float const* b) {
    float acc[16] = {};
    if (l2) {
      for (std::int64_t c = 0; c < blocks16; ++c) {
        for (int j = 0; j < 16; ++j) {
          float const d = a[c * lanes + j] - b[c * lanes + j];
          acc[j] += d * d;
        }
      }
    } else {
      for (std::int64_t c = 0; c < blocks16; ++c) {
        for (int j = 0; j < 16; ++j) {
          acc[j] += a[c * lanes + j] * b[c * lanes + j];
        }
      }
    }
    float s = 0.0f;
    for (std::int64_t e = blocks16 * lanes; e < row_elements; ++e) {
      s += l2 ? (a[e] - b[e]) * (a[e] - b[e]) : a[e] * b[e];
    }
    for (int j = 0; j < 16; ++j) {
      s += acc[j];
    }
    return l2 ? s : -s;  // both inner product and cosine rank by -dot
  };

  parallel_ranges(n, threads, [&](std::int64_t begin, std::int64_t end) {
    constexpr std::int64_t query_block = 16;
    using entry                        = std::pair<float, std::uint32_t>;
    std::vector<std::vector<entry>> heaps(query_block);
    for (std::int64_t q0 = begin; q0 < end; q0 += query_block) {
      std::int64_t const q1 = std::min(end, q0 + query_block);
      for (auto& h : heaps) {
        h.clear();
      }
      for (std::int64_t r = 0; r < n; ++r) {
        float const* row = data.data() + r * row_elements;
        for (std::int64_t q = q0; q < q1; ++q) {
          if (q == r) { continue; }
          float const d = distance(data.data() + q * row_elements, row);
          auto& h       = heaps[static_cast<std::size_t>(q - q0)];
          entry const e{d, static_cast<std::uint32_t>(r)};
          if (h.size() < k) {
            h.push_back(e);
            std::push_heap(h.begin(), h.end());
          } else if (e < h.front()) {
            std::pop_heap(h.begin(), h.end());
            h.back() = e;
            std::push_heap(h.begin(), h.end());
          }
        }
      }
      for (std::int64_t q = q0; q < q1; ++q) {
        auto& h = heaps[static_cast<std::size_t>(q - q0)];
        std::sort(h.begin(), h.end());
        for (std::uint32_t j = 0; j < k; ++j) {
          out[q * k + j] = j < h.size() ? h[j].second : invalid_node;
        }
      }
    }
  });
}

/// @brief splitmix64 (Vigna): the NN-descent sampler's hash, a pure function of its input.
constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept
{
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// @brief Knobs of `nn_descent_knn_host` (Dong, Charikar, Li 2011), the names of the paper.
struct nn_descent_knobs {
  float rho{0.5f};      ///< sampling rate: at most `ceil(rho * k)` new and old candidates
  float delta{0.001f};  ///< stop when an iteration makes fewer than `delta * n * k` updates
  std::uint32_t max_iterations{16};  ///< hard bound on the iterations
  std::uint64_t seed{0x6E6E64};      ///< the random initial graph and the samples depend only on it
};

/// @brief What one `nn_descent_knn_host` run did (for tests and benchmarks).
struct nn_descent_report {
  std::uint32_t iterations{0};
  std::uint64_t distances{0};     ///< distances computed, the initial graph's included
  std::uint64_t last_updates{0};  ///< list insertions in the last iteration
};

/**
 * @brief Approximate kNN graph by NN-descent: for each of the `n` padded rows `k` near other
 * rows, sorted by (distance, id), like `exact_knn_host` but in about `n * iterations * 1.5 *
 * (rho k)^2` distances instead of `n^2`.
 *
 * The algorithm (Dong, Charikar and Li, "Efficient k-nearest neighbor graph construction for
 * generic similarity measures", WWW 2011): start from `k` random neighbours per node; each
 * iteration gives every node `v` a *new* and an *old* candidate list: its neighbours flagged new
 * (not yet joined) and the nodes that have `v` as a new neighbour (reverse neighbours), and
 * likewise for old, each list a sample of at most `ceil(rho * k)` of them (forward and reverse
 * together, as pynndescent's `max_candidates`; the paper samples `rho k` of each kind, up to
 * twice as many). The local join then computes the distance of every new-new and new-old pair of
 * `v`'s candidates and offers each node to the other's list; a neighbour sampled into a new list
 * is flagged old. Iterations stop when fewer than `delta * n * k` offers were taken (or after
 * `max_iterations`).
 *
 * Deterministic for a given seed: single-threaded, and every random choice (initial neighbours,
 * sample priorities) is `splitmix64` of the seed, the iteration and the node ids. Distances are
 * the host's block fp32 dot products (`dot_block_for`: AVX-512 or AVX2 with FMA where the CPU
 * has them, so two CPUs of different instruction sets may order a near-tie differently and build
 * slightly different graphs; one CPU always builds the same one), squared L2 as
 * `|a|^2 + |b|^2 - 2 a.b` (only the ranking matters). Each node's local join computes its dot
 * products first, in blocks of 4 x 4 rows (AVX-512), then makes the offers in the pair order.
 *
 * Measured on a 30k x 384 mixture, one thread, the whole `graph_index::add` (2026-12-01): 11.0
 * CPU seconds with one product at a time and a scan from the list's end for the insertion point;
 * 9.0 with the block products; 7.0 with the membership test before the binary search (most
 * offers that pass the list's bound in the late iterations are of nodes already listed).
 *
 * @pre `k <= n - 1` (`degrees_for` guarantees it)
 */
template <class T>
nn_descent_report nn_descent_knn_host(T const* rows,
                                      std::int64_t row_elements,
                                      std::int64_t n,
                                      distance_metric metric,
                                      std::uint32_t k,
                                      nn_descent_knobs const& knobs,
                                      std::uint32_t* out)
{
  nn_descent_report report{};
  if (n == 0 || k == 0) { return report; }
  std::size_t const nz = static_cast<std::size_t>(n);
  std::vector<float> data(nz * static_cast<std::size_t>(row_elements));
  for (std::size_t i = 0; i < data.size(); ++i) {
    data[i] = to_float(rows[i]);
  }
  bool const l2 = metric == distance_metric::squared_l2;
  std::vector<float> norm2(l2 ? nz : 0);
  // the host's block dot products (AVX-512 or AVX2 with FMA): one chain per pair, so dot(a, b)
  // is the same bits in any block and in either order (each lane's fused a * b + acc is
  // b * a + acc)
  dot_block_fn const dot_block = dot_block_for();
  auto row                     = [&](std::uint32_t a) {
    return data.data() + std::size_t{a} * static_cast<std::size_t>(row_elements);
  };
  auto dot = [&](std::uint32_t a, std::uint32_t b) {
    float const* const pa = row(a);
    float const* const pb = row(b);
    float d;
    dot_block(&pa, 1, &pb, 1, row_elements, &d, 1);
    return d;
  };
  if (l2) {
    for (std::uint32_t v = 0; v < n; ++v) {
      norm2[v] = dot(v, v);
    }
  }
  auto from_dot = [&](std::uint32_t a, std::uint32_t b, float d) {
    ++report.distances;
    return l2 ? norm2[a] + norm2[b] - 2.0f * d : -d;
  };
  auto distance = [&](std::uint32_t a, std::uint32_t b) { return from_dot(a, b, dot(a, b)); };

  // neighbour lists: k (distance, id) sorted ascending, and a "new" flag per entry
  std::size_t const kz = k;
  std::vector<float> dist(nz * kz);
  std::vector<std::uint32_t> ids(nz * kz);
  std::vector<std::uint8_t> fresh(nz * kz, 1);
  // each list's last distance, packed (n floats stay in cache; most offers are refused by it)
  std::vector<float> worst(nz);
  auto less = [](float da, std::uint32_t ia, float db, std::uint32_t ib) {
    return da < db || (da == db && ia < ib);
  };
  // offers `x` at distance `d` to `u`'s list; true if it was taken
  auto offer = [&](std::uint32_t u, std::uint32_t x, float d) {
    if (d > worst[u]) { return false; }
    float* du         = dist.data() + std::size_t{u} * kz;
    std::uint32_t* iu = ids.data() + std::size_t{u} * kz;
    std::uint8_t* fu  = fresh.data() + std::size_t{u} * kz;
    if (!less(d, x, du[kz - 1], iu[kz - 1])) { return false; }
    // Most offers that pass the bound in the late iterations are of listed nodes: test
    // membership first, over all k ids at once (no dependent loads; the compiler vectorises it)
    unsigned listed = 0;
    for (std::size_t i = 0; i < kz; ++i) {
      listed |= static_cast<unsigned>(iu[i] == x);
    }
    if (listed != 0) { return false; }
    // where (d, x) goes: the first entry it is less than (binary search)
    std::size_t p = 0, len = kz - 1;  // (d, x) is less than the last entry: p <= kz - 1
    while (len > 0) {
      std::size_t const step = len / 2;
      bool const right       = !less(d, x, du[p + step], iu[p + step]);
      p                      = right ? p + step + 1 : p;
      len                    = right ? len - step - 1 : step;
    }
    std::size_t const moved = kz - 1 - p;
    std::memmove(du + p + 1, du + p, moved * sizeof(float));
    std::memmove(iu + p + 1, iu + p, moved * sizeof(std::uint32_t));
    std::memmove(fu + p + 1, fu + p, moved * sizeof(std::uint8_t));
    du[p]    = d;
    iu[p]    = x;
    fu[p]    = 1;
    worst[u] = du[kz - 1];
    return true;
  };

  // the random initial graph: k distinct other nodes per node
  std::uint64_t const n64 = static_cast<std::uint64_t>(n);
  {
    std::vector<std::pair<float, std::uint32_t>> row;
    for (std::uint32_t v = 0; v < n; ++v) {
      row.clear();
      for (std::uint64_t draw = 0; row.size() < kz; ++draw) {
        std::uint32_t const x = static_cast<std::uint32_t>(
          splitmix64(knobs.seed ^ splitmix64((std::uint64_t{v} << 32) + draw)) % n64);
        if (x == v) { continue; }
        bool present = false;
        for (auto const& e : row) {
          present |= e.second == x;
        }
        if (!present) { row.emplace_back(distance(v, x), x); }
      }
      std::sort(row.begin(), row.end());
      for (std::size_t i = 0; i < kz; ++i) {
        dist[std::size_t{v} * kz + i] = row[i].first;
        ids[std::size_t{v} * kz + i]  = row[i].second;
      }
      worst[v] = row[kz - 1].first;
    }
  }

  // candidate lists: at most `cap` entries per node, the ones of lowest priority kept (a
  // max-heap on priority per node, so a node's sample is independent of the visiting order)
  std::uint32_t const cap = std::max<std::uint32_t>(
    1, std::min<std::uint32_t>(k, static_cast<std::uint32_t>(std::ceil(knobs.rho * float(k)))));
  std::size_t const cz = cap;
  std::vector<std::uint64_t> new_prio(nz * cz), old_prio(nz * cz);
  std::vector<std::uint32_t> new_ids(nz * cz), old_ids(nz * cz);
  std::vector<std::uint32_t> new_count(nz), old_count(nz);
  auto push = [&](std::vector<std::uint64_t>& prio,
                  std::vector<std::uint32_t>& cand,
                  std::vector<std::uint32_t>& count,
                  std::uint32_t v,
                  std::uint32_t x,
                  std::uint64_t p) {
    std::uint64_t* pv = prio.data() + std::size_t{v} * cz;
    std::uint32_t* cv = cand.data() + std::size_t{v} * cz;
    std::uint32_t& c  = count[v];
    unsigned present  = 0;
    for (std::uint32_t i = 0; i < c; ++i) {
      present |= static_cast<unsigned>(cv[i] == x);
    }
    if (present != 0) { return; }
    auto heap_less = [](std::pair<std::uint64_t, std::uint32_t> a,
                        std::pair<std::uint64_t, std::uint32_t> b) { return a < b; };
    if (c < cap) {  // sift up
      std::uint32_t i = c++;
      while (i > 0) {
        std::uint32_t const parent = (i - 1) / 2;
        if (!heap_less({pv[parent], cv[parent]}, {p, x})) { break; }
        pv[i] = pv[parent];
        cv[i] = cv[parent];
        i     = parent;
      }
      pv[i] = p;
      cv[i] = x;
      return;
    }
    if (!heap_less({p, x}, {pv[0], cv[0]})) { return; }
    std::uint32_t i = 0;  // replace the root (highest priority) and sift down
    for (;;) {
      std::uint32_t const l = 2 * i + 1, r = l + 1;
      std::uint32_t m = i;
      std::pair<std::uint64_t, std::uint32_t> top{p, x};
      if (l < c && heap_less(top, {pv[l], cv[l]})) {
        m   = l;
        top = {pv[l], cv[l]};
      }
      if (r < c && heap_less(top, {pv[r], cv[r]})) { m = r; }
      if (m == i) { break; }
      pv[i] = pv[m];
      cv[i] = cv[m];
      i     = m;
    }
    pv[i] = p;
    cv[i] = x;
  };

  std::vector<float const*> join_rows(2 * cz);
  std::vector<float> dots(cz * 2 * cz);
  double const stop = static_cast<double>(knobs.delta) * static_cast<double>(n) * k;
  for (std::uint32_t it = 0; it < knobs.max_iterations; ++it) {
    std::fill(new_count.begin(), new_count.end(), 0u);
    std::fill(old_count.begin(), old_count.end(), 0u);
    std::uint64_t const salt = splitmix64(knobs.seed + 0x1000 + it);
    for (std::uint32_t v = 0; v < n; ++v) {
      for (std::size_t i = 0; i < kz; ++i) {
        std::uint32_t const u = ids[std::size_t{v} * kz + i];
        // one priority per edge (v, u): the forward and the reverse sample agree on it
        std::uint64_t const p = splitmix64(salt ^ ((std::uint64_t{v} << 32) | u));
        if (fresh[std::size_t{v} * kz + i]) {
          push(new_prio, new_ids, new_count, v, u, p);
          push(new_prio, new_ids, new_count, u, v, p);
        } else {
          push(old_prio, old_ids, old_count, v, u, p);
          push(old_prio, old_ids, old_count, u, v, p);
        }
      }
    }
    // a forward neighbour sampled into the new list has now been joined: flag it old
    for (std::uint32_t v = 0; v < n; ++v) {
      std::uint32_t const* cv = new_ids.data() + std::size_t{v} * cz;
      std::uint32_t const* iv = ids.data() + std::size_t{v} * kz;
      std::uint8_t* fv        = fresh.data() + std::size_t{v} * kz;
      for (std::uint32_t j = 0; j < new_count[v]; ++j) {
        std::uint32_t const x = cv[j];
        for (std::size_t i = 0; i < kz; ++i) {  // branch-free: vectorises
          fv[i] = static_cast<std::uint8_t>(fv[i] & static_cast<std::uint8_t>(iv[i] != x));
        }
      }
    }
    std::uint64_t updates = 0;
    for (std::uint32_t v = 0; v < n; ++v) {
      std::uint32_t const* nv = new_ids.data() + std::size_t{v} * cz;
      std::uint32_t const* ov = old_ids.data() + std::size_t{v} * cz;
      std::uint32_t const nn = new_count[v], no = old_count[v];
      if (nn == 0) { continue; }
      // the join's dot products first, in blocks: row a of `dots` holds new[a] against
      // (new, old), filled from column a on (four rows at a time share a start)
      std::uint32_t const width = nn + no;
      for (std::uint32_t a = 0; a < nn; ++a) {
        join_rows[a] = row(nv[a]);
      }
      for (std::uint32_t b = 0; b < no; ++b) {
        join_rows[nn + b] = row(ov[b]);
      }
      for (std::uint32_t a0 = 0; a0 < nn; a0 += 4) {
        std::uint32_t const rows_here = std::min<std::uint32_t>(4, nn - a0);
        dot_block(join_rows.data() + a0,
                  rows_here,
                  join_rows.data() + a0,
                  width - a0,
                  row_elements,
                  dots.data() + std::size_t{a0} * width + a0,
                  width);
      }
      for (std::uint32_t a = 0; a < nn; ++a) {
        std::uint32_t const x   = nv[a];
        float const* const dota = dots.data() + std::size_t{a} * width;
        for (std::uint32_t b = a + 1; b < nn; ++b) {
          std::uint32_t const y = nv[b];
          float const d         = from_dot(x, y, dota[b]);
          updates += offer(x, y, d);
          updates += offer(y, x, d);
        }
        for (std::uint32_t b = 0; b < no; ++b) {
          std::uint32_t const y = ov[b];
          if (y == x) { continue; }
          float const d = from_dot(x, y, dota[nn + b]);
          updates += offer(x, y, d);
          updates += offer(y, x, d);
        }
      }
    }
    report.iterations   = it + 1;
    report.last_updates = updates;
    if (static_cast<double>(updates) < stop) { break; }
  }
  for (std::size_t i = 0; i < nz * kz; ++i) {
    out[i] = ids[i];
  }
  return report;
}

/**
 * @brief Rank-based pruning of one node (CAGRA step B, the paper's criterion). With `L` the
 * node's kNN row, the edge to `L[b]` is detourable through `D = L[a]` when `a < b` and `L[b]`
 * appears in D's kNN row at a rank `j < b` (that is, `max(rank(A->D), rank(D->B)) < rank(A->B)`).
 * Keeps the `degree` edges with the fewest detours, ties by rank, in that order.
 *
 * @param knn       `[n][width]` kNN rows (node ids < n), each sorted by distance
 * @param width     row length of `knn`; the first `k` entries are used
 * @param scratch_ids, scratch_ranks, counts  `k` entries each (caller's scratch), entry `p` at
 *        `p * stride`: the host passes 1; the device kernel, one thread per node, interleaves its
 *        threads' scratch (stride = the launch's threads), so that neighbouring threads touch
 *        neighbouring words
 */
INFERSCALE_HOST_DEVICE inline void prune_node(std::uint32_t const* knn,
                                              std::uint32_t width,
                                              std::uint32_t k,
                                              std::uint32_t node,
                                              std::uint32_t degree,
                                              std::uint32_t* out,
                                              std::uint32_t* scratch_ids,
                                              std::uint32_t* scratch_ranks,
                                              std::uint32_t* counts,
                                              std::uint32_t stride = 1) noexcept
{
  auto const at            = [stride](std::uint32_t p) { return std::uint64_t{p} * stride; };
  std::uint32_t const* row = knn + std::uint64_t{node} * width;
  // (id, rank) pairs sorted by id for the rank lookups: insertion sort (k <= a few hundred)
  for (std::uint32_t i = 0; i < k; ++i) {
    std::uint32_t const id = row[i];
    std::uint32_t p        = i;
    while (p > 0 && scratch_ids[at(p - 1)] > id) {
      scratch_ids[at(p)]   = scratch_ids[at(p - 1)];
      scratch_ranks[at(p)] = scratch_ranks[at(p - 1)];
      --p;
    }
    scratch_ids[at(p)]   = id;
    scratch_ranks[at(p)] = i;
    counts[at(i)]        = 0;
  }
  for (std::uint32_t a = 0; a + 1 < k; ++a) {
    std::uint32_t const via = row[a];
    if (via == invalid_node) { continue; }
    std::uint32_t const* via_row = knn + std::uint64_t{via} * width;
    for (std::uint32_t j = 0; j + 1 < k; ++j) {
      std::uint32_t const target = via_row[j];
      if (target == invalid_node) { continue; }
      std::uint32_t lo = 0, hi = k;  // lower bound of target among the sorted ids
      while (lo < hi) {
        std::uint32_t const mid = (lo + hi) / 2;
        if (scratch_ids[at(mid)] < target) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      if (lo == k || scratch_ids[at(lo)] != target) { continue; }
      std::uint32_t const b = scratch_ranks[at(lo)];
      if (b > a && j < b) { ++counts[at(b)]; }
    }
  }
  // the `degree` smallest (count, rank): repeated minimum scan, stable in rank
  std::uint32_t written = 0;
  for (std::uint32_t c = 0; written < degree && c < k; ++c) {
    for (std::uint32_t r = 0; r < k && written < degree; ++r) {
      if (counts[at(r)] == c && row[r] != invalid_node) { out[written++] = row[r]; }
    }
  }
  for (std::uint32_t more = 0; written < degree; ++more) {  // counts >= k cannot happen; pad
    out[written++] = invalid_node;
    (void)more;
  }
}

/**
 * @brief Pruning of every node on the host (threads over nodes): `prune_node`'s result, with the
 * rank lookups in a dense table of `n` entries per thread instead of a binary search (the
 * lowest rank of an id, as `prune_node`'s stable sort gives; 5-10x faster at k = 64). At most
 * `threads` threads (`parallel_ranges`; 0 = one per hardware thread); the result does not depend
 * on it.
 */
inline void prune_host(std::uint32_t const* knn,
                       std::uint32_t width,
                       std::uint32_t k,
                       std::uint32_t n,
                       std::uint32_t degree,
                       std::uint32_t* pruned,
                       unsigned threads = 0)
{
  parallel_ranges(n, threads, [&](std::int64_t begin, std::int64_t end) {
    std::vector<std::uint32_t> rank_of(n, invalid_node), counts(k);
    for (std::int64_t v = begin; v < end; ++v) {
      std::uint32_t const* row = knn + static_cast<std::uint64_t>(v) * width;
      for (std::uint32_t i = 0; i < k; ++i) {
        counts[i] = 0;
        if (row[i] < n && rank_of[row[i]] == invalid_node) { rank_of[row[i]] = i; }
      }
      for (std::uint32_t a = 0; a + 1 < k; ++a) {
        std::uint32_t const via = row[a];
        if (via == invalid_node) { continue; }
        std::uint32_t const* via_row = knn + std::uint64_t{via} * width;
        for (std::uint32_t j = 0; j + 1 < k; ++j) {
          std::uint32_t const target = via_row[j];
          if (target >= n) { continue; }
          std::uint32_t const b = rank_of[target];
          if (b != invalid_node && b > a && j < b) { ++counts[b]; }
        }
      }
      std::uint32_t* out    = pruned + v * degree;
      std::uint32_t written = 0;
      for (std::uint32_t c = 0; written < degree && c < k; ++c) {
        for (std::uint32_t r = 0; r < k && written < degree; ++r) {
          if (counts[r] == c && row[r] != invalid_node) { out[written++] = row[r]; }
        }
      }
      for (; written < degree; ++written) {
        out[written] = invalid_node;
      }
      for (std::uint32_t i = 0; i < k; ++i) {
        if (row[i] < n) { rank_of[row[i]] = invalid_node; }
      }
    }
  });
}

/**
 * @brief CAGRA steps C and D: reverse edges (for each node, the sources pointing at it ordered
 * by the rank of that edge, then by source id, at most `degree`), then the merge: the first
 * `degree / 2` pruned edges, then reverse edges, then the remaining pruned edges, skipping
 * repeats, truncated to `degree` and padded with `invalid_node`.
 *
 * @param pruned `[n][degree]` pruned rows; @param out `[n][out_stride]` (the first `degree` used)
 * @param threads at most this many threads for the merge (`parallel_ranges`; 0 = one per hardware
 * thread); the result does not depend on it
 */
inline void reverse_and_merge_host(std::uint32_t const* pruned,
                                   std::uint32_t n,
                                   std::uint32_t degree,
                                   std::uint32_t* out,
                                   std::uint32_t out_stride,
                                   unsigned threads = 0)
{
  // bucket the edges by target in (rank, source) order with a counting sort by rank
  std::vector<std::uint32_t> fill(n, 0);
  std::vector<std::uint32_t> reverse(std::size_t{n} * degree, invalid_node);
  for (std::uint32_t r = 0; r < degree; ++r) {
    for (std::uint32_t s = 0; s < n; ++s) {
      std::uint32_t const t = pruned[std::size_t{s} * degree + r];
      if (t == invalid_node || t == s) { continue; }
      if (fill[t] < degree) { reverse[std::size_t{t} * degree + fill[t]++] = s; }
    }
  }
  std::uint32_t const keep = degree / 2;
  parallel_ranges(n, threads, [&](std::int64_t begin, std::int64_t end) {
    std::vector<std::uint32_t> merged;
    merged.reserve(3 * degree);
    for (std::int64_t v = begin; v < end; ++v) {
      merged.clear();
      auto push = [&](std::uint32_t x) {
        if (x == invalid_node || x == static_cast<std::uint32_t>(v)) { return; }
        if (std::find(merged.begin(), merged.end(), x) != merged.end()) { return; }
        merged.push_back(x);
      };
      std::uint32_t const* p = pruned + v * degree;
      for (std::uint32_t r = 0; r < keep; ++r) {
        push(p[r]);
      }
      for (std::uint32_t r = 0; r < fill[static_cast<std::size_t>(v)]; ++r) {
        push(reverse[static_cast<std::size_t>(v) * degree + r]);
      }
      for (std::uint32_t r = keep; r < degree; ++r) {
        push(p[r]);
      }
      std::uint32_t* o = out + v * out_stride;
      for (std::uint32_t r = 0; r < degree; ++r) {
        o[r] = r < merged.size() ? merged[r] : invalid_node;
      }
    }
  });
}

/// @brief Nodes reachable from `start` by breadth-first search over `[n][stride]` rows.
inline std::vector<std::uint8_t> reachable_from(std::uint32_t const* graph,
                                                std::uint32_t n,
                                                std::uint32_t degree,
                                                std::uint32_t stride,
                                                std::uint32_t start)
{
  std::vector<std::uint8_t> seen(n, 0);
  if (n == 0) { return seen; }
  std::vector<std::uint32_t> queue{start};
  seen[start] = 1;
  for (std::size_t head = 0; head < queue.size(); ++head) {
    std::uint32_t const* row = graph + std::size_t{queue[head]} * stride;
    for (std::uint32_t r = 0; r < degree; ++r) {
      std::uint32_t const t = row[r];
      if (t != invalid_node && t < n && !seen[t]) {
        seen[t] = 1;
        queue.push_back(t);
      }
    }
  }
  return seen;
}

/**
 * @brief Makes every node reachable from node 0. While a node `u` is unreachable, its nearest
 * reachable node `v` (by `distance(v, u)`) gets an edge to `u`: an empty slot if `v` has one,
 * otherwise the slot in `v`'s second half whose target has the most in-edges. Deterministic.
 *
 * @return the number of edges added
 */
template <class Distance>
std::uint32_t repair_reachability(std::uint32_t* graph,
                                  std::uint32_t n,
                                  std::uint32_t degree,
                                  std::uint32_t stride,
                                  Distance&& distance)
{
  if (n <= 1 || degree == 0) { return 0; }
  std::uint32_t added = 0;
  for (std::uint32_t round = 0; round < 4 * n; ++round) {
    auto const seen = reachable_from(graph, n, degree, stride, 0);
    std::uint32_t u = 0;
    while (u < n && seen[u]) {
      ++u;
    }
    if (u == n) { return added; }
    std::vector<std::uint32_t> in_degree(n, 0);
    for (std::size_t e = 0; e < std::size_t{n}; ++e) {
      for (std::uint32_t r = 0; r < degree; ++r) {
        std::uint32_t const t = graph[e * stride + r];
        if (t != invalid_node && t < n) { ++in_degree[t]; }
      }
    }
    std::uint32_t best = invalid_node;
    float best_d       = std::numeric_limits<float>::infinity();
    for (std::uint32_t v = 0; v < n; ++v) {
      if (!seen[v]) { continue; }
      float const d = distance(v, u);
      if (best == invalid_node || d < best_d) {
        best   = v;
        best_d = d;
      }
    }
    std::uint32_t* row = graph + std::size_t{best} * stride;
    std::uint32_t slot = degree;
    for (std::uint32_t r = 0; r < degree && slot == degree; ++r) {
      if (row[r] == invalid_node) { slot = r; }
    }
    if (slot == degree) {
      slot = degree - 1;
      for (std::uint32_t r = degree / 2; r < degree; ++r) {
        if (in_degree[row[r]] > in_degree[row[slot]]) { slot = r; }
      }
    }
    row[slot] = u;
    ++added;
  }
  return added;
}

}  // namespace inferscale::detail::index
