"""CopyEngine: host <-> device copies in the background, so the engine keeps computing ready
requests while a waiting request's adapter or KV blocks are brought to the device.

Jobs run one at a time, in submission order, on a single worker thread: like one PCIe link. On
CUDA each job runs on a side stream that first waits for everything the compute stream had queued
when the job was submitted (the pages it overwrites may still be read by earlier kernels), and the
worker waits for the job's completion event before reporting it, so a job that `poll` returns is
complete on the device: finished == synchronized, and any stream may read its pages.

Emulated transfer cost (`emulate_h2d_gbps`): on a CPU-only machine host and device memory are the
same RAM, so a copy costs next to nothing and no loading policy could show its worth. When set,
this emulation charges every byte at that bandwidth: a job of B bytes lasts at least
B / (gbps * 1e9) seconds (the worker sleeps the remainder after the real copy), and `charge_sync`
sleeps the same charge on the calling thread for copies done synchronously. Off by default.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CopyFn = Callable[[], int]
"""Performs a copy (writes into device pages) and returns the bytes it moved."""


class CopyJobError(RuntimeError):
    """A background copy failed; its device pages hold no valid data. The cause is `__cause__`."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"background copy job {job_id} failed")
        self.job_id = job_id


@dataclass(frozen=True, slots=True)
class CopyResult:
    job_id: int
    nbytes: int  # bytes the job moved (0 when it failed)
    seconds: float  # from the job's start on the worker to its completion, emulated charge included
    queued_s: float  # from submit to the job's start (time spent behind earlier jobs)
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class CopyStats:
    jobs: int = 0  # background jobs finished, failed ones included
    failed: int = 0
    bytes: int = 0  # moved by background jobs
    busy_s: float = 0.0  # the worker's time in jobs, emulated charge included
    sync_copies: int = 0  # synchronous copies charged by charge_sync
    sync_bytes: int = 0
    sync_s: float = 0.0  # time charge_sync slept
    emulated_s: float = 0.0  # sleep added by the emulation, both paths


@dataclass(slots=True)
class _Job:
    job_id: int
    fn: CopyFn
    submitted_at: float
    ready: torch.cuda.Event | None  # compute-stream work the job must follow (CUDA only)


