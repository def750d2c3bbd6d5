"""InferScaleConnector: InferScale as a vLLM V1 KV connector (``KVConnectorBase_V1``).

Enable with (nothing else in vLLM changes):
    --kv-transfer-config '{"kv_connector": "InferScaleConnector",
        "kv_connector_module_path": "inferscale_vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"memory_dir": "/path/to/memory"}}'

A request asks for memory through ``kv_transfer_params = {"inferscale": {"user", "facts",
"generation", "memory_tokens"[, "recompute_tokens"]}}`` with a prompt that starts with the memory segment (prefix + the
facts' tokens) and carries the memory's keyed ``cache_salt`` — ``Memory.request`` builds all three.

Scheduler side (one instance, in the engine core): checks the request against the memory (user,
facts, the prompt's leading tokens equal the composed segment, the salt, the model), and offers
vLLM the segment (but a request's recompute_tokens): as many of its tokens, the last block partly,
as leave vLLM a rest it computes with the GEMM kernels of its cold prefill (``partial_last_block``
"measured": the token classes each worker measures at start-up, token_classes.py), whole blocks
where nothing was measured (the GPU path). Anything
wrong is logged once with the reason and the request is prefilled normally (0 tokens offered).
Worker side (one per rank): holds its shard of the store (its KV heads under tensor parallelism),
and before the forward writes each admitted request's tokens into the blocks vLLM allocated,
through InferScale's C++ injection (rotation with vLLM's own rotary table, with the rounding that
reproduces vLLM's rotary kernel on this machine). Where vLLM's KV caches are CUDA tensors (a GPU
vLLM), the worker takes the device path: its store shard is copied to device memory, the caches
are described as vLLM's GPU layout (VllmFlashAttnCache) and the injection is enqueued on torch's
current CUDA stream (needs the extension built with INFERSCALE_VLLM_CUDA=ON). A failed load reports the request's blocks through
``get_block_ids_with_load_errors``; with ``kv_load_failure_policy = "recompute"`` vLLM then
prefills them, and keeps serving.

Testing failpoint: with INFERSCALE_VLLM_FAIL_LOAD_FOR_USER=<user> in the workers' environment, every
load for that user fails in the worker as an exception in the injection would (the tests use it).

Capture while serving (serve_capture.py): a request with
``kv_transfer_params = {"inferscale_capture": {"id": ...}}`` gets its prompt's K/V read back from
vLLM's cache, as cached, after the forward that computed its last prompt token
(``wait_for_save``), each rank its own KV heads, in ``<memory_dir>/.captures/<id>.rank<r>.npz``
with the rotation the reader needs; ``read_capture`` de-rotates them to pre-RoPE K/V (and makes
the keys exact) in the process that reads them, off the engine step. The rotation (pairing,
rotary dims, table) is read from the model's rotary module for both directions (rotary.py).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import _inferscale
from .memory import MemoryReader, cache_salt, check_model, describe_model, shard_store
from .rotary import find_model_runner, model_rotary
from .serve_capture import ROUNDING_MODES, CaptureScheduler, CaptureWriter
from .tensors import kv_cache_descriptor
from .token_classes import ClassCache, TokenClasses, exact_load, join, measure_layers

logger = logging.getLogger("vllm.inferscale")  # vLLM's handlers: its log shows ours
# How long a request may wait for a just-committed generation to load before it is prefilled.
DEFER_SECONDS = 30.0
# INFERSCALE_VLLM_TRACE=<file>: each memory request's connector work, one JSON line per event,
# appended by the process that does it (scheduler: the planning hooks; each worker: the load),
# for a TTFT breakdown (bench/vllm/bench_vllm.py). Unset (the default): nothing is timed.
TRACE_ENV = "INFERSCALE_VLLM_TRACE"


def _trace(event: dict) -> None:
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    import json

    try:
        with open(path, "a") as f:  # one write per line: lines of several processes interleave
            f.write(json.dumps(event) + "\n")
    except OSError as e:  # a trace never fails a request
        logger.warning("inferscale: %s=%s not written: %r", TRACE_ENV, path, e)


def _timed_hook(hook):
    """The scheduler hook, its seconds traced per memory request (INFERSCALE_VLLM_TRACE)."""
    import functools

    @functools.wraps(hook)
    def timed(self, request, *args):
        if not os.environ.get(TRACE_ENV) or not (request.kv_transfer_params or {}).get("inferscale"):
            return hook(self, request, *args)
        t = time.perf_counter()
        try:
            return hook(self, request, *args)
        finally:
            _trace({"side": "scheduler", "hook": hook.__name__, "request": request.request_id,
                    "seconds": time.perf_counter() - t})

    return timed


@dataclass
class _Load:
    request_id: str
    user: str
    facts: list  # fact ids in layout order (prefix first)
    slots: list  # one per segment token; -1 = not loaded (vLLM computes it, or already cached)
    block_ids: list  # the blocks these slots fall in (reported on a failed load)
    generation: int = 0  # the memory generation the plan was checked against (0: none, a failure)
    error: str | None = None  # set: the scheduler could not plan it; the worker reports its blocks


@dataclass
class InferScaleMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    # serve_capture.CaptureJob of the requests whose prompt is finished in this step: after the
    # forward each worker reads their K/V back from its cache (wait_for_save)
    captures: list = field(default_factory=list)


@dataclass
class InferScaleHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler side once, at start-up (vLLM's connector handshake):
    the token classes of its linear layers (token_classes.py, TokenClasses.to_list())."""
    token_classes: list = field(default_factory=list)


