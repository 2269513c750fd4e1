"""Paged attention (torch reference) against dense causal attention over contiguous keys/values."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex_kernels.attention import (
    AttentionBatch,
    PrefillChunk,
    decode_key_mask,
    paged_attention,
    write_kv,
)

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [start + n, KV, D]: causal attention, GQA by repetition."""
    groups = HEADS // KV_HEADS
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM ** -0.5
    n = q.shape[0]
    allowed = torch.arange(k.shape[0]).unsqueeze(0) <= torch.arange(start, start + n).unsqueeze(1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, -1), v)


def slots_of(block_table: list[int], positions: range) -> list[int]:
    return [block_table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


def test_decode_rows_and_chunked_prefill_match_dense():
    gen = torch.Generator().manual_seed(0)
    cache_k = torch.zeros(32, BLOCK, KV_HEADS, DIM)
    cache_v = torch.zeros_like(cache_k)
    # (block table, context length before this step, new tokens): two decodes, a continuing chunk,
    # and a fresh prefill; block tables are scattered and of different lengths
    requests = [([7, 3, 12], 9, 1), ([5], 2, 1), ([1, 30, 4, 8], 6, 7), ([20, 21], 0, 5)]
    full_k = [torch.randn(ctx + n, KV_HEADS, DIM, generator=gen) for _, ctx, n in requests]
    full_v = [torch.randn(ctx + n, KV_HEADS, DIM, generator=gen) for _, ctx, n in requests]
    for (table, ctx, _), k, v in zip(requests, full_k, full_v, strict=True):  # earlier steps' cache
        write_kv(cache_k, cache_v, k[:ctx], v[:ctx], torch.tensor(slots_of(table, range(ctx)), dtype=torch.long))
    q = [torch.randn(n, HEADS, DIM, generator=gen) for _, _, n in requests]
    new_k = torch.cat([k[ctx:] for (_, ctx, _), k in zip(requests, full_k, strict=True)])
    new_v = torch.cat([v[ctx:] for (_, ctx, _), v in zip(requests, full_v, strict=True)])
    slots = sum((slots_of(t, range(ctx, ctx + n)) for t, ctx, n in requests), [])
    tables = torch.tensor([[7, 3, 12], [5, 0, 0]])
    batch = AttentionBatch(
        slot_mapping=torch.tensor(slots), num_decode=2, decode_block_tables=tables,
        decode_key_mask=decode_key_mask(torch.tensor([10, 3]), 3 * BLOCK),
        prefills=[PrefillChunk(2, 9, 6, torch.tensor([1, 30, 4, 8])), PrefillChunk(9, 14, 0, torch.tensor([20, 21]))])
    write_kv(cache_k, cache_v, new_k, new_v, batch.slot_mapping)
    out = paged_attention(torch.cat(q), new_k, new_v, cache_k, cache_v, batch, DIM ** -0.5)
    expected = torch.cat([dense(qi, k, v, ctx) for qi, k, v, (_, ctx, _) in zip(q, full_k, full_v, requests, strict=True)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
