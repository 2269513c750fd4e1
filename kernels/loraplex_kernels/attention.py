"""Paged attention: write new keys/values into the block cache and attend over it (torch reference).

The cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`. Token
position `p` of a request lives in block `block_table[p // block_size]` at offset
`p % block_size`; its flat slot is `block * block_size + offset`.

A step's rows are laid out as: first `num_decode` decode rows (one new token each, batched into
one masked attention call), then the prefill chunks (several new tokens each, one call per chunk).
A chunk at `start_position` attends to the request's `start_position` cached tokens plus itself
causally, which makes chunked prefill exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    row_start: int
    row_end: int
    start_position: int  # tokens of this request already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_of_request] long, on the device

    @property
    def num_tokens(self) -> int:
        return self.row_end - self.row_start


@dataclass
class AttentionBatch:
    """Per-step attention metadata, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_rows] long: flat cache slot of each new token
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] long, padded with block 0
    decode_key_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [rows, num_kv_heads, head_dim] at their slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [batch, num_kv_heads, max_blocks * block_size, head_dim]."""
    batch, num_blocks = block_tables.shape
    # index_select copies whole blocks; advanced indexing (cache[block_tables]) is ~20x slower on CPU
    blocks = cache.index_select(0, block_tables.flatten())
    return blocks.view(batch, num_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """q [rows, heads, head_dim]; k, v [rows, kv_heads, head_dim] are this step's new keys/values,
    already written to the cache. Returns [rows, heads, head_dim]."""
    if not batch.prefills:  # a pure decode step: no copy into a shared output
        return _decode(q, k_cache, v_cache, batch, scale)
    out = torch.empty_like(q)
    if batch.num_decode:
        out[:batch.num_decode] = _decode(q[:batch.num_decode], k_cache, v_cache, batch, scale)
    for chunk in batch.prefills:
        rows = slice(chunk.row_start, chunk.row_end)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
            scale: float) -> torch.Tensor:
    keys = gather_blocks(k_cache, batch.decode_block_tables)
    values = gather_blocks(v_cache, batch.decode_block_tables)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=batch.decode_key_mask,
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    q = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
    if chunk.start_position == 0:  # nothing cached before: attend to the new keys alone
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        keys = gather_blocks(k_cache, chunk.block_table.unsqueeze(0))
        values = gather_blocks(v_cache, chunk.block_table.unsqueeze(0))
        mask = chunk_causal_mask(chunk.start_position, chunk.num_tokens, keys.shape[2], q.device)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def chunk_causal_mask(start: int, num_tokens: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """[num_tokens, num_keys] bool: query i (position start + i) sees key positions <= start + i."""
    query_pos = torch.arange(start, start + num_tokens, device=device).unsqueeze(1)
    key_pos = torch.arange(num_keys, device=device).unsqueeze(0)
    return key_pos <= query_pos


def decode_key_mask(context_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[batch, 1, 1, num_keys] bool: request b sees its first context_lens[b] positions."""
    key_pos = torch.arange(num_keys, device=context_lens.device)
    return (key_pos.unsqueeze(0) < context_lens.unsqueeze(1)).view(len(context_lens), 1, 1, num_keys)