class CopyEngine:
    def __init__(self, device: torch.device, emulate_h2d_gbps: float | None = None,
                 name: str = "loraplex-copy") -> None:
        if emulate_h2d_gbps is not None and emulate_h2d_gbps <= 0:
            raise ValueError(f"emulate_h2d_gbps must be positive, not {emulate_h2d_gbps}")
        self.device = device
        self.emulate_h2d_gbps = emulate_h2d_gbps
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Condition()
        self._jobs: deque[_Job | None] = deque()  # None asks the worker to stop
        self._finished: deque[CopyResult] = deque()
        self._job_seconds: list[float] = []
        self._stats = CopyStats()
        self._submitted = self._completed = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- the engine thread's side -------------------------------------------------------------

    def submit(self, job_id: int, fn: CopyFn) -> None:
        """Queue a copy; jobs run in submission order. On CUDA `fn` runs on the side stream after
        the work the current stream has queued so far, so it may overwrite pages that work reads."""
        job = _Job(job_id, fn, time.perf_counter(), self._record_ready())
        with self._lock:
            if self._closed:
                raise RuntimeError("the copy engine is closed")
            self._jobs.append(job)
            self._submitted += 1
            self._lock.notify_all()

    def poll(self) -> list[int]:
        """Ids of the jobs that completed since the last poll, in order, without blocking. A failed
        job raises CopyJobError once: the jobs completed before it are returned first, and it is
        raised on the next call (the jobs after it wait behind it), so no job is lost or repeated."""
        with self._lock:
            done: list[int] = []
            while self._finished and self._finished[0].ok:
                done.append(self._finished.popleft().job_id)
            if done or not self._finished:
                return done
            failed = self._finished.popleft()
        raise CopyJobError(failed.job_id) from failed.error

    def poll_results(self) -> list[CopyResult]:
        """Every job completed since the last poll, failed ones included (`error` set); never raises."""
        with self._lock:
            results = list(self._finished)
            self._finished.clear()
        return results

    def drain_job_seconds(self) -> list[float]:
        """Each background job's `seconds` since the last drain: observations for a load-time
        histogram, kept apart from poll so the metrics side and the executor don't compete."""
        with self._lock:
            seconds, self._job_seconds = self._job_seconds, []
        return seconds

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet completed."""
        with self._lock:
            return self._submitted - self._completed

    def stats(self) -> CopyStats:
        """A snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def wait_all(self, timeout: float | None = None) -> bool:
        """Block until every job submitted so far has completed (they stay for poll to report);
        False when `timeout` seconds passed first."""
        with self._lock:
            target = self._submitted
            return self._lock.wait_for(lambda: self._completed >= target, timeout)

    def charge_sync(self, nbytes: int, elapsed_s: float = 0.0) -> float:
        """Account a synchronous copy of `nbytes` that took `elapsed_s`; under the emulation, sleep
        on the calling thread for the rest of its charge. Returns the seconds slept."""
        slept = _sleep(self._charge_s(nbytes) - elapsed_s)
        with self._lock:
            self._stats.sync_copies += 1
            self._stats.sync_bytes += nbytes
            self._stats.sync_s += slept
            self._stats.emulated_s += slept
        return slept

    def settle(self, nbytes: int, since: float) -> None:
        """Inside a job (on the worker): return once the job's first `nbytes`, queued since
        `since` (perf_counter), are on the device. On CUDA that waits for the side stream; under
        the emulation it sleeps until they would have arrived at the emulated bandwidth. A job
        that loads layer by layer calls this after each layer before saying the layer arrived."""
        if self._stream is not None:
            self._stream.synchronize()
        slept = _sleep(self._charge_s(nbytes) - (time.perf_counter() - since))
        with self._lock:
            self._stats.emulated_s += slept

    def run_sync(self, fn: CopyFn) -> int:
        """Run a copy now, on the calling thread and the current stream (ordered before the step's
        compute), charge it with `charge_sync` and return its bytes. For synchronous adapter loads
        and swap-outs; waits for the device only under the emulation, which needs the real time."""
        start = time.perf_counter()
        nbytes = _checked_bytes(fn())
        if self._stream is not None and self.emulate_h2d_gbps is not None:
            torch.cuda.current_stream(self.device).synchronize()
        self.charge_sync(nbytes, time.perf_counter() - start)
        return nbytes

    def close(self) -> None:
        """Run the jobs already queued, then stop and join the worker. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.append(None)
                self._lock.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _record_ready(self) -> torch.cuda.Event | None:
        if self._stream is None:
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return ready

    def _charge_s(self, nbytes: int) -> float:
        return 0.0 if self.emulate_h2d_gbps is None else nbytes / (self.emulate_h2d_gbps * 1e9)

    # --- the worker's side --------------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._next_job()) is not None:
            self._complete(self._execute(job))

    def _next_job(self) -> _Job | None:
        with self._lock:
            self._lock.wait_for(lambda: bool(self._jobs))
            return self._jobs.popleft()

    def _execute(self, job: _Job) -> CopyResult:
        start = time.perf_counter()
        try:
            nbytes, error = self._copy(job), None
        except Exception as e:  # reported through poll: a dead worker would strand every later job
            log.warning("background copy job %d failed", job.job_id, exc_info=True)
            nbytes, error = 0, e
        emulated = _sleep(self._charge_s(nbytes) - (time.perf_counter() - start))
        with self._lock:
            self._stats.emulated_s += emulated
        return CopyResult(job.job_id, nbytes, time.perf_counter() - start, start - job.submitted_at, error)

    def _copy(self, job: _Job) -> int:
        if self._stream is None:
            return _checked_bytes(job.fn())
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if job.ready is not None:
                self._stream.wait_event(job.ready)
            nbytes = _checked_bytes(job.fn())
            # a blocking event sleeps the worker instead of spinning a core while the copy runs
            done = torch.cuda.Event(blocking=True)
            done.record(self._stream)
        done.synchronize()
        return nbytes

    def _complete(self, result: CopyResult) -> None:
        with self._lock:
            self._finished.append(result)
            self._job_seconds.append(result.seconds)
            self._stats.jobs += 1
            self._stats.failed += not result.ok
            self._stats.bytes += result.nbytes
            self._stats.busy_s += result.seconds
            self._completed += 1
            self._lock.notify_all()


def _checked_bytes(nbytes: object) -> int:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise TypeError(f"a copy job must return the bytes it moved (an int >= 0), not {nbytes!r}")
    return nbytes


def _sleep(seconds: float) -> float:
    """Sleep at least `seconds` (none when <= 0) and return the time slept. Loops, because a sleep
    may end early, and the emulation promises a lower bound."""
    if seconds <= 0:
        return 0.0
    start = time.perf_counter()
    deadline = start + seconds
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
    return time.perf_counter() - start
