"""The served memory as a client sees it: ``python -m inferscale_vllm.serve`` (vLLM's own
OpenAI-compatible server with the connector and the memory routes) started on 127.0.0.1 with an
API key, driven over HTTP with the ``openai`` client and httpx: memories written for three users,
Theorem 3 through the server (a jointly encoded memory answers as vLLM's own prefill of the same
tokens), isolation under prefix caching with concurrent users and a request without memory, every
refusal (the server keeps serving), erasure, a restart, and a kill during a write."""

import concurrent.futures
import json
import os
import signal
import tempfile
import time

import httpx
import pytest

from inferscale_vllm.server_process import BLOCK, Server

KEY = "test-key-" + os.urandom(6).hex()
MARKERS = {  # one marker fact per user; every answer is checked against its own user's
    "alice": "Alice's locker code is 4417.",
    "bob": "Bob keeps a parrot named Captain Biscuit.",
    "carol": "Carol's favourite mountain is Kilimanjaro.",
}
OTHER = {
    "alice": ["Alice plays the cello in a quartet.", "Alice was born in Porto."],
    "bob": ["Bob repairs vintage radios.", "Bob runs every Sunday morning."],
    "carol": ["Carol works as a glassblower.", "Carol's sister lives in Oslo."],
}
JOINT = ("Dana adopted a grey cat called Pixel in March; she trains for a marathon in Lisbon, "
         "teaches chemistry at a night school and collects old maps of the Azores.")


@pytest.fixture(scope="module")
def server(model_dir):
    directory = os.path.join(tempfile.mkdtemp(prefix="inferscale-served-"), "memory")
    log = open(os.path.join(os.path.dirname(directory), "server.log"), "w")
    s = Server(model_dir, directory, log, KEY)
    s.start()
    s.ids = {u: s.write(u, [MARKERS[u]] + OTHER[u]) for u in MARKERS}
    s.joint = s.write("dana", [JOINT])[0]
    yield s
    s.stop()
    log.close()


def chat(s, user, question, max_tokens=16, **extra):
    client = s.openai()
    body = {"return_token_ids": True}
    body.update(extra)
    r = client.chat.completions.create(model="smollm2", user=user, temperature=0.0,
                                       max_tokens=max_tokens, seed=0,
                                       messages=[{"role": "user", "content": question}],
                                       extra_body=body)
    return r.model_dump()


_PLAIN_SALTS = iter(range(10**9))


def plain_tokens(s, prompt_ids, max_tokens=16):
    """vLLM's own cold prefill of the same tokens: a completion without user or memory, with a
    cache salt of its own (no block of an earlier request is reused: a prefix-cache hit would let
    vLLM compute fewer tokens in the step, which its CPU GEMMs may round differently)."""
    client = s.openai()
    r = client.completions.create(model="smollm2", prompt=prompt_ids, temperature=0.0,
                                  max_tokens=max_tokens, seed=0,
                                  extra_body={"return_token_ids": True,
                                              "cache_salt": f"plain-{next(_PLAIN_SALTS)}"})
    return r.model_dump()["choices"][0]["token_ids"]


def loaded_ok(memory):
    """The segment came from memory: the connector loaded tokens past vLLM's own prefix-cache hit
    (blocks an earlier request with the same memory and salt left), as many as leave vLLM a rest
    it computes as in its cold prefill (token_classes.py: with this server's 37-token memories
    and short questions, fewer than the segment's whole blocks on an Intel Xeon with AMX), and
    something was loaded or cached."""
    m = memory["memory_tokens"]
    have = memory["loaded_tokens"] + memory["cached_tokens"]
    return 0 < have <= m


