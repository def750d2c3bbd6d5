"""Retrieval in the vLLM package: the MiniLM embedder, the library's host graph index bound into
_inferscale, and Memory's retrieve / request_for_query / persistence. No vLLM engine: the
facts' K/V here are placeholders (retrieval never reads them).

Expectations are independent of the code under test:
  - the embedder against sentence-transformers' own token ids and embeddings for the same weights
    (tests/engine/fixtures/minilm_reference.json, which the llama.cpp embedder's test also uses);
  - the index against a brute-force cosine top-k recomputed here in float64 with numpy, on real
    text: the turns of two LoCoMo conversations (read in place from ../shared/data/locomo, or
    $INFERSCALE_LOCOMO; never copied), queried with their QA questions.
A missing model or data set is a failure with a message, never a skip.
"""

import json
import os
import tempfile

import numpy as np
import pytest

from inferscale_vllm import Index
from inferscale_vllm.embed import MiniLMEmbedder
from inferscale_vllm.memory import Memory

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
LOCOMO = os.environ.get("INFERSCALE_LOCOMO") or os.path.join(REPO, "..", "shared", "data", "locomo",
                                                             "locomo10.json")
REFERENCE = os.path.join(REPO, "tests", "engine", "fixtures", "minilm_reference.json")
MODEL = {"name": "placeholder", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
         "rope_theta": 10000.0}
K = 10
# The graph search's recall@10 against brute force over ~400 LoCoMo turns per user, with the
# library's default search parameters (stated bound; the measured values are printed).
GRAPH_RECALL_BOUND = 0.95


@pytest.fixture(scope="module")
def embedder():
    try:
        return MiniLMEmbedder()
    except ValueError as e:
        pytest.fail(f"{e} (the real model is required; this test does not skip)")


@pytest.fixture(scope="module")
def locomo():
    if not os.path.isfile(LOCOMO):
        pytest.fail(f"LoCoMo is not at {LOCOMO} (set INFERSCALE_LOCOMO; this test does not skip)")
    with open(LOCOMO) as f:
        data = json.load(f)
    out = []
    for sample in data[:2]:  # two conversations: two users
        conv = sample["conversation"]
        turns = []
        for key in sorted((k for k in conv if k.startswith("session_") and isinstance(conv[k], list)),
                          key=lambda k: int(k.split("_")[1])):
            turns += [f"{t['speaker']}: {t['text']}" for t in conv[key]]
        questions = [q["question"] for q in sample["qa"]][:100]
        out.append({"user": sample["sample_id"], "turns": turns, "questions": questions})
    return out


@pytest.fixture(scope="module")
def vectors(embedder, locomo):
    """Each conversation's turn and question embeddings (computed once: the test's main cost)."""
    return [{"turns": embedder.embed(c["turns"]), "questions": embedder.embed(c["questions"])}
            for c in locomo]


def brute_force(rows: np.ndarray, queries: np.ndarray, k: int):
    """(order [n, k] of row indices, cosine distances [n, rows]) in float64."""
    r = rows.astype(np.float64)
    r /= np.linalg.norm(r, axis=1, keepdims=True)
    q = queries.astype(np.float64)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    d = 1.0 - q @ r.T
    return np.argsort(d, axis=1, kind="stable")[:, :k], d


def check_top_k(ids, distances, fact_ids, brute_d, k, tol=2e-6):
    """Every rank holds a fact at the brute-force distance of that rank (a correct top-k up to
    exact ties), ids are distinct facts of the namespace, distances are the true ones. Returns
    the number of queries whose id lists equal brute force's exactly."""
    position = {f: i for i, f in enumerate(fact_ids)}
    same = 0
    for q in range(ids.shape[0]):
        got = [int(i) for i in ids[q]]
        assert len(set(got)) == k, f"query {q}: repeated ids {got}"
        assert all(g in position for g in got), f"query {q}: ids outside the namespace: {got}"
        want = np.sort(brute_d[q])[:k]
        mine = brute_d[q][[position[g] for g in got]]
        np.testing.assert_allclose(mine, want, atol=tol, err_msg=f"query {q}: not the top {k}")
        np.testing.assert_allclose(distances[q], mine, atol=1e-5, err_msg=f"query {q}: distances")
        order = np.argsort(brute_d[q], kind="stable")[:k]
        same += got == [fact_ids[i] for i in order]
    return same


def fill(mem, user, texts):
    """Facts with placeholder K/V (one token): retrieval reads only their embeddings."""
    kv = np.zeros((1, 1, 1, 8), np.float32)
    return [mem.add_fact(user, t, [1], kv, kv) for t in texts]


