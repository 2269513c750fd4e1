"""Multi-LoRA in one batch over adapters paged in the KV pool: the segmented LoRA delta.

Semantics (the same as punica's SGMV and vLLM's `add_lora_linear`): the rows of a flat token batch
are grouped so that all tokens of one adapter are contiguous. Segment `s` covers rows
`row_start:row_end` and uses one resident adapter; for every module `m` of a fused group (q/k/v,
gate/up, or a single projection) that the adapter wraps

    y[rows, cols_m] += (x[rows] @ A_m^T) @ B_m^T

with `A_m` PEFT's `lora_A` `[r_m, in]` and `B_m` PEFT's `lora_B` `[out_m, r_m]` pre-scaled, both read
through the adapter's pages (`loraplex_kernels.lora_pages` has the layout). Rows in no segment
(base-model requests) get no LoRA term. Work follows each module's own rank: no padding to the
batch's largest rank or to a power of two, so a step costs the sum of its adapters' ranks.

`LoraBatch` (built once per step, read by every layer) holds the segments, the resident adapters
they use and, for the fused C++ kernel, the step's int64 tables; `LoraGroup` describes a fused
projection (built once per model).

Backends (`LORAPLEX_LORA_KERNEL`): `auto` (default) uses the Triton kernels
(`loraplex_kernels.triton_lora`, SGMV for prefill, one program per row for decode) on CUDA, the
fused C++ kernel (`loraplex_kernels.cpu_lora`, one call per fused group, streaming the weights at
memory bandwidth) for float32 tensors on the CPU when it builds, else the torch reference;
`reference` always uses the torch reference; `cpu` requires the C++ kernel for CPU float32 and
raises if it cannot be built; `triton` forces the Triton kernels (on the CPU only under
`TRITON_INTERPRET=1`, for tests). Triton is imported at its first use only, so CPU serving never
imports it. Both kernels read the same step tables (`LoraBatch.kernel_tables`, copied once per
device by `LoraBatch.device_tables`).
"""

from __future__ import annotations

import importlib
import logging
import os
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType

import torch

from loraplex_kernels import cpu_lora
from loraplex_kernels.lora_pages import (
    LORA_MODULES,
    AdapterPages,
    ModuleSpan,
    group_modules,
    read_adapter,
)

BACKEND_ENV = "LORAPLEX_LORA_KERNEL"
BACKENDS = ("auto", "reference", "cpu", "triton")
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

log = logging.getLogger(__name__)

# the C++ kernel's segment table: these columns, then MODULE_COLUMNS per module of LORA_MODULES
SEGMENT_COLUMNS = ("row_start", "row_end", "rank", "row_len", "page_offset", "page_count")
MODULE_COLUMNS = ("a_offset", "b_offset", "rank", "in_features", "out_features")  # rank 0: not wrapped


@dataclass(frozen=True)
class LoraGroup:
    """A fused projection's LoRA modules, in the output order of its columns, and their widths."""

    modules: tuple[str, ...]
    out_features: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.modules) != len(self.out_features) or not self.modules:
            raise ValueError(f"a LoRA group needs one output width per module: {self.modules}, {self.out_features}")

    @cached_property
    def columns(self) -> tuple[int, ...]:
        """First column of each module in the group's output."""
        return tuple(sum(self.out_features[:m]) for m in range(len(self.modules)))

    @cached_property
    def table(self) -> torch.Tensor:
        """int64 [modules, 3] on the CPU: (canonical module index, first column, out features)."""
        rows = zip(group_modules(self.modules), self.columns, self.out_features, strict=True)
        return torch.tensor(list(rows), dtype=torch.int64).view(len(self.modules), 3)

    @cached_property
    def _on_device(self) -> dict[torch.device, torch.Tensor]:
        return {}

    def device_table(self, device: torch.device) -> torch.Tensor:
        """`table` on `device`, copied once per device (a model's groups live as long as it does)."""
        if device.type == "cpu":
            return self.table
        if device not in self._on_device:
            self._on_device[device] = self.table.to(device)
        return self._on_device[device]


@dataclass(frozen=True)
class LoraSegment:
    """Rows `row_start:row_end` of the step use the resident adapter with handle `adapter`."""

    row_start: int
    row_end: int
    adapter: int