def test_write_list_and_answer(server):
    s = server
    for user, ids in s.ids.items():
        r = httpx.get(f"{s.url}/v1/memory/{user}/facts", headers=s.headers, timeout=30)
        assert r.status_code == 200
        listed = r.json()["facts"]
        assert [f["id"] for f in listed] == ids
        assert [f["text"] for f in listed] == [MARKERS[user]] + OTHER[user]
    r = chat(s, "bob", "What is the name of Bob's parrot?")
    memory = r["memory"]
    assert memory["user"] == "bob" and set(memory["facts"]) <= set(s.ids["bob"])
    assert len(memory["facts"]) == 2
    assert s.ids["bob"][0] in memory["facts"]  # retrieval found the marker
    assert loaded_ok(memory), json.dumps(memory)


def test_theorem3_through_the_server(server):
    """A memory encoded jointly (one fact, one forward behind the prefix, as the server encodes
    it) answers with exactly the tokens vLLM's own prefill of the same prompt gives."""
    s = server
    for q in ("What is Dana's cat called?", "Where does Dana train for a marathon?"):
        r = chat(s, "dana", q, max_tokens=24, memory={"k": 1})
        assert r["memory"]["facts"] == [s.joint]
        assert loaded_ok(r["memory"]), json.dumps(r["memory"])
        got = r["choices"][0]["token_ids"]
        want = plain_tokens(s, r["prompt_token_ids"], 24)
        print(f"{q!r}: prompt {len(r['prompt_token_ids'])} tokens, memory {json.dumps(r['memory'])}")
        assert got == want, f"{q!r}: {json.dumps(r['memory'])}"


def test_isolation_under_prefix_caching_with_concurrent_users(server):
    """Users asking at once, each twice (prefix caching on: the second finds cached blocks), and
    requests without memory beside them: every answer's prompt holds its own user's facts and no
    other user's marker."""
    s = server
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(s.model_dir)
    marker_ids = {u: tok.encode(f"- {m}\n", add_special_tokens=False) for u, m in MARKERS.items()}

    def holds(prompt, seq):
        return any(prompt[i:i + len(seq)] == seq for i in range(len(prompt) - len(seq) + 1))

    jobs = [(u, q) for _ in range(2) for u, q in (("alice", "What is Alice's locker code?"),
                                                  ("bob", "What is Bob's parrot called?"),
                                                  ("carol", "Which mountain does Carol like?"),
                                                  (None, "What is the capital of France?"))]

    def run(job):
        user, q = job
        if user is None:
            r = s.openai().chat.completions.create(
                model="smollm2", temperature=0.0, max_tokens=8,
                messages=[{"role": "user", "content": q}], extra_body={"return_token_ids": True})
            return user, r.model_dump()
        return user, chat(s, user, q, max_tokens=8, memory={"k": 3})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    leaks = 0
    for user, r in results:
        prompt = r["prompt_token_ids"]
        if user is None:
            assert "memory" not in r or r.get("memory") is None
            leaks += sum(holds(prompt, ids) for ids in marker_ids.values())
            continue
        assert set(r["memory"]["facts"]) <= set(s.ids[user])
        assert holds(prompt, marker_ids[user])
        leaks += sum(holds(prompt, ids) for u, ids in marker_ids.items() if u != user)
    assert leaks == 0


