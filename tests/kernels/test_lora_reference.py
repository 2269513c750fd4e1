"""The paged layout and the torch reference of the segmented LoRA delta against a dense per-row
computation: mixed ranks, rows straddling pages and K/V halves, module subsets, rank_pattern."""

from __future__ import annotations

import random

import pytest
import torch
from lora_cases import GROUPS, NO_ADAPTER, SHAPES, executor_rows, group, make_pool
from loraplex_kernels.lora import BACKEND_ENV, LoraBatch, LoraSegment, lora_linear_delta, reference_lora_delta
from loraplex_kernels.lora_pages import (
    LORA_MODULES,
    AdapterPages,
    RowLayout,
    adapter_rows,
    pages_for,
    read_adapter,
    write_adapter,
)


def test_layout_is_canonical_order_with_a_row_then_b_row_per_module():
    layout = RowLayout.build({"v_proj": (8, 4, 2), "q_proj": (8, 6, 3)})  # given out of order
    assert [s.module for s in layout.spans] == ["q_proj", "v_proj"]
    q, v = layout.spans
    assert (q.a_offset, q.b_offset, q.end) == (0, 8, 14)
    assert (v.a_offset, v.b_offset, v.end) == (14, 22, 26)
    assert layout.row_len == 26 and layout.span("k_proj") is None
    with pytest.raises(ValueError, match="unknown LoRA modules"):
        RowLayout.build({"lm_head": (8, 8, 1)})


def test_pages_for_is_a_ceiling_over_whole_rows():
    assert pages_for(rank=3, row_len=10, page_elements=8) == 4  # 30 elements, pages of 8
    assert pages_for(rank=4, row_len=8, page_elements=8) == 4
    assert pages_for(rank=1, row_len=1, page_elements=4096) == 1


