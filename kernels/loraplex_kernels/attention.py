"""Paged attention: write new keys/values into the block cache and attend over it.

The cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`. Token
position `p` of a request lives in block `block_table[p // block_size]` at offset
`p % block_size`; its flat slot is `block * block_size + offset`. A negative slot marks a padding
row (CUDA graphs run a fixed batch size): nothing is written for it.

A step's rows are laid out as: first `num_decode` decode rows (one new token each), then the
prefill chunks (several new tokens each). A chunk at `start_position` attends to the request's
`start_position` cached tokens plus itself causally, which makes chunked prefill exact.
`build_attention_batch` turns a step's plain lists into the `AttentionBatch` every layer reads.

Backends (`LORAPLEX_ATTENTION_KERNEL`): `auto` (default) runs the Triton kernels of
`loraplex_kernels.triton_attention` on CUDA tensors and the torch reference otherwise;
`reference` always runs the torch reference (decode rows in one masked SDPA call, one call per
prefill chunk); `triton` always runs Triton (on CPU tensors only under `TRITON_INTERPRET=1`, as the
tests do). Triton is imported only when chosen, so CPU serving never imports it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

BACKEND_ENV = "LORAPLEX_ATTENTION_KERNEL"
BACKENDS = ("auto", "reference", "triton")


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
    """Per-step attention metadata, built once (`build_attention_batch`) and read by every layer.
    The fields with defaults feed the Triton kernels; a batch built without them still runs there."""

    slot_mapping: torch.Tensor  # [num_rows] long: flat cache slot of each new token, -1 for a padding row
    num_decode: int  # decode rows, padding rows included
    decode_block_tables: torch.Tensor | None  # [num_decode, width] long, padded with block 0
    decode_key_mask: torch.Tensor | None  # [num_decode, 1, 1, width * block_size] bool
    prefills: list[PrefillChunk]
    decode_context_lens: torch.Tensor | None = None  # [num_decode] long, 0 for a padding row
    prefill_meta: torch.Tensor | None = None  # [num_chunks, 3] long: row_start, num_tokens, start_position
    prefill_block_tables: torch.Tensor | None = None  # [num_chunks, width] long, padded with block 0
    prefill_max_tokens: int = 0  # the longest chunk's new tokens: bounds the Triton prefill grid


class PrefillSpec(NamedTuple):
    """One prefill chunk as `build_attention_batch` takes it."""

    num_tokens: int
    start_position: int  # tokens of the request already in the cache (a prefix-cache hit included)
    block_ids: Sequence[int]  # the request's block table, covering start_position + num_tokens


def build_attention_batch(slot_mapping: Sequence[int], decode_block_ids: Sequence[Sequence[int]],
                          decode_context_lens: Sequence[int], prefills: Sequence[tuple[int, int, Sequence[int]]],
                          block_size: int, device: torch.device | str, decode_width: int | None = None,
                          num_decode_rows: int | None = None) -> AttentionBatch:
    """A step's attention metadata from plain lists, in one host-to-device copy.

    `slot_mapping` lists the slots of the real rows: decode rows first, then each prefill chunk's
    tokens in order. `prefills` holds `PrefillSpec`s (or `(num_tokens, start_position, block_ids)`
    tuples); chunk rows follow the decode rows. For CUDA graphs, `decode_width` fixes the decode
    block-table width and `num_decode_rows` pads the decode rows: padding rows get slot -1, context
    length 0 (their output is zeros) and block table zeros; prefill rows then start after them."""
    specs = [PrefillSpec(*chunk) for chunk in prefills]
    rows = len(decode_block_ids) if num_decode_rows is None else num_decode_rows
    width = max((len(ids) for ids in decode_block_ids), default=0) if decode_width is None else decode_width
    _check_step(slot_mapping, decode_block_ids, decode_context_lens, specs, block_size, rows, width)
    row_starts = list(accumulate((c.num_tokens for c in specs), initial=rows))[:-1]
    values, sizes = _pack(slot_mapping, decode_block_ids, decode_context_lens, specs, row_starts, rows, width)
    flat = torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
    slots, tables, context_lens, meta, prefill_tables = flat.split(sizes)
    prefill_tables = prefill_tables.view(len(specs), -1 if specs else 0)
    chunks = [PrefillChunk(row, row + c.num_tokens, c.start_position, prefill_tables[i, :len(c.block_ids)])
              for i, (row, c) in enumerate(zip(row_starts, specs, strict=True))]
    prefill = {} if not specs else dict(prefill_meta=meta.view(-1, 3), prefill_block_tables=prefill_tables,
                                        prefill_max_tokens=max(c.num_tokens for c in specs))
    if not rows:
        return AttentionBatch(slots, 0, None, None, chunks, **prefill)
    return AttentionBatch(slots, rows, tables.view(rows, width), decode_key_mask(context_lens, width * block_size),
                          chunks, decode_context_lens=context_lens, **prefill)


def _pack(slot_mapping: Sequence[int], decode_block_ids: Sequence[Sequence[int]],
          decode_context_lens: Sequence[int], specs: list[PrefillSpec], row_starts: list[int], rows: int,
          width: int) -> tuple[list[int], list[int]]:
    """All of a step's integers in one list (one device copy) and the sizes of its parts: slots,
    decode tables, context lengths, chunk meta, chunk tables. Padding decode rows are appended."""
    real = len(decode_block_ids)
    pad = rows - real
    values = [*slot_mapping[:real], *[-1] * pad, *slot_mapping[real:]]
    for ids in decode_block_ids:
        values += [*ids, *[0] * (width - len(ids))]
    values += [0] * (pad * width) + [*decode_context_lens, *[0] * pad]
    for row, c in zip(row_starts, specs, strict=True):
        values += [row, c.num_tokens, c.start_position]
    prefill_width = max((len(c.block_ids) for c in specs), default=0)
    for c in specs:
        values += [*c.block_ids, *[0] * (prefill_width - len(c.block_ids))]
    sizes = [len(slot_mapping) + pad, rows * width, rows, 3 * len(specs), prefill_width * len(specs)]
    return values, sizes


def _check_step(slot_mapping: Sequence[int], decode_block_ids: Sequence[Sequence[int]],
                decode_context_lens: Sequence[int], specs: list[PrefillSpec], block_size: int,
                rows: int, width: int) -> None:
    """Reject metadata the kernels would read out of bounds with: cheap checks on host lists."""
    if len(decode_context_lens) != len(decode_block_ids):
        raise ValueError(f"{len(decode_block_ids)} decode block tables but {len(decode_context_lens)} context lengths")
    if rows < len(decode_block_ids):
        raise ValueError(f"num_decode_rows={rows} is fewer than the {len(decode_block_ids)} decode rows")
    for ids, context in zip(decode_block_ids, decode_context_lens, strict=True):
        if len(ids) > width or not 0 <= context <= len(ids) * block_size:
            raise ValueError(f"a decode row of context {context} with {len(ids)} blocks does not fit "
                             f"width {width} x block_size {block_size}")
    for c in specs:
        if c.num_tokens < 1 or c.start_position < 0 or len(c.block_ids) * block_size < c.start_position + c.num_tokens:
            raise ValueError(f"prefill chunk {c.num_tokens} tokens at {c.start_position} does not fit "
                             f"{len(c.block_ids)} blocks of {block_size}")
    expected = len(decode_block_ids) + sum(c.num_tokens for c in specs)
    if len(slot_mapping) != expected:
        raise ValueError(f"slot_mapping has {len(slot_mapping)} slots for {expected} rows")


def attention_backend() -> str:
    """The backend chosen by `LORAPLEX_ATTENTION_KERNEL` (default `auto`)."""
    backend = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={backend!r}: expected one of {', '.join(BACKENDS)}")
    return backend


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [rows, num_kv_heads, head_dim] at their slots; rows with a negative slot (padding)
    write nothing, so no page outside the requests' own slots changes."""
    if _use_triton(k_cache):
        _triton().store_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):  # padding rows (a host sync; Triton has none)
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
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
    already written to the cache. Returns [rows, heads, head_dim]; padding decode rows get zeros."""
    if _use_triton(q):
        return _triton_attention(q, k_cache, v_cache, batch, scale)
    if not batch.prefills:  # a pure decode step: no copy into a shared output
        return _decode(q, k_cache, v_cache, batch, scale)
    out = torch.empty_like(q)
    if batch.num_decode:
        out[:batch.num_decode] = _decode(q[:batch.num_decode], k_cache, v_cache, batch, scale)
    for chunk in batch.prefills:
        rows = slice(chunk.row_start, chunk.row_end)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def uses_triton(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether attention runs the Triton kernels for tensors of this device and dtype."""
    return _use_triton(torch.empty(0, device=device, dtype=dtype))


