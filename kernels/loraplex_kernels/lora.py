"""Multi-LoRA in one batch: the segmented LoRA delta, with its torch reference implementation.

Semantics (the same as punica's SGMV and vLLM's `add_lora_linear`): the rows of a flat token batch
are grouped so that all tokens of one adapter are contiguous. Segment `s` covers rows
`start_s:end_s` and uses one resident adapter; for every LoRA-wrapped projection `m` of a fused
group (q/k/v, or gate/up, or a single projection)

    y[start_s:end_s, cols_m] += (x[start_s:end_s] @ A_s,m) @ B_s,m

where `A_s,m` is `[in_features, r]` (PEFT's `lora_A.weight` transposed) and `B_s,m` is
`[r, out_m]` (PEFT's `lora_B.weight` transposed, already multiplied by the adapter's scaling).
Rows in no segment (base-model requests) get no LoRA term.

Layout (`StackedLoraWeights`): the adapters of one fused group are stacked per *rank class*, the
adapter's rank rounded up to a power of two: per module m, `a[class][m]` is `[capacity, in, class]`
and `b[class][m]` is `[capacity, class, out_m]`, zero-padded beyond the adapter's rank. An adapter
lives at one (class, index) in every layer and group. Work therefore follows each adapter's own
rank rounded up to a power of two (ranks 8/16/32/64 pay nothing extra), never the batch's max rank,
and the expand writes each module's column slice of `y` (no block-diagonal B full of zeros).

Execution (`LoraBatch.runs`): consecutive segments of the same class and length whose indices
follow each other are one *run*, computed by one batched shrink and one batched expand per module
over views of the stacked buffers (no copies of weights). Decode steps with many adapters become a
few runs per class instead of one matmul pair per adapter; a prefill segment is a run of its own.
Modules are not fused on the shrink side: on the CPU a batched [1 x in] @ [in x 3r] product ran at
half the memory bandwidth of three [1 x in] @ [in x r] products once 3r reached ~100.

Backends (`LORAPLEX_LORA_KERNEL`): `auto` (default) uses the fused C++ kernel
(`loraplex_kernels.cpu_lora`, one call per fused group, streaming the weights at memory bandwidth)
for float32 tensors on the CPU when it builds, else the torch reference; `reference` always uses
the torch reference; `cpu` requires the C++ kernel for CPU float32 and raises if it cannot be built.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType

import torch

from loraplex_kernels import cpu_lora

BACKEND_ENV = "LORAPLEX_LORA_KERNEL"
BACKENDS = ("auto", "reference", "cpu")

LoraPair = tuple[torch.Tensor, torch.Tensor]  # (A [in, r], B [r, out]), B pre-scaled
KernelEntries = tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]  # see kernel_entries
Location = tuple[int, int]  # (rank class, index in that class's stacked buffers)


def rank_class(rank: int) -> int:
    """The power of two >= rank: the stacked buffer an adapter of this rank lives in."""
    if rank < 1:
        raise ValueError(f"a LoRA rank must be at least 1, not {rank}")
    return 1 << (rank - 1).bit_length()


@dataclass(frozen=True)
class LoraRun:
    """`num_segments` consecutive segments of `tokens` rows each, starting at `row_start`; segment k
    uses index `index_start + k` of the rank class `rank`."""

    row_start: int
    tokens: int
    num_segments: int
    rank: int
    index_start: int

    @property
    def row_end(self) -> int:
        return self.row_start + self.tokens * self.num_segments

    @property
    def index_end(self) -> int:
        return self.index_start + self.num_segments


@dataclass(frozen=True)
class LoraBatch:
    """Which rows of the step's flat token batch use which resident adapter; built once per step,
    read by every layer."""

    runs: tuple[LoraRun, ...]
    num_rows: int

    @property
    def is_empty(self) -> bool:
        return not self.runs

    @cached_property
    def run_table(self) -> torch.Tensor:
        """int64 [runs, 5] on the CPU: (row_start, tokens, num_segments, rank, index_start) per run,
        what the fused CPU kernel reads; built once per step."""
        rows = [(r.row_start, r.tokens, r.num_segments, r.rank, r.index_start) for r in self.runs]
        return torch.tensor(rows, dtype=torch.int64).view(len(rows), 5)

    @classmethod
    def from_row_slots(cls, row_slots: Sequence[int], locate: Callable[[int], Location],
                       no_adapter: int = -1) -> LoraBatch:
        """Runs from one slot per row, given in grouped order (equal slots adjacent); `locate(slot)`
        is the slot's (rank class, index). Rows of `no_adapter` belong to no run."""
        runs: list[LoraRun] = []
        start = 0
        for row in range(1, len(row_slots) + 1):
            if row < len(row_slots) and row_slots[row] == row_slots[start]:
                continue
            if row_slots[start] != no_adapter:
                _append_segment(runs, start, row - start, *locate(row_slots[start]))
            start = row
        return cls(tuple(runs), len(row_slots))


