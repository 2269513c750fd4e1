"""`loraplex up` and `loraplex operator` refuse a bad start at once, with one line and a non-zero exit:
a port another process listens on (named, with that process), a bad flag value, no cluster; and a
signal during start-up stops what has started."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loraplex_local.flags import agent_args_from
from loraplex_local.stack import LocalStack, StackConfig

from loraplex.ports import in_use

LORAPLEX = str(Path(sys.executable).parent / "loraplex")


def loraplex(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([LORAPLEX, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def one_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: ") and all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


@pytest.mark.parametrize("flag", ["--port", "--agent-base-port", "--redis-port"])
def test_a_port_in_use_is_refused_before_anything_starts(tmp_path, free_port, port_in_use, flag):
    ports = {"--port": str(free_port()), "--agent-base-port": str(free_port()), "--redis-port": str(free_port())}
    ports[flag] = str(port_in_use)
    started = time.monotonic()
    result = loraplex("up", "--agents", "1", "--workdir", str(tmp_path / "w"),
                      *[arg for item in ports.items() for arg in item], cwd=tmp_path)
    line = one_line(result, f"port {port_in_use}", "in use", f"pid {os.getpid()}")
    assert time.monotonic() - started < 30, line
    assert not (tmp_path / "w").exists() and not (tmp_path / "models").exists()  # nothing started or written


@pytest.mark.parametrize(("args", "fragment"), [
    (["--port", "99999"], "argument --port"),
    (["--placement", "bogus"], "--placement"),
    (["-f", "/nonexistent"], "argument -f/--file"),
    (["--placement-interval", "0"], "--placement-interval"),
])
def test_bad_flags_of_up_are_refused_at_once(tmp_path, args, fragment):
    one_line(loraplex("up", *args, cwd=tmp_path), fragment)
    assert not (tmp_path / ".loraplex").exists()


@pytest.mark.parametrize(("args", "fragment"), [
    (["--agent-arg=--bogus"], "agent arguments: unrecognized arguments: --bogus"),
    (["--agent-arg", "--bogus"], "argument --agent-arg"),  # argparse takes --bogus for a flag of `up`
    (["--agent-arg=--max-num-seqs=-1"], "argument --max-num-seqs: invalid int (>= 1) value"),
    (["--agent-arg=--max-num-se=4"], "unrecognized arguments: --max-num-se=4"),  # no abbreviations
    (["--agent-arg=-h"], "unrecognized arguments: -h"),
    (["--agent-arg=--port=9000"], "--agent-arg=--port=9000: `loraplex up` sets it itself"),
    (["--agent-arg=--redis-url", "--agent-arg=redis://x"], "--agent-arg=--redis-url: `loraplex up` sets it"),
])
def test_bad_agent_args_are_refused_before_anything_starts(tmp_path, args, fragment):
    one_line(loraplex("up", *args, cwd=tmp_path), fragment)
    assert not (tmp_path / ".loraplex").exists() and not (tmp_path / "models").exists()


def test_good_agent_args_pass_the_check_verbatim():
    args = argparse.Namespace(agent_arg=["--num-blocks=64", "--max-num-seqs", "4", "--scheduler", "fifo"])
    assert agent_args_from(args) == args.agent_arg


def test_the_operator_without_a_cluster_is_one_line(tmp_path):
    env = {"KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path), "KUBERNETES_SERVICE_HOST": ""}
    one_line(loraplex("operator", "--standalone", env=env), "no Kubernetes credentials")


def test_each_run_logs_in_a_folder_of_its_own(tmp_path):
    first, second = LocalStack(StackConfig(workdir=tmp_path)), LocalStack(StackConfig(workdir=tmp_path))
    time.sleep(1.1)
    third = LocalStack(StackConfig(workdir=tmp_path))
    assert first.logs.parent == tmp_path / "logs" and len({first.logs, third.logs}) == 2
    assert second.logs.parent == first.logs.parent


def test_a_signal_during_start_up_stops_what_has_started(tmp_path, tiny_model, free_port):
    """SIGTERM (or Ctrl-C) while the agents are still starting: `up` stops them and Redis, and leaves no
    process behind (one would keep its port and refuse the next `loraplex up`)."""
    router, agent, redis = free_port(), free_port(), free_port()
    up = subprocess.Popen([LORAPLEX, "up", "--agents", "1", "--model", str(tiny_model.base_dir), "--port", str(router),
                           "--agent-base-port", str(agent), "--redis-port", str(redis), "--workdir", str(tmp_path)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not in_use(agent) and up.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert in_use(agent) and in_use(redis) and not in_use(router)  # mid start-up
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
    deadline = time.monotonic() + 15
    while (in_use(agent) or in_use(redis)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not in_use(agent) and not in_use(redis)
