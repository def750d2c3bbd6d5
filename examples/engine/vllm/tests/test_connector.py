"""The connector inside a real vLLM (CPU build) on SmolLM2: fidelity (Theorem 3), the prefix-cache
isolation of injected blocks, and refusals that fall back to prefill. One engine for the module:
conftest's shared TP = 1 engine (its engine core in this process; test_tp.py reuses it), over a
memory of the facts encoded jointly for users 'caroline' and 'failpoint' (every load for the
latter fails in the worker: INFERSCALE_VLLM_FAIL_LOAD_FOR_USER)."""

import time

import numpy as np
import pytest
import torch

from inferscale_vllm import Rotation, Store, inject
from inferscale_vllm.connector import partial_last_block, rotation_matching_vllm
from inferscale_vllm.encode import capture
from inferscale_vllm.memory import Memory
from inferscale_vllm.tensors import vllm_cpu_cache

from caroline import GEN, QUESTIONS, query_tokens  # noqa: E402


@pytest.fixture(scope="module")
def setup(shared_engine):
    from vllm import SamplingParams

    from conftest import scheduler_connector

    s = shared_engine.get()
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN)
    return dict(s, greedy=greedy, sampling=SamplingParams,
                loading=scheduler_connector(s["llm"]).loading())


def loaded(setup, n, m, recompute=0):
    """The memory tokens the connector loads of an m-token segment in an n-token prompt
    (conftest.expected_loaded: every one where vLLM then computes the rest as in its cold
    prefill, else the most for which it does)."""
    from conftest import expected_loaded

    return expected_loaded(setup["loading"], n, m, recompute)


LOGPROBS = 3  # the top logprobs compared at every generated token


