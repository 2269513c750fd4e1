"""Triton paged attention against the torch reference, through `paged_attention` and directly.

Without a GPU the kernels run in Triton's interpreter (tests/kernels/conftest.py sets
TRITON_INTERPRET), which is slow: shapes are tiny and each case covers several properties at once
(scattered block tables, partial last blocks, prefix hits, grouped-query heads)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from loraplex_kernels.attention import (
    BACKEND_ENV,
    AttentionBatch,
    PrefillChunk,
    attention_backend,
    build_attention_batch,
    decode_key_mask,
    paged_attention,
    write_kv,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch):
    """The Triton module, skipping when it cannot run here."""
    pytest.importorskip("triton")
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from loraplex_kernels import triton_attention

    return triton_attention


@dataclass
class Step:
    """One step's inputs: the cache before it (random everywhere, like pages holding other data),
    this step's q / new k, v, and its attention batch."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    batch: AttentionBatch
    real_slots: list[int]  # the slots this step may write
    scale: float

    def to(self, dtype: torch.dtype) -> Step:
        cast = [t.to(dtype) for t in (self.q, self.k, self.v, self.k_cache, self.v_cache)]
        return Step(*cast, self.batch, self.real_slots, self.scale)


def make_step(requests: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype = torch.float32, seed: int = 0, pad_rows: int = 0,
              decode_width: int | None = None) -> Step:
    """requests: (tokens already cached, new tokens), decodes (1 new token) first."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(ctx + n) // block_size) for ctx, n in requests]
    free = list(range(sum(needed) + 3))  # a few blocks no request owns
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(count)] for count in needed]
    shape = (sum(needed) + 3, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    slots: list[int] = []
    for table, (ctx, n) in zip(tables, requests, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n)]
    decodes = [(t, ctx + 1) for t, (ctx, n) in zip(tables, requests, strict=True) if n == 1]
    prefills = [(n, ctx, t) for t, (ctx, n) in zip(tables, requests, strict=True) if n > 1]
    batch = build_attention_batch(slots, [t for t, _ in decodes], [c for _, c in decodes], prefills, block_size,
                                  DEVICE, decode_width=decode_width, num_decode_rows=len(decodes) + pad_rows)
    rows = len(slots) + pad_rows
    q = torch.randn(rows, heads, head_dim, generator=gen)
    kv = torch.randn(rows, 2 * kv_heads, head_dim, generator=gen)
    k, v = kv.split(kv_heads, dim=1)  # v is a strided view, as the model's split qkv gives
    step = Step(q, k, v, k_cache, v_cache, batch, slots, head_dim ** -0.5)
    return step.to(dtype)


def run(step: Step, backend: str, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """write_kv then paged_attention, as one layer does; returns the output and both caches."""
    monkeypatch.setenv(BACKEND_ENV, backend)
    k_cache, v_cache = step.k_cache.clone().to(DEVICE), step.v_cache.clone().to(DEVICE)
    k, v = step.k.to(DEVICE), step.v.to(DEVICE)
    write_kv(k_cache, v_cache, k, v, step.batch.slot_mapping)
    out = paged_attention(step.q.to(DEVICE), k, v, k_cache, v_cache, step.batch, step.scale)
    return out.cpu(), k_cache.cpu(), v_cache.cpu()


def assert_matches_reference(step: Step, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """Triton (in the step's dtype) against the reference run in float32 on the same values."""
    out, k_cache, v_cache = run(step, "triton", monkeypatch)
    expected, ref_k, ref_v = run(step.to(torch.float32), "reference", monkeypatch)
    tol = TOLERANCE[step.q.dtype]
    assert out.dtype == step.q.dtype
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    assert torch.equal(k_cache.float(), ref_k) and torch.equal(v_cache.float(), ref_v)
    return out


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 32, 64])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_mixed_step_matches_reference(kernels, monkeypatch, heads, kv_heads, head_dim, block_size):
    # two decodes (one ending a block exactly), a chunk after a prefix hit, a fresh prompt
    requests = [(2 * block_size - 1, 1), (5, 1), (block_size + 3, 6), (0, 2 * block_size + 1)]
    assert_matches_reference(make_step(requests, heads, kv_heads, head_dim, block_size, seed=head_dim), monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_half_precision(kernels, monkeypatch, dtype, heads, kv_heads):
    requests = [(9, 1), (30, 1), (7, 5), (0, 11)]
    assert_matches_reference(make_step(requests, heads, kv_heads, 32, 4, dtype=dtype), monkeypatch)


def test_decode_only_and_prefill_only_steps(kernels, monkeypatch):
    assert_matches_reference(make_step([(3, 1), (17, 1), (0, 1)], 4, 2, 16, 4), monkeypatch)
    assert_matches_reference(make_step([(0, 3), (12, 9), (4, 2)], 4, 2, 16, 4, seed=1), monkeypatch)


def test_many_chunks_and_a_long_chunk_in_one_launch(kernels, monkeypatch):
    # 70 tokens span two query tiles; chunks of every start and length share the launch
    requests = [(0, 70), (3, 2), (16, 16), (5, 11), (40, 3)]
    assert_matches_reference(make_step(requests, 2, 2, 16, 16, seed=3), monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_decode_rows(kernels, monkeypatch, dtype):
    """CUDA-graph padding: rows with slot -1 and context 0 write nothing and output zeros; a fixed
    table width wider than any request reads nothing past each context."""
    step = make_step([(6, 1), (1, 1), (4, 3)], 4, 2, 16, 4, dtype=dtype, pad_rows=2, decode_width=8)
    assert step.batch.num_decode == 4 and step.batch.decode_block_tables.shape == (4, 8)
    assert step.batch.slot_mapping[2:4].tolist() == [-1, -1]
    assert step.batch.prefills[0].row_start == 4
    out, k_cache, v_cache = run(step, "triton", monkeypatch)
    assert torch.count_nonzero(out[2:4]) == 0
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    before_k, before_v = step.k_cache.flatten(0, 1), step.v_cache.flatten(0, 1)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[step.real_slots] = False
    assert torch.equal(flat_k[untouched], before_k[untouched]) and torch.equal(flat_v[untouched], before_v[untouched])
    real = torch.tensor([0, 1, 4, 5, 6])
    assert torch.equal(flat_k[step.real_slots], step.k[real]) and torch.equal(flat_v[step.real_slots], step.v[real])
    assert_matches_reference(step, monkeypatch)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_decode(kernels, monkeypatch, num_splits):
    """Flash-decoding: the context split across programs, merged exactly; empty splits and an empty
    context included."""
    step = make_step([(150, 1), (20, 1), (0, 1), (190, 1)], 8, 2, 32, 4, seed=5, pad_rows=1, decode_width=48)
    batch = step.batch
    k_cache, v_cache = step.k_cache.to(DEVICE), step.v_cache.to(DEVICE)
    write_kv(k_cache, v_cache, step.k.to(DEVICE), step.v.to(DEVICE), batch.slot_mapping)
    q = step.q.to(DEVICE)
    args = (q, k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, step.scale)
    split = kernels.decode_attention(*args, num_splits=num_splits)
    whole = kernels.decode_attention(*args, num_splits=1)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(split[4]) == 0
    monkeypatch.setenv(BACKEND_ENV, "reference")
    expected = paged_attention(q, step.k, step.v, k_cache, v_cache, batch, step.scale)
    torch.testing.assert_close(split.cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)


def test_batch_built_by_hand_runs_on_triton(kernels, monkeypatch):
    """Batches without the kernel metadata (the older fields only) still run on Triton."""
    step = make_step([(5, 1), (2, 4)], 4, 2, 16, 4, seed=7)
    built = step.batch
    by_hand = AttentionBatch(built.slot_mapping, 1, built.decode_block_tables, built.decode_key_mask,
                             [PrefillChunk(c.row_start, c.row_end, c.start_position, c.block_table.clone())
                              for c in built.prefills])
    expected, _, _ = run(step, "reference", monkeypatch)
    step.batch = by_hand
    out, _, _ = run(step, "triton", monkeypatch)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_store_kv_skips_negative_slots(kernels):
    k_cache = torch.randn(4, 4, 2, 16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    k, v = torch.randn(3, 2, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kernels.store_kv(k_cache, v_cache, k, v, torch.tensor([13, -1, 2], device=DEVICE))
    expected_k.view(16, 2, 16)[[13, 2]] = k[[0, 2]]
    expected_v.view(16, 2, 16)[[13, 2]] = v[[0, 2]]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    kernels.store_kv(k_cache, v_cache, k[:0], v[:0], torch.tensor([], dtype=torch.long, device=DEVICE))


def test_kernels_reject_bad_inputs(kernels):
    cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    q = torch.zeros(2, 4, 16, device=DEVICE)
    tables = torch.zeros(2, 3, dtype=torch.long, device=DEVICE)
    lens = torch.ones(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="q is"):
        kernels.decode_attention(q.half(), cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        kernels.decode_attention(torch.zeros(2, 3, 16, device=DEVICE), cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        kernels.decode_attention(q, cache, cache, tables, lens.float(), 1.0)
    with pytest.raises(ValueError, match="decode rows"):
        kernels.decode_attention(q, cache, cache, tables[:1], lens, 1.0)
    with pytest.raises(ValueError, match="chunk_meta"):
        kernels.prefill_attention(q, cache, cache, tables, torch.zeros(2, 2, dtype=torch.long, device=DEVICE), 1, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.store_kv(cache, cache, q[:, :2], q[:, :2], lens[:1])
    empty = kernels.decode_attention(q[:0], cache, cache, tables[:0], lens[:0], 1.0)
    assert empty.shape == (0, 4, 16)


# ----------------------------------------------------------------- reference path and the builder


def test_builder_matches_the_hand_built_batch():
    """The builder's reference metadata equals what the executor built before it (bit-identical
    attention), plus the kernels' metadata."""
    batch = build_attention_batch([30, 9, 4, 5, 6, 80, 81], [[7, 3, 12], [2]], [10, 3],
                                  [(3, 3, [1, 30]), (2, 0, [20])], 4, "cpu")
    assert batch.slot_mapping.tolist() == [30, 9, 4, 5, 6, 80, 81]
    assert batch.num_decode == 2 and batch.decode_block_tables.tolist() == [[7, 3, 12], [2, 0, 0]]
    assert torch.equal(batch.decode_key_mask, decode_key_mask(torch.tensor([10, 3]), 12))
    assert batch.decode_context_lens.tolist() == [10, 3]
    assert [(c.row_start, c.row_end, c.start_position, c.block_table.tolist()) for c in batch.prefills] == [
        (2, 5, 3, [1, 30]), (5, 7, 0, [20])]
    assert batch.prefill_meta.tolist() == [[2, 3, 3], [5, 2, 0]]
    assert batch.prefill_block_tables.tolist() == [[1, 30], [20, 0]] and batch.prefill_max_tokens == 3
    assert all(t.dtype == torch.long for t in (batch.slot_mapping, batch.decode_block_tables))
    prefill_only = build_attention_batch([1, 2], [], [], [(2, 0, [0])], 4, "cpu")
    assert prefill_only.num_decode == 0 and prefill_only.decode_block_tables is None
    assert prefill_only.decode_key_mask is None and prefill_only.decode_context_lens is None
    assert build_attention_batch([5], [[1]], [2], [], 4, "cpu").prefill_meta is None


def test_builder_rejects_metadata_that_does_not_fit():
    with pytest.raises(ValueError, match="slot_mapping"):
        build_attention_batch([1, 2], [[0]], [1], [], 4, "cpu")
    with pytest.raises(ValueError, match="does not fit"):
        build_attention_batch([1], [[0]], [5], [], 4, "cpu")
    with pytest.raises(ValueError, match="does not fit"):
        build_attention_batch([1], [[0, 1]], [5], [], 4, "cpu", decode_width=1)
    with pytest.raises(ValueError, match="does not fit"):
        build_attention_batch([1, 2, 3], [], [], [(3, 3, [0])], 4, "cpu")
    with pytest.raises(ValueError, match="fewer"):
        build_attention_batch([1], [[0]], [1], [], 4, "cpu", num_decode_rows=0)


def test_reference_is_unchanged_and_pads_with_zeros(monkeypatch):
    """The reference path through the builder gives exactly the hand-built batch's output; padding
    rows are skipped by write_kv and output zeros."""
    monkeypatch.setenv(BACKEND_ENV, "reference")
    step = make_step([(9, 1), (2, 1), (6, 7), (0, 5)], 4, 2, 8, 4, seed=11)
    built = step.batch
    by_hand = AttentionBatch(built.slot_mapping.clone(), 2, built.decode_block_tables.clone(),
                             built.decode_key_mask.clone(),
                             [PrefillChunk(c.row_start, c.row_end, c.start_position, c.block_table.clone())
                              for c in built.prefills])
    out, k_cache, _ = run(step, "reference", monkeypatch)
    step.batch = by_hand
    assert torch.equal(out, run(step, "reference", monkeypatch)[0])
    padded = make_step([(9, 1), (6, 3)], 4, 2, 8, 4, seed=12, pad_rows=2, decode_width=6)
    out, k_cache, _ = run(padded, "reference", monkeypatch)
    assert torch.count_nonzero(out[1:3]) == 0
    untouched = torch.ones(k_cache.shape[0] * 4, dtype=torch.bool)
    untouched[padded.real_slots] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched], padded.k_cache.flatten(0, 1)[untouched])


def test_backend_switch(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "")
    assert attention_backend() == "auto"
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        attention_backend()


def test_cpu_serving_never_imports_triton():
    code = ("import sys, torch\n"
            "from loraplex_kernels.attention import build_attention_batch, paged_attention, write_kv\n"
            "cache = torch.zeros(2, 4, 1, 8)\n"
            "batch = build_attention_batch([0, 1], [], [], [(2, 0, [0])], 4, 'cpu')\n"
            "kv = torch.ones(2, 1, 8)\n"
            "write_kv(cache, cache, kv, kv, batch.slot_mapping)\n"
            "paged_attention(torch.ones(2, 2, 8), kv, kv, cache, cache, batch, 1.0)\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n")
    env = {k: v for k, v in os.environ.items() if k != BACKEND_ENV}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
