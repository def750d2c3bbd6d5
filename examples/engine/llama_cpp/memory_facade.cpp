// The memory facade (memory.hpp) on the reference engine: one memory object holds the fact store
// and the index; a user's conversation is added once (its facts encoded with context-window
// encoding, each behind the turns before it, branched off one pass over the conversation; their
// MiniLM embeddings indexed), and each question is served by retrieving the user's top facts,
// composing them behind the instruction prefix and injecting their KV into llama.cpp's sequence.
// The engine prefills only the question. Then the fact lifecycle: a corrected turn re-encodes
// the facts whose window held it, a changed fact supersedes the old one, the old one is erased.
//
// usage: example_engine_memory   (models from .ci/engine; INFERSCALE_SMOLLM2_GGUF and
// INFERSCALE_MINILM_GGUF override the paths)

#include "embedder.hpp"
#include "llama_adapter.hpp"
#include "memory_data.hpp"
#include "model_paths.hpp"

#include <inferscale/memory.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace inferscale;
namespace lc   = inferscale::llama_cpp;
namespace demo = inferscale::llama_cpp::demo;

int main()
{
  try {
    llama_backend_init();
    lc::quiet_logs();
    lc::model const smollm{lc::smollm2_path()};
    lc::model const minilm{lc::minilm_path()};
    lc::embedder embedder{minilm};

    lc::context_options co;
    co.n_ctx        = 2048;
    co.n_branch_seq = 8;  // facts branched off one trunk per forward
    lc::context ctx{smollm, co};
    lc::model_adapter model{ctx};

    // One deployment: fp32 fact KV on the host, a cosine index over 384-d MiniLM embeddings.
    memory_config config;
    config.store.model       = ctx.geometry();
    config.store.store_dtype = dtype::float32;
    config.store.num_pages   = 256;
    config.store.space       = memory_space::host;
    config.index.dim         = embedder.dimension();
    config.index.metric      = distance_metric::cosine;
    memory mem{config};
    mem.set_instruction_prefix(model, smollm.tokenize(demo::instruction_prefix), 1, 0);

    // The user's conversation and the facts extracted from it (turn they come from).
    std::uint64_t const user = 7;
    conversation c;
    c.lead = smollm.tokenize(demo::instruction_prefix);
    for (std::string const& turn : demo::conversation) {
      c.turns.push_back({smollm.tokenize(turn + "\n"), 0});
    }
    std::vector<std::int64_t> const source{0, 2, 4, 4, 4};
    std::vector<conversation_fact> facts;
    std::vector<std::string> texts;
    for (std::size_t i = 0; i < source.size(); ++i) {
      facts.push_back({100 + i, user, smollm.tokenize(demo::facts[i]), {source[i]}});
      texts.push_back(demo::facts[i]);
    }
    encoding_options eo;
    eo.window                 = 2;
    eo.strategy               = encoding_strategy::single_pass;
    auto const t0             = std::chrono::steady_clock::now();
    memory_add_report const r = mem.add_conversation(model, embedder, user, c, facts, texts, eo);
    std::printf(
      "added %lld facts for user %llu: %lld forward tokens (one forward per fact "
      "would run %lld) in %.2f s\n",
      static_cast<long long>(r.encode.facts),
      static_cast<unsigned long long>(user),
      static_cast<long long>(r.encode.forward_tokens),
      static_cast<long long>(r.plan.unbranched_tokens),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

    auto ask = [&](std::string const& q) {
      ctx.clear(0);
      lc::sequence_cache cache{ctx, 0};
      auto const t1            = std::chrono::steady_clock::now();
      memory_request const req = mem.serve(embedder, user, q, 2, 0, cache, model.rotation());
      std::vector<std::int32_t> const question = smollm.tokenize(demo::question_turn(q));
      ctx.decode(0, question, req.plan.length());
      double const ttft =
        1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
      std::vector<std::int32_t> answer =
        ctx.generate(0, req.plan.length() + static_cast<std::int64_t>(question.size()), 40);
      if (!answer.empty() && smollm.is_end_of_generation(answer.back())) { answer.pop_back(); }
      std::string text = smollm.detokenize(answer);
      for (char& ch : text) {
        if (ch == '\n') { ch = ' '; }
      }
      std::printf(
        "\nQ: %s\n   retrieved facts %llu, %llu; %lld memory tokens injected; "
        "first token after %.0f ms\nA: %s\n",
        q.c_str(),
        static_cast<unsigned long long>(req.fact_ids.at(0)),
        static_cast<unsigned long long>(req.fact_ids.at(1)),
        static_cast<long long>(req.plan.length()),
        ttft,
        text.c_str());
    };
    for (std::string const& q : demo::questions) {
      ask(q);
    }

    // The fact lifecycle. A turn is corrected: exactly the facts whose window held it are
    // re-encoded over the corrected conversation, every other fact keeps its bytes.
    std::string const corrected =
      "Assistant: Congratulations! How old is Pepper, and how is she "
      "settling in?";
    std::vector<std::uint64_t> const seeing = mem.facts_seeing_turn(r.conversation, 1);
    lifecycle_report const turns =
      mem.update_turns(model, r.conversation, {{1, smollm.tokenize(corrected + "\n")}});
    std::printf("\nturn 1 corrected: %zu facts saw it, %zu re-encoded (%lld forward tokens):",
                seeing.size(),
                turns.reencoded.size(),
                static_cast<long long>(turns.encode.forward_tokens));
    for (std::uint64_t id : turns.reencoded) {
      std::printf(" %llu", static_cast<unsigned long long>(id));
    }
    std::printf("\n");

    // A fact changes: the new version (from turn 4, re-encoded behind its window and re-embedded)
    // supersedes fact 103, which stays in the store for audit but is never retrieved again.
    std::string const moved =
      "Memory: The user's sister Clara moved from Porto to Lisbon this month.\n";
    fact_update change;
    change.fact_id   = 103;
    change.new_id    = 200;  // 103 itself would replace the fact in place
    change.token_ids = smollm.tokenize(moved);
    change.text      = moved;
    mem.update_fact(model, embedder, change);
    std::printf("fact 103 superseded by fact %llu (kept for audit: %s, retrievable: %s)\n",
                static_cast<unsigned long long>(mem.fact(103).superseded_by.value_or(0)),
                mem.store().contains(103) ? "yes" : "no",
                mem.fact(103).retrievable() ? "yes" : "no");
    ask("Where does my sister live now?");
    mem.erase_fact(103);  // the audit record goes; fact 200 still names it as the one it superseded
    std::printf("fact 103 erased: %lld facts left for user %llu\n",
                static_cast<long long>(mem.store().namespace_facts(user)),
                static_cast<unsigned long long>(user));
    llama_backend_free();
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "example_engine_memory: %s\n", e.what());
    return 1;
  }
}
