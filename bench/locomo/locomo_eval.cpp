// LoCoMo end to end on the reference engine (llama.cpp + SmolLM2-135M-Instruct on the CPU) with a
// real embedder (all-MiniLM-L6-v2 in llama.cpp) and the memory facade (memory.hpp).
//
//   locomo_eval --count            forward tokens of every encoding strategy and window w, all
//                                  10 conversations, SmolLM2 tokenizer (no model forward)
//   locomo_eval --retrieval        evidence recall@5/10/20 of MiniLM retrieval, all conversations
//   locomo_eval --fast             conv-26's first 3 sessions, 6 questions, w in {0, 20} (the
//                                  main job's --full; its default runs --fast --windows ''
//                                  --no-whole); the options below override these (CTest
//                                  locomo.fast: --fast --questions 3 --sessions 2 --windows 0,2)
//   locomo_eval --step [options]   retrieval inside the serving step at many users (issue 32):
//                                  per step of B requests, the query embeddings, one batched
//                                  search, the compositions and injections, beside the engine's
//                                  prefill of the step's questions (see step_mode)
//     --users U          users in the index (default 1000): the served conversations, and
//                        U - C index-only users of synthetic facts (see step_mode)
//     --batches 1,16,64  requests per step (at most 255)
//     --requests R       requests per batch size (default 256)
//   locomo_eval --full [options]   the figures for bench/results/
//     --conversations conv-26,conv-30 | all   (default conv-26)
//     --sessions N       only the first N sessions of each conversation (default: all)
//     --questions N      at most N questions per conversation (default: all)
//     --main-window W    the served encoding: single pass, every fact sees >= W turns (20);
//                        0: each fact alone behind the lead (per_fact)
//     --windows 0,5,10,20,50   the window curve: aligned windows of W .. 1.25 W turns
//     --k K              facts retrieved per question for answering (default 10)
//     --recompute 0,5,10 the recompute curve: after injection, that percent of the memory's fact
//                        tokens recomputed in context (recompute.hpp: chosen by the layer-1 K/V
//                        deviation probe; one batch), per encoding (default: 0 only)
//     --served-recompute P   the percent the main table serves with (one of --recompute; 0)
//     --compression bfloat16,fp8_e4m3,int4   what compressed fact KV costs in answers (issue
//                        52): the served encoding also into one memory per entry (bfloat16: an
//                        uncompressed bf16 store, the reference, always built; fp8_e4m3 / int4:
//                        compressed stores dequantized to bf16), each question's same retrieved
//                        facts injected from each (no recompute), and per store against the bf16
//                        store's run: next-token KL (mean, p95) and top-1 over the gold answer
//                        tokens (teacher-forced), greedy answer agreement, bytes per fact; the
//                        float32 store (the served one) is the first row
//     --no-whole         no (d) baseline: it prefills the whole (cut) conversation for every
//                        question (about 2,300 tokens in --fast), the largest part of --fast's
//                        answering time; the main job's default run skips it
//
// Per conversation: its observation facts are encoded with context-window encoding (single pass,
// facts branched off the conversation), their MiniLM embeddings indexed; each question is answered
// three ways with greedy decoding: (a) the top-k facts' KV injected, (b) the same facts' text
// re-prefilled (the Mem0-style baseline, the same prompt token ids), (c) no memory; and, where the
// conversation fits the context, (d) the whole conversation prefilled. Reported per category:
// evidence recall@k, token F1 against the gold answer, (a)-(b) agreement, TTFT of (a) and (b); and
// per window w: next-token KL and top-1 agreement of (a) against (b) and (d) over the gold answer
// tokens (teacher-forced), and F1 of (a).
//
// The data set is read in place from ../shared/data/locomo (CC BY-NC 4.0, not copied). Any failure
// (a missing model, data set or engine error) exits non-zero with the message.

#include "compression_fidelity.hpp"
#include "divergence.hpp"
#include "embedder.hpp"
#include "llama_adapter.hpp"
#include "llama_recompute.hpp"
#include "locomo/locomo_data.hpp"
#include "model_paths.hpp"

#include <inferscale/encoding.hpp>
#include <inferscale/memory.hpp>
#include <inferscale/recompute.hpp>

#include <gaussian_mixture.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

using namespace inferscale;
namespace lc = inferscale::llama_cpp;
namespace lm = inferscale::locomo;