def _worker_view(shard, device):
    """What a worker keeps of a generation: its store shard (its KV heads and layers), in device
    memory on the GPU path."""

    def transform(facade, app):
        store = facade.store
        if shard is not None:
            layers, heads, _ = store.geometry
            first_head, num_heads, first_layer, num_layers = shard
            if (first_head, num_heads, first_layer, num_layers) != (0, heads, 0, layers):
                store = shard_store(store, [int(k) for k in app["facts"]], *shard)
        if device:
            store = store.to_device()
        logger.info("inferscale: memory generation %d loaded (%d facts)", app["generation"],
                    len(app["facts"]))
        return (facade, store)  # the facade keeps a view's store alive

    return transform


def _layer_index(name: str) -> int:
    """The model's (global) layer index in a KV cache's name, e.g. 'model.layers.17.self_attn.attn'
    -> 17 (vLLM names a pipeline stage's layers by their index in the whole model)."""
    m = re.fullmatch(r"(?:.*\.)?layers\.(\d+)\.(?:.*)", name)
    if not m or len(re.findall(r"(?:^|\.)layers\.\d+\.", name)) != 1:
        raise ValueError(f"inferscale: cannot tell the layer of KV cache '{name}'")
    return int(m.group(1))


def rank_layers(kv_caches, total_layers: int) -> tuple[int, int]:
    """(first layer, number of layers) of the KV caches a worker was handed, by their names: one
    cache per layer, a contiguous run inside the model's [0, total_layers). Raises otherwise (a
    store shard is one run of layers; anything else would inject the wrong layers)."""
    if not kv_caches:
        raise ValueError("inferscale: register_kv_caches got no KV caches")
    by_layer = {}
    for name in kv_caches:
        i = _layer_index(name)
        if i in by_layer:
            raise ValueError(f"inferscale: KV caches '{by_layer[i]}' and '{name}' are both layer "
                             f"{i} (one cache per layer expected)")
        by_layer[i] = name
    layers = sorted(by_layer)
    first, last = layers[0], layers[-1]
    if last >= total_layers:
        raise ValueError(f"inferscale: KV cache '{by_layer[last]}' is layer {last}, the model has "
                         f"{total_layers} layers")
    missing = sorted(set(range(first, last + 1)) - set(layers))
    if missing:
        raise ValueError(f"inferscale: this worker's KV caches skip layers {missing} inside "
                         f"[{first}, {last}] (a contiguous run of layers is expected)")
    return first, len(layers)


def partial_last_block(vllm_config, setting="auto"):
    """How much of the memory segment the connector may load: True (every token, the last block
    partly: vLLM then prefills the query into the rest of it), False (whole blocks only: vLLM
    prefills the segment's tail with the query, up to block_size - 1 more tokens) or "measured"
    (the default on vLLM's CPU path, ``kv_connector_extra_config.partial_last_block`` = "auto"):
    the most tokens for which every row vLLM then computes is computed at a token count of the
    same class as in its cold prefill (token_classes.py: the classes of the model's linear layers,
    measured by every worker at start-up and joined over the ranks), which is every memory token
    wherever the query's count and the prompt's share a class.

    Why: vLLM's GEMMs pick their kernel by the number of tokens in the step, and on an Intel Xeon
    with AMX those kernels round some rows differently (SmolLM2: <= 32, 33-36, 37-575, ... tokens),
    so loading the whole segment made vLLM compute a 16-21-token query with other roundings than its
    cold prefill of the ~225-token prompt (2 of 8 greedy answers differed); its attention over a
    context that ends inside a block is exact (bench/results/2026-12-07-vllm-amx-tail.md). The
    GPU path is not measured: whole blocks there."""
    if setting is True or setting is False:
        return setting
    if setting != "auto":
        raise ValueError(f"InferScaleConnector: kv_connector_extra_config.partial_last_block is "
                         f"true, false or \"auto\", got {setting!r}")
    if getattr(vllm_config.device_config, "device_type", None) != "cpu":
        return False
    return "measured"