def _use_triton(t: torch.Tensor) -> bool:
    backend = attention_backend()
    if backend == "auto":
        return t.is_cuda and _triton_installed()
    return backend == "triton"


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton() -> ModuleType:
    """The Triton kernels, imported on first use only."""
    from loraplex_kernels import triton_attention

    return triton_attention


def _triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                      scale: float) -> torch.Tensor:
    """Decode rows in one launch, every prefill chunk in another, into one output."""
    kernels = _triton()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_decode = batch.num_decode
    if num_decode:
        context_lens = batch.decode_context_lens
        if context_lens is None:  # a batch built by hand: the mask says the same
            context_lens = batch.decode_key_mask.view(num_decode, -1).sum(-1)
        kernels.decode_attention(q[:num_decode], k_cache, v_cache, batch.decode_block_tables, context_lens,
                                 scale, out=out[:num_decode])
    if batch.prefills:
        meta, tables, max_tokens = _prefill_metadata(batch)
        kernels.prefill_attention(q, k_cache, v_cache, tables, meta, max_tokens, scale, out=out)
    return out


def _prefill_metadata(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(chunk meta, padded block tables, longest chunk) from the batch, or from its chunks."""
    if batch.prefill_meta is not None and batch.prefill_block_tables is not None:
        return batch.prefill_meta, batch.prefill_block_tables, batch.prefill_max_tokens
    chunks = batch.prefills
    device = chunks[0].block_table.device
    meta = torch.tensor([[c.row_start, c.num_tokens, c.start_position] for c in chunks], device=device)
    tables = torch.nn.utils.rnn.pad_sequence([c.block_table.long() for c in chunks], batch_first=True)
    return meta, tables, max(c.num_tokens for c in chunks)


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
