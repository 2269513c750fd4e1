"""Triton kernels for the paged KV cache: storing new keys/values and attending over block tables.

Layout (the same as `loraplex_kernels.attention`): a layer's cache is `[num_blocks, block_size,
num_kv_heads, head_dim]`; position `p` of a request lives in block `block_table[p // block_size]` at
offset `p % block_size`. Block tables are padded 2-D int tensors whose width may exceed what a
request needs (a fixed width keeps shapes static for CUDA graphs); keys past a request's context are
never read, and neither is any table entry past the table's width.

- `store_kv`: one program per new token; a negative slot (a padding row) writes nothing, so the
  pages around a request's slots (other requests' KV, resident LoRA weights) stay untouched.
- `decode_attention`: one query token per request. A program handles one request and one KV head
  with all the query heads that share it (grouped-query attention), so each KV tile is read once
  per KV head. Online softmax in float32. With few requests and long contexts the context is split
  across programs (flash-decoding) and a second kernel merges the partial softmaxes. The grid
  depends only on tensor shapes (no host read of tensor contents), so it can be captured in a
  CUDA graph; a row whose context length is 0 outputs zeros.
- `prefill_attention`: every prefill chunk of a step in one launch (varlen). Query `i` of a chunk
  sits at position `start_position + i` and attends to cached positions `0..start_position + i`;
  the chunk's own keys are already in the cache (they are written before attention runs).

Under `TRITON_INTERPRET=1` (tests on the CPU) tiles are upcast to float32 right after loading:
the interpreter's bfloat16 arithmetic is wrong. On the GPU the matmuls take the cache dtype and
accumulate in float32.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64  # keys per tile
PREFILL_BLOCK_N = 64
PREFILL_BLOCK_M = 64  # query rows (tokens x grouped heads) per tile
MIN_DOT = 16  # tl.dot needs every tile dimension >= 16 on the GPU
MIN_SPLIT_TOKENS = 256  # flash-decoding: fewest keys worth a program of their own
MAX_SPLITS = 16


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kr, stride_kh, stride_vr, stride_vh, stride_cb, stride_ct, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (slot >= 0)
    safe_slot = tl.maximum(slot, 0)
    dst = (safe_slot // BLOCK_SIZE) * stride_cb + (safe_slot % BLOCK_SIZE) * stride_ct + heads * stride_ch + dims
    k = tl.load(k_ptr + row * stride_kr + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + row * stride_vr + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _attend(q, q_pos, lo, hi, table_ptr, k_base, v_base, stride_cb, stride_ct, scale_log2,
            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
            PRECISION: tl.constexpr):
    """Online softmax of q [BLOCK_M, BLOCK_D] over cache positions lo..hi-1, row r seeing only
    positions <= q_pos[r]. Returns the running max (log2 domain), the sum and the unnormalised
    output, all float32."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dims = tl.arange(0, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        token = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct
        kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_base + token[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(COMPUTE)
        v = tl.load(v_base + token[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(COMPUTE)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=PRECISION)
        m = m_new
    return m, denom, acc


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, context_lens_ptr, out_ptr,
                   part_acc_ptr, part_ml_ptr,
                   stride_qr, stride_qh, stride_or, stride_oh, stride_tr, table_width,
                   stride_cb, stride_ct, stride_ch, tokens_per_split, scale_log2,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qr + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    context = tl.minimum(tl.load(context_lens_ptr + row).to(tl.int32), table_width * BLOCK_SIZE)
    lo = split * tokens_per_split
    hi = tl.minimum(context, lo + tokens_per_split)
    q_pos = tl.zeros([BLOCK_G], tl.int32) + hi  # no causal limit: the query follows its context
    table_ptr = tables_ptr + row.to(tl.int64) * stride_tr
    m, denom, acc = _attend(q.to(COMPUTE), q_pos, lo, hi, table_ptr, k_cache_ptr + kv_head * stride_ch,
                            v_cache_ptr + kv_head * stride_ch, stride_cb, stride_ct, scale_log2,
                            HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_D, BLOCK_N, COMPUTE, PRECISION)
    if NUM_SPLITS == 1:
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        out_offs = row * stride_or + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (row * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)
        tl.store(part_ml_ptr + part * 2, m, mask=g < GROUP)
        tl.store(part_ml_ptr + part * 2 + 1, denom, mask=g < GROUP)


@triton.jit
def _decode_merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_or, stride_oh,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    part = (row * tl.num_programs(1) + head) * NUM_SPLITS + splits
    live = splits < NUM_SPLITS
    m = tl.load(part_ml_ptr + part * 2, mask=live, other=float("-inf"))
    denom = tl.load(part_ml_ptr + part * 2 + 1, mask=live, other=0.0)
    acc_mask = live[:, None] & (dims[None, :] < HEAD_DIM)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=acc_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # an empty context: every split is empty
    weight = tl.exp2(m - m_max)
    total = tl.sum(denom * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_or + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, meta_ptr, out_ptr,
                    stride_qr, stride_qh, stride_or, stride_oh, stride_tr, table_width, stride_mc,
                    stride_cb, stride_ct, stride_ch, scale_log2,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr):
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    row_start = tl.load(meta_ptr + chunk * stride_mc).to(tl.int32)
    num_tokens = tl.load(meta_ptr + chunk * stride_mc + 1).to(tl.int32)
    start_position = tl.load(meta_ptr + chunk * stride_mc + 2).to(tl.int32)
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)  # query rows: BLOCK_Q tokens x the grouped heads
    token = tile * BLOCK_Q + r // GROUP_PAD
    g = r % GROUP_PAD
    dims = tl.arange(0, BLOCK_D)
    rows_ok = (token < num_tokens) & (g < GROUP)
    q_mask = rows_ok[:, None] & (dims[None, :] < HEAD_DIM)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + (row_start + token)[:, None] * stride_qr + heads[:, None] * stride_qh + dims[None, :],
                mask=q_mask, other=0.0)
    last = tl.minimum(num_tokens, (tile + 1) * BLOCK_Q)  # keys up to this tile's last query
    hi = tl.minimum(start_position + last, table_width * BLOCK_SIZE)
    hi = tl.where(tile * BLOCK_Q < num_tokens, hi, 0)
    table_ptr = tables_ptr + chunk.to(tl.int64) * stride_tr
    m, denom, acc = _attend(q.to(COMPUTE), start_position + token, 0, hi, table_ptr,
                            k_cache_ptr + kv_head * stride_ch, v_cache_ptr + kv_head * stride_ch,
                            stride_cb, stride_ct, scale_log2,
                            HEAD_DIM, BLOCK_SIZE, BLOCK_Q * GROUP_PAD, BLOCK_D, BLOCK_N, COMPUTE, PRECISION)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    out_offs = (row_start + token)[:, None] * stride_or + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# ---------------------------------------------------------------------------------------- wrappers


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v `[rows, num_kv_heads, head_dim]` to their flat cache slots; a row whose slot is
    negative (a padding row of a CUDA graph) writes nothing."""
    _check_cache(k_cache, v_cache)
    _check_same_device(k_cache, k=k, v=v, slot_mapping=slot_mapping)
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[1:] != k_cache.shape[2:] or t.shape[0] != k.shape[0]:
            raise ValueError(f"{name} must be [rows, {k_cache.shape[2]}, {k_cache.shape[3]}], got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} is {t.dtype}, the cache {k_cache.dtype}")
    _check_index(slot_mapping, "slot_mapping", 1)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} rows")
    if k.shape[0] == 0:
        return
    k, v = _unit_last_stride(k), _unit_last_stride(v)
    _, block_size, kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """One query token per request: q `[num_decode, heads, head_dim]` attends to the first
    `context_lens[r]` positions of request r's block table row (`[num_decode, width]`). Returns (or
    fills) out `[num_decode, heads, head_dim]`; a row with context 0 gets zeros. `num_splits`
    (default: chosen from the shapes) splits each context across programs (flash-decoding)."""
    group = _check_attention(q, k_cache, v_cache, block_tables)
    _check_same_device(q, context_lens=context_lens)
    _check_index(context_lens, "context_lens", 1)
    if block_tables.shape[0] != q.shape[0] or context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"{q.shape[0]} decode rows but block_tables has {block_tables.shape[0]} rows "
                         f"and context_lens {context_lens.shape[0]}")
    out = _output(q, out)
    if q.shape[0] == 0:
        return out
    q = _unit_last_stride(q)
    rows, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    splits, per_split = _split_plan(rows * kv_heads, block_tables.shape[1] * block_size, q.device, num_splits)
    block_g = max(MIN_DOT, triton.next_power_of_2(group))
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    part_acc = part_ml = out  # unused placeholders when there is a single split
    if splits > 1:
        part_acc = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), block_tables.shape[1],
        *k_cache.stride()[:3], per_split, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=block_g, BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=splits, **_dot_dtypes(q))
    if splits > 1:
        _decode_merge_kernel[(rows, heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim, NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(head_dim))
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, chunk_meta: torch.Tensor, max_chunk_tokens: int,
                      scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """All prefill chunks of a step in one launch. `chunk_meta [num_chunks, 3]` holds each chunk's
    (first row in q, number of new tokens, start_position); `block_tables [num_chunks, width]` its
    request's blocks. Query i of a chunk attends causally to cache positions
    `0..start_position + i` (its own keys are already stored). Fills only the chunks' rows of out
    `[rows, heads, head_dim]` (allocated when not given); `max_chunk_tokens` bounds the grid."""
    _check_attention(q, k_cache, v_cache, block_tables)
    _check_same_device(q, chunk_meta=chunk_meta)
    _check_index(chunk_meta, "chunk_meta", 2)
    if chunk_meta.shape != (block_tables.shape[0], 3):
        raise ValueError(f"chunk_meta must be [{block_tables.shape[0]}, 3], got {tuple(chunk_meta.shape)}")
    out = _output(q, out)
    if chunk_meta.shape[0] == 0 or max_chunk_tokens <= 0 or q.shape[0] == 0:
        return out
    q, chunk_meta = _unit_last_stride(q), chunk_meta.contiguous()
    heads, head_dim = q.shape[1:]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, PREFILL_BLOCK_M // group_pad)
    if block_q * group_pad < MIN_DOT:  # tiny tiles: keep the query tile tl.dot-sized
        block_q = MIN_DOT // group_pad
    grid = (chunk_meta.shape[0], kv_heads, triton.cdiv(max_chunk_tokens, block_q))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, chunk_meta, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), block_tables.shape[1],
        chunk_meta.stride(0), *k_cache.stride()[:3], scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)), BLOCK_N=PREFILL_BLOCK_N,
        **_dot_dtypes(q))
    return out


def default_decode_splits(programs: int, max_keys: int, device: torch.device) -> int:
    """Flash-decoding split count from shapes only: split long contexts when the (request, KV head)
    programs alone would leave most of the GPU idle."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms or max_keys < 2 * MIN_SPLIT_TOKENS:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), max_keys // MIN_SPLIT_TOKENS, MAX_SPLITS))


