// Example: a GPU engine's scheduler step with memory. The facts' pre-RoPE K/V live in a device
// store, the fact index on the host; the engine's paged KV cache is device memory (vLLM
// FlashAttention layout). Per step, one memory::serve_step serves every admitted request: each
// question embedded, one batched search of the users' namespaces, one composition per request
// behind the instruction prefix, and one injection launch on the engine's stream for the whole
// step (nothing waited for); each sequence then commits its memory tokens and the engine prefills
// only the questions, on the same stream.
//
// The engine is played by the adapters of memory/toy_engine.hpp (the CPU quick start's). With
// the same step served from a host store into a host cache as the reference (run and checked
// everywhere: each question's own fact first, every sequence committed), a CUDA device serves it
// from the device store and the device cache must hold the host cache's bytes (exit 1 when not).
// Without a device the program exits 77 after the host half, which CTest reports as skipped
// (examples.gpu_seam). Compiled in CI; the device half has not yet run on a GPU.
//
// usage: example_gpu_seam
#include "toy_engine.hpp"

#include <inferscale/cuda_error.hpp>
#include <inferscale/device_buffer.hpp>
#include <inferscale/memory.cuh>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace inferscale;
using namespace toy;

namespace {

/// A request the scheduler admitted this step: its user, question and sequence.
struct request {
  std::uint64_t user;
  std::string question;
  paged_sequence sequence;
};

/// The deployment of both examples, with its store in `space`: Alice's and Bob's conversations.
memory make_memory(memory_space space, toy_model& model, word_embedder& embedder)
{
  memory_config config;
  config.store.model       = model.geometry();
  config.store.store_dtype = dtype::bfloat16;
  config.store.num_pages   = 64;
  config.store.space       = space;
  config.index.dim         = embedder.dimension();
  config.index.metric      = distance_metric::cosine;
  memory mem{config};
  mem.set_instruction_prefix(model, tokenize("Facts about the user:"), /*id*/ 1, /*ns*/ 0);
  struct user_data {
    std::uint64_t ns;
    std::vector<std::string> turns;
    std::vector<std::string> facts;
  };
  std::vector<user_data> const users{
    {7,
     {"Alice: I adopted a green parrot and named him Kiwi.", "Alice: I work night shifts."},
     {"Alice keeps a parrot named Kiwi.", "Alice works night shifts as a nurse."}},
    {8,
     {"Bob: I am training for the Lisbon marathon.", "Bob: Pasta is my favourite dinner."},
     {"Bob trains for the Lisbon marathon.", "Bob likes pasta for dinner."}},
  };
  for (user_data const& u : users) {
    conversation chat;
    for (std::string const& turn : u.turns) {
      chat.turns.push_back({tokenize(turn), 0});
    }
    std::vector<conversation_fact> facts;
    for (std::size_t i = 0; i < u.facts.size(); ++i) {
      facts.push_back({u.ns * 100 + i, u.ns, tokenize(u.facts[i]), {std::int64_t(i)}});
    }
    mem.add_conversation(model, embedder, u.ns, chat, facts, u.facts, {/*window*/ 1});
  }
  return mem;
}

}  // namespace

