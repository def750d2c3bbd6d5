"""Starting vLLM (CPU build) with the InferScale connector, as the tests, the demo and the benchmark
do. ``make_llm`` sets the CPU environment that worked here (1 GiB of KV cache, OpenMP threads bound
to this process's CPUs, offline) unless already set, and turns the connector on with
``kv_load_failure_policy = "recompute"`` (a failed memory load is prefilled, never an error)."""

from __future__ import annotations

import os


def cpu_ranges(cpus) -> str:
    """{0, 1, 2, 5} -> '0-2,5' (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    cpus = sorted(cpus)
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(out)


def cpu_environment(ranks: int = 1) -> None:
    """`ranks`: the engine's worker count (tensor x pipeline parallel sizes)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cpus = sorted(os.sched_getaffinity(0))
    if ranks == 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_ranges(cpus))
    else:  # one group of CPUs per rank ("0|1|0" when there are fewer CPUs than ranks)
        groups = [str(cpus[r % len(cpus)]) for r in range(ranks)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(groups)
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                       ("VLLM_NO_USAGE_STATS", "1")):
        os.environ.setdefault(key, value)


MEMORY_LOADS = {"exact": "auto", "all": True, "blocks": False}  # -> partial_last_block


def kv_transfer_config(memory_dir: str, memory_load: str = "exact"):
    """The connector's vLLM configuration; `memory_load` (MEMORY_LOADS): exact (as many tokens as
    leave vLLM a rest it computes as in its cold prefill), all (every token), blocks (whole
    blocks only)."""
    from vllm.config import KVTransferConfig

    if memory_load not in MEMORY_LOADS:
        raise ValueError(f"memory_load is one of {sorted(MEMORY_LOADS)}, got {memory_load!r}")
    return KVTransferConfig(kv_connector="InferScaleConnector",
                            kv_connector_module_path="inferscale_vllm.connector",
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config={
                                "memory_dir": memory_dir,
                                "partial_last_block": MEMORY_LOADS[memory_load]})


def make_llm(model: str, memory_dir: str | None, *, capture: bool = True,
             tensor_parallel: int = 1, pipeline_parallel: int = 1, **kwargs):
    """vllm.LLM on `model` with the connector (when memory_dir is given) and the capture
    extension (when capture); other keyword arguments are vLLM engine arguments (they override
    the defaults here)."""
    cpu_environment(tensor_parallel * pipeline_parallel)
    from vllm import LLM

    args = dict(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=2048, seed=0,
                tensor_parallel_size=tensor_parallel)
    if pipeline_parallel > 1:
        args.update(pipeline_parallel_size=pipeline_parallel, distributed_executor_backend="mp")
    if memory_dir is not None:
        args["kv_transfer_config"] = kv_transfer_config(memory_dir)
    if capture:
        args["worker_extension_cls"] = "inferscale_vllm.capture.CaptureWorkerExtension"
    args.update(kwargs)
    return LLM(**args)
