"""Part 2 of the GPU run: the Triton kernels against their torch references, error and time.

Attention: paged decode (batches of one context) and a chunked prefill, Triton
(`LORAPLEX_ATTENTION_KERNEL=triton`) against the torch reference (`reference`) on the same paged
cache, plus torch SDPA over dense K/V of the same shapes as the floor of unpaged attention.
Mixed-rank LoRA: every fused group of one layer of the shape (qkv, o, gate_up, down), a decode batch
(one row per adapter, ranks 8-128 cycled) and a prefill batch (segments of one adapter each), the
Triton kernels against `reference_lora_delta` over the same pages. Error is the largest absolute
difference over the largest absolute value of the reference's result.
On the CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1): slow, and only the
errors mean anything there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from loraplex_agent.runtime.model.config import ModelConfig
from loraplex_agent.runtime.model.lora_pages import PagedAdapters, lora_groups

from loraplex.engine.messages import NO_ADAPTER_SLOT
from loraplex_bench import gpu
from loraplex_bench.gpu_state import GpuRun

BLOCK = 16


@dataclass
class KernelCheck:
    kernel: str  # attention-decode, attention-prefill, lora-decode, lora-prefill
    case: str  # e.g. "batch 16, context 2048" or "qkv, 64 rows"
    max_rel_error: float
    triton_s: float
    reference_s: float
    sdpa_s: float | None = None  # attention only: torch SDPA over dense K/V


@contextmanager
def backend(variable: str, value: str) -> Iterator[None]:
    """The kernels read their backend from the environment at every call."""
    before = os.environ.get(variable)
    os.environ[variable] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before


def relative_error(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / scale.float().abs().max().clamp_min(1e-12))


def run_part(run: GpuRun, out: dict[str, Any]) -> None:
    checks: list[KernelCheck] = []
    out["checks"] = checks_json = []
    s, config = run.sizes, run.config
    cases = [("decode", b, c) for b, c in s.attention_decode] + [("prefill", 1, s.attention_prefill)]
    for phase, batch, context in cases:
        if run.over():
            break
        checks.append(attention_check(config, run.device, run.dtype, phase, batch, context, s.kernel_repeats))
        checks_json.append(asdict(checks[-1]))
    one_layer = gpu.model_config(run.shape, num_hidden_layers=1)  # the LoRA kernels run per layer
    for phase, segments, rows in (("decode", s.lora_decode_rows, 1), ("prefill", *s.lora_prefill_segments)):
        for check in lora_checks(run, one_layer, phase, segments, rows):
            checks.append(check)
            checks_json.append(asdict(check))
            if run.over():
                return
    out["worst_rel_error"] = {kind: max(c.max_rel_error for c in checks if c.kernel == kind)
                              for kind in dict.fromkeys(c.kernel for c in checks)}


def _print(check: KernelCheck) -> None:
    sdpa = f", SDPA {check.sdpa_s * 1e6:9.1f} us" if check.sdpa_s is not None else ""
    print(f"{check.kernel:<17} {check.case:<26} error {check.max_rel_error:.1e}: "
          f"Triton {check.triton_s * 1e6:9.1f} us, "
          f"reference {check.reference_s * 1e6:9.1f} us{sdpa}", flush=True)


def attention_check(config: ModelConfig, device: torch.device, dtype: torch.dtype, phase: str, batch: int,
                    context: int, repeats: int) -> KernelCheck:
    from loraplex_kernels.attention import BACKEND_ENV, build_attention_batch, paged_attention, write_kv

    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_seq = -(-context // BLOCK)
    k_cache = torch.randn(batch * per_seq + 1, BLOCK, kv_heads, dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    if phase == "decode":
        slots = [t[(context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK for t in tables]
        meta = build_attention_batch(slots, tables, [context] * batch, [], BLOCK, device)
    else:
        slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t in tables for p in range(context)]
        meta = build_attention_batch(slots, [], [], [(context, 0, t) for t in tables], BLOCK, device)
    rows = len(slots)
    q = torch.randn(rows, heads, dim, device=device, dtype=dtype)
    k, v = (torch.randn(rows, kv_heads, dim, device=device, dtype=dtype) for _ in range(2))
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)  # the contract: this step's keys are in the cache
    scale = dim ** -0.5

    def attend() -> torch.Tensor:
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    with backend(BACKEND_ENV, "triton"):
        got = attend()
        triton_s = gpu.timed(attend, device, repeats)
    with backend(BACKEND_ENV, "reference"):
        want = attend()
        reference_s = gpu.timed(attend, device, repeats)
    queries = 1 if phase == "decode" else context
    q_dense = torch.randn(batch, heads, queries, dim, device=device, dtype=dtype)
    kv_dense = torch.randn(batch, kv_heads, context, dim, device=device, dtype=dtype)
    sdpa_s = gpu.timed(lambda: torch.nn.functional.scaled_dot_product_attention(
        q_dense, kv_dense, kv_dense, is_causal=phase == "prefill", enable_gqa=True), device, repeats)
    check = KernelCheck(f"attention-{phase}", f"batch {batch}, context {context}", relative_error(got, want, want),
                        triton_s, reference_s, sdpa_s)
    _print(check)
    return check


def lora_checks(run: GpuRun, config: ModelConfig, phase: str, segments: int, rows: int) -> list[KernelCheck]:
    """`segments` adapters of ranks 8-128 cycled, `rows` rows each, in every fused group of one layer."""
    from loraplex_kernels.lora import BACKEND_ENV, LoraBatch, lora_linear_delta, reference_lora_delta

    device, dtype = run.device, run.dtype
    weights = gpu.AdapterWeights(config, device, run.args.seed)
    hosts = [weights.adapter(config, f"k{i}", gpu.RANKS[i % len(gpu.RANKS)], i) for i in range(segments)]
    probe = [(torch.zeros(1, BLOCK, config.num_key_value_heads, config.head_dim, device=device, dtype=dtype),) * 2]
    need = [PagedAdapters(config, probe).pages_needed(h) for h in hosts]
    shape = (sum(need) + 1, BLOCK, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))]
    paged = PagedAdapters(config, caches)
    first = 1
    for handle, (host, pages) in enumerate(zip(hosts, need, strict=True)):
        paged.load(handle, host, range(first, first + pages))
        first += pages
    row_adapters = [h for h in range(segments) for _ in range(rows)]
    batch = LoraBatch.from_row_adapters(row_adapters, paged.resident, no_adapter=NO_ADAPTER_SLOT)
    k_cache, v_cache = caches[0]
    generator = torch.Generator(device).manual_seed(run.args.seed)
    checks = []
    for name, group in lora_groups(config).items():
        in_features = config.module_shape(group.modules[0])[0]
        x = torch.randn(len(row_adapters), in_features, generator=generator, device=device).to(dtype)
        # y starts at zero: in bf16 a base output around 1 would round away a delta a hundred times smaller
        got, want = (torch.zeros(len(row_adapters), sum(group.out_features), device=device, dtype=dtype)
                     for _ in range(2))
        with backend(BACKEND_ENV, "triton"):
            lora_linear_delta(got, x, batch, group, k_cache, v_cache)
        reference_lora_delta(want, x, batch, group, k_cache, v_cache)
        error = relative_error(got, want, want)
        with backend(BACKEND_ENV, "triton"):  # timed adding into `got` again: the sums no longer matter
            triton_s = gpu.timed(partial(lora_linear_delta, got, x, batch, group, k_cache, v_cache), device,
                                 run.sizes.kernel_repeats)
        reference_s = gpu.timed(partial(reference_lora_delta, want, x, batch, group, k_cache, v_cache), device,
                                run.sizes.kernel_repeats)
        ranks = sorted({h.rank for h in hosts})
        check = KernelCheck(f"lora-{phase}", f"{name}, {segments}x{rows} rows, ranks {ranks[0]}-{ranks[-1]}",
                            error, triton_s, reference_s)
        _print(check)
        checks.append(check)
    return checks