def new_memory(embedder, **kw):
    return Memory.create(tempfile.mkdtemp(prefix="inferscale-retr-"), model=MODEL,
                         dtype="float32", num_pages=2048, embedder=embedder, **kw)


# -- the embedder -------------------------------------------------------------------------------
def test_embedder_matches_sentence_transformers(embedder):
    with open(REFERENCE) as f:
        ref = json.load(f)
    assert ref["dimension"] == embedder.dimension == 384
    texts = [s["text"] for s in ref["sentences"]]
    got = embedder.embed(texts)
    assert got.dtype == np.float32 and got.shape == (len(texts), 384)
    worst = 1.0
    for s, v in zip(ref["sentences"], got):
        assert embedder.tokenize(s["text"]) == s["token_ids"], s["text"]
        r = np.asarray(s["embedding"], np.float64)
        c = float(v @ r / np.linalg.norm(v) / np.linalg.norm(r))
        worst = min(worst, c)
        assert c > 0.99999, (s["text"], c)
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
    print(f"\nembedder: {len(texts)} sentences, min cosine vs sentence-transformers {worst:.8f}")
    # one at a time equals the padded batch
    np.testing.assert_allclose(np.stack([embedder.embed(t)[0] for t in texts]), got, atol=1e-5)


def test_embedder_semantics_and_refusals(embedder):
    a, b, c = embedder.embed(["The Cat sat on the mat.", "A cat was sitting on the rug.",
                              "How do I reset my password?"])
    assert a @ b > a @ c + 0.3 and a @ b > 0.6
    with pytest.raises(ValueError, match="at most 256"):
        embedder.embed("word " * 300)  # never truncated
    with pytest.raises(ValueError, match="empty"):
        embedder.embed(["fine", "  "])
    with pytest.raises(ValueError, match="not the all-MiniLM-L6-v2 folder"):
        MiniLMEmbedder(tempfile.mkdtemp())


def test_query_batcher_embeds_concurrent_queries_together(embedder):
    """The server's QueryBatcher: queries that wait together share one forward, whatever the
    size of the thread pool, each caller gets its own text's vector (as embedding it alone,
    within the batch's rounding) or its own error, and a cancelled caller costs the others
    nothing."""
    import asyncio
    import concurrent.futures
    import time

    from inferscale_vllm.embed import QueryBatcher

    texts = [f"What did user {i} say about the {w}?" for i, w in
             enumerate(["guitar", "trip to Paris", "new job", "dog", "marathon", "garden",
                        "piano", "sister", "cooking"])]
    texts.append("word " * 300)  # too long for the model: refused, for its caller only
    n = len(texts)

    class Gated:  # the first forward waits until every other caller is queued behind it
        def __init__(self):
            self.calls = 0

        def embed(self, batch):
            self.calls += 1
            if self.calls == 1:
                deadline = time.monotonic() + 60
                while len(batcher._pending) < n and time.monotonic() < deadline:
                    time.sleep(0.005)
            return embedder.embed(batch)

    batcher = QueryBatcher(Gated())

    async def run():
        # a pool of 2 threads: a thread per waiting caller would serialise the batches
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(2))
        first = asyncio.ensure_future(batcher.embed(texts[0]))
        while batcher.batches == 0:  # the first forward has started, alone
            await asyncio.sleep(0.001)
        rest = [asyncio.ensure_future(batcher.embed(t)) for t in texts[1:]]
        gone = asyncio.ensure_future(batcher.embed(texts[1]))  # its caller goes away
        await asyncio.sleep(0)
        gone.cancel()
        return await asyncio.gather(first, *rest, return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(r, np.ndarray) for r in results[:-1]), results

    # Requests sent together reach the batcher over some milliseconds of parsing: queries that
    # keep arriving (each well within SETTLE_SECONDS of the last) still share the first forward.
    spread = QueryBatcher(embedder)

    async def trickle():
        tasks = []
        for t in texts[:6]:
            tasks.append(asyncio.ensure_future(spread.embed(t)))
            await asyncio.sleep(spread.SETTLE_SECONDS / 4)
        return await asyncio.gather(*tasks)

    asyncio.run(trickle())
    assert (spread.batches, spread.queries) == (1, 6)
    assert isinstance(results[-1], ValueError) and "at most 256" in str(results[-1])
    # Two batches: the first caller alone, then the others in one (the failing text made that
    # batch run again text by text), the cancelled caller's text included.
    assert (batcher.batches, batcher.queries) == (2, n + 1)
    alone = np.stack([embedder.embed(t)[0] for t in texts[:-1]])
    np.testing.assert_allclose(np.stack(results[:-1]), alone, atol=1e-5)


