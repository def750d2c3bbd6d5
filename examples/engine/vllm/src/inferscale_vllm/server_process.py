"""Starting and stopping ``python -m inferscale_vllm.serve`` as a child process on 127.0.0.1, as
the tests and the HTTP benchmark do: a free port, the API key, the health check, the process group
killed on stop (vLLM's engine processes with it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

BLOCK = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The memory server as a child process. `extra`: more `vllm serve` / memory flags."""

    def __init__(self, model_dir, directory, log, key, extra=()):
        self.model_dir, self.directory, self.log, self.key = model_dir, directory, log, key
        self.extra = list(extra)
        self.proc = None
        self.port = None

    def start(self, timeout=600):
        self.port = free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1")
        # later flags win: `extra` may override the defaults here
        cmd = [sys.executable, "-m", "inferscale_vllm.serve", self.model_dir, "--memory",
               self.directory, "--host", "127.0.0.1", "--port", str(self.port),
               "--api-key", self.key, "--dtype", "bfloat16", "--enforce-eager",
               "--max-model-len", "2048", "--seed", "0",
               "--block-size", str(BLOCK), "--memory-pages", "512", "--memory-k", "2",
               "--served-model-name", "smollm2"] + self.extra
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); log: "
                                   f"{self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    # /health answers once the engine is up; the memory routes once start() ran
                    r = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=5)
                    if r.status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"the server did not come up in {timeout} s; log: {self.log.name}")

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self):
        return {"Authorization": f"Bearer {self.key}"}

    def stop(self, sig=signal.SIGTERM):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.proc = None

    # -- the client's calls ------------------------------------------------------------------
    def post(self, path, body, **kw):
        return httpx.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=600, **kw)

    def write(self, user, facts, context=None):
        body = {"facts": facts} if context is None else {"facts": facts, "context": context}
        r = self.post(f"/v1/memory/{user}/facts", body)
        assert r.status_code == 200, r.text
        return r.json()["ids"]

    def openai(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0)
