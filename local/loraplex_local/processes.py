"""Child processes of the local stack: started with their output in a log file, stopped politely."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

LORAPLEX = [sys.executable, "-m", "loraplex.cli"]


class Child:
    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        # A new session: Ctrl-C in the terminal reaches the stack, which then stops its children in order.
        self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: an abrupt failure (tests use it to kill an agent mid-load)."""
        if self.alive:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.alive:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_http(url: str, child: Child, timeout_s: float) -> None:
    """Until GET url answers 200; fails early, with the child's log, if the child exits."""
    _wait_for(lambda: answers(url), child, timeout_s, 0.2, f"answer {url}")


def wait_port(port: int, child: Child, timeout_s: float) -> None:
    """Until something listens on 127.0.0.1:port; fails early, with the child's log, if the child exits."""
    _wait_for(lambda: _listens(port), child, timeout_s, 0.05, f"listen on port {port}")


def _wait_for(ready: Callable[[], bool], child: Child, timeout_s: float, interval_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive:
            raise RuntimeError(f"{child.name} exited while starting:\n{child.tail()}")
        if ready():
            return
        time.sleep(interval_s)
    raise RuntimeError(f"{child.name} did not {what} within {timeout_s:.0f} s:\n{child.tail()}")


def answers(url: str) -> bool:
    """GET url answers 200 now."""
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _listens(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
