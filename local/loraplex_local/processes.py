"""Child processes of the local stack: started with their output in a log file, stopped politely,
and bound to the stack's life (loraplex.util.lifetime: on Linux the kernel sends each child SIGTERM
when `up` dies), so even `kill -9` of `loraplex up` leaves no agent, router or redis-server holding
its port. A Supervisor restarts children that exit, with backoff, as a kubelet restarts containers."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from loraplex.util.lifetime import die_with_this_process

LORAPLEX = [sys.executable, "-m", "loraplex.cli"]
log = logging.getLogger("loraplex.up")


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
        # The kernel's parent-death signal is sent when the *thread* that forked exits: children are
        # started from the thread that runs the stack to its end (the main thread of `loraplex up`).
        self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True, preexec_fn=die_with_this_process())
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


class Supervisor:
    """Restarts the children that exit, each after a backoff that doubles from `first_s` up to `max_s`
    and starts again from `first_s` once a child has stayed up `steady_s`; each exit is one line."""

    def __init__(self, first_s: float = 1.0, max_s: float = 30.0, steady_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_s, self.max_s, self.steady_s, self.clock = first_s, max_s, steady_s, clock
        self._started: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._due: dict[str, float] = {}  # name -> when the exited child starts again

    def check(self, children: Sequence[Child]) -> list[Child]:
        """Says each newly exited child and restarts those whose backoff has passed; returns them."""
        now, restarted = self.clock(), []
        for child in children:
            if child.alive:
                self._started.setdefault(child.name, now)
                continue
            if child.name not in self._due:
                self._due[child.name] = now + self._next_backoff(child.name, now)
                log.error("%s exited with status %s; restarting it in %.0f s (its log: %s)", child.name,
                          child.process.returncode if child.process else None, self._due[child.name] - now,
                          child.log_path)
            elif now >= self._due.pop(child.name):
                child.start()
                self._started[child.name] = now
                restarted.append(child)
        return restarted

    def _next_backoff(self, name: str, now: float) -> float:
        started = self._started.pop(name, now)
        steady = now - started >= self.steady_s
        backoff = self.first_s if steady or name not in self._backoff else min(2 * self._backoff[name], self.max_s)
        self._backoff[name] = backoff
        return backoff


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