namespace {

using clock_type         = std::chrono::steady_clock;
using sequence_cache_ptr = std::unique_ptr<inferscale::llama_cpp::sequence_cache>;
double seconds_since(clock_type::time_point t)
{
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

struct run_options {
  std::string mode;
  std::vector<std::string> conversations{"conv-26"};
  int sessions{0};
  int questions{0};
  std::vector<std::int64_t> windows{0, 5, 10, 20, 50};
  std::uint32_t k{10};
  std::int32_t max_new{24};
  std::int64_t main_window{20};
  bool whole{true};               // (d), the whole conversation prefilled, where it fits
  std::vector<int> recompute{0};  // percent of memory fact tokens recomputed (the curve)
  int served_recompute{0};        // the main table's
  std::int64_t users{1000};       // --step
  std::vector<std::int64_t> batches{1, 16, 64};
  std::int64_t requests{256};
  std::vector<lc::store_variant> compression;  // --compression: empty = off
};

std::vector<std::string> split(std::string const& s, char sep)
{
  std::vector<std::string> out;
  std::stringstream in{s};
  std::string x;
  while (std::getline(in, x, sep)) {
    if (!x.empty()) { out.push_back(x); }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// A conversation as planner input

constexpr std::uint32_t n_ctx   = 8192;
constexpr std::uint32_t n_batch = 512;

struct prepared {
  lm::sample const* s{};
  conversation conv;
  std::vector<conversation_fact> facts;
  std::vector<std::string> texts;                     // embedded (the fact's own sentence)
  std::vector<std::vector<std::int64_t>> fact_turns;  // evidence turns per fact
  std::vector<lm::question const*> questions;
  std::int64_t turns{0};  // turns used (the first `sessions` sessions)
};

prepared prepare(
  lc::model const& m, lm::sample const& s, std::uint64_t ns, int sessions, std::uint64_t first_id)
{
  prepared p;
  p.s                     = &s;
  p.conv.lead             = m.tokenize(lm::instruction_prefix());
  int const used_sessions = sessions > 0
                              ? std::min<int>(sessions, static_cast<int>(s.sessions.size()))
                              : static_cast<int>(s.sessions.size());
  for (int si = 0; si < used_sessions; ++si) {
    p.conv.session_headers.push_back(m.tokenize(lm::session_header(s, si)));
  }
  for (lm::turn const& t : s.turns) {
    if (t.session >= used_sessions) { break; }
    p.conv.turns.push_back({m.tokenize(lm::turn_text(t)), t.session});
  }
  p.turns          = static_cast<std::int64_t>(p.conv.turns.size());
  std::uint64_t id = first_id;
  for (lm::fact const& f : s.facts) {
    if (f.session >= used_sessions) { continue; }
    conversation_fact cf;
    cf.fact_id      = id++;
    cf.namespace_id = ns;
    cf.token_ids    = m.tokenize(lm::fact_text(s, f));
    cf.source_turns = f.turns;
    p.facts.push_back(cf);
    p.texts.push_back(f.text);
    p.fact_turns.push_back(f.turns);
  }
  for (lm::question const& q : s.questions) {
    bool inside = !q.evidence.empty();
    for (std::int64_t t : q.evidence) {
      inside = inside && t < p.turns;
    }
    if (sessions > 0 && !inside) { continue; }  // a cut conversation: only its own questions
    p.questions.push_back(&q);
  }
  return p;
}

// ------------------------------------------------------------------------------------------------
// --count

int count_mode(lc::model const& m, std::vector<lm::sample> const& samples)
{
  std::vector<std::int64_t> const windows{0, 5, 10, 20, 50};
  struct row {
    std::string name;
    encoding_options o;
  };
  std::vector<row> rows;
  for (std::int64_t w : windows) {
    auto add = [&](
                 std::string name, encoding_strategy st, std::int64_t stride, std::int64_t budget) {
      encoding_options o;
      o.window              = w;
      o.strategy            = st;
      o.stride              = stride;
      o.max_sequence_tokens = budget;
      rows.push_back({name, o});
    };
    add("per_fact (the paper)", encoding_strategy::per_fact, 0, 0);
    add("shared_window", encoding_strategy::shared_window, 0, 0);
    add("aligned, stride w", encoding_strategy::aligned, 0, 0);
    add("aligned, stride 2w", encoding_strategy::aligned, std::max<std::int64_t>(1, 2 * w), 0);
    add("single_pass, 2048-token segments", encoding_strategy::single_pass, 0, 2048);
    add("single_pass, 4096-token segments", encoding_strategy::single_pass, 0, 4096);
    add("single_pass, 7680-token segments", encoding_strategy::single_pass, 0, n_ctx - n_batch);
    add("single_pass, unbounded", encoding_strategy::single_pass, 0, 0);
  }
  std::size_t const per_w  = rows.size() / windows.size();
  std::size_t const served = per_w - 2;  // single_pass in 7680-token segments (what runs)
  std::vector<encoding_stats> totals(rows.size());
  std::vector<std::string> unfit(rows.size());  // the first conversation a row's budget refused
  std::int64_t facts = 0, turns = 0, conv_tokens = 0, fact_tokens = 0;
  auto const t0 = clock_type::now();
  for (std::size_t si = 0; si < samples.size(); ++si) {
    prepared const p = prepare(m, samples[si], si + 1, 0, 1);
    facts += static_cast<std::int64_t>(p.facts.size());
    turns += p.turns;
    for (auto const& t : p.conv.turns) {
      conv_tokens += static_cast<std::int64_t>(t.token_ids.size());
    }
    for (auto const& f : p.facts) {
      fact_tokens += static_cast<std::int64_t>(f.token_ids.size());
    }
    for (std::size_t r = 0; r < rows.size(); ++r) {
      if (!unfit[r].empty()) { continue; }
      encoding_stats st;
      try {
        st = plan_encoding(p.conv, p.facts, rows[r].o).stats();
      } catch (inferscale::logic_error const&) {
        // A segment budget below one fact's window: the planner refuses it, as it should.
        unfit[r] = samples[si].id;
        continue;
      }
      totals[r].jobs += st.jobs;
      totals[r].facts += st.facts;
      totals[r].trunk_tokens += st.trunk_tokens;
      totals[r].fact_tokens += st.fact_tokens;
      totals[r].forward_tokens += st.forward_tokens;
      totals[r].unbranched_tokens += st.unbranched_tokens;
      totals[r].longest_sequence = std::max(totals[r].longest_sequence, st.longest_sequence);
    }
  }
  std::printf("## Context-window encoding: forward tokens on LoCoMo (SmolLM2 tokenizer)\n\n");
  std::printf(
    "%zu conversations, %lld turns (%lld tokens), %lld observation facts (%lld tokens); "
    "planned in %.1f s. Every fact sees at least the w turns before its source turn "
    "(all of them when fewer exist).\n\n",
    samples.size(),
    static_cast<long long>(turns),
    static_cast<long long>(conv_tokens),
    static_cast<long long>(facts),
    static_cast<long long>(fact_tokens),
    seconds_since(t0));
  std::printf(
    "| w | strategy | jobs | forward tokens | vs per_fact | without branching | longest sequence "
    "|\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (std::size_t r = 0; r < rows.size(); ++r) {
    if (!unfit[r].empty()) {
      std::printf(
        "| %lld | %s | refused: a fact of %s needs its %lld-turn window and itself in "
        "more tokens than the segment | | | | |\n",
        static_cast<long long>(rows[r].o.window),
        rows[r].name.c_str(),
        unfit[r].c_str(),
        static_cast<long long>(rows[r].o.window));
      continue;
    }
    std::size_t const base = r - r % per_w;
    double const ratio     = double(totals[base].forward_tokens) / double(totals[r].forward_tokens);
    std::printf("| %lld | %s | %lld | %lld | %.2fx fewer | %lld | %lld |\n",
                static_cast<long long>(rows[r].o.window),
                rows[r].name.c_str(),
                static_cast<long long>(totals[r].jobs),
                static_cast<long long>(totals[r].forward_tokens),
                ratio,
                static_cast<long long>(totals[r].unbranched_tokens),
                static_cast<long long>(totals[r].longest_sequence));
  }
  // The goal: >= 5x fewer than one forward per fact at w = 20, in segments the engine
  // can run (n_ctx 8192).
  std::size_t const w20 = 3 * per_w;
  double const goal_ratio =
    double(totals[w20].forward_tokens) / double(totals[w20 + served].forward_tokens);
  std::printf(
    "\nw = 20: one forward per fact %lld tokens, single pass in 7680-token segments "
    "%lld: %.2fx fewer (goal >= 5x: %s)\n",
    static_cast<long long>(totals[w20].forward_tokens),
    static_cast<long long>(totals[w20 + served].forward_tokens),
    goal_ratio,
    goal_ratio >= 5.0 ? "met" : "NOT met");
  return 0;
}

// ------------------------------------------------------------------------------------------------
// --retrieval: evidence recall@k of MiniLM retrieval over every conversation (no SmolLM2 forward)

double evidence_recall(std::vector<std::uint64_t> const& top,
                       std::size_t k,
                       std::map<std::uint64_t, std::size_t> const& fact_index,
                       std::vector<std::vector<std::int64_t>> const& fact_turns,
                       std::vector<std::int64_t> const& evidence)
{
  std::set<std::int64_t> covered;
  for (std::size_t j = 0; j < std::min(k, top.size()); ++j) {
    for (std::int64_t t : fact_turns[fact_index.at(top[j])]) {
      covered.insert(t);
    }
  }
  std::int64_t hit = 0;
  for (std::int64_t t : evidence) {
    hit += covered.count(t) ? 1 : 0;
  }
  return double(hit) / double(evidence.size());
}

int retrieval_mode(lc::model const& m, std::vector<lm::sample> const& samples);

// ------------------------------------------------------------------------------------------------
// Evaluation

struct answer_run {
  std::string text;
  std::vector<std::vector<float>> dists;  // teacher-forced logits over the gold answer tokens
  double ttft{0};                         // seconds to the first token's logits
  double inject{0};                       // (a): compose + inject part of ttft
  double recomputed{0};                   // (a): share of fact tokens recomputed
};

using lc::kl_top1;

struct evaluator {
  lc::model const& m;
  lc::context& ctx;
  lc::model_adapter& adapter;
  run_options const& opt;
  std::int32_t const seq = 0;

  std::vector<std::int32_t> answer_tokens(std::string const& gold) const
  {
    return gold.empty() ? std::vector<std::int32_t>{} : m.tokenize(gold + "<|im_end|>");
  }

  /// After the sequence holds the prompt up to the question's end (at `next` positions), the first
  /// logits in `first`: generate greedily, then teacher-force the gold answer.
  answer_run finish(std::vector<float> first,
                    std::int64_t next,
                    std::vector<std::int32_t> const& gold)
  {
    answer_run r;
    // Greedy generation from `first`.
    std::vector<std::int32_t> out;
    std::vector<float> logits = first;
    for (std::int32_t i = 0; i < opt.max_new; ++i) {
      std::int32_t const t =
        static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      if (m.is_end_of_generation(t)) { break; }
      out.push_back(t);
      ctx.decode(seq, {t}, next + i);
      logits = ctx.last_logits();
    }
    r.text = m.detokenize(out);
    ctx.truncate(seq, next);
    if (!gold.empty()) {
      r.dists.push_back(std::move(first));
      if (gold.size() > 1) {
        std::vector<std::int32_t> const head(gold.begin(), gold.end() - 1);
        for (auto& d : ctx.decode_logits(seq, head, next, head.size())) {
          r.dists.push_back(std::move(d));
        }
      }
    }
    ctx.clear(seq);
    return r;
  }

  /// Prefill `prompt` (text memory, no memory, or the whole conversation) + `question`.
  answer_run prefill(std::vector<std::int32_t> const& prompt,
                     std::vector<std::int32_t> const& q,
                     std::vector<std::int32_t> const& gold)
  {
    ctx.clear(seq);
    auto const t0                 = clock_type::now();
    std::vector<std::int32_t> all = prompt;
    all.insert(all.end(), q.begin(), q.end());
    ctx.decode(seq, all, 0);
    std::vector<float> first = ctx.last_logits();
    double const ttft        = seconds_since(t0);
    answer_run r = finish(std::move(first), static_cast<std::int64_t>(all.size()), gold);
    r.ttft       = ttft;
    return r;
  }

  /// (a): inject the facts' KV through the memory facade, prefill only the question.
  /// With `recompute_percent` > 0, that share of the memory's fact tokens (the largest layer-1 K/V
  /// deviations) is recomputed in context after injection, inside the TTFT.
  answer_run injected(memory const& mem,
                      std::vector<std::uint64_t> const& ids,
                      std::vector<std::int32_t> const& q,
                      std::vector<std::int32_t> const& gold,
                      int recompute_percent = 0)
  {
    ctx.clear(seq);
    lc::sequence_cache cache{ctx, seq};
    auto const t0          = clock_type::now();
    composition const plan = mem.prepare(ids, 0);
    mem.inject(plan, cache, adapter.rotation());
    double const inject = seconds_since(t0);
    double recomputed   = 0;
    if (recompute_percent > 0) {
      recompute_options ro;
      ro.selective_fraction        = recompute_percent / 100.0;
      ro.exact                     = mem.instruction_prefix();
      std::vector<float> const dev = lc::probe_deviation(ctx, seq, mem.store(), plan);
      recompute_plan const rp      = plan_recompute(plan, ro, dev);
      lc::recompute_memory(ctx, seq, plan, rp);
      recomputed = rp.fraction();
    }
    ctx.decode(seq, q, plan.length());
    std::vector<float> first = ctx.last_logits();
    double const ttft        = seconds_since(t0);
    answer_run r =
      finish(std::move(first), plan.length() + static_cast<std::int64_t>(q.size()), gold);
    r.ttft       = ttft;
    r.inject     = inject;
    r.recomputed = recomputed;
    return r;
  }
};

struct tally {
  double sum{0};
  std::int64_t n{0};
  void add(double x) { sum += x, ++n; }
  double mean() const { return n ? sum / double(n) : std::nan(""); }
};

std::string fmt(tally const& t, char const* f = "%.3f")
{
  if (t.n == 0) { return "n/a"; }
  char buf[64];
  std::snprintf(buf, sizeof buf, f, t.mean());
  return buf;
}

int eval_mode(lc::model const& m, std::vector<lm::sample> const& samples, run_options const& opt)
{
  lc::model embed_model{lc::minilm_path()};
  lc::embedder embedder{embed_model};

  lc::context_options co;
  co.n_ctx        = n_ctx;
  co.n_batch      = n_batch;
  co.n_threads    = 1;
  co.n_seq_max    = 2;
  co.n_branch_seq = 16;
  lc::context ctx{m, co};
  lc::model_adapter adapter{ctx};
  evaluator ev{m, ctx, adapter, opt};

  // The served encoding (the product's path): a single pass at w = main_window, facts branched
  // off the conversation in segments that fit the context; every fact sees >= w turns. The window
  // curve needs windows of (about) w turns: aligned windows with stride max(1, w/4), so a fact
  // sees between w and w + stride - 1 turns (w = 0: each fact alone).
  struct variant {
    std::string label;
    encoding_options o;
    bool main;
  };
  std::vector<variant> variants;
  std::int64_t const main_w = opt.main_window;
  {
    encoding_options o;
    o.window = main_w;
    // w = 0: each fact behind the lead only (per_fact); a single pass would show it whole turns.
    o.strategy = main_w == 0 ? encoding_strategy::per_fact : encoding_strategy::single_pass;
    o.max_sequence_tokens = n_ctx - n_batch;
    variants.push_back(
      {main_w == 0 ? std::string{"alone (w = 0)"} : "single pass, w >= " + std::to_string(main_w),
       o,
       true});
  }
  for (std::int64_t w : opt.windows) {
    encoding_options o;
    o.window              = w;
    o.strategy            = w == 0 ? encoding_strategy::per_fact : encoding_strategy::aligned;
    o.stride              = std::max<std::int64_t>(1, w / 4);
    o.max_sequence_tokens = n_ctx - n_batch;
    variants.push_back({w == 0 ? std::string{"alone (w = 0)"}
                               : "aligned, " + std::to_string(w) + ".." +
                                   std::to_string(w + o.stride - 1) + " turns",
                        o,
                        false});
  }

  // Per category (0 = all): the tables' cells.
  std::map<int, tally> recall5, recall10, recall20, f1a, f1b, f1c, f1d, agree_exact, agree_f1,
    ttft_a, ttft_b, inject_a, count;
  struct curve_cell {
    tally kl_b, top1_b, kl_d, top1_d, f1, exact_b, ttft, recomputed;
  };
  // Per variant, per recompute percent (opt.recompute).
  std::vector<std::vector<curve_cell>> curve(variants.size(),
                                             std::vector<curve_cell>(opt.recompute.size()));
  auto const served_rho = static_cast<std::size_t>(
    std::find(opt.recompute.begin(), opt.recompute.end(), opt.served_recompute) -
    opt.recompute.begin());
  std::vector<tally> turns_seen(variants.size());
  // --compression: float32 (the served store), then opt.compression's stores (bfloat16 first).
  std::vector<lc::fidelity_row> fidelity;
  std::vector<double> fidelity_bytes(opt.compression.size() + 1, 0.0);
  std::vector<std::int64_t> fidelity_facts(opt.compression.size() + 1, 0);
  tally retrieve_s;
  double encode_seconds      = 0;
  std::int64_t encode_tokens = 0, encode_facts = 0;
  std::set<std::string> wanted(opt.conversations.begin(), opt.conversations.end());
  bool const all = wanted.count("all") != 0;

  std::uint64_t ns = 0;
  for (lm::sample const& s : samples) {
    if (!all && !wanted.count(s.id)) { continue; }
    ++ns;
    prepared const p                    = prepare(m, s, ns, opt.sessions, 1000);
    std::vector<lm::question const*> qs = p.questions;
    if (opt.questions > 0 && static_cast<int>(qs.size()) > opt.questions) {
      // Spread over the conversation: every (n / Q)-th question.
      std::vector<lm::question const*> pick;
      for (int i = 0; i < opt.questions; ++i) {
        pick.push_back(
          qs[static_cast<std::size_t>(i) * qs.size() / static_cast<std::size_t>(opt.questions)]);
      }
      qs = pick;
    }
    std::fprintf(stderr,
                 "locomo: %s: %lld turns, %zu facts, %zu questions\n",
                 s.id.c_str(),
                 static_cast<long long>(p.turns),
                 p.facts.size(),
                 qs.size());

    // The whole (cut) conversation as a prompt, where it fits.
    std::vector<std::int32_t> full = p.conv.lead;
    for (std::size_t u = 0; u < p.conv.turns.size(); ++u) {
      if (u == 0 || p.conv.turns[u].session != p.conv.turns[u - 1].session) {
        auto const& h = p.conv.session_headers[static_cast<std::size_t>(p.conv.turns[u].session)];
        full.insert(full.end(), h.begin(), h.end());
      }
      full.insert(full.end(), p.conv.turns[u].token_ids.begin(), p.conv.turns[u].token_ids.end());
    }
    bool const full_fits = opt.whole && full.size() + 200 <= n_ctx;

    // Retrieval is the same for every w (the embeddings do not depend on it): one index.
    std::map<std::uint64_t, std::size_t> fact_index;
    for (std::size_t i = 0; i < p.facts.size(); ++i) {
      fact_index[p.facts[i].fact_id] = i;
    }
    struct per_question {
      std::vector<std::int32_t> q, gold;
      std::vector<std::uint64_t> ids;  // top-k for answering, best first
      answer_run b, c, d;
    };
    std::vector<per_question> pq(qs.size());

    for (std::size_t wi = 0; wi < variants.size(); ++wi) {
      std::int64_t const w = variants[wi].o.window;
      memory_config mc;
      mc.store.model       = ctx.geometry();
      mc.store.store_dtype = dtype::float32;
      mc.store.page_size   = 16;
      std::int64_t tokens  = 0;
      for (auto const& f : p.facts) {
        tokens += (static_cast<std::int64_t>(f.token_ids.size()) + 15) / 16;
      }
      std::vector<std::int32_t> const prefix_tokens = m.tokenize(lm::instruction_prefix());
      mc.store.num_pages = tokens + static_cast<std::int64_t>(prefix_tokens.size()) / 16 + 2;
      mc.store.space     = memory_space::host;
      mc.index.dim       = embedder.dimension();
      mc.index.metric    = distance_metric::cosine;
      memory mem{mc};
      mem.set_instruction_prefix(adapter, prefix_tokens, 1, 0);

      encoding_options const eo = variants[wi].o;
      for (encoding_job const& job : plan_encoding(p.conv, p.facts, eo).jobs) {
        for (encoding_branch const& b : job.branches) {
          turns_seen[wi].add(double(b.source_turn - b.first_turn));
        }
      }
      auto const t0 = clock_type::now();
      memory_add_report const rep =
        mem.add_conversation(adapter, embedder, ns, p.conv, p.facts, p.texts, eo);
      double const secs = seconds_since(t0);
      std::fprintf(stderr,
                   "locomo: %s %s: %lld facts encoded in %.1f s (%lld forward tokens, %.0f "
                   "tok/s, %.2f facts/s, %lld jobs)\n",
                   s.id.c_str(),
                   variants[wi].label.c_str(),
                   static_cast<long long>(rep.encode.facts),
                   secs,
                   static_cast<long long>(rep.encode.forward_tokens),
                   double(rep.encode.forward_tokens) / secs,
                   double(rep.encode.facts) / secs,
                   static_cast<long long>(rep.encode.jobs));
      (void)w;
      if (variants[wi].main) {
        encode_seconds += secs;
        encode_tokens += rep.encode.forward_tokens;
        encode_facts += rep.encode.facts;
      }
      // --compression: the served encoding again into one memory per store variant.
      std::vector<std::unique_ptr<memory>> cmem;
      if (variants[wi].main && !opt.compression.empty()) {
        if (fidelity.empty()) {
          fidelity.push_back({"float32 (served)"});
          for (lc::store_variant const& v : opt.compression) {
            fidelity.push_back({v.name});
          }
          fidelity[1].reference = true;
        }
        std::vector<memory const*> all_mem{&mem};
        for (lc::store_variant const& v : opt.compression) {
          memory_config vc     = mc;
          vc.store.store_dtype = v.store_dtype;
          vc.store.compression = v.compression;
          cmem.push_back(std::make_unique<memory>(vc));
          cmem.back()->set_instruction_prefix(adapter, prefix_tokens, 1, 0);
          auto const tc = clock_type::now();
          cmem.back()->add_conversation(adapter, embedder, ns, p.conv, p.facts, p.texts, eo);
          std::fprintf(stderr,
                       "locomo: %s %s: encoded into the %s store in %.1f s\n",
                       s.id.c_str(),
                       variants[wi].label.c_str(),
                       v.name.c_str(),
                       seconds_since(tc));
          all_mem.push_back(cmem.back().get());
        }
        for (std::size_t vi = 0; vi < all_mem.size(); ++vi) {
          kv_store const& st      = all_mem[vi]->store();
          fidelity[vi].page_bytes = static_cast<std::int64_t>(st.page_bytes());
          fidelity_bytes[vi] += double(st.namespace_pages(ns)) * double(st.page_bytes());
          fidelity_facts[vi] += st.namespace_facts(ns);
          fidelity[vi].bytes_per_fact = fidelity_bytes[vi] / double(fidelity_facts[vi]);
        }
      }

      for (std::size_t qi = 0; qi < qs.size(); ++qi) {
        lm::question const& q = *qs[qi];
        per_question& x       = pq[qi];
        if (wi == 0) {
          x.q                                  = m.tokenize(lm::question_turn(q.text));
          x.gold                               = ev.answer_tokens(q.answer);
          auto const tr                        = clock_type::now();
          std::vector<std::uint64_t> const top = mem.retrieve(embedder, ns, q.text, 20);
          retrieve_s.add(seconds_since(tr));
          x.ids.assign(top.begin(), top.begin() + std::min<std::size_t>(opt.k, top.size()));
          if (!q.evidence.empty()) {
            for (std::size_t kk : {5, 10, 20}) {
              double const r = evidence_recall(top, kk, fact_index, p.fact_turns, q.evidence);
              auto& table    = kk == 5 ? recall5 : kk == 10 ? recall10 : recall20;
              table[q.category].add(r);
              table[0].add(r);
            }
          }
          // (b) the same facts' text, best last as in the composition; (c) no memory; (d) all.
          composition const plan = mem.prepare(x.ids, 0);
          x.b                    = ev.prefill(plan.token_ids, x.q, x.gold);
          x.c                    = ev.prefill(prefix_tokens, x.q, x.gold);
          if (full_fits) { x.d = ev.prefill(full, x.q, x.gold); }
        }
        bool const scored = q.category != 5 && !q.answer.empty();
        answer_run a;
        for (std::size_t ri = 0; ri < opt.recompute.size(); ++ri) {
          answer_run const ar = ev.injected(mem, x.ids, x.q, x.gold, opt.recompute[ri]);
          curve_cell& cell    = curve[wi][ri];
          for (std::size_t j = 0; j < ar.dists.size(); ++j) {
            auto const [klb, t1b] = kl_top1(x.b.dists[j], ar.dists[j]);
            cell.kl_b.add(klb);
            cell.top1_b.add(t1b ? 1 : 0);
            if (full_fits) {
              auto const [kld, t1d] = kl_top1(x.d.dists[j], ar.dists[j]);
              cell.kl_d.add(kld);
              cell.top1_d.add(t1d ? 1 : 0);
            }
          }
          if (scored) { cell.f1.add(lm::token_f1(ar.text, q.answer)); }
          cell.exact_b.add(ar.text == x.b.text ? 1 : 0);
          cell.ttft.add(ar.ttft * 1e3);
          cell.recomputed.add(ar.recomputed);
          if (ri == served_rho) { a = ar; }
        }
        if (variants[wi].main) {
          for (int cat : {0, q.category}) {
            count[cat].add(1);
            if (scored) {
              f1a[cat].add(lm::token_f1(a.text, q.answer));
              f1b[cat].add(lm::token_f1(x.b.text, q.answer));
              f1c[cat].add(lm::token_f1(x.c.text, q.answer));
              if (full_fits) { f1d[cat].add(lm::token_f1(x.d.text, q.answer)); }
            }
            agree_exact[cat].add(a.text == x.b.text ? 1 : 0);
            agree_f1[cat].add(lm::token_f1(a.text, x.b.text));
            ttft_a[cat].add(a.ttft * 1e3);
            inject_a[cat].add(a.inject * 1e3);
            ttft_b[cat].add(x.b.ttft * 1e3);
          }
          if (opt.mode == "fast" || std::getenv("INFERSCALE_LOCOMO_VERBOSE")) {
            std::fprintf(stderr,
                         "  Q (cat %d) %s\n    gold: %s\n    (a) %s\n    (b) %s\n    (c) %s\n",
                         q.category,
                         q.text.c_str(),
                         q.answer.c_str(),
                         a.text.c_str(),
                         x.b.text.c_str(),
                         x.c.text.c_str());
          }
        }
        if (!cmem.empty()) {
          // The same facts from every store, no recompute: the stores' precision alone.
          answer_run const f32 =
            opt.served_recompute == 0 ? a : ev.injected(mem, x.ids, x.q, x.gold, 0);
          answer_run const ref = ev.injected(*cmem[0], x.ids, x.q, x.gold, 0);
          fidelity[0].add(ref.dists, f32.dists, f32.text == ref.text);
          fidelity[1].add(ref.dists, ref.dists, true);
          for (std::size_t vi = 1; vi < cmem.size(); ++vi) {
            answer_run const got = ev.injected(*cmem[vi], x.ids, x.q, x.gold, 0);
            fidelity[vi + 1].add(ref.dists, got.dists, got.text == ref.text);
            if (opt.mode == "fast" || std::getenv("INFERSCALE_LOCOMO_VERBOSE")) {
              std::fprintf(
                stderr, "    [%s] %s\n", opt.compression[vi].name.c_str(), got.text.c_str());
            }
          }
        }
      }
    }
  }
  if (count[0].n == 0) {
    std::fprintf(stderr, "locomo: no question was evaluated (check --conversations)\n");
    return 1;
  }

  std::printf(
    "## LoCoMo end to end: SmolLM2-135M-Instruct (llama.cpp, CPU, 1 thread), "
    "all-MiniLM-L6-v2 retrieval\n\n");
  if (opt.served_recompute > 0) {
    std::printf(
      "(a) is served with %d%% of its fact tokens recomputed in context after injection "
      "(the recompute curve below).\n\n",
      opt.served_recompute);
  }
  std::printf(
    "Facts encoded with context-window encoding at w = %lld (single pass, branched); "
    "answers from the top %u facts; greedy, at most %d new tokens. (a) injected fact "
    "KV, (b) the same facts' text re-prefilled (same prompt token ids), (c) no memory, "
    "(d) the whole conversation prefilled (%s).\n\n",
    static_cast<long long>(main_w),
    opt.k,
    opt.max_new,
    !opt.whole ? "not run: --no-whole"
    : f1d[0].n ? "it fits the context"
               : "does not fit the 8192-token context: n/a");
  std::printf(
    "| category | questions | recall@5 | recall@10 | recall@20 | F1 (a) | F1 (b) | F1 (c) "
    "| F1 (d) | (a)=(b) exact | F1(a, b) | TTFT (a) ms | of it inject ms | TTFT (b) ms |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int cat : {1, 2, 3, 4, 5, 0}) {
    if (!count.count(cat)) { continue; }
    std::printf("| %s | %lld | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
                cat == 0 ? "**all**" : lm::category_name(cat),
                static_cast<long long>(count[cat].n),
                fmt(recall5[cat]).c_str(),
                fmt(recall10[cat]).c_str(),
                fmt(recall20[cat]).c_str(),
                fmt(f1a[cat]).c_str(),
                fmt(f1b[cat]).c_str(),
                fmt(f1c[cat]).c_str(),
                fmt(f1d[cat]).c_str(),
                fmt(agree_exact[cat]).c_str(),
                fmt(agree_f1[cat]).c_str(),
                fmt(ttft_a[cat], "%.0f").c_str(),
                fmt(inject_a[cat], "%.0f").c_str(),
                fmt(ttft_b[cat], "%.0f").c_str());
  }
  std::printf(
    "\nF1: LoCoMo's token F1 (lower case, punctuation and a/an/the/and removed; no "
    "stemming) against the gold answers of categories 1-4 (category 5 has none). "
    "Retrieval (MiniLM embedding + search) %.1f ms per question, the same for (a) and "
    "(b). TTFT ratio (b)/(a): %.2fx.\n",
    retrieve_s.mean() * 1e3,
    ttft_b[0].mean() / ttft_a[0].mean());
  std::printf(
    "Encoding at w = %lld: %lld facts, %lld forward tokens in %.1f s: %.0f tokens/s, "
    "%.2f facts/s.\n\n",
    static_cast<long long>(main_w),
    static_cast<long long>(encode_facts),
    static_cast<long long>(encode_tokens),
    encode_seconds,
    double(encode_tokens) / encode_seconds,
    double(encode_facts) / encode_seconds);
  std::printf(
    "### Window curve: (a) injected vs (b) text re-prefill and (d) whole conversation\n\n");
  std::printf(
    "Next-token distributions over the gold answer tokens (teacher-forced), "
    "categories 1-4. The first row is the served encoding of the table above.\n\n");
  std::printf(
    "| encoding | w | turns seen per fact (mean) | KL(b ‖ a) nats | top-1 (a)=(b) | "
    "KL(d ‖ a) nats | top-1 (a)=(d) | F1 (a) | F1 (b) | F1 (d) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (std::size_t i = 0; i < variants.size(); ++i) {
    curve_cell const& c = curve[i][served_rho];
    std::printf("| %s | %lld | %s | %s | %s | %s | %s | %s | %s | %s |\n",
                variants[i].label.c_str(),
                static_cast<long long>(variants[i].o.window),
                fmt(turns_seen[i], "%.1f").c_str(),
                fmt(c.kl_b).c_str(),
                fmt(c.top1_b).c_str(),
                fmt(c.kl_d).c_str(),
                fmt(c.top1_d).c_str(),
                fmt(c.f1).c_str(),
                fmt(f1b[0]).c_str(),
                fmt(f1d[0]).c_str());
  }
  if (opt.recompute.size() > 1 || opt.recompute[0] != 0) {
    std::printf(
      "\n### Recompute curve: (a) with a share of its fact tokens recomputed in context\n\n");
    std::printf(
      "After injection, the fact tokens of the largest layer-1 K/V deviation (a probe of "
      "the memory's text through layers 0-1) are decoded again with the whole memory in "
      "place (recompute.hpp, llama_recompute.hpp, one batch). KL and top-1 against (b) "
      "over the gold answer tokens, categories 1-4; (a)=(b): the same greedy answer, "
      "every category; TTFT (a) includes probe and recompute; TTFT (b) %s ms.\n\n",
      fmt(ttft_b[0], "%.0f").c_str());
    std::printf(
      "| encoding | recompute %% | recomputed (mean) | KL(b ‖ a) nats | top-1 (a)=(b) | "
      "(a)=(b) exact | F1 (a) | F1 (b) | TTFT (a) ms |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    for (std::size_t i = 0; i < variants.size(); ++i) {
      for (std::size_t ri = 0; ri < opt.recompute.size(); ++ri) {
        curve_cell const& c = curve[i][ri];
        std::printf("| %s | %d | %s | %s | %s | %s | %s | %s | %s |\n",
                    variants[i].label.c_str(),
                    opt.recompute[ri],
                    fmt(c.recomputed).c_str(),
                    fmt(c.kl_b).c_str(),
                    fmt(c.top1_b).c_str(),
                    fmt(c.exact_b).c_str(),
                    fmt(c.f1).c_str(),
                    fmt(f1b[0]).c_str(),
                    fmt(c.ttft, "%.0f").c_str());
      }
    }
  }
  // A broken path shows as a missing or non-finite figure: fail then, do not print a table of NaN.
  for (std::size_t i = 0; i < variants.size(); ++i) {
    for (std::size_t ri = 0; ri < opt.recompute.size(); ++ri) {
      curve_cell const& c = curve[i][ri];
      if (c.kl_b.n == 0 || !std::isfinite(c.kl_b.mean()) || c.f1.n == 0) {
        std::fprintf(stderr,
                     "locomo: %s (recompute %d%%) produced no finite KL or F1\n",
                     variants[i].label.c_str(),
                     opt.recompute[ri]);
        return 1;
      }
    }
  }
  if (f1b[0].n == 0 || f1c[0].n == 0 || ttft_a[0].n != count[0].n) {
    std::fprintf(stderr, "locomo: a baseline produced no answers\n");
    return 1;
  }
  if (!opt.compression.empty()) {
    std::printf("\n### Compressed facts: the served encoding from each store against bfloat16\n\n");
    std::printf(
      "The same top-%u facts of every question injected (no recompute) from a memory per store, "
      "each encoded at w = %lld as above; KL(bf16 ‖ store) and top-1 of the next-token "
      "distributions over the gold answer tokens (teacher-forced, the categories with an "
      "answer); greedy answers (at most %d tokens) of every question compared with the bfloat16 "
      "store's; bytes per fact: the store pages the compared facts take (the prefix excluded). "
      "fp8_e4m3 and int4 are dequantized to bfloat16.\n\n",
      opt.k,
      static_cast<long long>(main_w),
      opt.max_new);
    if (fidelity.empty() || !lc::print_fidelity_table(fidelity, fidelity[1])) {
      std::fprintf(stderr, "locomo: --compression produced no complete figures\n");
      return 1;
    }
    for (lc::fidelity_row const& r : fidelity) {
      double const target = r.name == "fp8_e4m3" ? 0.01 : r.name == "int4" ? 0.05 : 0;
      if (target > 0) {
        std::printf("\n%s: KL mean %.5f nats (target <= %.2f: %s), %.2fx fewer bytes than bf16",
                    r.name.c_str(),
                    r.kl_mean(),
                    target,
                    r.kl_mean() <= target ? "met" : "NOT met",
                    fidelity[1].bytes_per_fact / r.bytes_per_fact);
      }
    }
    std::printf("\n");
  }
  return 0;
}

int retrieval_mode(lc::model const& m, std::vector<lm::sample> const& samples)
{
  lc::model embed_model{lc::minilm_path()};
  lc::embedder embedder{embed_model};
  index_config ic;
  ic.dim    = embedder.dimension();
  ic.metric = distance_metric::cosine;
  graph_index index{ic};
  std::map<int, tally> r5, r10, r20, ceiling;
  std::int64_t questions = 0, without = 0, facts = 0;
  auto const t0 = clock_type::now();
  for (std::size_t si = 0; si < samples.size(); ++si) {
    prepared const p = prepare(m, samples[si], si + 1, 0, 1000000 * (si + 1));
    std::vector<float> rows;
    std::vector<std::uint64_t> ids;
    std::map<std::uint64_t, std::size_t> fact_index;
    for (std::size_t i = 0; i < p.facts.size(); ++i) {
      std::vector<float> const v = embedder.embed(p.texts[i]);
      rows.insert(rows.end(), v.begin(), v.end());
      ids.push_back(p.facts[i].fact_id);
      fact_index[p.facts[i].fact_id] = i;
    }
    facts += static_cast<std::int64_t>(ids.size());
    index.add<float>(
      si + 1,
      make_matrix_view<float const>(rows.data(), static_cast<std::int64_t>(ids.size()), ic.dim),
      cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
    std::set<std::int64_t> cited;  // turns any fact of the conversation cites
    for (auto const& turns : p.fact_turns) {
      cited.insert(turns.begin(), turns.end());
    }
    for (lm::question const* q : p.questions) {
      ++questions;
      if (q->evidence.empty()) {
        ++without;
        continue;
      }
      std::vector<float> const v = embedder.embed(q->text);
      std::vector<std::uint64_t> top(20);
      std::vector<float> dist(20);
      std::uint64_t const ns = si + 1;
      inferscale::search<float>(index,
                                make_matrix_view<float const>(v.data(), 1, ic.dim),
                                cuda::std::span<std::uint64_t const>{&ns, 1},
                                20,
                                search_params{},
                                make_matrix_view<std::uint64_t>(top.data(), 1, 20),
                                make_matrix_view<float>(dist.data(), 1, 20));
      std::int64_t citable = 0;
      for (std::int64_t t : q->evidence) {
        citable += cited.count(t) ? 1 : 0;
      }
      for (int cat : {0, q->category}) {
        ceiling[cat].add(double(citable) / double(q->evidence.size()));
        r5[cat].add(evidence_recall(top, 5, fact_index, p.fact_turns, q->evidence));
        r10[cat].add(evidence_recall(top, 10, fact_index, p.fact_turns, q->evidence));
        r20[cat].add(evidence_recall(top, 20, fact_index, p.fact_turns, q->evidence));
      }
    }
  }
  std::printf("## LoCoMo retrieval: all-MiniLM-L6-v2 (llama.cpp) over the observation facts\n\n");
  std::printf(
    "%zu conversations, %lld facts indexed (one namespace each), %lld questions (%lld "
    "without usable evidence left out); %.1f s. Evidence recall@k: the share of a "
    "question's evidence turns cited by the top-k facts; ceiling: the share cited by "
    "any fact of the conversation (the observations do not cover every turn).\n\n",
    samples.size(),
    static_cast<long long>(facts),
    static_cast<long long>(questions),
    static_cast<long long>(without),
    seconds_since(t0));
  std::printf(
    "| category | questions | recall@5 | recall@10 | recall@20 | ceiling |\n"
    "|---|---|---|---|---|---|\n");
  for (int cat : {1, 2, 3, 4, 5, 0}) {
    std::printf("| %s | %lld | %s | %s | %s | %s |\n",
                cat == 0 ? "**all**" : lm::category_name(cat),
                static_cast<long long>(r5[cat].n),
                fmt(r5[cat]).c_str(),
                fmt(r10[cat]).c_str(),
                fmt(r20[cat]).c_str(),
                fmt(ceiling[cat]).c_str());
  }
  return 0;
}

// ------------------------------------------------------------------------------------------------
// --step: retrieval inside the serving step (issue 32, item 3)
//
// One memory holds C served users (the chosen conversations, all their sessions unless
// --sessions cuts them: facts encoded alone behind the prefix, w = 0, MiniLM embeddings indexed)
// and U - C index-only users: namespaces of synthetic 384-d facts (sizes n = clamp(round(exp(ln
// 100 + z)), 50, 5000), z ~ N(0, 1) from std::mt19937_64(20261205), as bench_index_tenants;
// each user's vectors a Gaussian mixture of 1 + n / 50 centres), added to the memory's index
// only: they are never served, so their K/V is not stored (a request reads only its own facts'
// K/V; their presence is the index's, whose rows then fill far more than the cache). The
// requests are the served conversations' questions, taken in turn from each conversation. A
// step of B requests runs what serve_step does, phase by phase and timed apart: the B question
// embeddings (MiniLM, one batched forward: embedder::embed(texts)), one batched `search` (each
// query in its namespace, the memory's search parameters), the B compositions (`prepare`, prefix +
// top k), the B injections into llama.cpp sequences 0 .. B-1 (`inject`: llama.cpp's sequences are
// separate state blobs, so each is injected alone, as serve() does); then the engine's prefill of
// the B questions
// (`decode_step`: the sequences packed into n_batch = 2,048-token batches, one thread, as the
// other modes) to each one's first token. Every request of a step waits for the whole step, so
// its TTFT is the step's time, and the retrieval share is (embed + search + compose + inject) /
// the step's time.

int step_mode(lc::model const& m, std::vector<lm::sample> const& samples, run_options const& opt)
{
  lc::model embed_model{lc::minilm_path()};
  lc::embedder embedder{embed_model};
  std::int64_t const max_batch = *std::max_element(opt.batches.begin(), opt.batches.end());
  lc::context_options co;
  co.n_ctx        = 32768;
  co.n_batch      = 2048;
  co.n_threads    = 1;
  co.n_seq_max    = static_cast<std::uint32_t>(max_batch) + 1;
  co.n_branch_seq = 0;
  lc::context ctx{m, co};
  lc::model_adapter adapter{ctx};

  std::set<std::string> wanted(opt.conversations.begin(), opt.conversations.end());
  bool const all = wanted.count("all") != 0;
  std::vector<prepared> served;
  std::uint64_t ns = 0;
  for (lm::sample const& s : samples) {
    ++ns;
    if (!all && !wanted.count(s.id)) { continue; }
    prepared p = prepare(m, s, ns, opt.sessions, 1000 + 100000 * ns);
    if (!p.facts.empty() && !p.questions.empty()) { served.push_back(std::move(p)); }
  }
  if (served.empty()) { throw std::runtime_error("--step: no conversation chosen"); }
  auto const C = static_cast<std::int64_t>(served.size());
  if (opt.users < C) {
    throw std::runtime_error("--step: --users " + std::to_string(opt.users) + " is below the " +
                             std::to_string(C) + " served conversations");
  }

  std::vector<std::int32_t> const prefix_tokens = m.tokenize(lm::instruction_prefix());
  memory_config mc;
  mc.store.model       = ctx.geometry();
  mc.store.store_dtype = dtype::float32;
  mc.store.page_size   = 16;
  std::int64_t pages   = static_cast<std::int64_t>(prefix_tokens.size()) / 16 + 2;
  std::int64_t facts   = 0;
  for (prepared const& p : served) {
    for (auto const& f : p.facts) {
      pages += (static_cast<std::int64_t>(f.token_ids.size()) + 15) / 16;
      ++facts;
    }
  }
  mc.store.num_pages = pages;
  mc.store.space     = memory_space::host;
  mc.index.dim       = embedder.dimension();
  mc.index.metric    = distance_metric::cosine;
  memory mem{mc};
  mem.set_instruction_prefix(adapter, prefix_tokens, 1, 0);
  encoding_options eo;
  eo.window        = 0;
  eo.strategy      = encoding_strategy::per_fact;
  auto const t_add = clock_type::now();
  for (prepared const& p : served) {
    mem.add_conversation(
      adapter, embedder, p.facts.front().namespace_id, p.conv, p.facts, p.texts, eo);
  }
  double const add_s = seconds_since(t_add);

  // the index-only users
  std::mt19937_64 size_rng{20261205};
  std::normal_distribution<double> normal;
  std::int64_t background_facts = 0;
  auto const t_bg               = clock_type::now();
  std::vector<std::uint64_t> ids;
  for (std::int64_t u = 0; u < opt.users - C; ++u) {
    double const x = std::round(std::exp(std::log(100.0) + normal(size_rng)));
    auto const n   = static_cast<std::int64_t>(std::clamp(x, 50.0, 5000.0));
    test::gaussian_mixture mix{
      test::mixture_spec{mc.index.dim, 1 + n / 50, true, 20261205 + static_cast<std::uint64_t>(u)}};
    std::vector<float> const rows = mix.draw(n);
    ids.resize(static_cast<std::size_t>(n));
    std::iota(ids.begin(),
              ids.end(),
              std::uint64_t{1} << 40 | static_cast<std::uint64_t>(background_facts));
    mem.index().add(std::uint64_t{1} << 32 | static_cast<std::uint64_t>(u),
                    make_matrix_view<float const>(rows.data(), n, mc.index.dim),
                    cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
    background_facts += n;
  }
  double const bg_s = seconds_since(t_bg);
  std::fprintf(stderr,
               "locomo --step: %lld served users (%lld facts, encoded and indexed in %.1f s), "
               "%lld index-only users (%lld facts, indexed in %.1f s)\n",
               static_cast<long long>(C),
               static_cast<long long>(facts),
               add_s,
               static_cast<long long>(opt.users - C),
               static_cast<long long>(background_facts),
               bg_s);

  // the requests: each conversation's questions in turn
  struct request {
    std::uint64_t ns;
    std::string text;
    std::vector<std::int32_t> tokens;
  };
  std::vector<request> pool;
  for (std::size_t i = 0; pool.size() < static_cast<std::size_t>(opt.requests); ++i) {
    bool any = false;
    for (prepared const& p : served) {
      if (i < p.questions.size() && pool.size() < static_cast<std::size_t>(opt.requests)) {
        pool.push_back({p.facts.front().namespace_id,
                        p.questions[i]->text,
                        m.tokenize(lm::question_turn(p.questions[i]->text))});
        any = true;
      }
    }
    if (!any) { break; }
  }

  std::printf(
    "## Retrieval inside the serving step: %lld users, LoCoMo questions, SmolLM2 "
    "(llama.cpp, CPU, 1 thread), MiniLM\n\n",
    static_cast<long long>(opt.users));
  std::printf(
    "%lld served users (%lld facts, K/V stored), %lld index-only users (%lld facts); "
    "%lld facts indexed in all. Top %u facts per request behind the instruction prefix. "
    "Per request (ms, mean over %zu requests): the phases of retrieval and composition, "
    "and the engine's prefill of the step's questions to their first tokens per request; "
    "step = the whole step's wall time (each request's TTFT, p50 over steps).\n\n",
    static_cast<long long>(C),
    static_cast<long long>(facts),
    static_cast<long long>(opt.users - C),
    static_cast<long long>(background_facts),
    static_cast<long long>(facts + background_facts),
    opt.k,
    pool.size());
  std::printf(
    "| B | embed | search | compose | inject | retrieval + composition | prefill | "
    "step p50 (TTFT) | share of TTFT | share without the embedder |\n"
    "|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<sequence_cache_ptr> caches;
  for (std::int64_t b = 0; b < max_batch; ++b) {
    caches.push_back(std::make_unique<lc::sequence_cache>(ctx, static_cast<std::int32_t>(b)));
  }
  auto const rotation = adapter.rotation();
  for (std::int64_t B : opt.batches) {
    tally embed_t, search_t, compose_t, inject_t, prefill_t;
    std::vector<double> step_t;
    std::int64_t served_requests = 0;
    for (std::size_t first = 0; first < pool.size(); first += static_cast<std::size_t>(B)) {
      std::size_t const count = std::min(static_cast<std::size_t>(B), pool.size() - first);
      for (std::size_t i = 0; i < count; ++i) {
        ctx.clear(static_cast<std::int32_t>(i));
      }
      auto const t0 = clock_type::now();
      std::vector<float> queries;
      std::vector<std::uint64_t> namespaces;
      std::vector<std::string> texts;
      for (std::size_t i = 0; i < count; ++i) {
        texts.push_back(pool[first + i].text);
        namespaces.push_back(pool[first + i].ns);
      }
      for (std::vector<float> const& v : embedder.embed(texts)) {  // one forward per step
        queries.insert(queries.end(), v.begin(), v.end());
      }
      auto const t1 = clock_type::now();
      std::vector<std::uint64_t> top(count * opt.k);
      std::vector<float> dist(top.size());
      inferscale::search<float>(
        mem.index(),
        make_matrix_view<float const>(
          queries.data(), static_cast<std::int64_t>(count), mc.index.dim),
        cuda::std::span<std::uint64_t const>{namespaces.data(), count},
        opt.k,
        mem.config().search,
        make_matrix_view<std::uint64_t>(top.data(), static_cast<std::int64_t>(count), opt.k),
        make_matrix_view<float>(dist.data(), static_cast<std::int64_t>(count), opt.k));
      auto const t2 = clock_type::now();
      std::vector<composition> plans;
      for (std::size_t i = 0; i < count; ++i) {
        std::vector<std::uint64_t> got;
        for (std::uint32_t j = 0; j < opt.k; ++j) {
          if (top[i * opt.k + j] != invalid_fact_id) { got.push_back(top[i * opt.k + j]); }
        }
        plans.push_back(mem.prepare(got, 0));
      }
      auto const t3 = clock_type::now();
      for (std::size_t i = 0; i < count; ++i) {
        mem.inject(plans[i], *caches[i], rotation);
      }
      auto const t4 = clock_type::now();
      std::vector<std::vector<std::int32_t>> tokens;
      std::vector<std::int64_t> positions;
      std::vector<std::int32_t> seqs;
      for (std::size_t i = 0; i < count; ++i) {
        tokens.push_back(pool[first + i].tokens);
        positions.push_back(plans[i].length());
        seqs.push_back(static_cast<std::int32_t>(i));
      }
      std::vector<std::int32_t> const firsts = ctx.decode_step(tokens, positions, seqs);
      auto const t5                          = clock_type::now();
      if (firsts.size() != count) { throw std::runtime_error("--step: first tokens missing"); }
      auto const d = [](clock_type::time_point a, clock_type::time_point b) {
        return std::chrono::duration<double>(b - a).count();
      };
      double const per = 1e3 / static_cast<double>(count);
      embed_t.add(d(t0, t1) * per);
      search_t.add(d(t1, t2) * per);
      compose_t.add(d(t2, t3) * per);
      inject_t.add(d(t3, t4) * per);
      prefill_t.add(d(t4, t5) * per);
      step_t.push_back(d(t0, t5) * 1e3);
      served_requests += static_cast<std::int64_t>(count);
    }
    std::vector<double> sorted = step_t;
    std::sort(sorted.begin(), sorted.end());
    double const retrieval = embed_t.mean() + search_t.mean() + compose_t.mean() + inject_t.mean();
    double const total     = retrieval + prefill_t.mean();
    std::printf("| %lld | %.3f | %.4f | %.3f | %.3f | %.3f | %.2f | %.1f | %.1f%% | %.2f%% |\n",
                static_cast<long long>(B),
                embed_t.mean(),
                search_t.mean(),
                compose_t.mean(),
                inject_t.mean(),
                retrieval,
                prefill_t.mean(),
                sorted[sorted.size() / 2],
                100.0 * retrieval / total,
                100.0 * (retrieval - embed_t.mean()) / total);
    std::fflush(stdout);
    (void)served_requests;
  }
  std::printf(
    "\nPhase means are per request over steps of B (a step's phase time / B). "
    "Shares: of the request's whole time (retrieval + composition + prefill). The "
    "search used search_params::threads = %u (0: one thread per core); the embedder and the "
    "engine one thread each.\n",
    mem.config().search.threads);
  return 0;
}

}  // namespace

int main(int argc, char** argv)
{
  run_options opt;
  std::set<std::string> given;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    given.insert(a);
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) { throw std::runtime_error(a + " needs a value"); }
      return argv[++i];
    };
    try {
      if (a == "--count" || a == "--fast" || a == "--full" || a == "--retrieval" || a == "--step") {
        opt.mode = a.substr(2);
      } else if (a == "--conversations") {
        opt.conversations = split(value(), ',');
      } else if (a == "--sessions") {
        opt.sessions = std::stoi(value());
      } else if (a == "--questions") {
        opt.questions = std::stoi(value());
      } else if (a == "--windows") {
        opt.windows.clear();
        for (auto const& w : split(value(), ',')) {
          opt.windows.push_back(std::stoll(w));
        }
      } else if (a == "--main-window") {
        opt.main_window = std::stoll(value());
      } else if (a == "--no-whole") {
        opt.whole = false;
      } else if (a == "--recompute") {
        opt.recompute.clear();
        for (auto const& r : split(value(), ',')) {
          opt.recompute.push_back(std::stoi(r));
        }
      } else if (a == "--served-recompute") {
        opt.served_recompute = std::stoi(value());
      } else if (a == "--users") {
        opt.users = std::stoll(value());
      } else if (a == "--requests") {
        opt.requests = std::stoll(value());
      } else if (a == "--batches") {
        opt.batches.clear();
        for (auto const& b : split(value(), ',')) {
          opt.batches.push_back(std::stoll(b));
        }
      } else if (a == "--compression") {
        opt.compression = lc::compression_variants(value());
      } else if (a == "--k") {
        opt.k = static_cast<std::uint32_t>(std::stoul(value()));
      } else {
        std::fprintf(
          stderr, "locomo_eval: unknown argument '%s' (see the file's header)\n", a.c_str());
        return 2;
      }
    } catch (std::exception const& e) {
      std::fprintf(stderr, "locomo_eval: %s: %s\n", a.c_str(), e.what());
      return 2;
    }
  }
  if (opt.mode.empty()) {
    std::fprintf(stderr,
                 "usage: locomo_eval --count | --retrieval | --fast | --full | --step [options]\n");
    return 2;
  }
  if (opt.mode == "fast") {  // its defaults; options given on the command line win
    if (!given.count("--conversations")) { opt.conversations = {"conv-26"}; }
    if (!given.count("--sessions")) { opt.sessions = 3; }
    if (!given.count("--questions")) { opt.questions = 6; }
    if (!given.count("--windows")) { opt.windows = {0, 20}; }
  }
  if (!opt.compression.empty() && opt.mode != "fast" && opt.mode != "full") {
    std::fprintf(stderr, "locomo_eval: --compression needs --fast or --full\n");
    return 2;
  }
  if (opt.mode == "step" && !given.count("--conversations")) { opt.conversations = {"all"}; }
  if (opt.mode == "step" && !given.count("--k")) { opt.k = 5; }
  for (std::int64_t b : opt.batches) {
    if (b < 1 || b > 255) {
      std::fprintf(
        stderr, "locomo_eval: --batches must be in 1..255, got %lld\n", static_cast<long long>(b));
      return 2;
    }
  }
  if (opt.batches.empty() || opt.users < 1 || opt.requests < 1) {
    std::fprintf(stderr, "locomo_eval: --batches, --users and --requests must be positive\n");
    return 2;
  }
  if (opt.k == 0 || opt.main_window < 0) {
    std::fprintf(stderr, "locomo_eval: --k must be positive and --main-window non-negative\n");
    return 2;
  }
  for (int r : opt.recompute) {
    if (r < 0 || r > 100) {
      std::fprintf(stderr, "locomo_eval: --recompute percents must be in 0..100, got %d\n", r);
      return 2;
    }
  }
  if (opt.recompute.empty() ||
      std::find(opt.recompute.begin(), opt.recompute.end(), opt.served_recompute) ==
        opt.recompute.end()) {
    std::fprintf(stderr,
                 "locomo_eval: --served-recompute %d is not one of --recompute\n",
                 opt.served_recompute);
    return 2;
  }
  try {
    std::string const model_path          = lc::smollm2_path();
    std::vector<lm::sample> const samples = lm::load(lm::default_path());
    llama_backend_init();
    lc::quiet_logs();
    lc::model const m{model_path};
    int const rc = opt.mode == "count"       ? count_mode(m, samples)
                   : opt.mode == "retrieval" ? retrieval_mode(m, samples)
                   : opt.mode == "step"      ? step_mode(m, samples, opt)
                                             : eval_mode(m, samples, opt);
    llama_backend_free();
    return rc;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "locomo_eval: error: %s\n", e.what());
    return 1;
  }
}