def _append_segment(runs: list[LoraRun], start: int, tokens: int, rank: int, index: int) -> None:
    last = runs[-1] if runs else None
    if (last is not None and last.row_end == start and last.tokens == tokens and last.rank == rank
            and last.index_end == index):
        runs[-1] = LoraRun(last.row_start, tokens, last.num_segments + 1, rank, last.index_start)
    else:
        runs.append(LoraRun(start, tokens, 1, rank, index))


class StackedLoraWeights:
    """One fused group's LoRA weights (one layer) for every resident adapter, stacked per rank class.

    A class's buffers exist once an adapter of that class wraps a module of the group, and grow (by
    doubling) to cover every index stored in the class. `wrapped[class][m]` counts the stored
    adapters that wrap module m: a module nobody wraps costs no expand, a class nobody wraps no work.
    (A module one adapter of a run wraps and another does not costs the other one zero rows.)
    """

    def __init__(self, in_features: int, out_features: Sequence[int], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.in_features = in_features
        self.out_features = list(out_features)
        self.device = device
        self.dtype = dtype
        self.a: dict[int, list[torch.Tensor]] = {}
        self.b: dict[int, list[torch.Tensor]] = {}
        self.wrapped: dict[int, list[int]] = {}
        self.present: dict[tuple[int, int], list[bool]] = {}
        self._entries: KernelEntries | None = None

    def put(self, location: Location, parts: Sequence[LoraPair | None]) -> None:
        """Store one adapter's pairs (one per module, None where it wraps nothing) at `location`."""
        rank, index = location
        self._check(rank, parts)
        self.clear(location)
        self._entries = None
        self.present[location] = [p is not None for p in parts]
        if rank not in self.a and not any(self.present[location]):
            return  # nothing of this class wraps the group yet: no buffer needed
        self._reserve(rank)
        for m, pair in enumerate(parts):
            a, b = self.a[rank][m][index], self.b[rank][m][index]
            a.zero_()
            b.zero_()
            if pair is not None:
                r = pair[0].shape[1]
                a[:, :r] = pair[0]
                b[:r] = pair[1]
                self.wrapped[rank][m] += 1

    def _check(self, rank: int, parts: Sequence[LoraPair | None]) -> None:
        if rank_class(rank) != rank:
            raise ValueError(f"rank class {rank} is not a power of two")
        if len(parts) != len(self.out_features):
            raise ValueError(f"expected {len(self.out_features)} LoRA pairs, got {len(parts)}")
        for pair, out in zip(parts, self.out_features, strict=True):
            if pair is None:
                continue
            r = pair[0].shape[1]
            if r > rank or pair[0].shape[0] != self.in_features or tuple(pair[1].shape) != (r, out):
                raise ValueError(f"LoRA pair of shapes {tuple(pair[0].shape)}, {tuple(pair[1].shape)} does not "
                                 f"fit rank class {rank}, in {self.in_features}, out {out}")

    def clear(self, location: Location) -> None:
        """Forget the adapter at `location` (its rows are never scheduled again)."""
        self._entries = None
        for m, wraps in enumerate(self.present.pop(location, [])):
            self.wrapped[location[0]][m] -= wraps

    def kernel_entries(self) -> KernelEntries:
        """What the fused CPU kernel reads: one entry per (class, module) that a stored adapter
        wraps, as int64 [entries, 3] (rank class, first column in y, out features) plus the
        matching A and B buffers; cached until the next put or clear."""
        if self._entries is None:
            starts = [sum(self.out_features[:m]) for m in range(len(self.out_features))]
            wrapped = [(rank, m) for rank in self.a for m in range(len(self.out_features)) if self.wrapped[rank][m]]
            meta = [(rank, starts[m], self.out_features[m]) for rank, m in wrapped]
            self._entries = (torch.tensor(meta, dtype=torch.int64).view(len(meta), 3),
                             [self.a[rank][m] for rank, m in wrapped], [self.b[rank][m] for rank, m in wrapped])
        return self._entries

    def _reserve(self, rank: int) -> None:
        """Make the class's buffers hold every index stored so far, including adapters that wrap
        nothing here, so a run over consecutive indices always finds its rows."""
        capacity = self.a[rank][0].shape[0] if rank in self.a else 0
        needed = 1 + max(index for r, index in self.present if r == rank)
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity)
        self.a[rank] = [self._grow(self.a.get(rank), m, (new_capacity, self.in_features, rank))
                        for m in range(len(self.out_features))]
        self.b[rank] = [self._grow(self.b.get(rank), m, (new_capacity, rank, out))
                        for m, out in enumerate(self.out_features)]
        self.wrapped.setdefault(rank, [0] * len(self.out_features))

    def _grow(self, old: list[torch.Tensor] | None, module: int, shape: tuple[int, ...]) -> torch.Tensor:
        new = torch.zeros(shape, device=self.device, dtype=self.dtype)
        if old is not None:
            new[:old[module].shape[0]] = old[module]
        return new