def run(setup, prompt, extra_args=None, logprobs=False):
    sp = setup["sampling"](temperature=0.0, max_tokens=GEN, extra_args=extra_args,
                           logprobs=LOGPROBS if logprobs else None)
    out = setup["llm"].generate([prompt], sp, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    if logprobs:
        lps = [sorted((k, v.logprob) for k, v in step.items()) for step in out.outputs[0].logprobs]
        return tokens, lps, out.num_cached_tokens or 0
    return tokens, out.num_cached_tokens or 0


_PLAIN = {}  # prompt token ids -> vLLM's greedy answer and logprobs (no memory), computed once


def plain_run(setup, ids):
    """vLLM's own prefill of `ids`: its greedy answer and the top logprobs of every token,
    computed once per prompt (the bf16 and float32 Theorem 3 tests and six of the refusals ask
    for the same prompts), with vLLM's prefix cache reset first (a cold prefill)."""
    key = tuple(ids)
    if key not in _PLAIN:
        assert setup["llm"].reset_prefix_cache()
        tokens, lps, _ = run(setup, {"prompt_token_ids": list(key),
                                     "cache_salt": f"plain-{len(_PLAIN)}"}, logprobs=True)
        _PLAIN[key] = (tokens, lps)
    return _PLAIN[key]


def plain_answer(setup, ids):
    return plain_run(setup, ids)[0]


def test_injected_bytes_equal_vllms_own_prefill_writes(setup):
    """The connector's rotation of the captured pre-RoPE keys gives the keys vLLM's own prefill
    handed its cache write, bit for bit (bf16), for every layer, token and head."""
    kv, mem = setup["kv"], setup["mem"]
    L, n, H, D = kv["k"].shape
    llm = setup["llm"]
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    mc = llm.llm_engine.model_config
    hf = mc.hf_config
    params = getattr(hf, "rope_parameters", None) or {"rope_type": "default",
                                                      "rope_theta": hf.rope_theta}
    with set_current_vllm_config(llm.llm_engine.vllm_config):
        rope = get_rope(D, max_position=hf.max_position_embeddings, is_neox_style=True,
                        rope_parameters=params, dtype=torch.bfloat16)
        rot, _table, mode = rotation_matching_vllm(rope, torch.bfloat16, D)
    print(f"rotation rounding matching vLLM's kernel here: {mode}")
    store = Store(L, H, D, "bfloat16", num_pages=(n + 15) // 16 + 1)
    k = torch.from_numpy(kv["k"]).to(torch.bfloat16).contiguous()
    v = torch.from_numpy(kv["v"]).to(torch.bfloat16).contiguous()
    store.insert(1, 0, list(range(n)),
                 k,
                 v)
    blocks = (n + 127) // 128
    caches = {f"model.layers.{l}.self_attn.attn": torch.zeros(blocks, H, 128, 2 * D,
                                                               dtype=torch.bfloat16)
              for l in range(L)}
    names = list(caches)
    inject(store, vllm_cpu_cache(caches, names), rot, [([1], 0, list(range(n)))])
    want_k = torch.from_numpy(kv["k_rotated"]).to(torch.bfloat16)
    want_v = v
    for l, name in enumerate(names):
        cells = caches[name].view(blocks, H, 2, 128 * D)
        kc = cells[:, :, 0].reshape(blocks, H, D, 128).permute(0, 3, 1, 2).reshape(-1, H, D)[:n]
        vc = cells[:, :, 1].reshape(blocks, H, 128, D).permute(0, 2, 1, 3).reshape(-1, H, D)[:n]
        bad = int((kc.view(torch.int16) != want_k[l].view(torch.int16)).sum())
        rel = float((kc.float() - want_k[l].float()).norm() / want_k[l].float().norm())
        vbad = int((vc.view(torch.int16) != want_v[l].view(torch.int16)).sum())
        assert bad == 0, f"layer {l} keys: {bad} of {kc.numel()} differ (relative {rel:.2e}), values {vbad}"
        assert torch.equal(vc.view(torch.int16), want_v[l].view(torch.int16)), f"layer {l} values"


def assert_theorem3(setup, memory, questions=QUESTIONS, preamble="", every_token=False):
    """Every question: the jointly encoded memory injected through the connector gives vLLM's
    prefill of the same prompt bit for bit (the greedy tokens and the top logprobs of every
    token), with the memory's tokens really loaded: as many as conftest.expected_loaded says (at
    least the segment's whole blocks), and with every_token, all of them."""
    tok = setup["tok"]
    for q in questions:
        r = memory.request("caroline", [setup["joint"]], query_tokens(tok, preamble + q))
        m, n = r["memory_tokens"], len(r["prompt"]["prompt_token_ids"])
        usable = loaded(setup, n, m)
        assert m % 128 != 0 and m > 128, "the segment must end inside a block, after the first"
        assert m // 128 * 128 <= usable <= m, (m, usable)
        if every_token:
            assert usable == m, (f"{q!r}: only {usable} of the {m} memory tokens would load "
                                 f"exactly here (query {n - m} tokens, prompt {n}; token "
                                 f"classes {setup['loading']['classes']})")
        plain, plain_lps = plain_run(setup, r["prompt"]["prompt_token_ids"])
        assert setup["llm"].reset_prefix_cache()
        injected, lps, cached = run(setup, r["prompt"], r["extra_args"], logprobs=True)
        assert cached == usable, f"{q!r}: vLLM reports {cached} cached tokens, memory offered {usable}"
        assert injected == plain, (f"{q!r}: injected {tok.decode(injected)!r} vs prefill "
                                   f"{tok.decode(plain)!r}")
        print(f"{q!r}: {cached} of {m} memory tokens loaded (query {n - m}, prompt {n}), "
              f"{len(injected)} tokens generated")
        first = next((i for i, (a, b) in enumerate(zip(lps, plain_lps)) if a != b), None)
        assert first is None, (f"{q!r}: {m - cached} memory tokens recomputed; the top logprobs "
                               f"of token {first} differ from vLLM's prefill: {lps[first]} vs "
                               f"{plain_lps[first]}")


def test_theorem3_greedy_tokens_equal_prefill(setup):
    """Memory encoded jointly, bf16 store (vLLM's own dtype)."""
    assert setup["mem"].store.dtype == "bfloat16"
    assert_theorem3(setup, setup["mem"])


# A sentence put before a question (0, 1, 2, ... times) until the query's token count falls in
# the token class of the whole prompt's (token_classes.py: on an Intel Xeon with AMX SmolLM2's
# linear layers compute 37-575 tokens alike, so a 16-21-token question alone does not): then
# every memory token is loaded and vLLM computes the query as in its cold prefill.
PREAMBLE = ("I am writing Caroline a birthday card and I want to get every detail right, so "
            "please answer briefly and only from what you know about her. ")


def test_theorem3_every_memory_token_loaded(setup):
    """Theorem 3 with every memory token loaded (the last block partly, the context ending
    inside a block): each question gets the fewest PREAMBLE sentences that put its query in the
    prompt's token class (none where the classes are one, as on a machine whose GEMMs compute
    every token count alike), nothing of the memory is recomputed, and the answers are vLLM's
    prefill's bit for bit."""
    tok, classes = setup["tok"], setup["loading"]["classes"]
    assert classes is not None, "the worker's token classes did not reach the scheduler side"
    for q in QUESTIONS:
        for times in range(4):
            ids = query_tokens(tok, PREAMBLE * times + q)
            r = setup["mem"].request("caroline", [setup["joint"]], ids)
            n = len(r["prompt"]["prompt_token_ids"])
            if classes.of(n - r["memory_tokens"]) == classes.of(n):
                break
        else:
            pytest.fail(f"{q!r}: no query of up to 3 preambles shares the prompt's token class "
                        f"({classes})")
        print(f"{q!r}: {times} preamble(s), query {len(ids)} tokens")
        assert_theorem3(setup, setup["mem"], questions=[q], preamble=PREAMBLE * times,
                        every_token=True)


def test_theorem3_with_a_float32_store(setup, shared_engine):
    """The same memory held as float32 (each bf16 key widened exactly, as the facade's load
    converts): the connector rotates in fp32 and converts as vLLM's kernel does, so the answers
    are again vLLM's prefill's. The float32 generation is committed over the running engine and
    the bf16 one restored after."""
    mem = setup["mem"]
    mem.close()  # one writer: the float32 one takes over, then the bf16 one again
    wide = Memory.open(mem.directory, writer=True, dtype="float32")
    try:
        assert wide.store.dtype == "float32"
        wide.commit()
        assert_theorem3(setup, wide)
    finally:
        wide.close()
        back = Memory.open(mem.directory, writer=True, dtype="bfloat16")
        back.commit()  # a new generation with the bf16 store again
        setup["mem"] = shared_engine.state["mem"] = back


def test_capture_by_extraction_equals_the_hook_within_rounding(setup):
    """The second way to capture: vLLM prefills the text, InferScale's extract reads its paged
    cache back and de-rotates the keys with the model's table. Values: exactly the hook's (bf16
    widened). Keys: vLLM's cache holds fp32 rotations truncated to bf16 (relative error below
    2^-7 per element) rotated with a bf16-valued table (cos^2 + sin^2 within about 2^-8 of 1), so
    each rotary pair comes back within 2^-6 of its norm."""
    from inferscale_vllm.encode import extract_from_cache

    llm, mem = setup["llm"], setup["mem"]
    ids = mem.store.token_ids(mem.prefix) + mem.store.token_ids(setup["joint"])
    kv = capture(llm, ids)  # a fresh forward: its blocks hold these tokens now
    assert kv["slots"].shape == (len(ids),)
    got = extract_from_cache(llm, kv["slots"])
    assert got["k"].shape == kv["k"].shape
    assert np.array_equal(got["v"], kv["v"]), "values read back differ from the hook's"
    half = kv["k"].shape[-1] // 2
    diff = got["k"] - kv["k"]
    err = np.sqrt(diff[..., :half] ** 2 + diff[..., half:] ** 2)
    norm = np.sqrt(kv["k"][..., :half] ** 2 + kv["k"][..., half:] ** 2)
    worst = float((err / np.maximum(norm, 1e-30)).max())
    print(f"extraction vs hook: worst pair error {worst:.2e} of the pair norm "
          f"(max abs {float(err.max()):.3e}); values equal")
    assert np.all(err <= 2.0 ** -6 * norm + 1e-6), f"a key pair is off by {worst:.2e} of its norm"


def test_injected_blocks_are_never_a_plain_text_prefix_hit(setup):
    """After a memory request, the same tokens as plain text (no salt) and under another user's
    salt find no cached block: the blocks filled from memory are keyed by the memory's salt."""
    mem, tok = setup["mem"], setup["tok"]
    r = mem.request("caroline", [setup["joint"]], query_tokens(tok, "Summarise Caroline's week."))
    # Only blocks filled from memory in the cache (earlier plain prefills of the same segment left
    # their own, legitimately computed blocks under the unsalted chain).
    assert setup["llm"].reset_prefix_cache()
    _, cached = run(setup, r["prompt"], r["extra_args"])
    assert cached >= 128
    _, plain_cached = run(setup, {"prompt_token_ids": r["prompt"]["prompt_token_ids"]})
    assert plain_cached == 0, f"a plain-text request hit {plain_cached} tokens of injected blocks"
    other = dict(r["prompt"], cache_salt="someone-else")
    _, other_cached = run(setup, other)
    assert other_cached == 0
    # The same memory request again is a prefix-cache hit on its own (identical) blocks.
    _, again = run(setup, r["prompt"], r["extra_args"])
    assert again >= 128


def test_suffix_recompute_loads_the_whole_blocks_before_it(setup):
    """recompute_tokens = r: the connector loads the segment's first m - r tokens (their whole
    blocks where it loads whole blocks only) and vLLM prefills the rest in context; with the joint
    memory (Theorem 3's case) the
    answer is vLLM's prefill's at every r. The salt differs from the r = 0 request's (blocks vLLM
    computed are not blocks injected), and an r outside [0, m] is refused by the client."""
    mem, tok = setup["mem"], setup["tok"]
    q = query_tokens(tok, "What instrument does Caroline play?")
    base = mem.request("caroline", [setup["joint"]], q)
    m = base["memory_tokens"]
    assert m > 128
    plain = plain_answer(setup, base["prompt"]["prompt_token_ids"])
    for r in (m - 128, m - 127, m):
        req = mem.request("caroline", [setup["joint"]], q, recompute_tokens=r)
        assert req["prompt"]["prompt_token_ids"] == base["prompt"]["prompt_token_ids"]
        assert req["prompt"]["cache_salt"] != base["prompt"]["cache_salt"]
        assert setup["llm"].reset_prefix_cache()
        out, cached = run(setup, req["prompt"], req["extra_args"])
        n = len(req["prompt"]["prompt_token_ids"])
        assert cached == loaded(setup, n, m, r), f"recompute {r} of {m}: {cached} tokens loaded"
        assert out == plain, f"recompute {r}: {tok.decode(out)!r} vs {tok.decode(plain)!r}"
    for bad in (-1, m + 1, 2.0, True):
        with pytest.raises(ValueError, match="recompute_tokens"):
            mem.request("caroline", [setup["joint"]], q, recompute_tokens=bad)


def test_the_last_block_is_loaded_partly_only_where_measured_exact(setup):
    """partial_last_block: an explicit true / false wins; "auto" is "measured" on vLLM's CPU path
    (any ISA, any TP: the workers' token classes decide, token_classes.py), whole blocks on a GPU;
    anything else is refused. This engine's connector got the token classes of its worker's
    linear layers at start-up: every count from 1 to the most tokens of a step has a class."""
    from types import SimpleNamespace

    def config(dtype=torch.bfloat16, tp=1, device="cpu"):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
            device_config=SimpleNamespace(device_type=device),
            model_config=SimpleNamespace(dtype=dtype, get_head_size=lambda: 64),
            cache_config=SimpleNamespace(block_size=128, cache_dtype="auto"))

    assert partial_last_block(config(), "auto") == "measured"
    assert partial_last_block(config(dtype=torch.float32)) == "measured"
    assert partial_last_block(config(tp=3)) == "measured"
    assert partial_last_block(config(), False) is False
    assert partial_last_block(config(tp=3), True) is True
    assert partial_last_block(config(device="cuda")) is False
    with pytest.raises(ValueError, match="partial_last_block"):
        partial_last_block(config(), "yes")
    loading = setup["loading"]
    assert loading["mode"] == "measured"
    classes = loading["classes"]
    assert classes is not None, "the worker's token classes did not reach the scheduler side"
    assert classes.max_tokens == min(loading["step_tokens"], 2048), classes.max_tokens
    assert all(classes.of(t) is not None for t in range(1, classes.max_tokens + 1))
    print(f"token classes here: {classes}")


@pytest.mark.parametrize("fault", ["unknown user", "unknown fact", "wrong salt",
                                   "prompt differs", "no salt", "recompute beyond the segment",
                                   "recompute not an int"])
def test_refused_requests_are_prefilled_and_answer_as_plain_text(setup, fault):
    mem, tok = setup["mem"], setup["tok"]
    q = query_tokens(tok, "What is the name of Caroline's cat?")
    r = mem.request("caroline", [setup["joint"]], q)
    prompt, extra = dict(r["prompt"]), {"kv_transfer_params": {
        "inferscale": dict(r["extra_args"]["kv_transfer_params"]["inferscale"])}}
    p = extra["kv_transfer_params"]["inferscale"]
    if fault == "unknown user":
        p["user"] = "nobody"
    elif fault == "unknown fact":
        p["facts"] = [987654]
    elif fault == "wrong salt":
        prompt["cache_salt"] = "x" + prompt["cache_salt"]
    elif fault == "prompt differs":
        ids = list(prompt["prompt_token_ids"])
        ids[40] = (ids[40] + 1) % 1000
        prompt["prompt_token_ids"] = ids
    elif fault == "no salt":
        del prompt["cache_salt"]
    elif fault == "recompute beyond the segment":
        p["recompute_tokens"] = r["memory_tokens"] + 1
    elif fault == "recompute not an int":
        p["recompute_tokens"] = "16"
    plain = plain_answer(setup, prompt["prompt_token_ids"])
    # Nothing cached: whatever vLLM reports as cached now came from the connector.
    assert setup["llm"].reset_prefix_cache()
    out, cached = run(setup, prompt, extra)
    assert cached == 0, f"{fault}: {cached} tokens were loaded from memory"
    assert out == plain


def test_malformed_parameters_never_reach_vllms_scheduler(setup):
    """kv_transfer_params of every wrong shape (valid JSON, as a client or another connector
    could send), and a generation never committed, in one batch: each request is prefilled (0
    tokens from memory), the engine keeps serving, and the next valid request loads its memory.
    A generation from the future is refused at once, never deferred forever."""
    mem, tok = setup["mem"], setup["tok"]
    q = query_tokens(tok, "What is the name of Caroline's cat?")
    r = mem.request("caroline", [setup["joint"]], q)
    good = r["extra_args"]["kv_transfer_params"]["inferscale"]
    shapes = [[], "caroline", 7, None, {"user": 5, "facts": [setup["joint"]]},
              dict(good, facts={"a": 1}), dict(good, facts=[True]), dict(good, facts=[-1]),
              dict(good, facts=[]), dict(good, facts="1,2"), dict(good, user=""),
              dict(good, user=["caroline"]), dict(good, generation="1"),
              dict(good, generation=None), dict(good, generation=10 ** 12),
              dict(good, memory_tokens="205"), dict(good, memory_tokens=None),
              dict(good, recompute_tokens=-1), {"inferscale": {"deep": {"deeper": [1, {}]}}},
              dict(good, facts=[setup["joint"], setup["joint"]])]
    # a short prompt (the question alone, the memory's salt): every shape is refused before the
    # prompt is compared, so the batch need not prefill 20 copies of the memory segment
    short = {"prompt_token_ids": list(q), "cache_salt": r["prompt"]["cache_salt"]}
    prompts = [dict(short) for _ in shapes]
    params = [setup["sampling"](temperature=0.0, max_tokens=1, extra_args={
        "kv_transfer_params": {"inferscale": shape}}) for shape in shapes]
    assert setup["llm"].reset_prefix_cache()
    t = time.monotonic()
    outs = setup["llm"].generate(prompts, params, use_tqdm=False)
    assert time.monotonic() - t < 120  # none waited for a generation that never comes
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * len(shapes)
    # the connector's report of each (request_finished, handed back with the output): nothing
    # loaded, and the reason for every request that asked for memory (vLLM's own prefix cache
    # may share the identical prompts' blocks within the batch: those were prefilled)
    for shape, o in zip(shapes, outs):
        report = (o.kv_transfer_params or {}).get("inferscale")
        if not shape:
            assert report is None, shape
            continue
        assert report["loaded_tokens"] == 0, (shape, report)
        assert isinstance(report["refused"], str) and report["refused"], (shape, report)
    assert setup["llm"].reset_prefix_cache()
    _, cached = run(setup, r["prompt"], r["extra_args"])
    assert cached == loaded(setup, len(r["prompt"]["prompt_token_ids"]), r["memory_tokens"]) > 0
    # a memory whose record is valid JSON of the wrong shape, committed over the running engine
    # (by the C++ save alone, as a foreign writer could): its load fails in the background (it is
    # logged), the engine keeps serving — requests naming the last good generation from it, a
    # newer one prefilled — and the memory serves again once a good generation is committed
    from inferscale_vllm import _inferscale

    _inferscale.Memory(1, 1, 8, "bfloat16", 1, 16, 1).save(mem.directory, b'{"format": 2}')
    newer = dict(good, generation=mem.generation + 1)
    for _ in range(3):
        assert setup["llm"].reset_prefix_cache()
        outs = setup["llm"].generate([r["prompt"], dict(short)], [setup["sampling"](
            temperature=0.0, max_tokens=1, extra_args=e) for e in (
                r["extra_args"], {"kv_transfer_params": {"inferscale": newer}})], use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 1]
        assert outs[1].kv_transfer_params["inferscale"]["loaded_tokens"] == 0
    mem.commit()  # the writer's state saved again over the foreign one
    r = mem.request("caroline", [setup["joint"]], q)
    assert setup["llm"].reset_prefix_cache()
    _, cached = run(setup, r["prompt"], r["extra_args"])
    assert cached == loaded(setup, len(r["prompt"]["prompt_token_ids"]), r["memory_tokens"]) > 0


def test_a_load_failing_in_the_worker_is_prefilled_and_vllm_keeps_serving(setup):
    """An exception in the worker's injection: the blocks are reported as load errors, vLLM
    (policy recompute) prefills them, the answer equals plain prefill, and the next memory
    request is served from memory again."""
    mem, tok = setup["mem"], setup["tok"]
    q = query_tokens(tok, "Where did Caroline study?")
    r = mem.request("failpoint", [setup["failing"]], q)
    plain = plain_answer(setup, r["prompt"]["prompt_token_ids"])
    assert setup["llm"].reset_prefix_cache()
    out, _ = run(setup, r["prompt"], r["extra_args"])
    assert out == plain
    assert setup["llm"].reset_prefix_cache()
    ok = mem.request("caroline", [setup["joint"]], q)
    _, cached = run(setup, ok["prompt"], ok["extra_args"])
    assert cached >= 128


def test_a_fact_erased_after_the_request_was_made_is_prefilled(setup):
    """The client built its request at generation G; the fact is erased and G + 1 committed before
    vLLM schedules it: the scheduler refuses (the fact is no longer the user's) and prefills."""
    from inferscale_vllm.encode import add_fact

    mem, tok, llm = setup["mem"], setup["tok"], setup["llm"]
    text = "Caroline once met a dolphin named Azul off the coast of Sagres."
    prefix = mem.store.token_ids(mem.prefix)
    fid = add_fact(mem, llm, "caroline", text, tok.encode(text, add_special_tokens=False),
                   context=prefix)
    mem.commit()
    r = mem.request("caroline", [setup["joint"], fid], query_tokens(tok, "Who is Azul?"))
    mem.erase_fact(fid)
    mem.commit()
    plain = plain_answer(setup, r["prompt"]["prompt_token_ids"])
    assert llm.reset_prefix_cache()
    out, cached = run(setup, r["prompt"], r["extra_args"])
    assert cached == 0
    assert out == plain
