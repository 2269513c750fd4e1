"""`loraplex bench gpu --all --out DIR`: the GPU run, seven parts in order, each writing its own JSON.

1. greedy tokens in float32 on the device equal the CPU engine's (8 adapters of mixed ranks);
2. the Triton kernels against their torch references: error and time (`gpu_kernels`);
3. decode tokens/s at batch 1, 16, 64 with 0, 1, 32 distinct adapters, fraction of the bandwidth
   bound, CUDA graphs on and off (`gpu.decode_sweep`);
4. a rank-8 + rank-128 batch against the sum of its homogeneous halves (`gpu.mixed_ranks`);
5. cold vs warm adapter TTFT, CPU assist off and on (the engine's copies from pinned memory on
   CUDA), and the host->device copy bandwidth from pageable and pinned memory (`gpu_policies`);
6. the memory policies (unified vs lru-static) and the schedulers (Chameleon vs FIFO at 0.9x FIFO's
   capacity) under memory pressure, on the drivers of `bench memory` and `bench schedulers` (`gpu_policies`);
7. a latency profile fitted on the steps of parts 3-6, written in the shipped profile format, and
   the twin's error against parts 3 and 6 (`gpu_twin`).

Part N writes DIR/partN-<name>.json as soon as it ends: its status (ok, failed, over budget,
interrupted), the error when it failed, its budget and elapsed time, and its results (what ran, also
when it failed). A failing part never stops the run. Each part has a time budget (`parts`, estimated in
docs/benchmarks.md for an H200); a part checks it between its measurements and stops early, and an
alarm at HARD_FACTOR x the budget stops one that hangs. On the CPU (`--shape tiny`, the rehearsal
the tests run) every part runs at CI size; the numbers then say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from loraplex_agent.runtime.device import resolve_device, weight_bytes

from loraplex.spec.errors import CommandError, one_line
from loraplex_bench import gpu, gpu_kernels, gpu_policies, gpu_twin
from loraplex_bench.gpu_sizes import SIZES
from loraplex_bench.gpu_state import GpuRun
from loraplex_bench.output import write_bench_json

HARD_FACTOR = 1.5  # a part still running at this multiple of its budget is stopped by an alarm


class OverBudget(Exception):
    """Raised by the alarm in a part that ran past HARD_FACTOR x its budget."""


# ---- parts 1, 3 and 4: the measurements of `bench gpu` ----------------------------------------------------

def greedy(run: GpuRun, out: dict[str, Any]) -> None:
    out.update(gpu.greedy_tokens_match(run.device, run.args.seed, run.workdir, run.sizes.greedy_adapters))
    if not out["identical"]:
        raise RuntimeError(f"greedy tokens differ from the CPU's in requests {out['differing_requests']}")


def decode(run: GpuRun, out: dict[str, Any]) -> None:
    s = run.sizes
    out.update(prompt_len=s.prompt_len, timed_steps=s.steps, bandwidth_gbps=run.bandwidth() / 1e9,
               weight_bytes=weight_bytes(run.config, run.dtype), decode=[])
    results: list[gpu.DecodeResult] = []
    modes = (True, False) if run.cuda else (False,)
    out["points_planned"] = len(modes) * len(s.batches) * len(s.adapter_counts)  # fewer measured: over budget
    try:
        for graphs in modes:
            bench = run.bench(s.decode_blocks, graphs, max_model_len=s.prompt_len + 256)
            try:
                gpu.decode_sweep(bench, run.dtype, run.bandwidth(), s.prompt_len, s.steps, s.batches,
                                 s.adapter_counts, graphs, results, run.deadline)
            finally:
                bench.close()
                run.free()
    finally:
        out["decode"] = [asdict(d) for d in results]
        batch1 = [d.bandwidth_fraction for d in results if d.batch == 1 and d.cuda_graphs == run.cuda]
        out["batch1_bandwidth_fraction"] = max(batch1, default=None)
        out["goal"] = "batch-1 decode >= 85% of the memory-bandwidth bound"


def mixed(run: GpuRun, out: dict[str, Any]) -> None:
    s = run.sizes
    bench = run.bench(s.decode_blocks, True, max_model_len=s.prompt_len + 256)
    try:
        out.update(asdict(gpu.mixed_ranks(bench, s.prompt_len, s.steps, half=s.mixed_half)))
        out["goal"] = "lora_cost_ratio <= 1.10"
    finally:
        bench.close()
        run.free()


# ---- the run ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Part:
    number: int
    name: str
    budget_s: float  # on an H200 (docs/benchmarks.md derives each from FLOPs and bytes)
    run: Callable[[GpuRun, dict[str, Any]], None]
    needs_model: bool = False  # runs engines over the random model (written before the budget starts)

    @property
    def file(self) -> str:
        return f"part{self.number}-{self.name}.json"


def parts() -> list[Part]:
    return [Part(1, "greedy", 60, greedy), Part(2, "kernels", 45, gpu_kernels.run_part),
            Part(3, "decode", 60, decode, True), Part(4, "mixed-ranks", 30, mixed, True),
            Part(5, "cold-warm", 40, gpu_policies.cold_warm, True),
            Part(6, "policies", 150, gpu_policies.policies, True), Part(7, "twin", 30, gpu_twin.run_part)]


def run(args: argparse.Namespace) -> int:
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if not args.out:
        raise CommandError("--all and --parts write a JSON per part: give the folder with --out DIR")
    if args.quick or args.num_blocks or args.plots:
        raise CommandError("--quick, --num-blocks and --plots are the single report's; the GPU run's parts are "
                           "sized by --shape")
    chosen = select(args.parts)
    shape = args.shape or ("llama2-7b" if device.type == "cuda" else "tiny")
    if device.type == "cpu":  # the Triton parts run in its interpreter (set before triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loraplex-gpu-run-") as tmp:
        run_state = GpuRun(args, device, shape, SIZES[shape], Path(tmp), out)
        for part in chosen:
            status = run_part(run_state, part)
            if status != "ok":
                failed.append(f"{part.number} ({status})")
    print(f"bench gpu: {len(chosen)} parts in {time.perf_counter() - began:.0f} s; "
          f"{'all ok' if not failed else 'not ok: ' + ', '.join(failed)}; JSON in {out}")
    return 1 if failed else 0


def select(text: str | None) -> list[Part]:
    every = parts()
    if not text or text == "all":
        return every
    try:
        wanted = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise CommandError(f"--parts must be comma-separated part numbers 1-7, not {text!r}") from None
    if not wanted or not wanted <= {p.number for p in every}:
        raise CommandError(f"--parts must be comma-separated part numbers 1-7, not {text!r}")
    return [p for p in every if p.number in wanted]


def run_part(run: GpuRun, part: Part) -> str:
    """Run one part and write its JSON whatever happens; returns its status."""
    print(f"== part {part.number}: {part.name} (budget {part.budget_s:.0f} s on an H200)", flush=True)
    out: dict[str, Any] = {}
    status, error = "ok", None
    began = time.perf_counter()
    try:
        if part.needs_model:  # the shared setup, once, outside the part's budget
            run.model_dir()
            run.bandwidth()
        began = time.perf_counter()
        run.deadline = began + part.budget_s
        with alarm(part.budget_s * HARD_FACTOR):
            part.run(run, out)
    except OverBudget:
        status, error = "over budget", f"stopped at {HARD_FACTOR} x its budget of {part.budget_s:g} s"
    except KeyboardInterrupt:  # `timeout --signal=INT` (scripts/gpu-run.sh): keep what ran, then stop
        status, error = "interrupted", "stopped by SIGINT (the run's overall time limit)"
    except Exception as exc:  # recorded in the part's JSON; the run goes on to the next part
        status, error = "failed", f"{type(exc).__name__}: {one_line(exc)}"
        out["traceback"] = traceback.format_exc(limit=8)
    elapsed = time.perf_counter() - began
    run.free()
    run.results[part.number] = out
    run.steps_recorded[part.number] = len(run.samples) - sum(run.steps_recorded.values())
    print(f"part {part.number} {part.name}: {status} in {elapsed:.1f} s" + (f": {error}" if error else ""), flush=True)
    write_bench_json(run.out / part.file, "bench gpu", run.args, {
        "part": part.number, "name": part.name, "status": status, "error": error, "budget_s": part.budget_s,
        "elapsed_s": elapsed, "over_soft_budget": elapsed > part.budget_s, "setup_s": dict(run.setup_s),
        "device": torch.cuda.get_device_name(run.device) if run.cuda else "cpu", "shape": run.shape,
        "dtype": str(run.dtype), "results": out})
    if status == "interrupted":
        raise KeyboardInterrupt
    return status


@contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """OverBudget in this (main) thread after `seconds`; nothing where signals are unavailable."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum: int, frame: object) -> None:
        raise OverBudget

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