def test_bfloat16_queries_retrieve_what_float32_queries_retrieve(embedder, locomo, vectors):
    """The server's queries in bfloat16 (--query-compute, bfloat16 autocast) against the float32
    facts: each value within 4e-3 of the float32 query's, and the top 20 of every LoCoMo question
    the same set but where a fact's float32 score lies within the bfloat16 error of the 20th
    (a near-tie, which either arithmetic may break either way)."""
    k, tie = 20, 2e-3
    changed = 0
    for c, v in zip(locomo, vectors):
        q16 = embedder.embed(c["questions"], compute="bfloat16")
        assert q16.dtype == np.float32 and q16.shape == v["questions"].shape
        np.testing.assert_allclose(np.linalg.norm(q16, axis=1), 1.0, atol=1e-5)
        assert np.abs(q16 - v["questions"]).max() < 4e-3
        s32 = v["questions"].astype(np.float64) @ v["turns"].astype(np.float64).T
        s16 = q16.astype(np.float64) @ v["turns"].astype(np.float64).T
        for i in range(len(c["questions"])):
            top32 = set(np.argsort(-s32[i], kind="stable")[:k])
            top16 = set(np.argsort(-s16[i], kind="stable")[:k])
            kth = np.sort(s32[i])[::-1][k - 1]
            for f in top32 ^ top16:
                assert abs(s32[i, f] - kth) < tie, (i, f, s32[i, f], kth)
            changed += top32 != top16
    asked = sum(len(c["questions"]) for c in locomo)
    print(f"bfloat16 queries: {changed} of {asked} top-{k} sets differ, each by near-ties only")
    assert changed <= asked // 10


# -- the bound index against brute force -------------------------------------------------------
def test_index_exact_and_graph_against_brute_force(locomo, vectors):
    index = Index(384)
    base = [0, 100_000]  # disjoint fact ids per user
    for u, (c, v) in enumerate(zip(locomo, vectors)):
        ids = [base[u] + i for i in range(len(c["turns"]))]
        index.add(u + 1, v["turns"], ids)
        assert index.size(u + 1) == len(ids)
    assert index.total_size == sum(len(c["turns"]) for c in locomo)
    for u, (c, v) in enumerate(zip(locomo, vectors)):
        fact_ids = [base[u] + i for i in range(len(c["turns"]))]
        q = np.ascontiguousarray(v["questions"])
        _, d = brute_force(v["turns"], q, K)
        results = {}
        for algo in ("exact", "graph", "automatic"):
            ids = np.empty((q.shape[0], K), np.uint64)
            dist = np.empty((q.shape[0], K), np.float32)
            index.search(u + 1, q, K, ids, dist, algo)
            results[algo] = (ids.astype(np.int64), dist)
        ids, dist = results["exact"]
        same = check_top_k(ids, dist, fact_ids, d, K)
        print(f"\n{c['user']}: {len(fact_ids)} turns, {q.shape[0]} questions; exact search equals "
              f"brute force's order on {same}/{q.shape[0]}, a correct top-{K} on all")
        # the graph search: recall@10 against brute force's top 10 (ties counted by distance)
        kth = np.sort(d, axis=1)[:, K - 1]
        pos = {f: i for i, f in enumerate(fact_ids)}
        ids, dist = results["graph"]
        hits = sum(int(np.sum(d[i][[pos[int(g)] for g in ids[i]]] <= kth[i] + 2e-6))
                   for i in range(q.shape[0]))
        recall = hits / (q.shape[0] * K)
        print(f"{c['user']}: graph search recall@{K} {recall:.4f} (bound {GRAPH_RECALL_BOUND})")
        assert recall >= GRAPH_RECALL_BOUND
        assert len(set(ids.ravel().tolist()) - set(fact_ids)) == 0  # the user's facts only
        assert np.all(np.diff(dist, axis=1) >= 0)  # best first
        found = np.take_along_axis(d, np.vectorize(pos.get)(ids), axis=1)
        np.testing.assert_allclose(dist, found, atol=1e-5)  # the true distances
        # automatic chooses per namespace between the two searches above and runs the one it
        # chose with the same parameters: its answer is one of theirs, ids and distances bit for bit
        same_as = [algo for algo in ("exact", "graph")
                   if all(np.array_equal(got, want)
                          for got, want in zip(results["automatic"], results[algo]))]
        assert same_as, f"{c['user']}: the automatic search's answer is neither search's"
        print(f"{c['user']}: automatic search answered as {' and '.join(same_as)}")


