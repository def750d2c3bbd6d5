/**
 * @file llama_recompute.hpp
 * @brief The recompute plan (inferscale/recompute.hpp) executed on llama.cpp: the deviation probe
 * (the memory's text through its first layers, compared with the injected rows) and the
 * recompute itself (the chosen tokens decoded again at their positions with the whole memory in
 * place, their new cells replacing the injected ones).
 *
 * llama.cpp decodes a sequence's batch only at the position after the last one it holds, so a
 * run of tokens inside the memory segment is decoded in the context's scratch sequence: it first
 * shares (llama_memory_seq_cp, unified cache: no copy) the request's cells below the run, then
 * decodes the run, which sees every memory token before it — the injected ones and the runs
 * recomputed before it; when every run is done, the request sequence drops its injected cells of
 * the runs and shares the scratch sequence's new ones instead.
 */
#pragma once

#include "llama_context.hpp"

#include <inferscale/compose.hpp>
#include <inferscale/recompute.hpp>
#include <inferscale/store.hpp>
#include <inferscale/views.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace inferscale::llama_cpp {

/**
 * @brief Deviation of every token of the memory segment `c`, injected into sequence `seq`, from
 * the K/V it gets in context at layer `layer` (kv_deviation): the segment's text is run through
 * layers 0 .. layer only, in the scratch sequence, seeing the cells `seq` holds below the segment.
 * @throw engine_error / logic_error as context::probe_layer and kv_deviation.
 */
inline std::vector<float> probe_deviation(context& ctx,
                                          std::int32_t seq,
                                          kv_store const& store,
                                          composition const& c,
                                          std::int32_t layer = 1)
{
  std::int32_t const scratch = ctx.scratch_sequence();
  if (seq == scratch) {
    throw engine_error("llama_cpp::probe_deviation: sequence " + std::to_string(seq) +
                       " is the scratch sequence");
  }
  ctx.clear(scratch);
  if (c.first_position > 0) { ctx.copy_sequence(seq, scratch, 0, c.first_position); }
  std::vector<float> keys, values;
  try {
    ctx.probe_layer(scratch, c.token_ids, c.first_position, layer, keys, values);
  } catch (...) {
    ctx.clear(scratch);
    throw;
  }
  ctx.clear(scratch);
  kv_geometry const g = ctx.geometry();
  return kv_deviation(
    store,
    c,
    layer,
    make_token_head_view<float const>(keys.data(), c.length(), g.num_kv_heads, g.head_dim),
    make_token_head_view<float const>(values.data(), c.length(), g.num_kv_heads, g.head_dim));
}

/// @brief How recompute_memory() batches the plan's runs.
enum class recompute_batching {
  /// One decode per run, in order: a run sees the runs before it recomputed (CacheBlend's view).
  sequential,
  /// The runs side by side in one decode (a branch sequence each; context_options::n_branch_seq
  /// runs and n_batch tokens per decode, the next decode seeing the earlier ones recomputed): a
  /// run sees the memory before it as injected. Far fewer engine calls.
  one_batch,
};

/**
 * @brief Recomputes the plan's tokens of the memory segment `c` held by sequence `seq` (see the
 * file comment); afterwards `seq` holds the same positions, the plan's ones with their cells
 * computed in context.
 * @throw engine_error if `seq` is a scratch or branch sequence, does not hold the segment, the
 *        plan does not fit the segment, one_batch is asked of a context without branch sequences,
 *        or llama.cpp refuses a batch (the scratch and branch sequences are cleared then; `seq`
 *        holds every run either as injected or as recomputed, never half of one, unless the
 *        exchange of cells itself failed).
 */
