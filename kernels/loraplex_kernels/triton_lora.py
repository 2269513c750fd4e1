"""Triton multi-LoRA delta over adapters paged in the KV pool: SGMV for prefill, BGMV-like for decode.

The kernels read the very tables the fused C++ kernel reads (`LoraBatch.kernel_tables`: the int64
segment table `[segments, 6 + 7 * 5]` and the flat page list, plus `LoraGroup.table`), so one
step's tables serve either backend. Element `e` of an adapter's rows lives in page
`pages[page_offset + e // 2H]` at offset `e % 2H`, the K half below H, else the V half
(`loraplex_kernels.lora_pages`).

Two launches per call, both accumulating in float32:

- shrink: `buf[row, g, :rank_g] = x[row] @ A_g^T` for every row of every segment and every module
  `g` of the group the segment's adapter wraps (`buf` is float32 `[rows, modules, max_rank]`);
- expand: `y[row, cols] += sum_g buf[row, g, :rank_g] @ B_g^T[:rank_g, cols]`, one read-add-write of
  `y` per tile (the scaling is folded into the stored B rows).

Prefill (SGMV) tiles rows of a segment by BLOCK_M and uses `tl.dot`; decode (one row per segment,
BGMV-like) gives every segment one program per rank block (shrink) or column block (expand) and
reduces with vector products, as a matrix core needs at least 16 rows. Every program loops over
its own module's rank only: rank blocks past it exit at once, so the work of a step is the sum of
its adapters' ranks, whatever `max_rank`.

CUDA-graph friendly: nothing on the launch path reads tensor contents on the host. Grids come from
tensor shapes and the caller's ints (`max_rank`, `max_rows`); a padded segment (row_end ==
row_start, or rank 0) is a no-op, so tables of a fixed, padded shape can be captured.

On the CPU this runs only under `TRITON_INTERPRET=1` (the tests). The interpreter computes garbage
from arithmetic on bfloat16 values, so every load is converted to float32 at once, and there the
matrix products run in float32 too (on a GPU, half-precision tiles go to the tensor cores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the segment table: `loraplex_kernels.lora.SEGMENT_COLUMNS` (6), then `MODULE_COLUMNS` (5) per module of
# LORA_MODULES (7); the kernels read these columns by number (`_segment`, `_module`)
SEGMENT_WIDTH = 6 + 7 * 5
GROUP_WIDTH = 3  # (canonical module index, first column, out features)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

# tile sizes: tl.dot needs 16 or more along every side
SGMV_BLOCKS = {"BLOCK_M": 32, "BLOCK_R": 16, "BLOCK_K": 64, "BLOCK_N": 64}
DECODE_BLOCKS = {"BLOCK_R": 16, "BLOCK_K": 64, "BLOCK_N": 64}


@triton.jit
def _paged_load(k_ptr, v_ptr, pages_ptr, page_base, elem, mask, HALF: tl.constexpr):
    """Adapter elements `elem` (offsets into its flat rows, any shape) read through its pages, as
    float32 (converted at once: see the module docstring); 0 where masked."""
    slot = elem // (2 * HALF)
    offset = elem % (2 * HALF)
    page = tl.load(pages_ptr + page_base + slot, mask=mask, other=0)
    in_k = offset < HALF
    k = tl.load(k_ptr + page * HALF + offset, mask=mask & in_k, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + page * HALF + (offset - HALF), mask=mask & (offset >= HALF), other=0.0).to(tl.float32)
    return tl.where(in_k, k, v)


@triton.jit
def _segment(seg_ptr, s, seg_stride):
    """Segment `s`: (row_start, row_end, row_len, page_offset), its columns 0, 1, 3 and 4."""
    row = seg_ptr + s * seg_stride
    return tl.load(row + 0), tl.load(row + 1), tl.load(row + 3), tl.load(row + 4)


@triton.jit
def _module(seg_ptr, s, seg_stride, group_ptr, g, max_rank):
    """Module `g` of the group for segment `s`: (a_offset, b_offset, rank, first column, out
    features); the rank is 0 where the adapter does not wrap it, and clipped to `max_rank` (the
    width of the shrink buffer). The module's columns start at 6 + 5 * its canonical index."""
    module = tl.load(group_ptr + g * 3)
    col = tl.load(group_ptr + g * 3 + 1)
    out = tl.load(group_ptr + g * 3 + 2)
    span = seg_ptr + s * seg_stride + 6 + module * 5
    rank = tl.minimum(tl.load(span + 2), max_rank)
    return tl.load(span), tl.load(span + 1), rank, col, out