@dataclass(frozen=True, eq=False)
class LoraBatch:
    """Which rows of the step's flat token batch use which resident adapter; built once per step,
    read by every layer."""

    segments: tuple[LoraSegment, ...]
    adapters: Mapping[int, AdapterPages]  # handle -> the resident adapter's pages
    num_rows: int

    @property
    def is_empty(self) -> bool:
        return not self.segments

    @classmethod
    def from_row_adapters(cls, row_adapters: Sequence[int], adapters: Mapping[int, AdapterPages],
                          no_adapter: int = -1) -> LoraBatch:
        """Segments from one adapter handle per row, given in grouped order (equal handles
        adjacent); rows of `no_adapter` belong to no segment."""
        segments: list[LoraSegment] = []
        start = 0
        for row in range(1, len(row_adapters) + 1):
            if row < len(row_adapters) and row_adapters[row] == row_adapters[start]:
                continue
            handle = row_adapters[start]
            if handle != no_adapter:
                if handle not in adapters:
                    raise ValueError(f"rows {start}:{row} use adapter handle {handle}, which holds no adapter")
                segments.append(LoraSegment(start, row, handle))
            start = row
        used = {s.adapter: adapters[s.adapter] for s in segments}
        return cls(tuple(segments), used, len(row_adapters))

    @cached_property
    def kernel_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the fused CPU kernel reads, as int64 CPU tensors: the segment table
        [segments, SEGMENT_COLUMNS + 7 * MODULE_COLUMNS] and every used adapter's pages once.
        Built from flat int arrays: torch.tensor over nested lists costs more than the kernel on
        a small model."""
        offsets: dict[int, int] = {}
        pages: list[int] = []
        for handle, adapter in self.adapters.items():
            offsets[handle] = len(pages)
            pages += adapter.pages
        rows: list[int] = []
        for s in self.segments:
            adapter = self.adapters[s.adapter]
            rows += (s.row_start, s.row_end, adapter.rank, adapter.layout.row_len, offsets[s.adapter],
                     len(adapter.pages))
            rows += adapter.layout.kernel_columns
        width = len(SEGMENT_COLUMNS) + len(LORA_MODULES) * len(MODULE_COLUMNS)
        return _int64(rows).view(len(self.segments), width), _int64(pages)

    @cached_property
    def _on_device(self) -> dict[torch.device, tuple[torch.Tensor, torch.Tensor]]:
        return {}

    def device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`kernel_tables` on `device`: copied once per step and device, then read by every layer."""
        if device.type == "cpu":
            return self.kernel_tables
        if device not in self._on_device:
            self._on_device[device] = tuple(t.to(device) for t in self.kernel_tables)
        return self._on_device[device]

    @cached_property
    def max_rank(self) -> int:
        """The largest rank of the adapters used (sizes the Triton kernels' shrink buffer)."""
        return max((adapter.rank for adapter in self.adapters.values()), default=0)

    @cached_property
    def max_segment_rows(self) -> int:
        """Rows of the longest segment (sizes the Triton prefill grid; 1 means a decode step)."""
        return max((s.row_end - s.row_start for s in self.segments), default=0)

    @cached_property
    def _fitted(self) -> set[tuple[LoraGroup, int]]:
        return set()

    def check_fits(self, group: LoraGroup, in_features: int) -> None:
        """Raise ValueError if an adapter's module shapes do not fit the layer (what the reference
        checks per call); checked once per group and width for the step, on the host."""
        if (group, in_features) in self._fitted:
            return
        for adapter in self.adapters.values():
            _wrapped_spans(adapter, group, in_features)
        self._fitted.add((group, in_features))


def _int64(values: list[int]) -> torch.Tensor:
    return torch.frombuffer(array("q", values), dtype=torch.int64) if values else torch.zeros(0, dtype=torch.int64)