inline void recompute_memory(context& ctx,
                             std::int32_t seq,
                             composition const& c,
                             recompute_plan const& plan,
                             recompute_batching batching = recompute_batching::one_batch)
{
  std::int32_t const scratch = ctx.scratch_sequence();
  if (seq >= scratch) {
    throw engine_error("llama_cpp::recompute_memory: sequence " + std::to_string(seq) +
                       " is the scratch sequence or a branch sequence");
  }
  if (plan.empty()) { return; }
  std::int64_t const end = c.first_position + c.length();
  if (ctx.max_position(seq) < end - 1) {
    throw engine_error("llama_cpp::recompute_memory: sequence " + std::to_string(seq) +
                       " holds positions up to " + std::to_string(ctx.max_position(seq)) +
                       ", the memory segment ends at " + std::to_string(end - 1));
  }
  for (recompute_run const& r : plan.runs) {
    if (r.begin < 0 || r.length <= 0 || r.begin + r.length > c.length()) {
      throw engine_error("llama_cpp::recompute_memory: a run of the plan lies outside the segment");
    }
  }
  auto const branches = static_cast<std::int32_t>(ctx.options().n_branch_seq);
  if (batching == recompute_batching::one_batch && branches == 0) {
    throw engine_error(
      "llama_cpp::recompute_memory: one_batch needs branch sequences "
      "(context_options::n_branch_seq)");
  }
  auto const tokens_of = [&](recompute_run const& r) {
    return std::vector<std::int32_t>(c.token_ids.begin() + r.begin,
                                     c.token_ids.begin() + r.begin + r.length);
  };
  // Where each run's new cells are, once computed.
  std::vector<std::int32_t> holder(plan.runs.size(), scratch);
  auto const clear_all = [&] {
    ctx.clear(scratch);
    for (std::int32_t b = 0; b < branches; ++b) {
      ctx.clear(ctx.first_branch_sequence() + b);
    }
  };
  clear_all();
  std::size_t done = 0;
  try {
    if (batching == recompute_batching::sequential) {
      std::int64_t shared = 0;  // the scratch sequence holds the positions below this
      for (recompute_run const& r : plan.runs) {
        std::int64_t const p = c.first_position + r.begin;
        if (shared < p) { ctx.copy_sequence(seq, scratch, shared, p); }
        ctx.decode(scratch, tokens_of(r), p);
        shared = p + r.length;
      }
      done = plan.runs.size();
    } else {
      auto const n_batch = static_cast<std::int64_t>(ctx.options().n_batch);
      while (done < plan.runs.size()) {
        // Runs, each in its own branch sequence sharing the request's cells below it, while
        // branch sequences and the batch last (a run longer than the batch goes alone, split).
        std::vector<std::int32_t> tokens, seqs;
        std::vector<std::int64_t> positions;
        std::size_t next = done;
        while (next < plan.runs.size() && static_cast<std::int32_t>(next - done) < branches) {
          recompute_run const& r = plan.runs[next];
          if (next > done && static_cast<std::int64_t>(tokens.size()) + r.length > n_batch) {
            break;
          }
          std::int32_t const b =
            ctx.first_branch_sequence() + static_cast<std::int32_t>(next - done);
          std::int64_t const p = c.first_position + r.begin;
          if (p > 0) { ctx.copy_sequence(seq, b, 0, p); }
          holder[next] = b;
          if (r.length > n_batch) {  // alone: decode() splits it in order
            ctx.decode(b, tokens_of(r), p);
            ++next;
            break;
          }
          for (std::int64_t j = 0; j < r.length; ++j) {
            tokens.push_back(c.token_ids[static_cast<std::size_t>(r.begin + j)]);
            positions.push_back(p + j);
            seqs.push_back(b);
          }
          ++next;
        }
        if (!tokens.empty()) { ctx.decode_tokens(tokens, positions, seqs); }
        for (std::size_t i = done; i < next; ++i) {  // hand the new cells to the request
          recompute_run const& r = plan.runs[i];
          std::int64_t const p   = c.first_position + r.begin;
          ctx.remove(seq, p, p + r.length);
          ctx.copy_sequence(holder[i], seq, p, p + r.length);
          ctx.clear(holder[i]);
        }
        done = next;
      }
      clear_all();
      return;
    }
  } catch (...) {
    clear_all();
    throw;
  }
  for (recompute_run const& r : plan.runs) {
    std::int64_t const p = c.first_position + r.begin;
    ctx.remove(seq, p, p + r.length);
    ctx.copy_sequence(scratch, seq, p, p + r.length);
  }
  clear_all();
}

}  // namespace inferscale::llama_cpp