def test_index_refusals_change_nothing():
    index = Index(4)
    v = np.eye(4, dtype=np.float32)
    index.add(1, v, [1, 2, 3, 4])
    version = index.version
    bad = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="dimension is 4"):
        index.add(1, bad, [5, 6])
    with pytest.raises(ValueError, match="2 vectors but 1 ids"):
        index.add(1, v[:2], [5])
    with pytest.raises(ValueError):
        index.add(2, v[:1], [1])  # id 1 exists (in another namespace)
    z = np.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match="zero"):
        index.add(1, z, [9])
    with pytest.raises(ValueError, match="unknown fact id 77"):
        index.erase([2, 77])
    assert index.version == version and index.size(1) == 4 and index.contains(2)
    out_i = np.empty((1, 2), np.uint64)
    out_d = np.empty((1, 2), np.float32)
    with pytest.raises(ValueError):
        index.search(5, v[:1], 2, out_i, out_d)  # no ns 5
    with pytest.raises(ValueError, match="algo"):
        index.search(1, v[:1], 2, out_i, out_d, "fuzzy")
    # arrays are checked before anything is read or written: the outputs' shapes, the dtype
    with pytest.raises(ValueError, match=r"out_ids is \[1, 3\], the search writes \[1, 2\]"):
        index.search(1, v[:1], 2, np.empty((1, 3), np.uint64), out_d)
    with pytest.raises(ValueError, match=r"out_distances is \[2, 2\]"):
        index.search(1, v[:1], 2, out_i, np.empty((2, 2), np.float32))
    with pytest.raises(TypeError):  # float64 rows: nanobind refuses the argument's type
        index.add(1, np.ones((1, 4)), [10])
    with pytest.raises(TypeError):  # not C-contiguous
        index.add(1, np.ones((4, 8), np.float32)[:, ::2], [10, 11, 12, 13])
    assert index.version == version and index.size(1) == 4
    with pytest.raises(ValueError, match="metric"):
        Index(4, "manhattan")


# -- Memory: retrieve, request_for_query, persistence, erase, refusals --------------------
@pytest.fixture(scope="module")
def small(embedder, locomo, vectors):
    """A memory with two users' first 40 turns each (the library searches these exactly)."""
    mem = new_memory(embedder)
    users = {}
    for c, v in zip(locomo, vectors):
        ids = fill(mem, c["user"], c["turns"][:40])
        users[c["user"]] = {"ids": ids, "rows": v["turns"][:40], "questions": c["questions"][:15],
                            "q": v["questions"][:15]}
    mem.commit()
    return mem, users


def test_retrieve_equals_brute_force(small):
    mem, users = small
    for user, u in users.items():
        order, d = brute_force(u["rows"], u["q"], 5)
        got = np.array([mem.retrieve(user, text, 5) for text in u["questions"]])
        dist = np.array([[d[i][u["ids"].index(f)] for f in row] for i, row in enumerate(got)])
        same = check_top_k(got, dist, u["ids"], d, 5)
        assert same == len(u["questions"]), f"{user}: {same}/{len(u['questions'])} in brute force's order"


def test_request_for_query_composes_retrieval(small):
    mem, users = small
    user = next(iter(users))
    q = users[user]["questions"][0]
    retrieved = mem.retrieve(user, q, 3)
    r = mem.request_for_query(user, q, [7, 8, 9], 3)
    assert r["retrieved"] == retrieved
    expect = mem.request(user, retrieved[::-1], [7, 8, 9])  # best last: nearest the query
    assert r["prompt"] == expect["prompt"] and r["extra_args"] == expect["extra_args"]
    assert r["extra_args"]["kv_transfer_params"]["inferscale"]["facts"] == retrieved[::-1]
    first = mem.request_for_query(user, q, [7, 8, 9], 3, order="best_first")
    assert first["extra_args"]["kv_transfer_params"]["inferscale"]["facts"] == retrieved
    with pytest.raises(ValueError, match="order"):
        mem.request_for_query(user, q, [7], 3, order="random")


