"""Pipeline parallelism: vLLM CPU 0.32 cannot run a pipeline-parallel forward (NOTES-vllm-api.md (e):
its second stage fails an assertion on the first step), so the connector refuses
pipeline_parallel_size > 1 when a stage registers its KV caches, with an error that says so,
rather than serve an untested configuration. This test starts a PP = 2 engine with the connector
(in a child process, its engine core in that process: the engine must not start) and checks the
engine fails with that error.
The layer mapping a stage would use is tested without an engine in test_layers.py."""

import os
import subprocess
import sys

SCRIPT = """
import sys
from inferscale_vllm.engine import make_llm

if __name__ == "__main__":
    make_llm(sys.argv[1], sys.argv[2], capture=False, pipeline_parallel=2)
    print("ENGINE STARTED")
"""


def test_pp2_is_refused_when_a_stage_registers_its_caches(model_dir, tmp_path):
    script = tmp_path / "start_pp2.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env.pop("INFERSCALE_VLLM_ALLOW_PP", None)
    # The engine core in the child itself (the two stages' workers are processes of their own
    # still): one process fewer to start, the same refusal in a worker.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, str(script), model_dir, str(tmp_path / "memory")],
                          capture_output=True, text=True, timeout=1200, env=env)
    out = proc.stdout + proc.stderr
    assert "ENGINE STARTED" not in out and proc.returncode != 0, out[-4000:]
    want = ("inferscale: pipeline parallelism (pipeline_parallel_size = 2) is not supported by "
            "InferScaleConnector")
    assert want in out, f"the engine failed without the connector's error:\n{out[-4000:]}"
    # A stage names the layers it would have injected: one half of the model's 30 (the first
    # stage to fail stops the engine, so the other's message may not appear).
    assert ("would inject layers [0, 15)" in out) or ("would inject layers [15, 30)" in out), \
        out[-4000:]
