"""Waiting for a server the test started as a subprocess, and stopping it."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path


def wait_healthy(url: str, process: subprocess.Popen, log: Path | None = None, timeout_s: float = 180) -> None:
    """Return once GET {url}/health answers; raise (with the log) if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the server was not healthy within {timeout_s} s:\n{_tail(log)}")


def _tail(log: Path | None) -> str:
    return log.read_text()[-4000:] if log is not None and log.exists() else ""


def terminate(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; returns once it has exited."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
