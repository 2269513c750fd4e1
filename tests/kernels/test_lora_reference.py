"""The segmented LoRA delta (torch reference over rank-class stacks) against a per-row dense computation."""

from __future__ import annotations

import pytest
import torch
from loraplex_kernels.lora import LoraBatch, LoraRun, StackedLoraWeights, lora_linear_delta, rank_class

OUTS = [32, 8, 8]  # a fused group of three projections, like q/k/v
D_IN = 24


def random_pair(rank: int, d_out: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(D_IN, rank, generator=gen), torch.randn(rank, d_out, generator=gen)


def test_rank_classes_are_powers_of_two():
    assert [rank_class(r) for r in (1, 2, 3, 8, 9, 16, 64, 65)] == [1, 2, 4, 8, 16, 16, 64, 128]
    with pytest.raises(ValueError):
        rank_class(0)


def test_runs_merge_equal_segments_at_consecutive_indices():
    locations = {0: (8, 0), 1: (8, 1), 2: (8, 2), 3: (16, 0), 4: (8, 4)}
    batch = LoraBatch.from_row_slots([0, 1, 2, 3, -1, 4, 4, 1, 1, 2], locations.__getitem__)
    assert batch.runs == (LoraRun(0, 1, 3, 8, 0), LoraRun(3, 1, 1, 16, 0), LoraRun(5, 2, 1, 8, 4),
                          LoraRun(7, 2, 1, 8, 1), LoraRun(9, 1, 1, 8, 2))
    assert batch.num_rows == 10
    assert LoraBatch.from_row_slots([-1, -1], locations.__getitem__).is_empty
    assert LoraBatch.from_row_slots([], locations.__getitem__).is_empty


def test_delta_equals_per_row_dense_with_mixed_ranks_and_modules():
    gen = torch.Generator().manual_seed(0)
    stack = StackedLoraWeights(D_IN, OUTS, torch.device("cpu"), torch.float32)
    ranks = {0: 1, 1: 8, 2: 12, 3: 8, 4: 64}  # slot -> rank; 12 lives in class 16
    wraps = {0: [True] * 3, 1: [True, False, True], 2: [True] * 3, 3: [False, False, True], 4: [True] * 3}
    pairs, locations = {}, {}
    per_class: dict[int, int] = {}
    for slot, rank in ranks.items():
        cls = rank_class(rank)
        locations[slot] = (cls, per_class.get(cls, 0))
        per_class[cls] = per_class.get(cls, 0) + 1
        pairs[slot] = [random_pair(rank, out, gen) if w else None for w, out in zip(wraps[slot], OUTS, strict=True)]
        stack.put(locations[slot], pairs[slot])
    row_slots = [1, 3, 0, -1, 2, 2, 4, 4, 4, -1, 1, 1]
    x = torch.randn(len(row_slots), D_IN, generator=gen)
    base = torch.randn(len(row_slots), sum(OUTS), generator=gen)
    y = base.clone()
    lora_linear_delta(y, x, LoraBatch.from_row_slots(row_slots, locations.__getitem__), stack)
    for row, slot in enumerate(row_slots):
        expected = base[row].clone()
        if slot >= 0:
            deltas = [x[row] @ p[0] @ p[1] if p is not None else torch.zeros(out)
                      for p, out in zip(pairs[slot], OUTS, strict=True)]
            expected += torch.cat(deltas)
        torch.testing.assert_close(y[row], expected, rtol=1e-5, atol=1e-5)


def test_buffers_grow_and_cleared_adapters_stop_counting():
    gen = torch.Generator().manual_seed(1)
    stack = StackedLoraWeights(D_IN, OUTS, torch.device("cpu"), torch.float32)
    stack.put((8, 0), [None, None, None])
    assert 8 not in stack.a  # nothing wraps the group: no buffer
    first = [random_pair(8, out, gen) for out in OUTS]
    stack.put((8, 5), first)
    assert stack.a[8][0].shape == (6, D_IN, 8) and stack.wrapped[8] == [1, 1, 1]
    stack.put((8, 6), [random_pair(4, OUTS[0], gen), None, None])
    assert stack.a[8][2].shape[0] == 12 and stack.wrapped[8] == [2, 1, 1]
    torch.testing.assert_close(stack.b[8][1][5], first[1][1])  # survived the growth
    stack.clear((8, 5))
    assert stack.wrapped[8] == [1, 0, 0]
    stack.clear((8, 5))  # clearing twice is harmless
    assert stack.wrapped[8] == [1, 0, 0]


def test_put_refuses_pairs_that_do_not_fit():
    gen = torch.Generator().manual_seed(2)
    stack = StackedLoraWeights(D_IN, OUTS, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        stack.put((8, 0), [random_pair(16, OUTS[0], gen), None, None])
    with pytest.raises(ValueError, match="power of two"):
        stack.put((12, 0), [random_pair(12, OUTS[0], gen), None, None])
    with pytest.raises(ValueError, match="expected 3"):
        stack.put((8, 0), [None])
    assert not stack.present