int main()
{
  try {
    toy_model model;
    word_embedder embedder;
    checks check{"example_gpu_seam"};
    auto expect = [&](bool ok, std::string const& what) { check.expect(ok, what); };
    struct ask {
      std::uint64_t user;
      std::string question;
      std::vector<std::int32_t> blocks;
    };
    std::vector<ask> const asks{{7, "What is my parrot called?", {5, 2}},
                                {8, "Which marathon am I running?", {1, 3}}};

    // The step from a host store into a host cache first: the reference the device must equal
    // (this half runs everywhere). Every cache element is -100 before the step.
    std::vector<float> const blank(static_cast<std::size_t>(layer_elements), -100.0f);
    memory host_mem = make_memory(memory_space::host, model, embedder);
    std::vector<std::vector<float>> host_layers(num_layers, blank);
    paged_kv_cache const host_cache =
      make_toy_cache({host_layers[0].data(), host_layers[1].data()});
    std::vector<paged_sequence> host_sequences;
    for (ask const& a : asks) {
      host_sequences.emplace_back(host_cache, a.blocks);
    }
    std::vector<memory_step_request<paged_sequence>> host_step;
    for (std::size_t i = 0; i < asks.size(); ++i) {
      host_step.push_back({asks[i].user, asks[i].question, 0, &host_sequences[i]});
    }
    std::vector<memory_request> const expected =
      host_mem.serve_step(embedder, host_step, 2, model.rotation());
    expect(expected.size() == 2 && expected[0].fact_ids.at(0) == 700 &&
             expected[1].fact_ids.at(0) == 800,
           "each question's own fact ranks first");
    for (std::size_t i = 0; i < asks.size(); ++i) {
      expect(host_sequences[i].computed_tokens == expected[i].plan.length(),
             "host sequence " + std::to_string(i) + " committed its memory tokens");
    }
    for (std::int32_t l = 0; l < num_layers; ++l) {
      expect(host_layers[static_cast<std::size_t>(l)] != blank,
             "the host step wrote layer " + std::to_string(l));
    }
    if (!check.passed()) { return 1; }

    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::printf(
        "example_gpu_seam: the host step passed; no CUDA device visible: the device "
        "step is skipped\n");
      return 77;
    }
    cudaStream_t engine_stream{};
    INFERSCALE_CUDA_TRY(cudaStreamCreate(&engine_stream));
    cuda::stream_ref const stream{engine_stream};

    // The engine's paged cache in device memory, and the step's requests.
    std::vector<device_buffer<float>> device_layers;
    std::vector<void*> device_bases;
    for (std::int32_t l = 0; l < num_layers; ++l) {
      device_layers.emplace_back(blank);
      device_bases.push_back(device_layers.back().data());
    }
    paged_kv_cache const cache = make_toy_cache(device_bases);
    std::vector<request> admitted;
    for (ask const& a : asks) {
      admitted.push_back({a.user, a.question, paged_sequence{cache, a.blocks}});
    }
    constexpr std::int64_t max_step_tokens = 128;

    // The README shows this region as written (docs.snippets): not reformatted.
    // clang-format off
    // [snippet:gpu_step]
    memory mem = make_memory(memory_space::device, model, embedder);  // K/V in device memory
    injection_workspace workspace{max_step_tokens};  // device staging, allocated once
    // Per scheduler step: one batched search, one injection launch on the engine's stream.
    std::vector<memory_step_request<paged_sequence>> step;
    for (request& r : admitted) step.push_back({r.user, r.question, /*p0*/ 0, &r.sequence});
    std::vector<memory_request> const served =
      mem.serve_step(embedder, step, /*k*/ 2, model.rotation(), device_context{workspace, stream});
    // [/snippet:gpu_step]
    // clang-format on

    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(engine_stream));
    for (std::size_t i = 0; i < admitted.size(); ++i) {
      std::string const which = "request " + std::to_string(i);
      expect(served[i].fact_ids == expected[i].fact_ids, which + ": the host step's facts");
      expect(served[i].plan.token_ids == expected[i].plan.token_ids, which + ": the host's plan");
      expect(admitted[i].sequence.computed_tokens == served[i].plan.length(),
             which + ": its sequence committed the memory tokens");
    }
    for (std::int32_t l = 0; l < num_layers; ++l) {
      std::vector<float> const device = device_layers[static_cast<std::size_t>(l)].to_host();
      std::vector<float> const& host  = host_layers[static_cast<std::size_t>(l)];
      expect(std::memcmp(device.data(), host.data(), host.size() * sizeof(float)) == 0,
             "layer " + std::to_string(l) + " of the device cache equals the host step's bytes");
    }
    INFERSCALE_CUDA_TRY(cudaStreamDestroy(engine_stream));
    if (!check.passed()) { return 1; }
    std::printf(
      "example_gpu_seam: %zu requests served in one step on the device; the cache "
      "equals the host step's, byte for byte\n",
      admitted.size());
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "example_gpu_seam: %s\n", e.what());
    return 1;
  }
}