def test_persistence_round_trip(small, embedder):
    mem, users = small
    queries = {user: u["questions"][:10] for user, u in users.items()}
    before = {user: [mem.retrieve(user, t, 4) for t in qs] for user, qs in queries.items()}
    # a reader of the snapshot the facade saved (index loaded, nothing re-embedded) answers alike
    reader = Memory.open(mem.directory, embedder)
    after = {user: [reader.retrieve(user, t, 4) for t in qs] for user, qs in queries.items()}
    assert after == before
    # a reader refreshes onto the writer's new generation
    user = next(iter(users))
    fid = fill(mem, user, ["Caroline's boat is called Maré."])[0]
    with pytest.raises(ValueError, match="k must be an int"):  # not committed: not there yet
        reader.retrieve(user, "boat", len(reader.facts(user)) + 1)
    mem.commit()
    assert reader.refresh() is True and reader.refresh() is False
    assert reader.retrieve(user, "What is the name of Caroline's boat?", 1) == [fid]
    # one writer: a second one is refused while this one holds the lock
    with pytest.raises(ValueError, match="another writer"):
        Memory.open(mem.directory, embedder, writer=True)
    third = Memory.open(mem.directory, embedder)
    assert third.retrieve(user, "What is the name of Caroline's boat?", 1) == [fid]


def test_erase_removes_from_retrieval(embedder, locomo, vectors):
    mem = new_memory(embedder)
    c, v = locomo[0], vectors[0]
    ids = fill(mem, "u", c["turns"][:40])
    mem.commit()
    q = c["questions"][0]
    top = mem.retrieve("u", q, 3)
    mem.erase_fact(top[0])
    left = [i for i in ids if i != top[0]]
    rows = np.stack([v["turns"][ids.index(i)] for i in left])
    order, _ = brute_force(rows, embedder.embed(q), 3)
    expect = [left[i] for i in order[0]]
    assert mem.retrieve("u", q, 3) == expect and top[0] not in expect
    with pytest.raises(ValueError, match="k must be an int in 1 .. 39"):
        mem.retrieve("u", q, 40)  # one fewer fact now
    mem.commit()
    reopened = Memory.open(mem.directory, embedder)
    assert reopened.retrieve("u", q, 3) == expect
    assert top[0] not in reopened.facts("u")
    for f in left:  # the last fact gone: the user is gone
        mem.erase_fact(f)
    with pytest.raises(ValueError, match="unknown user"):
        mem.retrieve("u", q, 1)
    mem.close()


def test_bad_input_refused_before_anything_changes(small, embedder):
    mem, users = small
    user = next(iter(users))
    n = len(mem.facts(user))
    with pytest.raises(ValueError, match="unknown user 'nobody'"):
        mem.retrieve("nobody", "anything", 1)
    for k in (0, -1, n + 1, 2.0, True):
        with pytest.raises(ValueError, match=f"k must be an int in 1 .. {n}"):
            mem.retrieve(user, "anything", k)
    with pytest.raises(ValueError, match="384"):
        mem.search(user, np.ones(383, np.float32), 1)
    with pytest.raises(ValueError, match="NaN"):
        mem.search(user, np.full(384, np.nan, np.float32), 1)
    with pytest.raises(ValueError, match="zero"):
        mem.search(user, np.zeros(384, np.float32), 1)
    with pytest.raises(ValueError, match="at most 256"):
        mem.retrieve(user, "word " * 300, 1)
    # a refused add_fact leaves the memory as it was (ids, store, index, catalogue)
    state = (mem.manifest["next_id"], mem.store.num_facts, mem.facts(user))
    kv = np.zeros((1, 1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="empty"):
        mem.add_fact(user, "   ", [1], kv, kv)
    with pytest.raises(ValueError):
        mem.add_fact(user, "wrong K/V shape", [1], np.zeros((2, 1, 1, 8), np.float32), kv)
    assert (mem.manifest["next_id"], mem.store.num_facts, mem.facts(user)) == state
    # without its embedder a memory with retrieval still opens, but refuses to embed
    blind = Memory.open(mem.directory)
    blind_state = (blind.manifest["next_id"], blind.store.num_facts)
    with pytest.raises(ValueError, match="open it with that embedder"):
        blind.retrieve(user, "anything", 1)
    with pytest.raises(ValueError, match="needs the writer"):
        blind.add_fact(user, "a fact", [1], kv, kv)
    assert (blind.manifest["next_id"], blind.store.num_facts) == blind_state

    class Other:
        def description(self):
            return {"name": "other-model", "dim": 384}

    with pytest.raises(ValueError, match="embeds with"):
        Memory.open(mem.directory, Other())
    # a memory made without an embedder has no retrieval
    plain = Memory.create(tempfile.mkdtemp(), model=MODEL, dtype="float32", num_pages=8)
    fill(plain, "u", ["a fact"])
    with pytest.raises(ValueError, match="no embedder"):
        plain.retrieve("u", "a fact", 1)
    with pytest.raises(ValueError, match="no embedder"):
        plain.add_fact("u", "x", [1], kv, kv, embed_text="x")
