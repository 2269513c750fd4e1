"""The Triton multi-LoRA kernels (SGMV prefill, one-program-per-row decode) against the torch
reference: adapter mixes, ranks 1..256 in one batch, module subsets and rank_pattern, base rows,
padded no-op segments of fixed-shape tables, half precision, and the backend switch.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
which is slow: the shapes are tiny and each case covers several properties at once."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from lora_cases import GROUPS, NO_ADAPTER, SHAPES, Pool, executor_rows, group, make_pool
from loraplex_kernels.lora import (
    BACKEND_ENV,
    LoraBatch,
    lora_backend,
    lora_linear_delta,
    reference_lora_delta,
)

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RANKS = [1, 2, 7, 16, 17, 33, 64, 100, 256]


@pytest.fixture(scope="module")
def tk() -> ModuleType:
    """The Triton kernels module; on the CPU only under the interpreter."""
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from loraplex_kernels import triton_lora

    return triton_lora


def on_device(pool: Pool) -> Pool:
    return Pool(pool.k.to(DEVICE), pool.v.to(DEVICE), pool.adapters, pool.weights, pool.scaling)


def inputs(rows: list[int], name: str, seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(rows), SHAPES[GROUPS[name][0]][0], generator=gen).to(dtype)
    base = torch.randn(len(rows), sum(group(name).out_features), generator=gen).to(dtype)
    return x, base


def expected_delta(pool: Pool, x: torch.Tensor, base: torch.Tensor, batch: LoraBatch, name: str) -> torch.Tensor:
    out = base.clone()
    reference_lora_delta(out, x, batch, group(name), pool.k, pool.v)
    return out


def run_triton(tk: ModuleType, pool: Pool, x: torch.Tensor, base: torch.Tensor, batch: LoraBatch, name: str,
               **kwargs) -> torch.Tensor:
    """The kernels on DEVICE over the batch's own tables; the result back on the CPU."""
    dev = on_device(pool)
    y = base.to(DEVICE, copy=True)
    segments, pages = batch.device_tables(DEVICE)
    kwargs.setdefault("max_rows", batch.max_segment_rows)
    tk.triton_lora_delta(y, x.to(DEVICE), segments, pages, group(name).device_table(DEVICE), dev.k, dev.v,
                         batch.max_rank, **kwargs)
    return y.cpu()


def base_rows(rows: list[int]) -> list[int]:
    return [r for r, handle in enumerate(rows) if handle == NO_ADAPTER]


def one_adapter(rng: random.Random, n: int) -> list[int]:
    """A long prefill of one adapter between base rows."""
    return [NO_ADAPTER] * 2 + [rng.randrange(n)] * 70 + [NO_ADAPTER]


def zipf(rng: random.Random, n: int) -> list[int]:
    """Decode rows whose adapters follow Zipf's law, then a prefill chunk."""
    handles = rng.choices(range(n), weights=[1 / (i + 1) for i in range(n)], k=30)
    return sorted(handles) + [NO_ADAPTER] * 3 + [0] * 9


def all_distinct(rng: random.Random, n: int) -> list[int]:
    """A decode step, every row its own adapter, base rows among them: the decode variant."""
    rows = list(range(n)) + [NO_ADAPTER] * 3
    rng.shuffle(rows)
    return rows


MIXES = {"one": one_adapter, "uniform": executor_rows, "zipf": zipf, "distinct": all_distinct}
CASES = [("one", "qkv", (4, 2, 5)), ("uniform", "gate_up", (2, 1, 8)), ("zipf", "down", (4, 2, 5)),
         ("distinct", "qkv", (2, 1, 8)), ("uniform", "o", (16, 1, 4))]


@pytest.mark.parametrize(("mix", "name", "block"), CASES)
def test_matches_the_reference_on_adapter_mixes(tk, mix, name, block):
    """Ranks 1..256 mixed, random module subsets with rank_pattern, rows straddling pages and K/V
    halves, odd row counts and widths (48, 16, 72: no multiple of a block); base rows untouched."""
    rng = random.Random(mix + name)
    pool = make_pool(RANKS, seed=len(mix), block=block)
    rows = MIXES[mix](rng, len(RANKS))
    x, base = inputs(rows, name, seed=3)
    batch = pool.batch(rows)
    got = run_triton(tk, pool, x, base, batch, name)
    torch.testing.assert_close(got, expected_delta(pool, x, base, batch, name), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[base_rows(rows)], base[base_rows(rows)])


