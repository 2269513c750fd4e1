"""Resident memory of processes, sampled in a thread (`loraplex bench soak`), and their CPU time."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path


def vm_rss_kib(pid: int) -> int | None:
    """VmRSS of process `pid` in KiB, from /proc/PID/status; None once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None  # a zombie has no VmRSS line


def cpu_seconds(pid: int) -> float | None:
    """utime+stime (+ waited children) of a live process, from /proc/PID/stat; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
    return ticks / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """VmRSS of every named process at 0, interval_s, 2 interval_s, ... seconds, until the `with` block
    ends; each sample is {"t": seconds since the start, name: KiB or None (exited)}."""

    def __init__(self, pids: dict[str, int], interval_s: float) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: list[dict[str, float | int | None]] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def latest(self) -> dict[str, float | int | None]:
        return self.samples[-1] if self.samples else {}

    def __enter__(self) -> RssSampler:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        for n in itertools.count():
            # On a schedule from the start, not after each sample: the samples do not drift apart.
            if self._stop.wait(max(0.0, n * self.interval_s - self.now())):
                return
            self.samples.append({"t": round(self.now(), 2), **{name: vm_rss_kib(pid) for name, pid in self.pids.items()}})
