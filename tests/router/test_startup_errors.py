"""`loraplex router` refuses a bad start with one line on stderr and a non-zero exit, never a
traceback; a good start still serves."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from processes import wait_healthy

LORAPLEX = str(Path(sys.executable).parent / "loraplex")


def start_router(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LORAPLEX, "router", *args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and all(f in lines[0] for f in fragments), lines[0]
    assert "Traceback" not in result.stderr


def test_a_port_in_use_is_one_line(redis_url, free_port):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        port = sock.getsockname()[1]
        result = start_router("--redis-url", redis_url, "--port", str(port))
    assert_one_line_error(result, f"127.0.0.1:{port}", "in use")


@pytest.mark.parametrize(("url", "fragment"), [
    ("redis://127.0.0.1:{port}/0", "cannot reach Redis"),  # nothing listens there
    ("http://127.0.0.1:{port}", "bad --redis-url"),
])
def test_an_unusable_redis_is_one_line(free_port, url, fragment):
    result = start_router("--redis-url", url.format(port=free_port()), "--port", str(free_port()))
    assert_one_line_error(result, fragment)


def test_a_good_start_serves(redis_url, free_port, tmp_path):
    port = free_port()
    log = tmp_path / "router.log"
    with log.open("w") as out:
        process = subprocess.Popen([LORAPLEX, "router", "--redis-url", redis_url, "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log)
        assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 503  # no agent registered
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert f"listening on http://127.0.0.1:{port}" in log.read_text()