def prefill_step_tokens(vllm_config) -> int:
    """The most tokens vLLM computes for one request in one step (its chunk under chunked
    prefill): max_num_batched_tokens, or a smaller long_prefill_token_threshold."""
    sc = vllm_config.scheduler_config
    chunk = int(sc.max_num_batched_tokens)
    threshold = int(getattr(sc, "long_prefill_token_threshold", 0) or 0)
    return min(chunk, threshold) if threshold > 0 else chunk


class InferScaleConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        directory = extra.get("memory_dir")
        if not directory:
            raise ValueError("InferScaleConnector: kv_connector_extra_config.memory_dir is required")
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")
        if policy != "recompute":
            logger.warning("inferscale: kv_load_failure_policy is %r: a failed memory load will "
                           "end its request with an error instead of prefilling it; set "
                           "\"recompute\"", policy)
        self._directory = directory
        self._block_size = vllm_config.cache_config.block_size
        self._partial_block = partial_last_block(vllm_config, extra.get("partial_last_block",
                                                                        "auto"))
        self._step_tokens = prefill_step_tokens(vllm_config)
        self._classes = None  # scheduler side: the workers' token classes (handshake), joined
        self._worker_classes = None  # worker side: this rank's, measured in register_kv_caches
        model = vllm_config.model_config
        # what a memory must have been encoded with (geometry, rotation, dtype, weights' digest)
        self._model = describe_model(model)
        self._vllm_config = vllm_config
        self._refused = {}  # request id -> reason (scheduler side: logged once)
        self._plans = {}  # request id -> (facts, memory_tokens, local hit asked with)
        self._pending = []  # loads decided this step
        self._errors = set()  # worker side: block ids of failed loads
        # scheduler side, for observation: loads planned, and of those for preempted requests
        self.counters = {"loads": 0, "loads_after_preemption": 0}
        self._finished = {}  # request id -> what its load did (returned with its output)
        self._deferred = {}  # request id -> when it first waited for a generation to load
        if role == KVConnectorRole.SCHEDULER:
            self._memory = MemoryReader(directory, transform=_worker_view(None, False))
            self._captures = CaptureScheduler(self._block_size)  # serve_capture.py
        else:
            self._memory = None  # made in register_kv_caches (knows this rank's heads)
            self._cache = None
            self._rotation = None
            self._capture_writer = None  # register_kv_caches (host caches only)
            self._rank = None  # (TP rank, PP stage): register_kv_caches

    # ---------------------------------------------------------------------------------------
    # Scheduler side
    def _plan(self, request):
        """(facts in layout order, memory tokens, tokens to recompute, user, generation), the str
        reason of a refusal, or None while the request's generation is still loading."""
        params = (request.kv_transfer_params or {}).get("inferscale")
        if not isinstance(params, dict):
            return "kv_transfer_params.inferscale is not a dict"
        user, facts, generation = params.get("user"), params.get("facts"), params.get("generation")
        if not isinstance(user, str) or not user:
            return f"user must be a non-empty str, got {user!r}"
        if (not isinstance(facts, list) or not facts
                or not all(isinstance(f, int) and not isinstance(f, bool) for f in facts)):
            return "facts must be a non-empty list of fact ids"
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
            return f"generation must be an int >= 1, got {generation!r}"
        try:
            app, (facade, _) = self._memory.poll()
        except Exception as e:  # noqa: BLE001 - an unreadable memory: prefill
            return f"the memory cannot be read: {e}"
        if app["generation"] < generation:
            if not self._memory.loading:
                return (f"generation {generation} is not committed (the memory's newest is "
                        f"{app['generation']})")
            # committed, still loading here (in the background, off the scheduling path): vLLM
            # asks again in a later step; a load that takes too long is given up (prefill)
            first = self._deferred.setdefault(request.request_id, time.monotonic())
            if time.monotonic() - first > DEFER_SECONDS:
                return f"generation {generation} did not load within {DEFER_SECONDS} s"
            return None
        reason = check_model(app["model"], self._model)
        if reason:
            return reason
        ns = app["users"].get(user)
        owned = set(int(i) for i in facade.facts(ns)) if ns is not None else set()
        if not owned:
            return f"unknown user {user!r}"
        missing = [f for f in facts if f not in owned]
        if missing:
            return f"facts {missing} are not (or no longer) in {user!r}'s memory"
        if len(set(facts)) != len(facts):
            return f"facts {facts} name a fact twice"
        order = ([app["prefix"]] if app["prefix"] is not None else []) + facts
        tokens = facade.store.composed_tokens(order)
        prompt = request.prompt_token_ids or []
        if list(prompt[: len(tokens)]) != list(tokens):
            return "the prompt does not start with the composed memory segment"
        if params.get("memory_tokens") != len(tokens):
            return f"memory_tokens {params.get('memory_tokens')!r} != the segment's {len(tokens)}"
        recompute = params.get("recompute_tokens", 0)
        if (isinstance(recompute, bool) or not isinstance(recompute, int)
                or not 0 <= recompute <= len(tokens)):
            return (f"recompute_tokens {recompute!r} is not an int in [0, {len(tokens)}] (the "
                    "segment's tokens)")
        salt = cache_salt(self._directory, user, facts, generation, recompute)
        if getattr(request, "cache_salt", None) != salt:
            return ("the request's cache_salt is not the memory's (blocks filled from memory "
                    "must not be shared with plain-text requests)")
        return order, len(tokens), recompute, user, app["generation"]

    def _refuse(self, request, reason):
        if self._refused.get(request.request_id) != reason:
            logger.warning("inferscale: request %s served by prefill: %s", request.request_id,
                           reason)
            self._refused[request.request_id] = reason

    @_timed_hook
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        # Nothing a request or a file holds may escape into vLLM's scheduler (it would stop the
        # engine for every user): any failure is logged with the request id and the request is
        # prefilled normally.
        try:
            if not (request.kv_transfer_params or {}).get("inferscale"):
                return 0, False
            plan = self._plan(request)
            if plan is None:
                return None, False  # vLLM asks again in a later step
            if isinstance(plan, str):
                self._refuse(request, plan)
                return 0, False
            order, m, recompute, user, generation = plan
            # Every memory token but the request's recompute_tokens (suffix recompute), at least
            # one prompt token left for vLLM to compute, and of those as many as leave vLLM a
            # rest it computes as in its cold prefill (partial_last_block, token_classes.py).
            usable = min(m - recompute, request.num_prompt_tokens - 1)
            usable = self._exact_usable(request, num_computed_tokens, usable)
            self._plans[request.request_id] = (order, m, num_computed_tokens, user, generation)
            # the report handed back with the output: vLLM's own prefix-cache hit (blocks of an
            # earlier identical request) and what this connector loads on top of it
            self._finished[request.request_id] = {
                "loaded_tokens": 0, "cached_tokens": min(num_computed_tokens, m),
                "memory_tokens": m, "generation": generation}
            return max(0, usable - num_computed_tokens), False
        except Exception as e:  # noqa: BLE001
            logger.exception("inferscale: request %s: the memory check failed", request.request_id)
            self._refuse(request, f"internal error: {e!r}")
            return 0, False

    def _exact_usable(self, request, num_computed_tokens, usable):
        """The memory tokens to count as computed (loaded, or vLLM's own prefix-cache hit) out of
        the `usable` ones, by partial_last_block: all of them; whole blocks; or ("measured") the
        most for which vLLM computes the rest of the prompt as in its cold prefill
        (token_classes.exact_load), whole blocks where no count qualifies or nothing was
        measured."""
        if self._partial_block is True:
            return usable
        whole = usable // self._block_size * self._block_size
        if self._partial_block is False or self._classes is None:
            return whole
        exact = exact_load(request.num_prompt_tokens, num_computed_tokens, usable, self._classes,
                           self._step_tokens)
        return whole if exact is None else exact

    def loading(self) -> dict:
        """How this scheduler-side connector decides what to load (for tests and logs): the mode
        (partial_last_block), the joined token classes (None: not measured), the most tokens of
        one step and the block size."""
        return {"mode": self._partial_block, "classes": self._classes,
                "step_tokens": self._step_tokens, "block_size": self._block_size}

    def set_xfer_handshake_metadata_pp_aware(self, metadata):
        """Scheduler side, once at start-up: every worker's token classes (InferScaleHandshake),
        joined; without one from every rank, nothing is measured (whole blocks)."""
        ranks = (self._vllm_config.parallel_config.tensor_parallel_size
                 * self._vllm_config.parallel_config.pipeline_parallel_size)
        got = [m for m in (metadata or {}).values() if isinstance(m, InferScaleHandshake)]
        if len(got) != ranks or not all(m.token_classes for m in got):
            logger.info("inferscale: token classes from %d of %d workers: the memory's whole "
                        "blocks are loaded (partial_last_block)", len(got), ranks)
            self._classes = None
            return
        self._classes = join(TokenClasses(m.token_classes) for m in got)
        logger.info("inferscale: token classes of the model's linear layers (every rank): %s",
                    self._classes)

    def set_xfer_handshake_metadata(self, metadata):
        self.set_xfer_handshake_metadata_pp_aware({(0, r): m for r, m in metadata.items()})

    @_timed_hook
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens <= 0:
            return
        try:
            order, m, start, user, generation = self._plans[request.request_id]
            block_ids = list(blocks.get_block_ids()[0])
            bs = self._block_size
            end = start + num_external_tokens
            slots = [block_ids[p // bs] * bs + p % bs if start <= p < end else -1
                     for p in range(m)]
            loaded_blocks = sorted({block_ids[p // bs] for p in range(start, end)})
            self._pending.append(_Load(request.request_id, user, order, slots, loaded_blocks,
                                       generation))
            self._finished.setdefault(request.request_id, {
                "cached_tokens": start, "memory_tokens": m, "generation": generation})
            self._finished[request.request_id]["loaded_tokens"] = num_external_tokens
            self.counters["loads"] += 1
            if getattr(request, "num_preemptions", 0) > 0:
                self.counters["loads_after_preemption"] += 1
        except Exception as e:  # noqa: BLE001 - the tokens were promised: the worker reports them
            logger.exception("inferscale: request %s: planning its load failed", request.request_id)
            try:
                ids = sorted(set(blocks.get_block_ids()[0]))
            except Exception:  # noqa: BLE001
                ids = []
            self._pending.append(_Load(request.request_id, "", [], [], ids, 0, repr(e)))

    def build_connector_meta(self, scheduler_output):
        meta = InferScaleMetadata(loads=self._pending,
                                  captures=self._capture_jobs(scheduler_output))
        self._pending = []
        return meta

    # Capture while serving (serve_capture.py): a request with kv_transfer_params.inferscale_capture
    # is noted when vLLM adds it; in the step that computes its last prompt token the workers get
    # its token ids and slots, and read its K/V back after that step's forward.
    def on_new_request(self, request):
        self._captures.on_new_request(request)  # never raises (a malformed one is logged)

    def _capture_jobs(self, scheduler_output) -> list:
        try:
            return self._captures.jobs(
                scheduler_output,
                lambda request_id: self._kv_cache_manager.get_block_ids(request_id)[0])
        except Exception as e:  # noqa: BLE001 - never into vLLM's scheduling
            logger.warning("inferscale: captures of this step dropped: %r", e)
            return []

    @_timed_hook
    def request_finished(self, request, block_ids):
        self._plans.pop(request.request_id, None)
        self._deferred.pop(request.request_id, None)
        self._captures.finished(request.request_id)
        reason = self._refused.pop(request.request_id, None)
        done = self._finished.pop(request.request_id, None)
        if not (getattr(request, "kv_transfer_params", None) or {}).get("inferscale"):
            return False, None
        # what the memory did for this request, handed back with its output
        # (RequestOutput.kv_transfer_params; the OpenAI server's responses carry it)
        report = {"loaded_tokens": 0, "refused": reason} if done is None else dict(done)
        return False, {"inferscale": report}  # blocks are vLLM's to free now (loads are sync)

    def request_state(self) -> dict:
        """The request ids this (scheduler-side) connector holds state for: planned loads,
        refusals, loads not yet handed to the workers. Empty when no request is in flight."""
        return {"plans": set(self._plans), "refused": set(self._refused),
                "finished": set(self._finished), "deferred": set(self._deferred),
                "pending": {load.request_id for load in self._pending},
                "captures": set(self._captures.requests)}

    # ---------------------------------------------------------------------------------------
    # Worker side
    def register_kv_caches(self, kv_caches):
        from vllm.distributed.parallel_state import get_pp_group, \
            get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        first_layer, num_layers = rank_layers(kv_caches, self._model["num_layers"])
        names = sorted(kv_caches, key=_layer_index)
        pp, pp_rank = get_pp_group().world_size, get_pp_group().rank_in_group
        if pp > 1 and not os.environ.get("INFERSCALE_VLLM_ALLOW_PP"):
            # The layer mapping below is by name and would give this stage its own layers, but
            # vLLM CPU 0.32 cannot run a pipeline-parallel forward (NOTES-vllm-api.md), so it has
            # never been checked against one: refuse rather than serve it untested.
            raise ValueError(
                f"inferscale: pipeline parallelism (pipeline_parallel_size = {pp}) is not "
                f"supported by InferScaleConnector: injection per pipeline stage is untested "
                f"(vLLM CPU 0.32 fails its first pipeline-parallel forward); use "
                f"pipeline_parallel_size = 1 (tensor parallelism is supported), or set "
                f"INFERSCALE_VLLM_ALLOW_PP=1 to try it (this stage would inject layers "
                f"[{first_layer}, {first_layer + num_layers}))")
        # vLLM's own split of the layers over pipeline stages must be what the names say.
        start, end = self._vllm_config.model_config.get_layers_start_end_indices(
            self._vllm_config.parallel_config)
        if (start, end) != (first_layer, first_layer + num_layers):
            raise ValueError(f"inferscale: pipeline stage {pp_rank}/{pp} got the KV caches of "
                             f"layers [{first_layer}, {first_layer + num_layers}), vLLM assigns "
                             f"it layers [{start}, {end})")
        self._device, self._cache = kv_cache_descriptor(
            kv_caches, names, self._vllm_config.model_config.dtype,
            self._vllm_config.cache_config.cache_dtype)
        self._kv_caches = kv_caches  # keep the tensors alive with the descriptor
        self._isa = None
        if not self._device:  # vLLM's CPU attention kernels (the cache layout) of these layers
            from .tensors import vllm_cpu_isa

            self._isa = vllm_cpu_isa(self._vllm_config.model_config.dtype, kv_caches[names[0]],
                                     self._vllm_config.cache_config.cache_dtype)
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self._rank = (rank, pp_rank)
        heads = self._model["num_kv_heads"]
        if heads % tp:
            raise ValueError(f"inferscale: {heads} KV heads do not split over {tp} ranks")
        per = heads // tp
        if self._cache.num_heads != per:
            raise ValueError(f"inferscale: rank {rank}'s cache holds {self._cache.num_heads} heads, "
                             f"expected {per}")
        self._memory = MemoryReader(self._directory, transform=_worker_view(
            (rank * per, per, first_layer, num_layers), self._device))
        self._rotation = self._make_rotation(names)
        self._capture_writer = None
        if self._device or pp > 1:
            logger.warning("inferscale: capture while serving is not available on this worker "
                           "(%s): requests asking for it are served without capture",
                           "device caches" if self._device else "pipeline parallelism")
        else:
            # In the step only the cached bytes are read and written; the reader de-rotates
            # them and runs ExactKeys with this rounding (serve_capture.read_capture).
            try:
                self._capture_writer = CaptureWriter(
                    self._directory, self._cache, [kv_caches[n] for n in names], self._table,
                    self._rotary.neox, rank=rank, tp=tp, first_head=rank * per,
                    kv_heads=heads, rounding=self._rotation_mode)
            except ValueError as e:
                logger.warning("inferscale: capture while serving is not available on this "
                               "worker (%s): requests asking for it are served without "
                               "capture", e)
        if not self._device and self._partial_block == "measured":
            self._worker_classes = self._measure_token_classes()
        logger.info("inferscale: TP rank %d/%d, PP stage %d/%d injects KV heads [%d, %d) into "
                    "layers [%d, %d) of %d slots (%s path)", rank, tp, pp_rank, pp, rank * per,
                    rank * per + per, first_layer, first_layer + num_layers, self._cache.num_slots,
                    "device" if self._device else "host")

    def _measure_token_classes(self):
        """This rank's token classes (token_classes.measure_layers on the model vLLM built, up
        to the most tokens of one step), or None (logged) where they cannot be measured."""
        try:
            runner = find_model_runner()
            if runner is None:
                raise ValueError("the model runner was not found")
            mc = self._vllm_config.model_config
            top = min(self._step_tokens, int(mc.max_model_len))
            t = time.monotonic()
            cache = ClassCache.default()
            classes, per, hits = measure_layers(runner.get_model(), top, mc.dtype, cache=cache)
            if classes is None:
                raise ValueError("the model has no linear layers vLLM's LinearBase describes")
            logger.info("inferscale: token classes of %d linear layer kinds up to %d tokens in "
                        "%.1f s (%d of them kept from an earlier start, in %s): %s (%s)",
                        len(per), top, time.monotonic() - t, hits,
                        cache.directory if cache else "no cache", classes,
                        "; ".join(f"{k}: {v}" for k, v in per.items()))
            return classes
        except Exception as e:  # noqa: BLE001 - then whole blocks, never a failed start
            logger.warning("inferscale: the token classes of this worker's linear layers could "
                           "not be measured (%r): the memory's whole blocks are loaded", e)
            return None

    def get_handshake_metadata(self):
        if self._worker_classes is None:
            return None
        return InferScaleHandshake(self._worker_classes.to_list())

    def _make_rotation(self, layer_names):
        """The rotation of the model vLLM built, read from its attention layers' rotary module
        (rotary.model_rotary: pairing, rotary dims and the table with any scaling in it; a
        rotation the library cannot reproduce is refused here, at start-up, with the reason),
        and the rounding vLLM's rotary kernel uses on this machine, found by running that module
        (``rotation_matching_vllm``, which also checks the whole rotation bit for bit)."""
        from vllm.config import set_current_vllm_config

        mc = self._vllm_config.model_config
        runner = find_model_runner()
        if runner is None:
            raise ValueError("inferscale: register_kv_caches was not called by vLLM's model "
                             "runner: the model whose rotation InferScale must reproduce cannot "
                             "be found")
        self._rotary = model_rotary(runner.get_model(), layer_names, mc.get_head_size(),
                                    mc.hf_config)
        rope = self._rotary.module
        with set_current_vllm_config(self._vllm_config):
            rotation, self._table, mode = rotation_matching_vllm(
                rope, mc.dtype, mc.get_head_size(), device=self._device)
        self._rope = rope
        self._rotation_mode = mode
        logger.info("inferscale: the model's rotation: %s; rounding '%s' (matches vLLM's rotary "
                    "kernel here bit for bit)", self._rotary.description, mode)
        return rotation

    def start_load_kv(self, forward_context, **kwargs):
        try:
            meta = self._get_connector_metadata()
        except Exception:  # noqa: BLE001 - no metadata bound: nothing to load
            return
        if not isinstance(meta, InferScaleMetadata) or not meta.loads:
            return
        failpoint = os.environ.get("INFERSCALE_VLLM_FAIL_LOAD_FOR_USER")
        for load in meta.loads:
            started = time.perf_counter()
            try:
                if load.error is not None:
                    raise RuntimeError(f"the scheduler could not plan it: {load.error}")
                if failpoint and load.user == failpoint:
                    raise RuntimeError(f"failpoint INFERSCALE_VLLM_FAIL_LOAD_FOR_USER={failpoint}")
                # the generation the scheduler checked (loaded in the background; waited for
                # here only if this worker has not finished loading it yet)
                _, (_, store) = self._memory.wait_for(load.generation)
                if self._device:
                    import torch

                    # enqueued before the forward on the stream it runs on; not waited for
                    _inferscale.inject(store, self._cache, self._rotation,
                                             [(load.facts, 0, load.slots)],
                                             torch.cuda.current_stream().cuda_stream)
                else:
                    _inferscale.inject(store, self._cache, self._rotation,
                                       [(load.facts, 0, load.slots)])
            except Exception as e:  # noqa: BLE001 - any failure: prefill instead, keep serving
                self._fail(load, str(e))
            if os.environ.get(TRACE_ENV):
                _trace({"side": "worker", "rank": self._rank, "request": load.request_id,
                        "seconds": time.perf_counter() - started,
                        "tokens": sum(1 for s in load.slots if s >= 0)})

    def _fail(self, load, reason):
        logger.warning("inferscale: request %s: memory load failed (%s); its %d blocks are "
                       "reported for recompute", load.request_id, reason, len(load.block_ids))
        self._errors.update(load.block_ids)

    def wait_for_layer_load(self, layer_name):
        return  # every layer was written in start_load_kv, before the forward

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return  # captures read every layer at once, after the forward (wait_for_save)

    def wait_for_save(self):
        """After this step's forward (vLLM has written every scheduled token's K/V to its cache):
        the captures of the requests whose prompt this step finished (serve_capture.py)."""
        try:
            if not self.has_connector_metadata():
                return
            meta = self._get_connector_metadata()
            captures = getattr(meta, "captures", None)
            if not captures:
                return
            if self._capture_writer is None:
                for job in captures:
                    logger.warning("inferscale: request %s: capture %s not made (capture is not "
                                   "available on this worker)", job.request_id, job.capture_id)
                return
            self._capture_writer.run(captures)
        except Exception as e:  # noqa: BLE001 - a capture never takes the engine down
            logger.warning("inferscale: captures of this step failed: %r", e)

    def get_block_ids_with_load_errors(self):
        errors, self._errors = self._errors, set()
        return errors




def rotation_for(table, head_dim: int, mode: str, neox: bool = True):
    """neox: the model's pairing (vLLM's is_neox_style: halves; False: GPT-J interleaved)."""
    round_each, truncate = ROUNDING_MODES[mode]
    return _inferscale.Rotation(table, head_dim, bool(neox), round_each, truncate)


def rotation_matching_vllm(rope, dtype, head_dim: int, tokens: int = 64, heads: int = 2,
                           device: bool = False):
    """(Rotation, table, mode): the library rotation that reproduces `rope` (vLLM's module, called
    as the model calls it, inside the caller's vLLM config) bit for bit on random keys at random
    positions. vLLM's CPU kernel computes in fp32 and truncates to bf16 in its AVX2 build; its
    torch path and its CUDA kernel round each operation; the first mode that matches is used.
    device: run both on the GPU (vLLM's CUDA kernel against the library's device path, the table
    in device memory). Raises if no mode matches."""
    import torch

    from ._inferscale import Store, VllmCpuCache, inject

    where = torch.device("cuda", torch.cuda.current_device()) if device else torch.device("cpu")
    neox = bool(rope.is_neox_style)  # the module's pairing, never assumed
    if device:
        rope = rope.to(where)  # the model's own module is there already (get_rope caches it)
    table = rope.cos_sin_cache.to(device=where, dtype=dtype).contiguous()
    gen = torch.Generator().manual_seed(1234)
    keys = (torch.randn(tokens, heads, head_dim, generator=gen) * 3).to(dtype)
    positions = torch.randint(0, table.shape[0], (tokens,), generator=gen)
    q = torch.zeros(tokens, heads * head_dim, dtype=dtype, device=where)
    _, want = rope(positions.to(where), q, keys.reshape(tokens, -1).clone().to(where))
    want = want.reshape(tokens, heads, head_dim)
    name = str(dtype).replace("torch.", "")
    # one one-token fact per key, injected at its own position into its own block (block size 1)
    store = Store(1, heads, head_dim, name, tokens)
    for i in range(tokens):
        ki = keys[i].reshape(1, 1, heads, head_dim).contiguous()
        store.insert(100 + i, 0, [0], ki, ki)
    requests = [([100 + i], int(positions[i]), [i]) for i in range(tokens)]
    if device:
        from ._inferscale import VllmFlashAttnCache, inject

        store = store.to_device()
        # vLLM 0.32's GPU layout (num_blocks, heads, block_size, 2 * head_dim): K = [..., :head_dim]
        cache = torch.zeros(tokens, heads, 1, 2 * head_dim, dtype=dtype, device=where)
        desc = VllmFlashAttnCache([cache])

        def run(rotation):
            inject(store, desc, rotation, requests, torch.cuda.current_stream().cuda_stream)
            torch.cuda.current_stream().synchronize()
            return cache[:, :, 0, :head_dim]
    else:
        cache = torch.zeros(tokens, heads, 1, 2 * head_dim, dtype=dtype)
        desc = VllmCpuCache([cache])

        def run(rotation):
            inject(store, desc, rotation, requests)
            return cache[:, :, 0, :head_dim]  # block_size 1: the key region is [dim, 1]
    tried = []
    for mode in ROUNDING_MODES:
        if mode == "fp32_truncate" and (dtype != torch.bfloat16 or device):
            continue  # vLLM's AVX2 CPU kernel only (the library refuses it on the device)
        rotation = rotation_for(table, head_dim, mode, neox)
        cache.zero_()
        got = run(rotation).clone()
        bad = int((got.view(torch.int16) != want.view(torch.int16)).sum())
        tried.append(f"{mode}: {bad} of {want.numel()} differ")
        if bad == 0:
            return rotation, table, mode
    raise RuntimeError("inferscale: no rotation rounding reproduces vLLM's rotary kernel here ("
                       + "; ".join(tried) + ")")
