#!/usr/bin/env python3
"""Load over HTTP: the memory server (``python -m inferscale_vllm.serve``) under 1 / 8 / 32 / 64
concurrent users, each with a memory of their own, memory injected against the same server
answering with the facts as text (the Mem0 way), in the same run.

Each user's facts are LoCoMo turns (read from ../shared/data/locomo, never copied), a slice of one
conversation per user, written through the server's API (encoded by the running engine). Each
request asks one of that conversation's LoCoMo questions; the server retrieves the user's top k
(k = --k) for it, so every request has its own set and order of facts, as real questions give.
  injected  POST /v1/chat/completions with ``user``: retrieval, composition and the connector's
            load in the server; TTFT from the request to the first streamed token.
  text      the same facts, retrieved beforehand (untimed) through /v1/memory/{user}/retrieve,
            sent as a system message of plain text to the same server without ``user``: vLLM
            prefills them (prefix caching on: the shared system head is a hit, the facts are not).
  repeated  one user asking the same question again and again, both ways: vLLM's own prefix
            cache then holds the text request's facts too, where injection pays least.
  offline   (--offline N) after the server stops, the same memory directory, users, questions
            and k through the connector in an offline ``vllm.LLM`` (the package's Memory composes
            the same prompt ids and salt; the facts as text the same chat) with the server's
            engine configuration (block size, sequences, --max-num-batched-tokens: vLLM's CPU
            defaults differ, 2048 served against 4096 offline): N requests at once,
            TTFT from vLLM's request metrics, so the server's speed-up can be set beside the
            offline connector's, same machine, same run.
Every injected answer is checked for its own user's facts (``x-inferscale-memory``: the user
and fact ids) and, for each user's marker fact (a code of their own, written first), the
answer's text for another user's code; the leak count is printed. --leak-requests N adds N
more injected requests (all users at once, max_tokens 8) for that check alone. Prints the CPU (model, AVX2 / AVX-512 / AMX) with
the figures and writes JSON (--json); plot_serve.py draws TTFT and throughput against users from it.
Usage:
  eval "$(bash .ci/vllm --print)"; export INFERSCALE_MINILM_HF
  PYTHONPATH=build/ci/examples/engine/vllm/python "$INFERSCALE_VLLM_PYTHON" \\
      bench/serve/bench_serve.py --users 1,8,32,64 --k 20 [--offline 32] [--leak-requests 1000] \\
      [--json out.json]
  python3 bench/serve/plot_serve.py out.json out.png   # a Python with matplotlib
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "vllm"))
from bench_args import add_model_and_locomo, check_model_and_locomo, cpu_description  # noqa: E402

SYSTEM = "You are a helpful assistant. Facts you remember about the user:"


def locomo_users(path, users, facts):
    """Per user: `facts` turns of one conversation (user u reads conversation u % 10 from turn
    (u // 10) * facts), and that conversation's questions."""
    with open(path) as f:
        data = json.load(f)
    out = []
    for u in range(users):
        conv = data[u % len(data)]
        turns = []
        s = 1
        while f"session_{s}" in conv["conversation"]:
            turns += [f"{t['speaker']}: {t['text']}" for t in conv["conversation"][f"session_{s}"]]
            s += 1
        start = (u // len(data)) * facts
        if start + facts > len(turns):
            raise SystemExit(f"bench_serve: conversation {u % len(data)} has {len(turns)} turns")
        questions = [q["question"] for q in conv["qa"] if isinstance(q.get("question"), str)]
        # at most 600 characters a fact: MiniLM embeds up to 256 word pieces, never truncated
        out.append({"user": f"user{u}", "facts": [t[:600] for t in turns[start:start + facts]],
                    "questions": questions, "marker": marker_code(u)})
    return out


def marker_code(u: int) -> str:
    """User u's own code (distinct digits per user: no code is a substring of another's)."""
    return f"Q{7000 + 37 * u}Z"


def marker_fact(u: dict) -> str:
    return f"My locker code is {u['marker']}."


async def stream_ttft(client, url, headers, body):
    """(TTFT, total, the memory header or None, the answer's text) of one streamed request."""
    t = time.perf_counter()
    first = None
    text = []
    async with client.stream("POST", url, json=body, headers=headers, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()[:300]}")
        memory = r.headers.get("x-inferscale-memory")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
            if first is None and delta:
                first = time.perf_counter() - t
            text.append(delta)
    return first if first is not None else time.perf_counter() - t, \
        time.perf_counter() - t, json.loads(memory) if memory else None, "".join(text)


def engine_ttft(server) -> tuple[float, int]:
    """(sum of seconds, count) of vLLM's own ``vllm:time_to_first_token_seconds`` histogram on the
    server's /metrics: TTFT from the request's arrival in vLLM's engine client (after the memory
    server's retrieval and composition) to its first token, as the offline connector's
    ``first_token_latency`` counts it."""
    import httpx

    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text
    total, count = 0.0, 0
    for line in text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:time_to_first_token_seconds_count"):
            count += int(float(line.rsplit(" ", 1)[1]))
    return total, count


def leaked(u: dict, memory, answer: str, codes: set) -> bool:
    """A response that used another user's memory, or names another user's code."""
    if memory is None or memory["user"] != u["user"] or not set(memory["facts"]) <= set(u["ids"]):
        return True
    return any(c in answer for c in codes - {u["marker"]})


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def level(server, users, n, reqs, k, max_tokens, mode, repeated=False, offset=0,
                marker=False):
    """n users at once, `reqs` requests each (one after another per user); `offset` shifts the
    questions asked (a warm-up asks others than the measured requests, so that these find
    nothing of it in the prefix cache); marker: each user asks for their own code."""
    import httpx

    url = f"{server.url}/v1/chat/completions"
    ttfts, leaks, checked, compose, embed, batches = [], 0, 0, [], [], set()
    codes = {u["marker"] for u in users}
    def question(u, i):
        return "What is my locker code?" if marker else u["questions"][
            0 if repeated else (i * 7 + len(u["user"]) + offset) % len(u["questions"])]

    async with httpx.AsyncClient() as client:
        texts = {}
        if mode == "text":
            # the facts each text request sends, retrieved before the level starts (untimed, as
            # the offline run composes its prompts before generate): the requests then reach the
            # server together, as the injected ones do, not spaced by the retrievals' batches
            async def facts_of(u, i):
                r = await client.post(f"{server.url}/v1/memory/{u['user']}/retrieve",
                                      json={"query": question(u, i), "k": k},
                                      headers=server.headers, timeout=300)
                r.raise_for_status()
                texts[(u["user"], i)] = [f["text"] for f in r.json()["facts"]][::-1]  # best last
            await asyncio.gather(*(facts_of(u, i) for u in users[:n] for i in range(reqs)))

        async def one_user(u):
            nonlocal leaks, checked
            for i in range(reqs):
                q = question(u, i)
                if mode == "injected":
                    body = {"model": "smollm2", "user": u["user"], "stream": True,
                            "max_tokens": max_tokens, "temperature": 0.0,
                            "messages": [{"role": "user", "content": q}],
                            "memory": {"k": k}}
                else:
                    system = SYSTEM + "\n" + "".join(f"- {f}\n" for f in texts[(u["user"], i)])
                    body = {"model": "smollm2", "stream": True, "max_tokens": max_tokens,
                            "temperature": 0.0,
                            "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": q}]}
                ttft, _, memory, answer = await stream_ttft(client, url, server.headers, body)
                ttfts.append(ttft)
                if mode == "injected":
                    checked += 1
                    if memory is not None:
                        compose.append(memory.get("compose_ms", 0.0))
                        parts = memory.get("compose_parts_ms", {})
                        embed.append(parts.get("embed", 0.0))
                        batches.add((parts.get("embed_batch"), parts.get("embed_forward")))
                    leaks += leaked(u, memory, answer, codes)

        t = time.perf_counter()
        await asyncio.gather(*(one_user(u) for u in users[:n]))
        wall = time.perf_counter() - t
    return {"users": n, "mode": mode, "requests": len(ttfts), "rps": len(ttfts) / wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_mean_ms": 1e3 * statistics.fmean(ttfts),
            "ttft_p99_ms": 1e3 * percentile(ttfts, 99), "leaks": leaks, "checked": checked,
            "compose_p50_ms": statistics.median(compose) if compose else None,
            "embed_p50_ms": statistics.median(embed) if embed else None,
            "embed_batches": sorted(batches, key=str)}


def offline(a, users, n, directory):
    """The offline connector on the server's memory: n users' requests at once through
    ``vllm.LLM`` with InferScaleConnector, injected and as text; TTFT from vLLM's request
    metrics (first_token_latency)."""
    import transformers
    from vllm import SamplingParams

    from inferscale_vllm.embed import MiniLMEmbedder
    from inferscale_vllm.engine import make_llm
    from inferscale_vllm.memory import Memory
    from inferscale_vllm.serve import DEFAULT_SYSTEM, MARKER
    from inferscale_vllm.server_process import BLOCK

    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    embedder = MiniLMEmbedder(os.environ.get("INFERSCALE_MINILM_HF") or None)
    mem = Memory.open(directory, embedder)
    # the server's engine configuration (block, sequences, token budget, prefix caching)
    from inferscale_vllm.engine import kv_transfer_config

    llm = make_llm(a.model, directory, capture=False, block_size=BLOCK,
                   kv_transfer_config=kv_transfer_config(directory, a.memory_load),
                   max_num_seqs=max(max(int(x) for x in a.users.split(",")), 1),
                   max_num_batched_tokens=a.max_num_batched_tokens,
                   enable_prefix_caching=True, disable_log_stats=False)  # stats: the TTFTs
    rows = []
    try:
        def prompts(mode, offset):
            out = []
            for i, u in enumerate(users[:n]):
                q = u["questions"][(i * 7 + len(u["user"]) + offset) % len(u["questions"])]
                text = tok.apply_chat_template(
                    [{"role": "system", "content": DEFAULT_SYSTEM + "\n" + MARKER},
                     {"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                tail = text.split(MARKER)[1]
                retrieved = mem.retrieve(u["user"], embedder.embed(q)[0], a.k)
                if mode == "injected":
                    r = mem.request(u["user"], retrieved[::-1],
                                    tok.encode(tail, add_special_tokens=False))
                    out.append((r["prompt"], SamplingParams(temperature=0.0,
                                                            max_tokens=a.max_tokens,
                                                            extra_args=r["extra_args"])))
                else:
                    facts = [mem.text(f) for f in retrieved][::-1]
                    system = SYSTEM + "\n" + "".join(f"- {f}\n" for f in facts)
                    text = tok.apply_chat_template(
                        [{"role": "system", "content": system}, {"role": "user", "content": q}],
                        tokenize=False, add_generation_prompt=True)
                    ids = tok.encode(text, add_special_tokens=False)
                    out.append(({"prompt_token_ids": ids},
                                SamplingParams(temperature=0.0, max_tokens=a.max_tokens)))
            return out

        for mode in ("injected", "text"):
            warm = prompts(mode, 3)[:1]
            llm.generate([p for p, _ in warm], [s for _, s in warm], use_tqdm=False)
            batch = prompts(mode, 0)
            t = time.perf_counter()
            outs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
            wall = time.perf_counter() - t
            if any(o.metrics is None for o in outs):
                raise SystemExit("bench_serve: vLLM handed back no request metrics (TTFT)")
            ttfts = [o.metrics.first_token_latency for o in outs]
            loaded = [((o.kv_transfer_params or {}).get("inferscale") or {}).get("loaded_tokens", 0)
                      for o in outs]
            if mode == "injected" and min(loaded) <= 0:
                raise SystemExit(f"bench_serve: an offline injected request loaded nothing: {loaded}")
            rows.append({"users": n, "mode": f"offline-{mode}", "requests": len(outs),
                         "rps": len(outs) / wall, "ttft_p50_ms": 1e3 * statistics.median(ttfts),
                         "ttft_mean_ms": 1e3 * statistics.fmean(ttfts),
                         "ttft_p99_ms": 1e3 * percentile(ttfts, 99)})
    finally:
        llm.llm_engine.engine_core.shutdown()
        mem.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_and_locomo(ap)
    ap.add_argument("--users", default="1,8,32,64")
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--requests", type=int, default=2, help="requests per user per level")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--offline", type=int, default=0,
                    help="users at once for the offline connector on the same memory (0: none)")
    ap.add_argument("--leak-requests", type=int, default=0,
                    help="injected requests more, all users at once, each answer checked for "
                         "other users' codes")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="the engine's token budget per step, the same for the server and the "
                         "offline run (vLLM's CPU defaults differ: 2048 served, 4096 offline)")
    ap.add_argument("--memory", help="the memory directory: kept after the run, and a user whose "
                    "facts it already holds (the same texts) is not written again")
    ap.add_argument("--memory-load", default="exact", choices=("exact", "all", "blocks"),
                    help="the server's --memory-load (the offline run's connector the same)")
    ap.add_argument("--write-only", action="store_true",
                    help="write the users' facts into --memory and stop (no level is measured)")
    ap.add_argument("--json")
    a = ap.parse_args()
    check_model_and_locomo(a, "bench_serve")
    from inferscale_vllm.server_process import Server

    levels = [int(x) for x in a.users.split(",")]
    users = locomo_users(a.locomo, max(levels), a.k)
    cpu = cpu_description()
    print(f"bench_serve: {cpu}", flush=True)
    work = tempfile.mkdtemp(prefix="inferscale-bench-serve-")
    log = open(os.path.join(work, "server.log"), "w")
    memory_dir = os.path.abspath(a.memory) if a.memory else os.path.join(work, "memory")
    server = Server(a.model, memory_dir, log, "bench-" + os.urandom(4).hex(),
                    ["--memory-pages", str(max(levels) * a.k * 8 + 64), "--memory-k", str(a.k),
                     "--max-num-seqs", str(max(levels)),
                     "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                     "--memory-load", a.memory_load])
    t = time.perf_counter()
    server.start()
    print(f"bench_serve: server up in {time.perf_counter() - t:.0f} s", flush=True)
    try:
        import httpx

        t = time.perf_counter()
        for u in users:
            r = httpx.get(f"{server.url}/v1/memory/{u['user']}/facts", headers=server.headers,
                          timeout=60)
            if r.status_code == 200:  # a kept memory (--memory): reused if it holds these facts
                held = r.json()["facts"]
                if [f["text"] for f in held] == [x.strip() for x in [marker_fact(u)] + u["facts"]]:
                    u["ids"] = [f["id"] for f in held]
                    continue
                raise SystemExit(f"bench_serve: {memory_dir} holds other facts for {u['user']}")
            r = httpx.post(f"{server.url}/v1/memory/{u['user']}/facts",
                           json={"facts": [marker_fact(u)] + u["facts"]},
                           headers=server.headers, timeout=3600)
            r.raise_for_status()
            u["ids"] = r.json()["ids"]
        written = sum(len(u["ids"]) for u in users)
        print(f"bench_serve: {written} facts of {len(users)} users written through the API in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        if a.write_only:
            if not a.memory:
                raise SystemExit("bench_serve: --write-only keeps nothing without --memory")
            return 0
        rows = []
        for n in levels:
            for mode in ("injected", "text"):
                # warm (the engine's first requests pay one-time costs): another question
                asyncio.run(level(server, users, 1, 1, a.k, a.max_tokens, mode, offset=3))
                before = engine_ttft(server)
                row = asyncio.run(level(server, users, n, a.requests, a.k, a.max_tokens, mode))
                after = engine_ttft(server)
                if after[1] - before[1] != row["requests"]:
                    raise SystemExit(f"bench_serve: vLLM counted {after[1] - before[1]} first "
                                     f"tokens for {row['requests']} requests")
                row["engine_ttft_mean_ms"] = 1e3 * (after[0] - before[0]) / row["requests"]
                rows.append(row)
                print(f"  {n:3d} users  {mode:8s}  TTFT p50 {row['ttft_p50_ms']:8.1f} ms  p99 "
                      f"{row['ttft_p99_ms']:8.1f} ms  {row['rps']:6.2f} req/s  mean "
                      f"{row['ttft_mean_ms']:.1f} ms (vLLM's own {row['engine_ttft_mean_ms']:.1f})"
                      + (f"  retrieval+composition p50 {row['compose_p50_ms']:.1f} ms (the "
                         f"query's embedding {row['embed_p50_ms']:.1f}; forwards (queries, ms) "
                         f"{row['embed_batches']})  leaks "
                         f"{row['leaks']}/{row['checked']}" if mode == "injected" else ""),
                      flush=True)
        repeated = []
        for mode in ("injected", "text"):
            row = asyncio.run(level(server, users, 1, 4, a.k, a.max_tokens, mode, repeated=True))
            row["mode"] = f"{mode}-repeated"
            repeated.append(row)
            print(f"  repeated question, 1 user  {mode:8s}  TTFT p50 {row['ttft_p50_ms']:.1f} ms",
                  flush=True)
        if a.leak_requests:
            reqs = -(-a.leak_requests // len(users))
            t = time.perf_counter()
            row = asyncio.run(level(server, users, len(users), reqs, a.k, 8, "injected",
                                    marker=True))
            row["mode"] = "injected-leak-check"
            repeated.append(row)
            print(f"  leak check: {row['checked']} injected answers of {len(users)} users at once "
                  f"(each asked for their own code) in {time.perf_counter() - t:.0f} s: "
                  f"{row['leaks']} leaks; TTFT p50 {row['ttft_p50_ms']:.1f} ms, "
                  f"{row['rps']:.2f} req/s", flush=True)
        by = {(r["users"], r["mode"]): r for r in rows}
        for n in levels:
            i, x = by[(n, "injected")], by[(n, "text")]
            print(f"  {n:3d} users: TTFT speed-up {x['ttft_p50_ms'] / i['ttft_p50_ms']:.2f}x (p50), "
                  f"requests/s {i['rps'] / x['rps']:.2f}x", flush=True)
        leaks = sum(r["leaks"] for r in rows + repeated)
        checked = sum(r["checked"] for r in rows + repeated)
        print(f"bench_serve: leaks {leaks} in {checked} injected answers", flush=True)
    finally:
        server.stop()
        log.close()
    result = {"cpu": cpu, "k": a.k, "max_tokens": a.max_tokens, "rows": rows,
              "repeated": repeated, "leaks": leaks, "checked": checked}
    if a.offline:
        n = a.offline
        off = offline(a, users, n, memory_dir)
        result["offline"] = off
        o = {r["mode"]: r for r in off}
        oi, ot = o["offline-injected"], o["offline-text"]
        offline_x = ot["ttft_p50_ms"] / oi["ttft_p50_ms"]
        for r in off:
            print(f"  {n:3d} users  {r['mode']:16s}  TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p99 "
                  f"{r['ttft_p99_ms']:8.1f} ms  {r['rps']:6.2f} req/s", flush=True)
        line = f"  {n:3d} users: offline connector TTFT speed-up {offline_x:.2f}x (p50)"
        if (n, "injected") in by:
            served_x = by[(n, "text")]["ttft_p50_ms"] / by[(n, "injected")]["ttft_p50_ms"]
            result["served_over_offline"] = served_x / offline_x
            line += (f"; through HTTP {served_x:.2f}x: {100 * served_x / offline_x:.0f} % of the "
                     f"offline speed-up")
        print(line, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if leaks == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