def test_refusals_and_the_server_keeps_serving(server):
    s = server
    client = s.openai()
    import openai

    cases = [
        ("unknown user", dict(user="nobody"), 404),
        ("k = 0", dict(user="alice", extra_body={"memory": {"k": 0}}), 400),
        ("k too large", dict(user="alice", extra_body={"memory": {"k": 99}}), 400),
        ("k not an int", dict(user="alice", extra_body={"memory": {"k": "2"}}), 400),
        ("a user of bad characters", dict(user="../alice"), 400),
        ("client kv_transfer_params", dict(user="alice", extra_body={
            "kv_transfer_params": {"inferscale": {"user": "bob", "facts": s.ids["bob"]}}}), 400),
        ("an inferscale- salt", dict(extra_body={"cache_salt": "inferscale-0123"}), 400),
    ]
    for name, kw, status in cases:
        extra = kw.pop("extra_body", {})
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="smollm2", max_tokens=4,
                                           messages=[{"role": "user", "content": "Hi"}],
                                           extra_body=extra, **kw)
        assert e.value.status_code == status, (name, e.value.status_code, e.value.response.text)
    # a system message with memory, and the server's own system prompt
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="smollm2", user="alice", max_tokens=4, messages=[
            {"role": "system", "content": "x"}, {"role": "user", "content": "Hi"}])
    assert e.value.status_code == 400 and "system" in e.value.response.text
    # an unknown user answered without memory when the request allows it
    r = chat(s, "nobody", "Hi", max_tokens=4, memory={"required": False})
    assert r.get("memory") is None
    # memory routes: malformed bodies, oversized text, another user's fact, a missing key
    bad = [("/v1/memory/alice/facts", {"facts": []}, 400),
           ("/v1/memory/alice/facts", {"facts": "one string"}, 400),
           ("/v1/memory/alice/facts", {"facts": [None]}, 400),
           ("/v1/memory/alice/facts", {"facts": ["x" * 5000]}, 413),
           ("/v1/memory/alice/facts", {"facts": ["ok"], "context": 3}, 400),
           ("/v1/memory/al%20ice/facts", {"facts": ["ok"]}, 400)]
    for path, body, status in bad:
        r = s.post(path, body)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        assert "error" in r.json()
    r = httpx.post(f"{s.url}/v1/memory/alice/facts", content=b"{not json",
                   headers=s.headers, timeout=30)
    assert r.status_code == 400
    r = httpx.delete(f"{s.url}/v1/memory/alice/facts/{s.ids['bob'][0]}", headers=s.headers,
                     timeout=30)
    assert r.status_code == 404  # bob's fact, asked for as alice's: nothing erased
    r = httpx.get(f"{s.url}/v1/memory/alice/facts", timeout=30)  # no key
    assert r.status_code == 401
    listed = httpx.get(f"{s.url}/v1/memory/bob/facts", headers=s.headers, timeout=30).json()
    assert [f["id"] for f in listed["facts"]] == s.ids["bob"]
    # still serving
    r = chat(s, "alice", "What is Alice's locker code?", max_tokens=4)
    assert set(r["memory"]["facts"]) <= set(s.ids["alice"])


def test_erase_restart_and_kill_during_a_write(server):
    s = server
    victim = s.ids["carol"][2]
    r = httpx.delete(f"{s.url}/v1/memory/carol/facts/{victim}", headers=s.headers, timeout=60)
    assert r.status_code == 200
    for _ in range(3):
        r = chat(s, "carol", "Where does Carol's sister live?", max_tokens=4, memory={"k": 2})
        assert victim not in r["memory"]["facts"]
    before = chat(s, "dana", "What is Dana's cat called?", max_tokens=16, memory={"k": 1})
    listed = {u: httpx.get(f"{s.url}/v1/memory/{u}/facts", headers=s.headers,
                           timeout=30).json()["facts"] for u in ("alice", "bob", "carol")}
    # a write killed half-way: the memory reloads at the old or the new generation, whole
    body = {"facts": [f"Erin fact number {i}." for i in range(12)]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(s.post, "/v1/memory/erin/facts", body)
        time.sleep(1.5)
        s.stop(signal.SIGKILL)
        try:
            pending.result()
        except httpx.HTTPError:
            pass
    s.start()
    erin = httpx.get(f"{s.url}/v1/memory/erin/facts", headers=s.headers, timeout=30)
    assert erin.status_code in (200, 404)
    if erin.status_code == 200:
        assert len(erin.json()["facts"]) == 12  # all of the write, or none of it
    for u, facts in listed.items():
        again = httpx.get(f"{s.url}/v1/memory/{u}/facts", headers=s.headers, timeout=30)
        assert again.json()["facts"] == facts
    after = chat(s, "dana", "What is Dana's cat called?", max_tokens=16, memory={"k": 1})
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert after["memory"]["facts"] == before["memory"]["facts"]