def lora_linear_delta(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, group: LoraGroup,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Add every segment's LoRA term of `group` to `y` [tokens, sum(out)] in place; `x` is
    [tokens, in]; the adapters are read from this layer's KV pool (`k_cache`, `v_cache`).

    The Triton kernels on CUDA, the fused C++ kernel on CPU float32 tensors where it is available,
    else the torch reference (see the module docstring for `LORAPLEX_LORA_KERNEL`).
    """
    if batch.is_empty:
        return
    if _use_triton(y, x, k_cache):
        _triton_lora_delta(y, x, batch, group, k_cache, v_cache)
        return
    kernel = _cpu_kernel(y, x, k_cache)
    if kernel is None:
        reference_lora_delta(y, x, batch, group, k_cache, v_cache)
        return
    segments, pages = batch.kernel_tables
    kernel.lora_delta(y, x if x.stride(-1) == 1 else x.contiguous(), k_cache, v_cache, segments, pages,
                      group.table)


def prepare_lora_backend(device: torch.device, dtype: torch.dtype) -> None:
    """Build the fused CPU kernel (or import Triton) now, at startup, when this device and dtype
    will use it, so the one-time compile or import never lands inside a request."""
    probe = torch.empty(0, device=device, dtype=dtype)
    if not _use_triton(probe, probe, probe):
        _cpu_kernel(probe, probe, probe)


def lora_backend() -> str:
    """The backend chosen by `LORAPLEX_LORA_KERNEL` (default `auto`)."""
    backend = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={backend!r}: expected one of {', '.join(BACKENDS)}")
    return backend


def _cpu_kernel(y: torch.Tensor, x: torch.Tensor, k_cache: torch.Tensor) -> ModuleType | None:
    backend = lora_backend()
    if (backend == "reference" or x.device.type != "cpu" or x.dtype != torch.float32
            or y.dtype != torch.float32 or k_cache.dtype != torch.float32 or y.stride(-1) != 1):
        return None
    kernel = cpu_lora.load()
    if kernel is None and backend == "cpu":
        raise RuntimeError(f"{BACKEND_ENV}=cpu but the fused CPU LoRA kernel is unavailable: "
                           f"{cpu_lora.unavailable_reason()}")
    return kernel


_triton_state: dict[str, ModuleType | str | None] = {"module": None, "reason": None}


def _triton() -> ModuleType | None:
    """`loraplex_kernels.triton_lora`, imported at first use; None (logged once) without Triton."""
    if _triton_state["module"] is None and _triton_state["reason"] is None:
        try:
            _triton_state["module"] = importlib.import_module("loraplex_kernels.triton_lora")
        except ImportError as error:
            _triton_state["reason"] = f"{type(error).__name__}: {error}"
            log.warning("Triton LoRA kernels unavailable, using the torch reference: %s", _triton_state["reason"])
    module = _triton_state["module"]
    return module if isinstance(module, ModuleType) else None


def uses_triton(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the LoRA delta runs the Triton kernels for tensors of this device and dtype."""
    probe = torch.empty(0, device=device, dtype=dtype)
    return _use_triton(probe, probe, probe)


def _use_triton(y: torch.Tensor, x: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """`triton` always (it raises later if it cannot run); `auto` on CUDA when Triton imports and
    the dtypes are its own."""
    backend = lora_backend()
    if backend == "triton":
        if _triton() is None:
            raise RuntimeError(f"{BACKEND_ENV}=triton but Triton is unavailable: {_triton_state['reason']}")
        return True
    return (backend == "auto" and x.device.type == "cuda" and x.dtype in TRITON_DTYPES
            and x.dtype == y.dtype == k_cache.dtype and _triton() is not None)


def _triton_lora_delta(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, group: LoraGroup,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The Triton kernels over the step's tables on x's device; decode when no segment has two rows."""
    batch.check_fits(group, x.shape[1])
    segments, pages = batch.device_tables(x.device)
    kernels = _triton()
    assert kernels is not None  # _use_triton checked
    kernels.triton_lora_delta(y, x, segments, pages, group.device_table(x.device), k_cache, v_cache,
                              batch.max_rank, max_rows=batch.max_segment_rows)


def reference_lora_delta(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, group: LoraGroup,
                         k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Torch reference of `lora_linear_delta`: per segment, gather the adapter's rows from its
    pages, then per wrapped module one shrink and one expand, accumulated in float32 (the Triton
    kernels replace this on the GPU)."""
    for segment in batch.segments:
        adapter = batch.adapters[segment.adapter]
        wrapped = _wrapped_spans(adapter, group, x.shape[1])
        if not wrapped:
            continue  # the adapter wraps no module of this group
        weights = read_adapter(k_cache, v_cache, adapter)
        rows = slice(segment.row_start, segment.row_end)
        xs = x[rows].float()
        for span, col in wrapped:
            a = weights[:span.rank, span.a_offset:span.b_offset].float()
            b_t = weights[:span.rank, span.b_offset:span.end].float()
            cols = slice(col, col + span.out_features)
            y[rows, cols] += ((xs @ a.t()) @ b_t).to(y.dtype)


def _wrapped_spans(adapter: AdapterPages, group: LoraGroup, in_features: int) -> list[tuple[ModuleSpan, int]]:
    """(span, first column) of each module of `group` the adapter wraps, checked against the shapes."""
    wrapped = []
    for module, col, out in zip(group.modules, group.columns, group.out_features, strict=True):
        span = adapter.layout.span(module)
        if span is None:
            continue
        if span.in_features != in_features or span.out_features != out:
            raise ValueError(f"{module}: the adapter's [{span.out_features}, {span.in_features}] does not fit "
                             f"the layer's [{out}, {in_features}]")
        wrapped.append((span, col))
    return wrapped
