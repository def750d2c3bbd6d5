"""The connector under vLLM's scheduling machinery: chunked prefill, preemption with recompute, and
requests aborted after their memory was loaded. One engine for the module, made small on purpose:
prefill chunks of CHUNK tokens and a KV cache of NUM_BLOCKS blocks, so that a memory request's
prefill spans several steps and four memory requests at once do not fit (vLLM must preempt).

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the tests can look at
the scheduler itself: the connector's per-request state, the block pool, a request mid-prefill.
The memory is the one of test_connector.py (the facts encoded jointly, behind the shared prefix:
Theorem 3's case), captured by this engine (the same chunking as the prefill it is compared with),
held by four users (four salts: their blocks are never shared)."""

import math
import tempfile

import pytest
from caroline import QUESTIONS, joint_memory, query_tokens
from conftest import InProcessEngine

from inferscale_vllm.engine import make_llm

BLOCK = 128  # vLLM CPU's block size (its default; the fixture checks it)
CHUNK = 64  # max_num_batched_tokens: no step computes more than this many tokens
NUM_BLOCKS = 7  # the KV cache (one of them is vLLM's null block): 6 x 128 tokens usable
USERS = ["ana", "bea", "carla", "dora"]
BRIEF = ("Answer in one or two sentences, using only what you know about Caroline from the facts "
         "above, and do not invent anything. ")  # brings a prompt close below 2 blocks
LONG = ("I am organising a surprise weekend for Caroline and I want every detail to fit her life: "
        "her work, her family, her pets, her hobbies, her training schedule, what she likes to read "
        "and to eat. Please think carefully about everything you know about her before you "
        "answer. ")


@pytest.fixture(scope="module")
def setup(model_dir, shared_engine):
    from vllm import SamplingParams

    shared_engine.close()  # one engine at a time
    directory = tempfile.mkdtemp(prefix="inferscale-machinery-")
    engine = InProcessEngine(lambda: make_llm(
        model_dir, directory, max_model_len=4 * BLOCK, enable_chunked_prefill=True,
        max_num_batched_tokens=CHUNK, max_num_seqs=4, num_gpu_blocks_override=NUM_BLOCKS,
        disable_log_stats=False))
    try:
        llm = engine.llm
        core = llm.llm_engine.engine_core.engine_core  # in-process EngineCore
        sched = core.scheduler
        assert sched.block_size == BLOCK, f"vLLM's block size is {sched.block_size}"
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
        mem, tok, facts, _ = joint_memory(llm, directory, USERS)
        print(f"async scheduling: {llm.llm_engine.vllm_config.scheduler_config.async_scheduling}")
        yield {"llm": llm, "tok": tok, "mem": mem, "facts": facts, "sched": sched,
               "connector": sched.connector, "sampling": SamplingParams,
               "loading": sched.connector.loading()}
    finally:
        engine.close()


@pytest.fixture(autouse=True)
def nothing_left_behind(setup):
    """After every test: no request in the scheduler, no per-request state in the connector, and
    every block back in the pool (a block the connector kept would be missing here)."""
    yield
    sched = setup["sched"]
    assert not sched.requests, f"requests left in the scheduler: {list(sched.requests)}"
    state = setup["connector"].request_state()
    assert not any(state.values()), f"the connector still holds state: {state}"
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == NUM_BLOCKS - 1, f"{NUM_BLOCKS - 1 - free} KV blocks were not given back"


def loaded(setup, n, m):
    """The memory tokens the connector loads of an m-token segment in an n-token prompt
    (conftest.expected_loaded: every one where vLLM then computes the rest, in its chunks, as in
    its cold prefill, else the most for which it does)."""
    from conftest import expected_loaded

    return expected_loaded(setup["loading"], n, m)


def params(setup, gen, extra_args=None, ignore_eos=False):
    return setup["sampling"](temperature=0.0, max_tokens=gen, ignore_eos=ignore_eos,
                             extra_args=extra_args)