@pytest.mark.parametrize("decode", [True, False])
def test_both_variants_are_correct_for_any_segments(tk, decode):
    """Decode is chosen for single-row segments but loops over a segment's rows; SGMV takes
    single-row segments too."""
    pool = make_pool([3, 40, 130], seed=5, all_modules=True)
    rows = [0, 1, 2, NO_ADAPTER, 2, 2, 2, 2, 1, NO_ADAPTER, 0]
    x, base = inputs(rows, "qkv", seed=5)
    batch = pool.batch(rows)
    got = run_triton(tk, pool, x, base, batch, "qkv", decode=decode)
    torch.testing.assert_close(got, expected_delta(pool, x, base, batch, "qkv"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode", [True, False])
def test_padded_tables_of_a_fixed_shape_are_no_ops_where_padded(tk, decode):
    """As a CUDA graph captures them: extra segments with no rows or no wrapped module, extra
    pages, max_rank and max_rows above the step's, and the same result."""
    pool = make_pool([5, 20], seed=6, all_modules=True)
    rows = [1, NO_ADAPTER, 0, 1] if decode else [1, 1, 1, NO_ADAPTER, 0, 0]
    x, base = inputs(rows, "gate_up", seed=6)
    batch = pool.batch(rows)
    segments, pages = batch.kernel_tables
    empty = segments[0].clone()
    empty[0] = empty[1] = 2  # rows 2:2 of a real adapter
    unwrapped = torch.zeros_like(segments[0])
    unwrapped[1] = len(rows)  # every row, but no module wrapped
    padded = torch.cat([segments, empty[None], unwrapped[None], torch.zeros(5, segments.shape[1], dtype=torch.int64)])
    padded_pages = torch.cat([pages, torch.zeros(7, dtype=torch.int64)])
    dev = on_device(pool)
    y = base.to(DEVICE, copy=True)
    tk.triton_lora_delta(y, x.to(DEVICE), padded.to(DEVICE), padded_pages.to(DEVICE),
                         group("gate_up").device_table(DEVICE), dev.k, dev.v, max_rank=64,
                         max_rows=1 if decode else 8, decode=decode)
    torch.testing.assert_close(y.cpu(), expected_delta(pool, x, base, batch, "gate_up"), rtol=1e-5, atol=1e-5)
    assert torch.equal(y.cpu()[base_rows(rows)], base[base_rows(rows)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_in_float32(tk, dtype):
    pool = make_pool([8, 64, 3, 256], seed=7, dtype=dtype, all_modules=True)
    for rows in ([0, 1, 2, 3, NO_ADAPTER], [3] * 20 + [NO_ADAPTER, 1, 1, 1]):  # decode, then prefill
        x, base = inputs(rows, "qkv", seed=7, dtype=dtype)
        batch = pool.batch(rows)
        got = run_triton(tk, pool, x, base, batch, "qkv")
        torch.testing.assert_close(got.float(), expected_delta(pool, x, base, batch, "qkv").float(),
                                   rtol=2e-2, atol=2e-2)
        assert torch.equal(got[base_rows(rows)], base[base_rows(rows)])


def test_the_backend_variable_routes_to_triton(tk, monkeypatch):
    """`triton` forces the kernels (a column slice of y, a strided x); `auto` keeps the CPU paths;
    shapes that do not fit are refused as by the reference; an empty batch launches nothing."""
    calls = []
    launch = tk.triton_lora_delta
    monkeypatch.setattr(tk, "triton_lora_delta", lambda *a, **k: calls.append(1) or launch(*a, **k))
    pool = make_pool([4, 8], seed=8, all_modules=True)
    rows = [0, 1, 1, 1, 1, NO_ADAPTER]
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(8))[:, ::2]
    expected = torch.zeros(6, 48)
    reference_lora_delta(expected, x, pool.batch(rows), group("o"), pool.k, pool.v)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert lora_backend() == "triton"
    dev = on_device(pool)
    wide = torch.zeros(6, 56, device=DEVICE)
    lora_linear_delta(wide[:, 8:], x.to(DEVICE), pool.batch(rows), group("o"), dev.k, dev.v)
    assert calls == [1]
    torch.testing.assert_close(wide[:, 8:].cpu(), expected, rtol=1e-5, atol=1e-5)
    assert not wide[:, :8].any()
    with pytest.raises(ValueError, match="does not fit"):
        lora_linear_delta(torch.zeros(2, 48, device=DEVICE), torch.zeros(2, 40, device=DEVICE), pool.batch([0, 0]),
                          group("o"), dev.k, dev.v)
    lora_linear_delta(wide, x.to(DEVICE), pool.batch([NO_ADAPTER] * 6), group("o"), dev.k, dev.v)
    assert calls == [1]
    monkeypatch.setenv(BACKEND_ENV, "auto")  # bfloat16 on the CPU: the reference, whatever the device
    half = make_pool([4, 8], seed=8, dtype=torch.bfloat16, all_modules=True)
    lora_linear_delta(torch.zeros(6, 48, dtype=torch.bfloat16), x.bfloat16(), pool.batch(rows), group("o"),
                      half.k, half.v)
    assert calls == [1]


def test_cpu_serving_never_imports_triton():
    """The `auto` path on CPU tensors (C++ kernel or reference) leaves triton unimported."""
    code = ("import sys, torch\n"
            "from lora_cases import group, make_pool\n"
            "from loraplex_kernels.lora import lora_linear_delta, prepare_lora_backend\n"
            "prepare_lora_backend(torch.device('cpu'), torch.float32)\n"
            "pool = make_pool([4], seed=9, all_modules=True)\n"
            "for dtype in (torch.float32, torch.bfloat16):\n"
            "    k, v = pool.k.to(dtype), pool.v.to(dtype)\n"
            "    y, x = torch.zeros(2, 48, dtype=dtype), torch.ones(2, 48, dtype=dtype)\n"
            "    lora_linear_delta(y, x, pool.batch([0, 0]), group('o'), k, v)\n"
            "    assert y.any()\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n")
    support = Path(__file__).resolve().parents[1] / "support"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(support), os.environ.get("PYTHONPATH", "")])}
    env.pop(BACKEND_ENV, None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
