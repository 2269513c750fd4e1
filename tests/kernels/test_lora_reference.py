"""The segmented LoRA delta (torch reference) against a per-row dense computation."""

from __future__ import annotations

import pytest
import torch
from loraplex_kernels.lora import LoraBatch, fuse_lora_weights, lora_linear_delta


def random_pair(rank: int, d_in: int, d_out: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(d_in, rank, generator=gen), torch.randn(rank, d_out, generator=gen)


def test_segments_from_row_slots_skip_base_rows():
    batch = LoraBatch.from_row_slots([2, 2, 0, -1, -1, 3, 3, 3])
    assert batch.segments == ((0, 2, 2), (2, 3, 0), (5, 8, 3))
    assert batch.runs == ([2, 1, 2, 3], [2, 0, None, 3])
    assert LoraBatch(((1, 2, 0),), 4).runs == ([1, 1, 2], [None, 0, None])
    assert LoraBatch.from_row_slots([-1, -1]).is_empty
    assert LoraBatch.from_row_slots([]).is_empty
    with pytest.raises(ValueError, match="ascending"):
        _ = LoraBatch(((2, 4, 0), (3, 5, 1)), 6).runs


def test_delta_equals_per_row_dense_with_mixed_ranks():
    gen = torch.Generator().manual_seed(0)
    d_in, d_out = 24, 40
    weights = [random_pair(r, d_in, d_out, gen) for r in (1, 8, 64)] + [None]  # slot 3 wraps nothing here
    row_slots = [1, 1, 1, 0, -1, 2, 2, 3, -1]
    x = torch.randn(len(row_slots), d_in, generator=gen)
    base = torch.randn(len(row_slots), d_out, generator=gen)
    y = base.clone()
    lora_linear_delta(y, x, LoraBatch.from_row_slots(row_slots), weights)
    for row, slot in enumerate(row_slots):
        expected = base[row].clone()
        if slot >= 0 and weights[slot] is not None:
            a, b = weights[slot]
            expected += x[row] @ a @ b
        torch.testing.assert_close(y[row], expected, rtol=1e-5, atol=1e-5)


def test_fused_pair_equals_concatenated_deltas():
    gen = torch.Generator().manual_seed(1)
    d_in, outs = 16, [32, 8, 8]
    parts = [random_pair(4, d_in, outs[0], gen), None, random_pair(16, d_in, outs[2], gen)]
    a, b = fuse_lora_weights(parts, outs)
    assert a.shape == (d_in, 20) and b.shape == (20, sum(outs))
    x = torch.randn(5, d_in, generator=gen)
    expected = torch.cat([x @ parts[0][0] @ parts[0][1], torch.zeros(5, 8), x @ parts[2][0] @ parts[2][1]], 1)
    torch.testing.assert_close((x @ a) @ b, expected, rtol=1e-5, atol=1e-5)
    assert fuse_lora_weights([None, None], [4, 4]) is None