def test_rows_are_stored_k_half_then_v_half_page_by_page():
    """Element e of the adapter's flat rows is in page pages[e // 2H], K half below H."""
    gen = torch.Generator().manual_seed(0)
    weights = {(0, "q_proj"): (torch.randn(3, 5, generator=gen), torch.randn(4, 3, generator=gen)),
               (1, "q_proj"): (torch.randn(3, 5, generator=gen), torch.randn(4, 3, generator=gen))}
    layout = RowLayout.of_weights(weights)
    caches = [(torch.zeros(6, 2, 1, 2), torch.zeros(6, 2, 1, 2)) for _ in range(2)]  # H = 4, pages of 8
    pages = [4, 1, 3, 0]  # 3 rows of 9 = 27 elements: 4 pages, out of order
    moved = write_adapter(caches, pages, weights, 2.0, layout, 3)
    assert moved == 4 * 8 * 4 * 2  # whole pages of both layers
    for layer, (k, v) in enumerate(caches):
        flat = adapter_rows(weights, layer, layout, 3, 2.0).reshape(-1)
        a, b = weights[(layer, "q_proj")]
        torch.testing.assert_close(flat.view(3, 9), torch.cat([a, b.t() * 2.0], dim=1))
        for e, value in enumerate(flat.tolist()):
            page, offset = pages[e // 8], e % 8
            half = k[page] if offset < 4 else v[page]
            assert half.reshape(-1)[offset % 4].item() == value
        stored = read_adapter(k, v, AdapterPages.create(pages, 3, layout, torch.device("cpu")))
        torch.testing.assert_close(stored, flat.view(3, 9))
    assert not caches[0][0][[2, 5]].any()  # pages of nobody are untouched


def test_too_few_pages_are_refused():
    gen = torch.Generator().manual_seed(1)
    weights = {(0, "o_proj"): (torch.randn(8, 6, generator=gen), torch.randn(6, 8, generator=gen))}
    layout = RowLayout.of_weights(weights)
    caches = [(torch.zeros(4, 2, 1, 2), torch.zeros(4, 2, 1, 2))]
    with pytest.raises(ValueError, match="needs 12 pages, got 3"):
        write_adapter(caches, [0, 1, 2], weights, 1.0, layout, 8)


def test_a_module_rank_is_its_largest_over_layers_and_smaller_ranks_get_zero_rows():
    gen = torch.Generator().manual_seed(2)
    weights = {(0, "k_proj"): (torch.randn(2, 4, generator=gen), torch.randn(3, 2, generator=gen)),
               (1, "k_proj"): (torch.randn(5, 4, generator=gen), torch.randn(3, 5, generator=gen)),
               (0, "down_proj"): (torch.randn(1, 6, generator=gen), torch.randn(4, 1, generator=gen))}
    layout = RowLayout.of_weights(weights)
    assert [(s.module, s.rank) for s in layout.spans] == [("k_proj", 5), ("down_proj", 1)]
    rows = adapter_rows(weights, 0, layout, 5, 1.0)
    assert not rows[2:, :7].any() and not rows[1:, 7:].any()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", list(GROUPS))
def test_reference_equals_dense_on_executor_batches(monkeypatch, seed, name):
    monkeypatch.setenv(BACKEND_ENV, "reference")
    rng = random.Random(seed)
    ranks = [rng.choice([1, 2, 3, 7, 8, 16, 33, 64, 100, 128, 256]) for _ in range(rng.randint(1, 8))]
    pool = make_pool(ranks, seed=seed)
    rows = executor_rows(rng, len(ranks))
    modules = GROUPS[name]
    x = torch.randn(len(rows), SHAPES[modules[0]][0], generator=torch.Generator().manual_seed(seed))
    base = torch.randn(len(rows), sum(group(name).out_features))
    y = base.clone()
    lora_linear_delta(y, x, pool.batch(rows), group(name), pool.k, pool.v)
    torch.testing.assert_close(y.double() - base.double(), pool.dense_delta(x, rows, name), rtol=1e-4, atol=1e-4)
    assert torch.equal(y[[r for r, h in enumerate(rows) if h == NO_ADAPTER]],
                       base[[r for r, h in enumerate(rows) if h == NO_ADAPTER]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_reference_accumulates_in_float32(dtype):
    pool = make_pool([8, 64, 3], seed=3, dtype=dtype, all_modules=True)
    rows = [0, 1, 2, NO_ADAPTER] + [1] * 20
    x = torch.randn(len(rows), 48, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = torch.zeros(len(rows), sum(group("qkv").out_features), dtype=dtype)
    lora_linear_delta(y, x, pool.batch(rows), group("qkv"), pool.k, pool.v)
    expected = pool.dense_delta(x, rows, "qkv")
    torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2)


def test_segments_group_equal_adjacent_handles_and_skip_base_rows():
    pool = make_pool([4, 8, 2], seed=4)
    batch = pool.batch([0, 0, 1, NO_ADAPTER, 2, 2, 2, 0])
    assert batch.segments == (LoraSegment(0, 2, 0), LoraSegment(2, 3, 1), LoraSegment(4, 7, 2),
                              LoraSegment(7, 8, 0))
    assert batch.num_rows == 8 and set(batch.adapters) == {0, 1, 2}
    assert pool.batch([NO_ADAPTER, NO_ADAPTER]).is_empty and pool.batch([]).is_empty
    with pytest.raises(ValueError, match="handle 9, which holds no adapter"):
        pool.batch([0, 9])


def test_kernel_tables_follow_each_adapters_own_rank_and_layout():
    pool = make_pool([5, 12], seed=5, all_modules=True)
    segments, pages = pool.batch([1, 0, 0]).kernel_tables
    assert segments.dtype == torch.int64 and segments.shape == (2, 6 + 5 * len(LORA_MODULES))
    first = segments[0].tolist()
    assert first[:6] == [0, 1, 12, pool.adapters[1].layout.row_len, 0, len(pool.adapters[1].pages)]
    q = pool.adapters[1].layout.span("q_proj")
    assert first[6:11] == [q.a_offset, q.b_offset, q.rank, q.in_features, q.out_features]
    assert pages.tolist() == [*pool.adapters[1].pages, *pool.adapters[0].pages]


def test_an_empty_batch_touches_nothing():
    pool = make_pool([4], seed=6)
    y = torch.randn(3, 80)
    before = y.clone()
    batch = LoraBatch((), {}, 3)
    lora_linear_delta(y, torch.randn(3, 48), batch, group("qkv"), pool.k, pool.v)
    reference_lora_delta(y, torch.randn(3, 48), batch, group("qkv"), pool.k, pool.v)
    assert torch.equal(y, before)


def test_shapes_that_do_not_fit_the_layer_are_refused(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")
    pool = make_pool([4], seed=7, all_modules=True)
    with pytest.raises(ValueError, match="does not fit"):
        lora_linear_delta(torch.zeros(2, 48), torch.zeros(2, 40), pool.batch([0, 0]), group("o"), pool.k, pool.v)
