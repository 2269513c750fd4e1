"""The fused C++ CPU LoRA kernel against the torch reference, and the backend switch around it."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from loraplex_kernels import cpu_lora
from loraplex_kernels.lora import (
    BACKEND_ENV,
    LoraBatch,
    StackedLoraWeights,
    lora_backend,
    lora_linear_delta,
    rank_class,
    reference_lora_delta,
)

NO_ADAPTER = -1


@pytest.fixture(scope="module")
def kernel():
    module = cpu_lora.load()
    if module is None:
        missing = cpu_lora.toolchain_missing()
        if missing:
            pytest.skip(f"cannot build the C++ kernel here: {missing}")
        pytest.fail(f"the toolchain is there but the C++ kernel did not build: {cpu_lora.unavailable_reason()}")
    return module


def make_stack(rng: random.Random, gen: torch.Generator, d_in: int, outs: list[int], ranks: list[int],
               dtype: torch.dtype = torch.float32) -> tuple[StackedLoraWeights, dict[int, tuple[int, int]]]:
    """A fused group holding one adapter per rank (slot = position), each wrapping a random subset of
    the modules (at least one)."""
    stack = StackedLoraWeights(d_in, outs, torch.device("cpu"), dtype)
    locations: dict[int, tuple[int, int]] = {}
    per_class: dict[int, int] = {}
    for slot, rank in enumerate(ranks):
        cls = rank_class(rank)
        locations[slot] = (cls, per_class.get(cls, 0))
        per_class[cls] = per_class.get(cls, 0) + 1
        wraps = [rng.random() < 0.7 for _ in outs]
        wraps[rng.randrange(len(outs))] = True
        stack.put(locations[slot], [(torch.randn(d_in, rank, generator=gen, dtype=dtype) / d_in ** 0.5,
                                     torch.randn(rank, out, generator=gen, dtype=dtype) / rank ** 0.5) if w else None
                                    for w, out in zip(wraps, outs, strict=True)])
    return stack, locations


def random_row_slots(rng: random.Random, num_adapters: int, locations: dict[int, tuple[int, int]]) -> list[int]:
    """Decode rows (one per request) sorted by location, then prefill chunks of random lengths, with
    base-model rows in both parts: the executor's order."""
    decode = [rng.choice([NO_ADAPTER, *range(num_adapters)]) for _ in range(rng.randint(0, 40))]
    decode.sort(key=lambda slot: (-1, -1) if slot == NO_ADAPTER else locations[slot])
    rows = list(decode)
    for _ in range(rng.randint(0, 4)):
        rows += [rng.choice([NO_ADAPTER, *range(num_adapters)])] * rng.randint(2, 70)
    return rows


@pytest.mark.parametrize("seed", range(8))
def test_kernel_matches_reference_on_random_batches(kernel, monkeypatch, seed):
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    d_in = rng.choice([24, 40, 256])
    outs = rng.choice([[32, 8, 8], [48], [40, 72], [100, 3, 36]])  # widths that are no multiple of 16 too
    ranks = [rng.choice([1, 2, 3, 5, 8, 12, 16, 24, 33, 64, 100, 130]) for _ in range(rng.randint(1, 12))]
    stack, locations = make_stack(rng, gen, d_in, outs, ranks)
    row_slots = random_row_slots(rng, len(ranks), locations)
    batch = LoraBatch.from_row_slots(row_slots, locations.__getitem__, no_adapter=NO_ADAPTER)
    x = torch.randn(len(row_slots), d_in, generator=gen)
    base = torch.randn(len(row_slots), sum(outs), generator=gen)
    expected, got = base.clone(), base.clone()
    reference_lora_delta(expected, x, batch, stack)
    lora_linear_delta(got, x, batch, stack)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    base_rows = [row for row, slot in enumerate(row_slots) if slot == NO_ADAPTER]
    assert torch.equal(got[base_rows], base[base_rows])  # base-model rows are left alone