def run(setup, prompt, sp):
    out = setup["llm"].generate([prompt], sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


def plain(r):
    """The memory request's prompt as plain text: the same tokens, prefilled by vLLM."""
    return {"prompt_token_ids": r["prompt"]["prompt_token_ids"], "cache_salt": "plain"}


def in_scheduler(setup, request_id):
    """The scheduler's Request for an id given to add_request (vLLM appends a suffix)."""
    found = [r for rid, r in setup["sched"].requests.items()
             if rid == request_id or rid.startswith(request_id + "-")]
    return found[0] if found else None


def preemptions(setup) -> float:
    return sum(m.value for m in setup["llm"].get_metrics() if m.name == "vllm:num_preemptions")


def test_chunked_prefill_with_memory_equals_chunked_prefill(setup):
    """The memory segment spans several prefill chunks and so does the query after it: the
    injected run loads the segment (as much of it as vLLM then computes, in its chunks, as in its
    cold chunked prefill: conftest.expected_loaded), vLLM computes the rest chunk by chunk, and the
    greedy tokens and their top logprobs equal vLLM's own (chunked) prefill of the same prompt."""
    llm, mem, tok, sched = setup["llm"], setup["mem"], setup["tok"], setup["sched"]

    def lps(out):
        return [sorted((k, v.logprob) for k, v in step.items()) for step in out.outputs[0].logprobs]

    for i, q in enumerate(["What should I keep in mind about her diet?",
                           "Which city should we travel to, and why?"]):
        r = mem.request("ana", [setup["facts"]["ana"]], query_tokens(tok, LONG + q))
        m, n = r["memory_tokens"], len(r["prompt"]["prompt_token_ids"])
        usable = loaded(setup, n, m)
        assert usable >= BLOCK and n - m > CHUNK and m % BLOCK != 0, (m, n)
        sp = setup["sampling"](temperature=0.0, max_tokens=24, logprobs=3,
                               extra_args=r["extra_args"])
        assert llm.reset_prefix_cache()
        cold = llm.generate([plain(r)], setup["sampling"](temperature=0.0, max_tokens=24,
                                                          logprobs=3), use_tqdm=False)[0]
        want, plain_cached = list(cold.outputs[0].token_ids), cold.num_cached_tokens or 0
        assert plain_cached == 0
        assert llm.reset_prefix_cache()
        # Step by step: after the first step the request is mid-prefill, its memory counted.
        engine = llm.llm_engine
        rid = f"chunked-{i}"
        engine.add_request(rid, r["prompt"], sp)
        engine.step()
        req = in_scheduler(setup, rid)
        assert req is not None and req.num_computed_tokens < n, "the prefill did not need chunks"
        computed = req.num_computed_tokens
        assert computed > usable and (computed - usable) % CHUNK == 0, (
            f"after one step {computed} tokens are computed; expected the {usable} loaded from "
            f"memory plus whole chunks of {CHUNK}")
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
        got, cached = list(final.outputs[0].token_ids), final.num_cached_tokens or 0
        assert cached == usable, f"{q!r}: {cached} tokens reported cached, memory offered {usable}"
        assert got == want, f"{q!r}: injected {tok.decode(got)!r} vs prefill {tok.decode(want)!r}"
        assert lps(final) == lps(cold), f"{q!r}: the top logprobs differ from vLLM's prefill"
        print(f"chunked: {usable} of {m} memory tokens loaded (prompt {n}, chunks of {CHUNK})")


NEAR_TIE = 0.25  # logprob margin within which bf16 batch effects may flip a greedy choice


def test_a_chunked_prompt_is_captured_after_its_last_chunk(setup):
    """Capture while serving under chunked prefill: a prompt of several CHUNK-token steps asks to
    be captured; its capture file appears after the step that computed its last prompt token, not
    before, and holds every prompt token: the hook capture of the same (chunked) forward read back
    (values bit for bit, keys within the rounding bound: capture_check.py)."""
    import os
    import uuid

    from capture_check import (capture_params, check_served_against_hook, hook_and_served,
                               vllm_rotation)

    from inferscale_vllm.serve_capture import capture_path

    llm, mem, tok = setup["llm"], setup["mem"], setup["tok"]
    ids = (mem.store.token_ids(mem.manifest["prefix"]) + mem.store.token_ids(setup["facts"]["ana"])
           + query_tokens(tok, LONG + "Which city should we travel to?"))
    n = len(ids)
    assert n > 3 * CHUNK and n % BLOCK != 0, n
    # Step by step: the file is written in the step whose batch holds the last prompt token.
    engine, rid = llm.llm_engine, "capture-chunked"
    path = capture_path(mem.directory, "chunked-steps", 0)
    engine.add_request(rid, {"prompt_token_ids": ids, "cache_salt": uuid.uuid4().hex},
                       params(setup, 2, capture_params("chunked-steps")))
    steps, captured_at = 0, None
    while engine.has_unfinished_requests():
        req = in_scheduler(setup, rid)
        before = req.num_computed_tokens if req is not None else 0
        engine.step()
        steps += 1
        if captured_at is None:
            if before + CHUNK < n:
                assert not os.path.exists(path), f"captured after {before} of {n} prompt tokens"
            else:
                assert os.path.exists(path), "the last prompt chunk ran and nothing was captured"
                captured_at = steps
    assert captured_at == -(-n // CHUNK) and steps > captured_at, (captured_at, steps)
    os.remove(path)
    hook, served, _ = hook_and_served(llm, ids, mem.directory, "chunked")
    print(check_served_against_hook(hook, served, ids, vllm_rotation(llm), f"chunked by {CHUNK}"))


def test_preempted_memory_requests_recompute_to_greedy_answers(setup):
    """Four memory requests with long generations in a cache that holds three prompts and none of
    their growth: vLLM preempts (counted by its own metric) and recomputes. Every token each
    request generated is the greedy choice of vLLM's own prefill of its prompt and the tokens
    before it (the argmax, or within NEAR_TIE of it), and every request loaded its memory.

    Not asserted: equality with the request run alone. vLLM's CPU decode is not batch-invariant
    (a batch of 3 and a batch of 1 round differently), so a near-tie can flip with or without the
    connector; the run reports how many requests matched their lone run."""
    llm, mem, tok = setup["llm"], setup["mem"], setup["tok"]
    gen = 16
    reqs = [mem.request(u, [setup["facts"][u]], query_tokens(tok, BRIEF + q))
            for u, q in zip(USERS, QUESTIONS)]
    lengths = [len(r["prompt"]["prompt_token_ids"]) for r in reqs]
    # Three prompts fit at once, but not with their answers (each answer opens a block).
    first = sum(math.ceil(n / BLOCK) for n in lengths[:3])
    final = sum(math.ceil((n + gen) / BLOCK) for n in lengths[:3])
    assert first <= NUM_BLOCKS - 1 < final, (lengths, first, final)
    alone = []
    for r in reqs:
        assert llm.reset_prefix_cache()
        alone.append(run(setup, r["prompt"], params(setup, gen, r["extra_args"], True)))
    for (_, cached), r in zip(alone, reqs):
        n = len(r["prompt"]["prompt_token_ids"])
        assert cached == loaded(setup, n, r["memory_tokens"]) > 0, (cached, r["memory_tokens"])
    assert llm.reset_prefix_cache()
    before, loads = preemptions(setup), dict(setup["connector"].counters)
    outs = llm.generate([r["prompt"] for r in reqs],
                        [params(setup, gen, r["extra_args"], True) for r in reqs], use_tqdm=False)
    preempted = preemptions(setup) - before
    after = setup["connector"].counters
    got = [list(out.outputs[0].token_ids) for out in outs]
    print(f"preemptions: {preempted}; loads: {after['loads'] - loads['loads']}, of which after a "
          f"preemption: {after['loads_after_preemption'] - loads['loads_after_preemption']}; "
          f"equal to the lone run: {sum(g == a for g, (a, _) in zip(got, alone))} of {len(reqs)}")
    assert preempted >= 1, "no request was preempted: the test did not test preemption"
    assert after["loads"] - loads["loads"] >= len(reqs), "not every request loaded its memory"
    worst = 0.0
    for r, g in zip(reqs, got):
        user = r["extra_args"]["kv_transfer_params"]["inferscale"]["user"]
        assert len(g) == gen
        ids = r["prompt"]["prompt_token_ids"] + g
        check = setup["sampling"](temperature=0.0, max_tokens=1, prompt_logprobs=1)
        out = llm.generate([{"prompt_token_ids": ids, "cache_salt": f"check-{user}"}], check,
                           use_tqdm=False)[0]
        for j, token in enumerate(g):
            lp = out.prompt_logprobs[len(r["prompt"]["prompt_token_ids"]) + j]
            best = max(v.logprob for v in lp.values())
            margin = best - lp[token].logprob
            worst = max(worst, margin)
            assert margin <= NEAR_TIE, (
                f"{user}: generated token {j} ({tok.decode([token])!r}) is {margin:.3f} below "
                f"the greedy choice of the prefill of the same tokens; generated "
                f"{tok.decode(g)!r}, alone {tok.decode(alone[reqs.index(r)][0])!r}")
    print(f"largest margin below the prefill's greedy choice: {worst:.3f}")


def test_requests_aborted_after_their_load_leave_vllm_serving(setup):
    """Aborted after their memory was loaded: a memory request mid-prefill (alone), then one
    already decoding together with a refused one mid-prefill. The connector forgets each
    (request_finished), their blocks go back, and the next memory request and a plain request
    give the answers they give alone."""
    llm, mem, tok = setup["llm"], setup["mem"], setup["tok"]
    q = query_tokens(tok, LONG + "What instrument does she play?")
    ok = mem.request("bea", [setup["facts"]["bea"]], query_tokens(tok, "Who is Melanie?"))
    text = {"prompt_token_ids": query_tokens(tok, "What is the capital of Portugal?")}
    assert llm.reset_prefix_cache()
    want_ok = run(setup, ok["prompt"], params(setup, 16, ok["extra_args"]))
    want_text = run(setup, text, params(setup, 16))
    assert want_ok[1] >= BLOCK

    engine, connector = llm.llm_engine, setup["connector"]
    assert llm.reset_prefix_cache()
    early = mem.request("ana", [setup["facts"]["ana"]], q)
    engine.add_request("abort-early", early["prompt"], params(setup, 16, early["extra_args"]))
    engine.step()
    c = in_scheduler(setup, "abort-early")
    n = len(early["prompt"]["prompt_token_ids"])
    usable = early["memory_tokens"] // BLOCK * BLOCK
    assert usable < c.num_computed_tokens < n, f"{c.num_computed_tokens}: not mid-prefill"
    assert c.request_id in connector.request_state()["plans"]
    print(f"aborting: memory request mid-prefill at {c.num_computed_tokens}/{n} tokens")
    engine.abort_request(["abort-early"])
    assert in_scheduler(setup, "abort-early") is None
    state = connector.request_state()
    assert not any(state.values()), f"state kept after abort: {state}"
    free = setup["sched"].kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == NUM_BLOCKS - 1, f"{NUM_BLOCKS - 1 - free} blocks not given back after abort"

    assert llm.reset_prefix_cache()
    loaded = mem.request("carla", [setup["facts"]["carla"]], q)
    refused = mem.request("dora", [setup["facts"]["dora"]], q)
    refused_prompt = dict(refused["prompt"], cache_salt="not-the-memory's")  # refused: wrong salt
    engine.add_request("abort-loaded", loaded["prompt"], params(setup, 16, loaded["extra_args"]))
    engine.add_request("abort-refused", refused_prompt, params(setup, 16, refused["extra_args"]))
    n = len(loaded["prompt"]["prompt_token_ids"])
    for _ in range(10):  # until vLLM has scheduled both (the connector has seen both)
        engine.step()
        a, b = in_scheduler(setup, "abort-loaded"), in_scheduler(setup, "abort-refused")
        if a.request_id in connector.request_state()["plans"] and \
                b.request_id in connector.request_state()["refused"]:
            break
    state = connector.request_state()
    assert a.request_id in state["plans"] and b.request_id in state["refused"], state
    assert a.num_computed_tokens >= loaded["memory_tokens"] // BLOCK * BLOCK, "nothing loaded"
    assert b.num_computed_tokens < n and not a.is_finished(), "aborted too late to test an abort"
    print(f"aborting: loaded request at {a.num_computed_tokens}/{n} tokens, refused one at "
          f"{b.num_computed_tokens}/{n}")
    engine.abort_request(["abort-loaded", "abort-refused"])
    assert in_scheduler(setup, "abort-loaded") is None and in_scheduler(setup, "abort-refused") is None
    state = connector.request_state()
    assert not any(state.values()), f"state kept after abort: {state}"
    free = setup["sched"].kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == NUM_BLOCKS - 1, f"{NUM_BLOCKS - 1 - free} blocks not given back after abort"

    assert llm.reset_prefix_cache()
    got_ok = run(setup, ok["prompt"], params(setup, 16, ok["extra_args"]))
    got_text = run(setup, text, params(setup, 16))
    assert got_ok[1] >= BLOCK, f"the next memory request loaded {got_ok[1]} tokens"
    assert got_ok[0] == want_ok[0], f"{tok.decode(got_ok[0])!r} vs {tok.decode(want_ok[0])!r}"
    assert got_text[0] == want_text[0]


def test_the_connector_traces_its_own_work_per_memory_request(setup, tmp_path, monkeypatch):
    """INFERSCALE_VLLM_TRACE (the TTFT breakdown of bench_vllm.py): a memory request gets one
    line per scheduler hook it went through and one per worker load, with the tokens that load
    wrote (those vLLM reports cached); a request without memory, and any request while the
    variable is unset, get none."""
    import json

    from inferscale_vllm.connector import TRACE_ENV

    llm, mem, tok = setup["llm"], setup["mem"], setup["tok"]
    trace = tmp_path / "trace.jsonl"
    r = mem.request("bea", [setup["facts"]["bea"]], query_tokens(tok, "Where does she live?"))
    assert llm.reset_prefix_cache()
    run(setup, r["prompt"], params(setup, 2, r["extra_args"]))  # unset: nothing written
    assert not trace.exists()
    monkeypatch.setenv(TRACE_ENV, str(trace))
    assert llm.reset_prefix_cache()
    _, cached = run(setup, r["prompt"], params(setup, 2, r["extra_args"]))
    run(setup, plain(r), params(setup, 2))  # no memory asked: nothing traced
    monkeypatch.delenv(TRACE_ENV)
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {e["request"] for e in events} == {events[0]["request"]}, events
    hooks = sorted(e["hook"] for e in events if e["side"] == "scheduler")
    assert hooks == ["get_num_new_matched_tokens", "request_finished",
                     "update_state_after_alloc"], hooks
    loads = [e for e in events if e["side"] == "worker"]
    assert len(loads) == 1 and loads[0]["rank"] == [0, 0], loads
    n = len(r["prompt"]["prompt_token_ids"])
    assert loads[0]["tokens"] == loaded(setup, n, r["memory_tokens"]) == cached, (loads, cached)
    assert all(0 <= e["seconds"] < 60 for e in events), events
