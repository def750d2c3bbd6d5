"""Capture while serving on the real engine (conftest's shared TP = 1 engine, SmolLM2, bf16): a
request with ``kv_transfer_params.inferscale_capture`` is served as usual, and after the forward
that computed its last prompt token the connector's worker reads its prompt's K/V back from vLLM's
paged cache, de-rotated (serve_capture.py); ``read_capture`` gives them back.

Compared with the hook capture (capture.py) of the same forward and of another forward of the
same tokens: values bit for bit; keys bf16 values that the engine's rotation maps back to exactly
the rotated keys vLLM wrote (serve_capture.ExactKeys), within twice the bf16 rounding of vLLM's
rotation (2^-7 of each pair's norm: capture_check.py) of the pre-RoPE keys the hook saw. Prompts: 205 tokens (longer than one 128-token
block, ending inside the second), 77 (inside the first), 256 (ending on a block boundary), a prompt
whose first block is a prefix-cache hit, and a memory request whose first block was injected.
Chunked prefill: test_machinery.py; TP = 3: test_tp.py."""

import os
import uuid

import numpy as np
import pytest
from capture_check import (PAIR_BOUND, capture_params, check_served_against_hook, generate,
                           hook_and_served, pair_error)

from inferscale_vllm.encode import capture
from inferscale_vllm.serve_capture import CAPTURE_DIR, read_capture


@pytest.fixture(scope="module")
def setup(shared_engine):
    s = shared_engine.get()
    llm = s["llm"]
    mem = s["mem"]
    ids = mem.store.token_ids(mem.manifest["prefix"]) + mem.store.token_ids(s["joint"])
    theta = float(mem.manifest["model"]["rope_theta"])
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    from capture_check import vllm_rotation

    return dict(s, ids=ids, theta=theta, connector=connector, rotate=vllm_rotation(llm))


def captures_left(directory):
    folder = os.path.join(directory, CAPTURE_DIR)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


@pytest.fixture(autouse=True)
def clean(setup):
    yield
    assert not captures_left(setup["directory"]), "capture files (or temporaries) left behind"
    state = setup["connector"].request_state()
    assert not state["captures"], f"capture requests left in the connector: {state}"


@pytest.mark.parametrize("length", [205, 77, 256])
def test_served_capture_is_the_hooks_forward_read_back(setup, length):
    """One forward, captured both ways: 205 tokens (prefix + facts, a block and a part), 77 (inside
    the first block), 256 (two whole blocks: the prompt's last token is a block's last slot)."""
    ids = (setup["ids"] * 2)[:length]
    hook, served, _ = hook_and_served(setup["llm"], ids, setup["directory"], f"same-{length}")
    print(check_served_against_hook(hook, served, ids, setup["rotate"], f"{length} tokens"))


def test_served_capture_equals_encode_capture_of_the_same_tokens(setup):
    """encode.capture (the hook capture facts are encoded with) and a served capture of the same
    205 tokens, two forwards: vLLM's forward of the same tokens is deterministic here, so the
    values are equal bit for bit and the keys within the rounding bound."""
    llm, ids = setup["llm"], setup["ids"]
    hook = capture(llm, ids)
    generate(llm, ids, capture_params("separate"))
    served = read_capture(setup["directory"], "separate", 1)
    print(check_served_against_hook(hook, served, ids, setup["rotate"], "separate forwards"))


def test_a_prefix_cache_hit_is_read_from_its_block(setup):
    """The same prompt and salt twice: the second request's first block is a prefix-cache hit
    (vLLM computes only the rest), and its capture still holds every prompt token, bit for bit
    the first capture (read from the cached block the first request filled)."""
    llm, ids = setup["llm"], setup["ids"]
    salt = uuid.uuid4().hex
    _, cached1 = generate(llm, ids, capture_params("cold"), salt)
    _, cached2 = generate(llm, ids, capture_params("warm"), salt)
    assert cached1 == 0 and cached2 == 128, (cached1, cached2)
    cold = read_capture(setup["directory"], "cold", 1)
    warm = read_capture(setup["directory"], "warm", 1)
    for name in ("k", "v", "token_ids"):
        assert np.array_equal(cold[name], warm[name]), name


def test_a_memory_request_is_captured_with_its_injected_segment(setup):
    """A memory request (its first block loaded from the memory by the connector) that also asks
    to be captured: the capture's segment tokens read back the memory's K/V (values bit for bit,
    keys within the rounding bound) and the rest is the query vLLM computed."""
    from caroline import query_tokens

    llm, mem, tok = setup["llm"], setup["mem"], setup["tok"]
    r = mem.request("caroline", [setup["joint"]], query_tokens(tok, "Who is Melanie?"))
    extra = {"kv_transfer_params": dict(r["extra_args"]["kv_transfer_params"],
                                        **capture_params("with-memory")["kv_transfer_params"])}
    assert llm.reset_prefix_cache()
    from vllm import SamplingParams

    out = llm.generate([r["prompt"]], SamplingParams(max_tokens=1, temperature=0.0,
                                                     extra_args=extra), use_tqdm=False)[0]
    assert (out.num_cached_tokens or 0) >= 128, "the memory's first block was not loaded"
    got = read_capture(setup["directory"], "with-memory", 1)
    ids = r["prompt"]["prompt_token_ids"]
    assert got["token_ids"].tolist() == ids
    kv = setup["kv"]  # the memory's K/V: the joint capture of prefix + facts (bf16 store)
    m = r["memory_tokens"]
    loaded = out.num_cached_tokens
    assert np.array_equal(got["v"][:, :loaded], kv["v"][:, :loaded]), "injected values differ"
    err, norm = pair_error(got["k"][:, :loaded], kv["k"][:, :loaded])
    assert np.all(err <= 2 * PAIR_BOUND * norm + 1e-6)
    assert got["k"].shape[1] == len(ids) > m


MALFORMED = ["not a dict", {}, {"id": ""}, {"id": "x" * 65}, {"id": "../../escape"},
             {"id": "a b"}, {"id": 7}, {"id": "ok", "user": "extra key"}, None, ["id", "list"]]


def test_a_malformed_capture_parameter_is_ignored_and_vllm_keeps_serving(setup):
    """Each malformed parameter: the request is served (the same answer as without it), nothing is
    written, the parameter is counted as malformed (and logged with the request id); then a
    well-formed capture works."""
    llm, ids = setup["llm"], setup["ids"][:24]
    counters = setup["connector"]._captures.counters
    before = counters["malformed"]
    plain, _ = generate(llm, ids, max_tokens=2)
    for param in MALFORMED:
        out, _ = generate(llm, ids, {"kv_transfer_params": {"inferscale_capture": param}},
                          max_tokens=2)
        assert out == plain, param
    assert counters["malformed"] == before + len(MALFORMED)
    assert not captures_left(setup["directory"])
    generate(llm, ids, capture_params("after-malformed"))
    assert read_capture(setup["directory"], "after-malformed", 1)["k"].shape[1] == 24


def test_read_capture_refuses_a_capture_never_made(setup):
    with pytest.raises(ValueError, match=r"never-made\.rank0\.npz: missing"):
        read_capture(setup["directory"], "never-made", 1, timeout=0)
