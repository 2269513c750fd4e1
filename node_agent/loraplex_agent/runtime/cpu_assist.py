"""CPU-assisted LoRA while an adapter is copied to the device (Toppings).

A request whose adapter is still being copied in runs anyway. The copy proceeds layer by layer
(`LayerProgress` says which layers have reached the device); for a layer not there yet, CPU
workers compute the request rows' LoRA term `(x·A)·B` from the host copy of the adapter while the
device computes the base projection, and the result is added before the layer's output is used.
A layer whose weights have arrived uses the device kernel like any resident adapter.

The workers are threads (torch's matmuls release the GIL); a segment's rows are split between
them in proportion to each worker's speed, measured once at start-up (the paper's splitting
rule). The base model never waits for the CPU longer than for the copy: if the layer's weights
arrive first, or a worker fails, the device kernel computes the term instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from loraplex_kernels.lora import LoraBatch, LoraGroup, LoraSegment, lora_linear_delta
from loraplex_kernels.lora_pages import AdapterPages

from loraplex_agent.adapters.host import HostAdapter

log = logging.getLogger(__name__)

CALIBRATION_ROWS = 64
CALIBRATION_WIDTH = 512


def default_assist_workers() -> int:
    """Half the host's cores: the other half keeps feeding the device (or, on a CPU-only host,
    computing the base model)."""
    return max(1, (os.cpu_count() or 2) // 2)


class LayerProgress:
    """Layers of one adapter copy that are on the device: the copy worker marks them in order
    (after the layer's copy completed on the device), the engine thread reads and waits."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.failed = False  # the copy failed: no more layers will arrive
        self._ready = 0
        self._changed = threading.Condition()

    def mark(self, layer: int) -> None:
        with self._changed:
            self._ready = max(self._ready, layer + 1)
            self._changed.notify_all()

    def fail(self) -> None:
        with self._changed:
            self.failed = True
            self._changed.notify_all()

    def arrived(self, layer: int) -> bool:
        return layer < self._ready

    def notify(self) -> None:
        """Wake waiters (a CPU result is ready)."""
        with self._changed:
            self._changed.notify_all()

    def wait_until(self, done: Callable[[], bool], layer: int, timeout: float | None = None) -> bool:
        """Block until `done()` or layer `layer` arrived; True if the layer arrived. Raises
        AdapterCopyFailed when the copy failed and `done()` is false."""
        with self._changed:
            self._changed.wait_for(lambda: done() or self.arrived(layer) or self.failed, timeout)
        if self.failed and not done() and not self.arrived(layer):
            raise AdapterCopyFailed("the adapter's copy to the device failed")
        return self.arrived(layer)


class AdapterCopyFailed(RuntimeError):
    """The copy an assisted request waited for failed (the executor reports the copy's error)."""


@dataclass
class AssistedAdapter:
    """An adapter being copied in: its pages record, the host weights as the host tier holds them
    ((A [rank, in], B [out, rank]) by (layer, module); the workers read them transposed in place,
    so starting an assisted request copies nothing on the engine thread) and copy progress."""

    record: AdapterPages
    progress: LayerProgress
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    scaling: float = 1.0

    @classmethod
    def of(cls, host: HostAdapter, record: AdapterPages, progress: LayerProgress) -> AssistedAdapter:
        return cls(record, progress, host.weights, host.scaling)


class CpuAssist:
    """The worker pool; `speeds` are rows/s of each worker on a calibration matmul."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"cpu assist needs at least one worker, not {workers}")
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="loraplex-assist")
        self.speeds = self._calibrate(workers)
        self.failures = 0  # worker errors that fell back to the copy
        self.assisted_layers = 0  # (segment, layer) pairs computed on the CPU

    def _calibrate(self, workers: int) -> list[float]:
        barrier = threading.Barrier(workers)  # one calibration on every worker, run together

        def measure() -> float:
            barrier.wait()
            x = torch.randn(CALIBRATION_ROWS, CALIBRATION_WIDTH)
            w = torch.randn(CALIBRATION_WIDTH, CALIBRATION_WIDTH)
            begin = time.perf_counter()
            for _ in range(4):
                x @ w
            return 4 * CALIBRATION_ROWS / max(time.perf_counter() - begin, 1e-9)

        return [f.result() for f in [self.pool.submit(measure) for _ in range(workers)]]

    def split(self, rows: int) -> list[int]:
        """Rows per worker in proportion to its speed (largest remainders get the leftovers)."""
        total = sum(self.speeds)
        shares = [rows * s / total for s in self.speeds]
        counts = [int(s) for s in shares]
        order = sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])
        for i in order[:rows - sum(counts)]:
            counts[i] += 1
        return counts

    def submit(self, x: torch.Tensor, adapter: AssistedAdapter, layer: int, group: LoraGroup) -> Future:
        """Start the LoRA term of `group` for the rows `x` (float32, on the host): the future gives
        [rows, sum(out)] float32, zero where the adapter wraps no module of the group."""
        parts, start = [], 0
        for count in self.split(x.shape[0]):
            if count:
                parts.append(self.pool.submit(_lora_term, x[start:start + count], adapter, layer, group))
            start += count
        return _gather(parts)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _lora_term(x: torch.Tensor, adapter: AssistedAdapter, layer: int, group: LoraGroup) -> torch.Tensor:
    out = torch.zeros(x.shape[0], sum(group.out_features))
    for module, col, width in zip(group.modules, group.columns, group.out_features, strict=True):
        pair = adapter.weights.get((layer, module))
        if pair is not None:
            a, b = (w if w.dtype == torch.float32 else w.float() for w in pair)
            out[:, col:col + width] = ((x @ a.t()) * adapter.scaling) @ b.t()  # scaled at rank width
    return out


def _gather(parts: list[Future]) -> Future:
    """One future over the parts, concatenated in order; failed if any part failed."""
    whole: Future = Future()
    remaining = [len(parts)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            whole.set_result(torch.cat([p.result() for p in parts]))
        except Exception as error:  # noqa: BLE001 - the caller falls back to the copy
            whole.set_exception(error)

    for part in parts:
        part.add_done_callback(done)
    return whole


@dataclass
class _Pending:
    segment: LoraSegment
    adapter: AssistedAdapter
    future: Future


class StepAssist:
    """One step's assisted segments: which segments each layer computes on the device, and the
    CPU terms of the others."""

    def __init__(self, lora: LoraBatch, assisted: Mapping[int, AssistedAdapter], workers: CpuAssist) -> None:
        self.lora = lora
        self.assisted = {s.adapter: assisted[s.adapter] for s in lora.segments if s.adapter in assisted}
        self.workers = workers
        self._device_lora: dict[frozenset[int], LoraBatch] = {}

    def waiting(self, layer: int) -> list[int]:
        """Handles of the assisted adapters whose layer `layer` is not on the device yet."""
        return [h for h, a in self.assisted.items() if not a.progress.arrived(layer)]

    def device_lora(self, waiting: Sequence[int]) -> LoraBatch:
        """The step's LoRA batch without the segments of `waiting` adapters."""
        key = frozenset(waiting)
        if key not in self._device_lora:
            segments = tuple(s for s in self.lora.segments if s.adapter not in key)
            self._device_lora[key] = LoraBatch(segments, {s.adapter: self.lora.adapters[s.adapter] for s in segments},
                                               self.lora.num_rows)
        return self._device_lora[key]

    def start(self, x: torch.Tensor, layer: int, group: LoraGroup, waiting: Sequence[int]) -> list[_Pending]:
        """Submit the CPU terms of the `waiting` adapters' segments for the input `x`."""
        if not waiting:
            return []
        host_x = x.float().cpu() if x.device.type != "cpu" else x.float()
        pending = []
        for segment in self.lora.segments:
            if segment.adapter in waiting:
                adapter = self.assisted[segment.adapter]
                future = self.workers.submit(host_x[segment.row_start:segment.row_end], adapter, layer, group)
                future.add_done_callback(lambda _, p=adapter.progress: p.notify())
                pending.append(_Pending(segment, adapter, future))
        return pending

    def finish(self, pending: list[_Pending], y: torch.Tensor, x: torch.Tensor, layer: int, group: LoraGroup,
               kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Add each pending term to `y`: the CPU's result, or the device kernel's when the layer's
        weights arrived first or the CPU failed (then it waits for the copy)."""
        for p in pending:
            arrived = p.adapter.progress.wait_until(p.future.done, layer)
            rows = slice(p.segment.row_start, p.segment.row_end)
            if not arrived:
                try:
                    y[rows] += p.future.result().to(y.device, y.dtype, non_blocking=True)
                    self.workers.assisted_layers += 1
                    continue
                except Exception:  # noqa: BLE001 - degrade to the copy, never to a wrong result
                    self.workers.failures += 1
                    log.warning("CPU-assisted LoRA failed; waiting for the adapter's copy", exc_info=True)
                    p.adapter.progress.wait_until(lambda: False, layer)
            single = LoraBatch((p.segment,), {p.segment.adapter: p.adapter.record}, self.lora.num_rows)
            lora_linear_delta(y, x, single, group, *kv_cache)
