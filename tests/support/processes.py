"""Waiting for a server the test started as a subprocess, stopping it, and telling whether a process
(one the test did not start) still runs."""

from __future__ import annotations

import os
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


def alive(pid: int) -> bool:
    """The process runs: it exists and is not a zombie (one that has exited, whose parent has not read
    its status yet; a reparented one may stay so where nothing reaps orphans)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    state = stat.read_text().split(")")[-1].split()[0] if stat.exists() else "X"
    return state not in ("Z", "X")
