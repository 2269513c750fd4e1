"""The fused C++ CPU LoRA kernel over paged adapters against a dense computation and the torch
reference, and the backend switch around it."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from lora_cases import GROUPS, NO_ADAPTER, SHAPES, executor_rows, group, make_pool
from loraplex_kernels import cpu_lora
from loraplex_kernels.lora import BACKEND_ENV, lora_backend, lora_linear_delta, reference_lora_delta


@pytest.fixture(scope="module")
def kernel():
    module = cpu_lora.load()
    if module is None:
        missing = cpu_lora.toolchain_missing()
        if missing:
            pytest.skip(f"cannot build the C++ kernel here: {missing}")
        pytest.fail(f"the toolchain is there but the C++ kernel did not build: {cpu_lora.unavailable_reason()}")
    return module


def inputs(rows: list[int], name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(len(rows), SHAPES[GROUPS[name][0]][0], generator=gen),
            torch.randn(len(rows), sum(group(name).out_features), generator=gen))


@pytest.mark.parametrize("seed", range(10))
def test_kernel_matches_dense_and_reference_on_executor_batches(kernel, monkeypatch, seed):
    """Ranks 1..256 in one batch, module subsets, rank_pattern, decode and prefill segments, base
    rows, on pages small enough that rows straddle pages and K/V halves."""
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    rng = random.Random(seed)
    ranks = [rng.choice([1, 2, 3, 5, 8, 12, 16, 24, 33, 64, 100, 128, 200, 256]) for _ in range(rng.randint(1, 10))]
    pool = make_pool(ranks, seed=seed, block=rng.choice([(4, 2, 5), (2, 1, 8), (16, 2, 16)]))
    rows = executor_rows(rng, len(ranks))
    name = rng.choice(list(GROUPS))
    x, base = inputs(rows, name, seed)
    expected, got = base.clone(), base.clone()
    reference_lora_delta(expected, x, pool.batch(rows), group(name), pool.k, pool.v)
    lora_linear_delta(got, x, pool.batch(rows), group(name), pool.k, pool.v)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double() - base.double(), pool.dense_delta(x, rows, name), rtol=1e-4, atol=1e-4)
    base_rows = [row for row, handle in enumerate(rows) if handle == NO_ADAPTER]
    assert torch.equal(got[base_rows], base[base_rows])  # base-model rows are left alone


@pytest.mark.parametrize("name", list(GROUPS))
def test_decode_of_many_adapters_of_mixed_ranks(kernel, monkeypatch, name):
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    ranks = [1, 4, 8, 16, 17, 31, 64, 96, 128, 255, 256, 3]
    pool = make_pool(ranks, seed=11, all_modules=True)
    rows = list(range(len(ranks)))
    x, base = inputs(rows, name, 11)
    got = base.clone()
    lora_linear_delta(got, x, pool.batch(rows), group(name), pool.k, pool.v)
    torch.testing.assert_close(got.double() - base.double(), pool.dense_delta(x, rows, name), rtol=1e-4, atol=1e-4)


def test_rows_are_bit_identical_alone_and_in_any_blocking(kernel, monkeypatch):
    """Prefill rows go four at a time, a decode row alone, and one item may take several modules:
    the same row must get the same bits either way (a request gives identical tokens alone and
    inside a batch)."""
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    pool = make_pool([8, 16, 24, 64, 128, 130], seed=7, all_modules=True)
    x = torch.randn(37, 48, generator=torch.Generator().manual_seed(7))
    for handle in pool.adapters:
        whole = torch.zeros(37, 80)
        lora_linear_delta(whole, x, pool.batch([handle] * 37), group("qkv"), pool.k, pool.v)
        for start, length in ((0, 1), (5, 1), (3, 7), (36, 1), (8, 29), (1, 2)):
            part = torch.zeros(length, 80)
            rows = slice(start, start + length)
            lora_linear_delta(part, x[rows], pool.batch([handle] * length), group("qkv"), pool.k, pool.v)
            assert torch.equal(part, whole[rows]), (handle, start, length)
        mixed = torch.zeros(len(pool.adapters), 80)  # a decode step of every adapter
        lora_linear_delta(mixed, x[:len(pool.adapters)].index_select(0, torch.full((len(pool.adapters),), 4)),
                          pool.batch(list(pool.adapters)), group("qkv"), pool.k, pool.v)
        assert torch.equal(mixed[handle], whole[4]), handle


def test_thread_count_does_not_change_the_result(kernel, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    pool = make_pool([8, 16, 32, 64] * 4, seed=3, all_modules=True)
    rows = list(range(16)) + [2] * 33
    x, _ = inputs(rows, "gate_up", 3)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            y = torch.zeros(len(rows), 144)
            lora_linear_delta(y, x, pool.batch(rows), group("gate_up"), pool.k, pool.v)
            results.append(y)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_column_slices_and_strided_inputs(kernel, monkeypatch):
    """y may be a column slice of a wider tensor and x a non-contiguous view, as in the model."""
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    pool = make_pool([4, 8], seed=4, all_modules=True)
    rows = [0, 1, 1, 1, 1, 1]
    wide_x = torch.randn(6, 96, generator=torch.Generator().manual_seed(4))
    x = wide_x[:, ::2]  # stride 2 along features: the kernel gets a contiguous copy
    expected, wide = torch.zeros(6, 48), torch.zeros(6, 56)
    reference_lora_delta(expected, x, pool.batch(rows), group("o"), pool.k, pool.v)
    lora_linear_delta(wide[:, 8:], x, pool.batch(rows), group("o"), pool.k, pool.v)
    torch.testing.assert_close(wide[:, 8:], expected, rtol=1e-5, atol=1e-5)
    assert not wide[:, :8].any()


def test_the_kernel_refuses_tables_that_do_not_fit(kernel, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    pool = make_pool([4], seed=8, all_modules=True)
    batch = pool.batch([0, 0])
    segments, pages = batch.kernel_tables
    y, x = torch.zeros(2, 48), torch.zeros(2, 48)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.lora_delta(y, torch.zeros(2, 40), pool.k, pool.v, segments, pages, group("o").table)
    with pytest.raises(RuntimeError, match="columns outside y"):
        kernel.lora_delta(torch.zeros(2, 40), x, pool.k, pool.v, segments, pages, group("o").table)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel.lora_delta(y, x, pool.k[:1], pool.v[:1], segments, pages, group("o").table)
    short = segments.clone()
    short[0, 5] = 0  # no pages
    with pytest.raises(RuntimeError, match="fewer pages"):
        kernel.lora_delta(y, x, pool.k, pool.v, short, pages, group("o").table)


def test_other_dtypes_use_the_reference(kernel, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cpu")  # required for float32 only
    pool = make_pool([8, 16], seed=5, dtype=torch.bfloat16, all_modules=True)
    rows = [0, 1, 1]
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    expected, got = torch.zeros(3, 48, dtype=torch.bfloat16), torch.zeros(3, 48, dtype=torch.bfloat16)
    reference_lora_delta(expected, x, pool.batch(rows), group("o"), pool.k, pool.v)
    lora_linear_delta(got, x, pool.batch(rows), group("o"), pool.k, pool.v)
    assert torch.equal(got, expected)


def test_backend_variable(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert lora_backend() == "auto"
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert lora_backend() == "reference"
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        lora_backend()


def test_a_failed_build_falls_back_to_the_reference_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(cpu_lora, "_state", {"module": None, "reason": None})
    monkeypatch.setenv("CXX", "no-such-compiler-loraplex")
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    pool = make_pool([4], seed=6, all_modules=True)
    batch = pool.batch([0, 0])
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(6))
    expected, got = torch.zeros(2, 48), torch.zeros(2, 48)
    reference_lora_delta(expected, x, batch, group("o"), pool.k, pool.v)
    with caplog.at_level(logging.WARNING, logger=cpu_lora.__name__):
        lora_linear_delta(got, x, batch, group("o"), pool.k, pool.v)
        lora_linear_delta(torch.zeros(2, 48), x, batch, group("o"), pool.k, pool.v)
    assert torch.equal(got, expected)
    assert len(caplog.records) == 1 and "no C++ compiler" in caplog.records[0].getMessage()
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    with pytest.raises(RuntimeError, match="unavailable"):
        lora_linear_delta(got, x, batch, group("o"), pool.k, pool.v)