def lora_linear_delta(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, weights: StackedLoraWeights) -> None:
    """Add every segment's LoRA term to `y` [tokens, sum(out)] in place; `x` is [tokens, in].

    The fused C++ kernel on CPU float32 tensors where it is available, else the torch reference
    (see the module docstring for `LORAPLEX_LORA_KERNEL`).
    """
    if batch.is_empty:
        return
    kernel = _cpu_kernel(y, x)
    if kernel is None:
        reference_lora_delta(y, x, batch, weights)
        return
    entries, a, b = weights.kernel_entries()
    if a:
        kernel.lora_delta(y, x if x.stride(-1) == 1 else x.contiguous(), batch.run_table, entries, a, b)


def prepare_lora_backend(device: torch.device, dtype: torch.dtype) -> None:
    """Build the fused CPU kernel now, at startup, when this device and dtype will use it, so the
    one-time compile never lands inside a request."""
    probe = torch.empty(0, device=device, dtype=dtype)
    _cpu_kernel(probe, probe)


def lora_backend() -> str:
    """The backend chosen by `LORAPLEX_LORA_KERNEL` (default `auto`)."""
    backend = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={backend!r}: expected one of {', '.join(BACKENDS)}")
    return backend


def _cpu_kernel(y: torch.Tensor, x: torch.Tensor) -> ModuleType | None:
    backend = lora_backend()
    if (backend == "reference" or x.device.type != "cpu" or x.dtype != torch.float32
            or y.dtype != torch.float32 or y.stride(-1) != 1):
        return None
    kernel = cpu_lora.load()
    if kernel is None and backend == "cpu":
        raise RuntimeError(f"{BACKEND_ENV}=cpu but the fused CPU LoRA kernel is unavailable: "
                           f"{cpu_lora.unavailable_reason()}")
    return kernel


def reference_lora_delta(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, weights: StackedLoraWeights) -> None:
    """Torch reference of `lora_linear_delta`: per run and wrapped module one batched shrink and one
    batched expand (a Triton kernel replaces this on the GPU later)."""
    for run in batch.runs:
        if run.rank not in weights.a or not any(weights.wrapped[run.rank]):
            continue  # no adapter of this class wraps this group
        rows = slice(run.row_start, run.row_end)
        indices = slice(run.index_start, run.index_end)
        xs = x[rows].view(run.num_segments, run.tokens, -1)
        col = 0
        for m, out in enumerate(weights.out_features):
            if weights.wrapped[run.rank][m]:
                h = torch.bmm(xs, weights.a[run.rank][m][indices])
                ys = y[rows, col:col + out].view(run.num_segments, run.tokens, out)
                ys.baddbmm_(h, weights.b[run.rank][m][indices])
            col += out
