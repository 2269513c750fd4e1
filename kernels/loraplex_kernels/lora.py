"""Multi-LoRA in one batch: the segmented LoRA delta, with its torch reference implementation.

Semantics (the same as punica's SGMV and vLLM's `add_lora_linear`): the rows of a flat token batch
are grouped so that all tokens of one adapter are contiguous. Segment `s` covers rows
`start_s:end_s` and uses adapter slot `slot_s`; for every LoRA-wrapped linear layer

    y[start_s:end_s] += (x[start_s:end_s] @ A_s) @ B_s

where `A_s` is `[in_features, r_s]` (PEFT's `lora_A.weight` transposed) and `B_s` is
`[r_s, out_features]` (PEFT's `lora_B.weight` transposed, already multiplied by the adapter's
scaling `alpha / r` or `alpha / sqrt(r)`). Rows in no segment (base-model requests) get no LoRA
term, and a slot whose adapter does not wrap this layer is `None` in `weights`.

The work is `sum_s (end_s - start_s) * r_s * (in + out)`: it follows the ranks of the adapters
present, never `batch x max rank`. Several projections that read the same input (q/k/v, gate/up)
are fused by stacking their `A` matrices side by side and their `B` matrices block-diagonally when
a slot is loaded (`fuse_lora_weights`), so one shrink and one expand serve the whole group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

LoraPair = tuple[torch.Tensor, torch.Tensor]  # (A [in, r], B [r, out]), B pre-scaled


@dataclass(frozen=True)
class LoraBatch:
    """Which rows of the step's flat token batch use which adapter slot.

    segments: (start_row, end_row, slot), ascending and disjoint, end > start; rows covered by no
    segment run on the base model alone. num_rows: rows in the batch. Built once per step, read by
    every layer.
    """

    segments: tuple[tuple[int, int, int], ...]
    num_rows: int

    @property
    def is_empty(self) -> bool:
        return not self.segments

    @cached_property
    def runs(self) -> tuple[list[int], list[int | None]]:
        """The rows cut into consecutive runs: (run sizes, slot of each run or None for base rows).
        One `split` per layer then yields every segment's rows as views in a single call."""
        sizes: list[int] = []
        slots: list[int | None] = []
        row = 0
        for start, end, slot in self.segments:
            if start < row or end <= start:
                raise ValueError(f"LoRA segments must be ascending, disjoint and non-empty: {self.segments}")
            if start > row:
                sizes.append(start - row)
                slots.append(None)
            sizes.append(end - start)
            slots.append(slot)
            row = end
        if row > self.num_rows:
            raise ValueError(f"LoRA segments reach row {row}, beyond the batch's {self.num_rows} rows")
        if row < self.num_rows:
            sizes.append(self.num_rows - row)
            slots.append(None)
        return sizes, slots

    @classmethod
    def from_row_slots(cls, row_slots: Sequence[int], no_adapter: int = -1) -> LoraBatch:
        """Segments from one slot per row, given in grouped order (equal slots adjacent)."""
        segments = []
        start = 0
        for row in range(1, len(row_slots) + 1):
            if row == len(row_slots) or row_slots[row] != row_slots[start]:
                if row_slots[start] != no_adapter:
                    segments.append((start, row, row_slots[start]))
                start = row
        return cls(tuple(segments), len(row_slots))


def lora_linear_delta(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch,
                      weights: Sequence[LoraPair | None]) -> None:
    """Add every segment's LoRA term to `y` [tokens, out] in place; `x` is [tokens, in].

    `weights[slot]` is the slot's (A, B) pair for this layer, or None. Torch reference: one shrink
    and one expand matmul per segment (a Triton kernel replaces this loop on the GPU later).
    """
    if batch.is_empty:
        return
    sizes, slots = batch.runs
    for x_rows, y_rows, slot in zip(x.split(sizes), y.split(sizes), slots, strict=True):
        pair = None if slot is None else weights[slot]
        if pair is not None:
            y_rows.addmm_(x_rows.mm(pair[0]), pair[1])


def fuse_lora_weights(parts: Sequence[LoraPair | None], out_features: Sequence[int]) -> LoraPair | None:
    """Fuse the LoRA pairs of projections that share their input into one pair.

    parts[i] is projection i's (A [in, r_i], B [r_i, out_i]) or None when the adapter does not wrap
    it. The fused A is [in, sum r_i] (the A's side by side) and the fused B is
    [sum r_i, sum out_i], block-diagonal, so `(x @ A) @ B` equals the projections' deltas
    concatenated along the output dimension.
    """
    present = [p for p in parts if p is not None]
    if not present:
        return None
    a = torch.cat([p[0] for p in present], dim=1)
    b = a.new_zeros(a.shape[1], sum(out_features))
    row, col = 0, 0
    for pair, out in zip(parts, out_features, strict=True):
        if pair is not None:
            rank = pair[0].shape[1]
            b[row:row + rank, col:col + out] = pair[1]
            row += rank
        col += out
    return a.contiguous(), b
