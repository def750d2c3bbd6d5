"""Fixtures shared by the connector's tests: the model folder, and the TP = 1 engine that
test_connector.py and test_tp.py share (its start is most of a test's cost on a 2-core machine:
every process vLLM starts imports torch and vLLM again)."""

import os
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

FAILPOINT_USER = "failpoint"  # every load for this user fails in the worker (connector.py)


def _limit_cpus() -> None:
    """INFERSCALE_TEST_CPUS=N: this session and every process it starts (vLLM's workers) use the
    last N CPUs this process may run on, one OpenMP thread each (CTest sets N = 1 so that another
    test runs on the other core of a 2-core machine instead of waiting: most of these tests' time
    is Python on one core, and vLLM's threads are bound to their cores, so sharing one with
    another process would stall its OpenMP barriers)."""
    n = os.environ.get("INFERSCALE_TEST_CPUS", "")
    if not n:
        return
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"INFERSCALE_TEST_CPUS={n!r}: expected a positive CPU count")
    cpus = sorted(os.sched_getaffinity(0))[-int(n):]
    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))


_limit_cpus()  # before anything imports torch (which sizes its thread pool once)


@pytest.fixture(scope="session")
def model_dir():
    d = os.environ.get("INFERSCALE_SMOLLM2_HF", "")
    if not d or not os.path.isfile(os.path.join(d, "config.json")):
        pytest.fail("INFERSCALE_SMOLLM2_HF is not a model folder: run `bash .ci/vllm` and export "
                    "what it prints (the real model is required; this test does not skip)")
    return d


class InProcessEngine:
    """A vLLM engine whose engine core and (TP = 1) worker run in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): no process is spawned, so nothing imports torch and vLLM
    again, and a step needs no messages between processes. The connector's scheduler side and
    worker side are still two instances, each reading the memory directory itself. The
    multi-process arrangement (front end, engine core and workers apart, the connector's
    metadata and the requests' kv_transfer_params crossing processes) is test_tp.py's."""

    def __init__(self, make):
        import torch

        # The worker binds this process's threads to the cores it is given (and sets torch's
        # thread count): both are given back on close, so that processes started afterwards (a
        # multi-process engine's, a child's) inherit this process's CPUs, not one core.
        self.affinity = os.sched_getaffinity(0)
        self.threads = torch.get_num_threads()
        self.saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            self.llm = make()
        except BaseException:
            self._restore()
            raise

    def close(self):
        if self.llm is None:
            return
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            self.llm = None
            self._restore()

    def _restore(self):
        import gc

        import torch
        import vllm.envs
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if self.saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = self.saved
        gc.collect()
        # The in-process worker set up torch.distributed (world size 1) and froze vLLM's
        # environment: both are undone so that the next engine of this process starts afresh.
        cleanup_dist_env_and_memory()
        vllm.envs.disable_envs_cache()
        os.sched_setaffinity(0, self.affinity)
        torch.set_num_threads(self.threads)


class SharedEngine:
    """The TP = 1 engine with the connector and the capture extension (in process), and its
    memory: SYSTEM as the prefix and the whole fact list encoded jointly (Theorem 3's case),
    one fact each for users 'caroline' and FAILPOINT_USER, a bf16 store. ``get()`` starts it
    (again, after ``close()``); a test that starts another engine calls ``close()`` first (one
    engine at a time: each uses every core)."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.engine = None
        self.state = None

    def get(self) -> dict:
        if self.state is None:
            from caroline import joint_memory

            from inferscale_vllm.engine import make_llm

            directory = tempfile.mkdtemp(prefix="inferscale-memory-")
            os.environ["INFERSCALE_VLLM_FAIL_LOAD_FOR_USER"] = FAILPOINT_USER  # read per load
            self.engine = InProcessEngine(lambda: make_llm(self.model_dir, directory))
            try:
                mem, tok, facts, kv = joint_memory(self.engine.llm, directory,
                                                   ["caroline", FAILPOINT_USER], dtype="bfloat16")
            except BaseException:
                self.close()
                raise
            self.state = {"llm": self.engine.llm, "directory": directory, "mem": mem, "tok": tok,
                          "joint": facts["caroline"], "failing": facts[FAILPOINT_USER], "kv": kv}
        return self.state

    def close(self):
        self.state = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()


@pytest.fixture(scope="session")
def shared_engine(model_dir):
    holder = SharedEngine(model_dir)
    yield holder
    holder.close()


def scheduler_connector(llm):
    """The scheduler-side InferScaleConnector of an in-process engine (InProcessEngine)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def expected_loaded(loading, n, m, recompute=0, computed=0):
    """The memory tokens an n-token prompt with an m-token segment should have counted as
    computed (loaded, plus vLLM's own prefix-cache hit `computed`), given the connector's
    ``loading()``: stated here on its own terms, row by row, not with the connector's code
    (token_classes.exact_load). Mode True: every usable token; False, or no measured classes:
    whole blocks; "measured": the most L in [computed, usable] such that every row p >= L that
    vLLM computes (steps of step_tokens from L, the request alone) is computed at a token count
    of the class its row has in the cold prefill (steps from 0); whole blocks where none."""
    usable = min(m - recompute, n - 1)
    mode, classes = loading["mode"], loading["classes"]
    whole = usable // loading["block_size"] * loading["block_size"]
    if mode is True:
        return usable
    if mode is False or classes is None:
        return whole
    step = loading["step_tokens"]

    def step_size(start, p):  # tokens in the step that computes row p, steps from `start`
        first = start + (p - start) // step * step
        return min(first + step, n) - first

    for L in range(usable, computed - 1, -1):
        if all(classes.of(step_size(L, p)) is not None
               and classes.of(step_size(L, p)) == classes.of(step_size(0, p))
               for p in range(L, n)):
            return L
    return whole