def test_rows_are_bit_identical_alone_and_in_any_blocking(kernel, monkeypatch):
    """A prefill chunk's rows go four at a time, a decode row alone: the same row must get the
    same bits either way (a request gives identical tokens alone and inside a batch)."""
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    stack, locations = make_stack(rng, gen, 256, [256, 64, 64], [8, 16, 24, 64, 128, 130])
    x = torch.randn(37, 256, generator=gen)
    for slot in locations:
        whole = torch.zeros(37, 384)
        lora_linear_delta(whole, x, LoraBatch.from_row_slots([slot] * 37, locations.__getitem__), stack)
        for start, length in ((0, 1), (5, 1), (3, 7), (36, 1), (8, 29)):
            part = torch.zeros(length, 384)
            rows = slice(start, start + length)
            lora_linear_delta(part, x[rows], LoraBatch.from_row_slots([slot] * length, locations.__getitem__), stack)
            assert torch.equal(part, whole[rows]), (slot, start, length)


def test_thread_count_does_not_change_the_result(kernel, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    stack, locations = make_stack(rng, gen, 64, [64, 32], [8, 16, 32, 64] * 4)
    row_slots = sorted(range(16), key=locations.__getitem__) + [2] * 33
    batch = LoraBatch.from_row_slots(row_slots, locations.__getitem__)
    x = torch.randn(len(row_slots), 64, generator=gen)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = torch.zeros(len(row_slots), 96)
            lora_linear_delta(y, x, batch, stack)
            results.append(y)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


def test_column_slices_and_strided_inputs(kernel, monkeypatch):
    """y may be a column slice of a wider tensor and x a non-contiguous view, as in the model."""
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    stack, locations = make_stack(rng, gen, 32, [16, 16], [4, 8])
    batch = LoraBatch.from_row_slots([0, 1, 1, 1, 1, 1], locations.__getitem__)
    wide_x = torch.randn(6, 64, generator=gen)
    x = wide_x[:, ::2]  # stride 2 along features: the kernel gets a contiguous copy
    expected, wide = torch.zeros(6, 32), torch.zeros(6, 40)
    reference_lora_delta(expected, x, batch, stack)
    lora_linear_delta(wide[:, 8:], x, batch, stack)
    torch.testing.assert_close(wide[:, 8:], expected, rtol=1e-5, atol=1e-5)
    assert not wide[:, :8].any()


def test_other_dtypes_use_the_reference(kernel, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cpu")  # required for float32 only
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    stack, locations = make_stack(rng, gen, 32, [16], [8, 16], dtype=torch.bfloat16)
    batch = LoraBatch.from_row_slots([0, 1, 1], locations.__getitem__)
    x = torch.randn(3, 32, generator=gen, dtype=torch.bfloat16)
    expected, got = torch.zeros(3, 16, dtype=torch.bfloat16), torch.zeros(3, 16, dtype=torch.bfloat16)
    reference_lora_delta(expected, x, batch, stack)
    lora_linear_delta(got, x, batch, stack)
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
    rng, gen = random.Random(6), torch.Generator().manual_seed(6)
    stack, locations = make_stack(rng, gen, 16, [8], [4])
    batch = LoraBatch.from_row_slots([0, 0], locations.__getitem__)
    x = torch.randn(2, 16, generator=gen)
    expected, got = torch.zeros(2, 8), torch.zeros(2, 8)
    reference_lora_delta(expected, x, batch, stack)
    with caplog.at_level(logging.WARNING, logger=cpu_lora.__name__):
        lora_linear_delta(got, x, batch, stack)
        lora_linear_delta(torch.zeros(2, 8), x, batch, stack)
    assert torch.equal(got, expected)
    assert len(caplog.records) == 1 and "no C++ compiler" in caplog.records[0].getMessage()
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    with pytest.raises(RuntimeError, match="unavailable"):
        lora_linear_delta(got, x, batch, stack)