# ----------------------------------------------------------------------------------------- helpers


def _split_plan(programs: int, max_keys: int, device: torch.device, num_splits: int | None) -> tuple[int, int]:
    """(splits, keys per split): whole tiles per split, no split left empty by the table width."""
    splits = default_decode_splits(programs, max_keys, device) if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    per_split = triton.cdiv(triton.cdiv(max(max_keys, 1), splits), DECODE_BLOCK_N) * DECODE_BLOCK_N
    return max(1, triton.cdiv(max_keys, per_split)), per_split


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _dot_dtypes(q: torch.Tensor) -> dict:
    """The matmul input dtype (the tensors' own on the GPU, float32 in the interpreter) and its
    precision: float32 matmuls stay exact ("ieee", not TF32) to match the torch reference."""
    if q.dtype == torch.float32 or _interpreting():
        return {"COMPUTE": tl.float32, "PRECISION": "ieee"}
    return {"COMPUTE": tl.float16 if q.dtype == torch.float16 else tl.bfloat16, "PRECISION": "tf32"}


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"caches must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must share shape, strides and dtype")
    if k_cache.dtype not in DTYPES:
        raise ValueError(f"cache dtype {k_cache.dtype} is not one of {DTYPES}")
    if k_cache.stride(3) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    _check_same_device(k_cache, v_cache=v_cache)
    if k_cache.device.type == "cpu" and not _interpreting():
        raise ValueError("Triton attention on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")


def _check_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor) -> int:
    """Validate an attention call; returns the number of query heads per KV head."""
    _check_cache(k_cache, v_cache)
    _check_same_device(k_cache, q=q, block_tables=block_tables)
    _check_index(block_tables, "block_tables", 2)
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q must be [rows, heads, {k_cache.shape[3]}], got {tuple(q.shape)}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype}, the cache {k_cache.dtype}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if block_tables.shape[1] and block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    return q.shape[1] // k_cache.shape[2]


def _check_index(t: torch.Tensor, name: str, dims: int) -> None:
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")


def _check_same_device(ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device}, expected {ref.device}")


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous last dim")
    return out


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
