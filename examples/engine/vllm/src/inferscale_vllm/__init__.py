"""InferScale as a vLLM KV connector.

A user's long-term memory is stored once as pre-RoPE K/V (one fact per memory item); at request time
the facts a request names are composed at its first positions, rotated with vLLM's own rotary table
and written by InferScale's C++ injection path straight into the paged cache tensors vLLM hands the
connector, so vLLM prefills only the query.

Pieces:
  - ``Memory`` (memory.py): the memory directory through the library's memory facade, bound once
    (``_inferscale.Memory``: store, index, fact lifecycle, crash-safe snapshot), with this
    package's record of users, texts and the model's identity in the same snapshot; one writer
    at a time, readers that never fail while it commits; retrieval and the client helpers
    ``request`` / ``request_for_query``. Fact capture through vLLM itself is encode.py.
  - ``InferScaleConnector`` (connector.py): the KVConnectorBase_V1 subclass vLLM loads with
    ``--kv-transfer-config '{"kv_connector": "InferScaleConnector",
    "kv_connector_module_path": "inferscale_vllm.connector", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"memory_dir": ...}}'``.
  - ``MiniLMEmbedder`` (embed.py): all-MiniLM-L6-v2 sentence embeddings (torch + transformers),
    what a memory with retrieval embeds its facts and queries with.
  - ``_inferscale``: the compiled extension (store, vLLM CPU cache descriptor, inject, extract, the
    library's host graph index for retrieval; built with INFERSCALE_VLLM_CUDA=ON also device stores,
    vLLM's GPU cache descriptor ``VllmFlashAttnCache`` and ``inject`` with a CUDA stream —
    ``HAS_CUDA`` says which).
"""

from ._inferscale import (  # noqa: F401
    HAS_CUDA, Index, Rotation, Store, VllmCpuCache, VllmFlashAttnCache, extract, inject)
from .memory import Memory, MemoryReader  # noqa: F401

__all__ = ["HAS_CUDA", "Index", "Memory", "MemoryReader", "Rotation", "Store",
           "VllmCpuCache", "VllmFlashAttnCache", "extract", "inject"]
__version__ = "0.1.0"