@triton.jit
def _sgmv_shrink(x_ptr, buf_ptr, seg_ptr, pages_ptr, group_ptr, k_ptr, v_ptr,
                 in_features, max_rank, rank_blocks, stride_xm, stride_xk, seg_stride, stride_bm, stride_bg,
                 HALF: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (row block, rank block) tile of `x[rows] @ A^T` for one segment and one module."""
    s = tl.program_id(1)
    g = tl.program_id(2)
    row_start, row_end, row_len, page_base = _segment(seg_ptr, s, seg_stride)
    a_off, b_off, rank, col, out = _module(seg_ptr, s, seg_stride, group_ptr, g, max_rank)
    m0 = row_start + (tl.program_id(0) // rank_blocks) * BLOCK_M
    r0 = (tl.program_id(0) % rank_blocks) * BLOCK_R
    if (m0 >= row_end) | (r0 >= rank):
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    ranks = r0 + tl.arange(0, BLOCK_R)
    row_ok = rows < row_end
    rank_ok = ranks < rank
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < in_features
        xt = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk,
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        a_t = _paged_load(k_ptr, v_ptr, pages_ptr, page_base, ranks[None, :] * row_len + a_off + ks[:, None],
                          rank_ok[None, :] & k_ok[:, None], HALF)  # A^T [BLOCK_K, BLOCK_R]
        acc += tl.dot(xt.to(DOT), a_t.to(DOT), input_precision=PRECISION)
    tl.store(buf_ptr + rows.to(tl.int64)[:, None] * stride_bm + g * stride_bg + ranks[None, :], acc,
             mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit
def _sgmv_expand(y_ptr, buf_ptr, seg_ptr, pages_ptr, group_ptr, k_ptr, v_ptr,
                 num_modules, out_total, max_rank, stride_ym, stride_yn, seg_stride, stride_bm, stride_bg,
                 HALF: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (row block, column block) tile of `y += buf @ B^T` for one segment, over every module of
    the group whose columns meet the block."""
    s = tl.program_id(1)
    row_start, row_end, row_len, page_base = _segment(seg_ptr, s, seg_stride)
    m0 = row_start + tl.program_id(0) * BLOCK_M
    if m0 >= row_end:
        return
    n0 = tl.program_id(2) * BLOCK_N
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(num_modules):
        a_off, b_off, rank, col, out = _module(seg_ptr, s, seg_stride, group_ptr, g, max_rank)
        if (rank > 0) & (col < n0 + BLOCK_N) & (col + out > n0):
            col_ok = (cols >= col) & (cols < col + out)
            for r0 in range(0, rank, BLOCK_R):
                ranks = r0 + tl.arange(0, BLOCK_R)
                rank_ok = ranks < rank
                st = tl.load(buf_ptr + rows.to(tl.int64)[:, None] * stride_bm + g * stride_bg + ranks[None, :],
                             mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
                b_t = _paged_load(k_ptr, v_ptr, pages_ptr, page_base,
                                  ranks[:, None] * row_len + b_off + (cols - col)[None, :],
                                  rank_ok[:, None] & col_ok[None, :], HALF)  # B^T [BLOCK_R, BLOCK_N]
                acc += tl.dot(st.to(DOT), b_t.to(DOT), input_precision=PRECISION)
    _add_into(y_ptr, rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn,
              row_ok[:, None] & (cols < out_total)[None, :], acc)


@triton.jit
def _add_into(y_ptr, offsets, mask, acc):
    """y[offsets] += acc, added in float32 and rounded once to y's dtype."""
    old = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, (old + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_shrink(x_ptr, buf_ptr, seg_ptr, pages_ptr, group_ptr, k_ptr, v_ptr,
                   in_features, max_rank, stride_xm, stride_xk, seg_stride, stride_bm, stride_bg,
                   HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One rank block of `x[row] @ A^T` for the row(s) of one segment and one module."""
    s = tl.program_id(0)
    g = tl.program_id(1)
    row_start, row_end, row_len, page_base = _segment(seg_ptr, s, seg_stride)
    a_off, b_off, rank, col, out = _module(seg_ptr, s, seg_stride, group_ptr, g, max_rank)
    ranks = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(2) * BLOCK_R >= rank:
        return
    rank_ok = ranks < rank
    for row in range(row_start, row_end):  # one row when decoding; any count stays correct
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < in_features
            xv = tl.load(x_ptr + row * stride_xm + ks * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
            a = _paged_load(k_ptr, v_ptr, pages_ptr, page_base, ranks[:, None] * row_len + a_off + ks[None, :],
                            rank_ok[:, None] & k_ok[None, :], HALF)  # A [BLOCK_R, BLOCK_K]
            acc += tl.sum(a * xv[None, :], axis=1)
        tl.store(buf_ptr + row * stride_bm + g * stride_bg + ranks, acc, mask=rank_ok)


@triton.jit
def _decode_expand(y_ptr, buf_ptr, seg_ptr, pages_ptr, group_ptr, k_ptr, v_ptr,
                   num_modules, out_total, max_rank, stride_ym, stride_yn, seg_stride, stride_bm, stride_bg,
                   HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """One column block of `y[row] += buf[row] @ B^T` for the row(s) of one segment."""
    s = tl.program_id(0)
    row_start, row_end, row_len, page_base = _segment(seg_ptr, s, seg_stride)
    n0 = tl.program_id(1) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    for row in range(row_start, row_end):
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for g in range(num_modules):
            a_off, b_off, rank, col, out = _module(seg_ptr, s, seg_stride, group_ptr, g, max_rank)
            if (rank > 0) & (col < n0 + BLOCK_N) & (col + out > n0):
                col_ok = (cols >= col) & (cols < col + out)
                for r0 in range(0, rank, BLOCK_R):
                    ranks = r0 + tl.arange(0, BLOCK_R)
                    rank_ok = ranks < rank
                    sv = tl.load(buf_ptr + row * stride_bm + g * stride_bg + ranks, mask=rank_ok, other=0.0)
                    b_t = _paged_load(k_ptr, v_ptr, pages_ptr, page_base,
                                      ranks[:, None] * row_len + b_off + (cols - col)[None, :],
                                      rank_ok[:, None] & col_ok[None, :], HALF)  # B^T [BLOCK_R, BLOCK_N]
                    acc += tl.sum(sv[:, None] * b_t, axis=0)
        _add_into(y_ptr, row * stride_ym + cols * stride_yn, cols < out_total, acc)


def triton_lora_delta(y: torch.Tensor, x: torch.Tensor, segments: torch.Tensor, pages: torch.Tensor,
                      group_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, max_rank: int,
                      max_rows: int | None = None, decode: bool | None = None) -> None:
    """Add every segment's LoRA term of one fused group to `y` [rows, sum(out)] in place.

    `segments`, `pages`, `group_table`: the C++ kernel's int64 tables, on `x`'s device. `max_rank`:
    at least every module rank in the tables (it sizes the float32 shrink buffer; larger ranks
    are clipped). `max_rows`: at least the longest segment (default: all rows); it sizes the
    prefill grid. `decode`: the one-program-per-row variant; by default chosen when no segment
    has more than one row (`max_rows == 1`), or, without `max_rows`, when there are no more rows
    than segments. Either variant is correct for any segments. Reads no tensor on the host, so it
    may be captured in a CUDA graph.
    """
    _check(y, x, segments, pages, group_table, k_cache, v_cache)
    if max_rank <= 0 or segments.shape[0] == 0 or group_table.shape[0] == 0 or x.shape[0] == 0:
        return
    buf = torch.empty((x.shape[0], group_table.shape[0], max_rank), dtype=torch.float32, device=x.device)
    if decode is None:
        decode = max_rows == 1 if max_rows is not None else x.shape[0] <= segments.shape[0]
    tables = (segments, pages, group_table, k_cache, v_cache)
    if decode:
        _launch_decode(y, x, buf, tables, max_rank)
    else:
        _launch_sgmv(y, x, buf, tables, max_rank, x.shape[0] if max_rows is None else max_rows)


def _check(y: torch.Tensor, x: torch.Tensor, segments: torch.Tensor, pages: torch.Tensor,
           group_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Shapes, dtypes and devices only: nothing here reads a tensor's contents."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x [rows, in] and y [rows, out] expected, got {tuple(x.shape)} and {tuple(y.shape)}")
    if not (x.dtype == y.dtype == k_cache.dtype == v_cache.dtype) or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x, y and the pool must share one of {SUPPORTED_DTYPES}: x {x.dtype}, y {y.dtype}, "
                         f"pool {k_cache.dtype}/{v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
        raise ValueError("the K and V caches must be contiguous and of one shape")
    if segments.dim() != 2 or segments.shape[1] != SEGMENT_WIDTH or group_table.dim() != 2 \
            or group_table.shape[1] != GROUP_WIDTH or pages.dim() != 1:
        raise ValueError(f"segments [n, {SEGMENT_WIDTH}], pages [p] and group [g, {GROUP_WIDTH}] expected")
    for name, table in (("segments", segments), ("pages", pages), ("group", group_table)):
        if table.dtype != torch.int64 or table.device != x.device or not table.is_contiguous():
            raise ValueError(f"{name}: a contiguous int64 tensor on {x.device} expected")
    if {t.device for t in (y, k_cache, v_cache)} != {x.device}:
        raise ValueError("x, y and the pool must be on one device")


def _half(k_cache: torch.Tensor) -> int:
    """Elements of one page's K block (H)."""
    return k_cache[0].numel() if k_cache.shape[0] else 1


def _dot_type(x: torch.Tensor) -> tuple[tl.dtype, str]:
    """The dtype and precision of the matrix products: float32 (exact) for float32 inputs and in the
    CPU interpreter, else the inputs' half type on the tensor cores."""
    if x.dtype == torch.float32 or x.device.type == "cpu":
        return tl.float32, "ieee"
    return _TL_DTYPES[x.dtype], "tf32"  # the precision only applies to float32 operands


def _launch_sgmv(y: torch.Tensor, x: torch.Tensor, buf: torch.Tensor, tables: tuple, max_rank: int,
                 max_rows: int) -> None:
    """Prefill: row blocks of every segment through `tl.dot` tiles."""
    segments, pages, group_table, k_cache, v_cache = tables
    b = SGMV_BLOCKS
    row_blocks = triton.cdiv(max(max_rows, 1), b["BLOCK_M"])
    rank_blocks = triton.cdiv(max_rank, b["BLOCK_R"])
    dot, precision = _dot_type(x)
    common = (segments, pages, group_table, k_cache, v_cache)
    _sgmv_shrink[(row_blocks * rank_blocks, segments.shape[0], group_table.shape[0])](
        x, buf, *common, x.shape[1], max_rank, rank_blocks, x.stride(0), x.stride(1), segments.stride(0),
        buf.stride(0), buf.stride(1), HALF=_half(k_cache), DOT=dot, PRECISION=precision,
        BLOCK_M=b["BLOCK_M"], BLOCK_R=b["BLOCK_R"], BLOCK_K=b["BLOCK_K"])
    _sgmv_expand[(row_blocks, segments.shape[0], triton.cdiv(y.shape[1], b["BLOCK_N"]))](
        y, buf, *common, group_table.shape[0], y.shape[1], max_rank, y.stride(0), y.stride(1), segments.stride(0),
        buf.stride(0), buf.stride(1), HALF=_half(k_cache), DOT=dot, PRECISION=precision,
        BLOCK_M=b["BLOCK_M"], BLOCK_R=b["BLOCK_R"], BLOCK_N=b["BLOCK_N"])


def _launch_decode(y: torch.Tensor, x: torch.Tensor, buf: torch.Tensor, tables: tuple, max_rank: int) -> None:
    """Decode: one program per segment (its single row) and rank or column block."""
    segments, pages, group_table, k_cache, v_cache = tables
    b = DECODE_BLOCKS
    common = (segments, pages, group_table, k_cache, v_cache)
    _decode_shrink[(segments.shape[0], group_table.shape[0], triton.cdiv(max_rank, b["BLOCK_R"]))](
        x, buf, *common, x.shape[1], max_rank, x.stride(0), x.stride(1), segments.stride(0),
        buf.stride(0), buf.stride(1), HALF=_half(k_cache), BLOCK_R=b["BLOCK_R"], BLOCK_K=b["BLOCK_K"])
    _decode_expand[(segments.shape[0], triton.cdiv(y.shape[1], b["BLOCK_N"]))](
        y, buf, *common, group_table.shape[0], y.shape[1], max_rank, y.stride(0), y.stride(1), segments.stride(0),
        buf.stride(0), buf.stride(1), HALF=_half(k_cache), BLOCK_R=b["BLOCK_R"], BLOCK_N=b["BLOCK_N"])
