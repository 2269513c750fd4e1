"""`loraplex bench cpu-assist`: cold-adapter TTFT against warm-adapter TTFT, with and without
CPU-assisted LoRA (Toppings), on the real engine.

Each pass builds a fresh engine over the same tiny model and adapters (ranks 8-64 cycled, all
seven target modules), keeps `--background` base-model requests decoding, and then probes every
adapter twice in turn: first cold (its weights only in host memory), then warm (on the device).
A probe is one request of `--prompt-len` tokens; its TTFT runs from its arrival to its first token.
Goal (issue 13): with assistance the mean cold TTFT is at most 1.05x the warm one; Toppings
reports ~7% over all-cached.

On a CPU host a copy is a memcpy, so the copy time is an EMULATION: each byte is charged at
`--emulate-h2d-gbps`, by default calibrated so that copying an adapter costs the same multiple of
a decode step as on the what-if H100 / Llama-3.1-8B profile (`memory_engine.calibrated_bandwidth`'s
rule). On CUDA copies are real and nothing is emulated.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from loraplex_agent.runtime.llm import LLM

from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.latency.features import StepFeatures
from loraplex.spec.errors import CommandError
from loraplex_bench.memory_engine import decode_step_seconds, model_bytes, reference_profile
from loraplex_bench.output import write_bench_json

RANKS = (8, 16, 32, 64)


@dataclass
class AssistResult:
    cpu_assist: bool
    cold_ttft_s: list[float]
    warm_ttft_s: list[float]
    assisted_layers: int
    worker_failures: int

    @property
    def cold_over_warm(self) -> float:
        return statistics.mean(self.cold_ttft_s) / statistics.mean(self.warm_ttft_s)


def run(args: argparse.Namespace) -> int:
    from loraplex_agent.tools.tiny_model import make_tiny_model

    if args.adapters < 1 or args.prompt_len < 1 or args.background < 0:
        raise CommandError("--adapters and --prompt-len must be at least 1, --background at least 0")
    if args.emulate_h2d_gbps is not None and args.emulate_h2d_gbps <= 0:
        raise CommandError("--emulate-h2d-gbps must be positive")
    ranks = [RANKS[i % len(RANKS)] for i in range(args.adapters)]
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-assist-") as tmp:
        tiny = make_tiny_model(Path(tmp) / "tiny", num_adapters=args.adapters, ranks=ranks, seed=args.seed)
        gbps, note = emulated_bandwidth(args, tiny.base_dir)
        print(f"copy bandwidth: {note}")
        results = [probe_pass(args, tiny.base_dir, tiny.adapters, gbps, assist) for assist in (False, True)]
    for r in results:
        print(f"cpu assist {'on ' if r.cpu_assist else 'off'}: cold TTFT {1e3 * statistics.mean(r.cold_ttft_s):7.1f} ms, "
              f"warm {1e3 * statistics.mean(r.warm_ttft_s):7.1f} ms, cold/warm {r.cold_over_warm:.3f} "
              f"(assisted layer-groups {r.assisted_layers}, worker failures {r.worker_failures})")
    print("goal: cold/warm <= 1.05 with cpu assist (Toppings: ~1.07 over all-cached)")
    if args.out:
        write_bench_json(Path(args.out), "bench cpu-assist", args, {
            "copy_bandwidth": note, "emulated_h2d_gbps": gbps,
            "results": [{**asdict(r), "cold_over_warm": r.cold_over_warm} for r in results]})
    return 0


def emulated_bandwidth(args: argparse.Namespace, base_dir: Path) -> tuple[float | None, str]:
    """The emulated bandwidth (None on CUDA: real copies) and a sentence saying how it was chosen."""
    if args.emulate_h2d_gbps is not None:
        return args.emulate_h2d_gbps, f"EMULATED at {args.emulate_h2d_gbps:g} GB/s (given)"
    llm = LLM(base_dir, dtype="float32", device=args.device, num_blocks=args.num_blocks, threads=args.threads)
    if llm.executor.device.type == "cuda":
        return None, "real host->device copies (CUDA)"
    reference = reference_profile("whatif-h100-llama8b")
    decode_s = decode_step_seconds(llm)
    ref_decode_s = reference.step_seconds(StepFeatures(batch=1, adapters=1, decodes=1))
    _, rank_bytes = model_bytes(llm.model_config)
    gbps = reference.memory.h2d_gbps * (rank_bytes / reference.memory.adapter_bytes_per_rank) * (ref_decode_s / decode_s)
    return gbps, (f"EMULATED at {gbps:.3g} GB/s: an adapter copy costs the same multiple of a decode step "
                  f"as on {reference.name}")


def probe_pass(args: argparse.Namespace, base_dir: Path, adapters: dict[str, Path], gbps: float | None,
               assist: bool) -> AssistResult:
    llm = LLM(base_dir, dtype="float32", device=args.device, num_blocks=args.num_blocks, threads=args.threads,
              emulate_h2d_gbps=gbps, cpu_assist=assist, max_num_batched_tokens=max(512, args.prompt_len))
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    result = probe_adapters(llm, list(adapters), args.prompt_len, args.background, assist)
    llm.executor.close()
    return result


def probe_adapters(llm: LLM, adapters: list[str], prompt_len: int, background: int, assist: bool) -> AssistResult:
    """Probe every adapter cold, then warm, next to `background` base-model requests decoding all along.
    `llm` is anything with `core`, `executor`, `model_config` and `make_request` (the GPU run's bench too)."""
    running = [llm.make_request([11 + i] * 32, SamplingParams(max_tokens=1_000_000, ignore_eos=True))
               for i in range(background)]
    for request in running:
        llm.core.add_request(request)
    while any(r.first_token_time is None for r in running):  # probes meet a batch already decoding
        llm.core.step()
    cold, warm = [], []
    for index, name in enumerate(adapters):
        cold.append(probe(llm, name, prompt_len, seed=2 * index))
        while llm.core.memory.copies_in_flight:  # warm means on the device: an assisted copy may still run
            llm.core.step()
        warm.append(probe(llm, name, prompt_len, seed=2 * index + 1))
    for request in running:
        llm.core.abort_request(request.request_id)
    while llm.core.has_unfinished():
        llm.core.step()
    helper = llm.executor.assist
    return AssistResult(assist, cold, warm, helper.assisted_layers if helper else 0, helper.failures if helper else 0)


def probe(llm: LLM, adapter: str, prompt_len: int, seed: int) -> float:
    """TTFT of one request of `adapter`, stepping the engine (and its background load) meanwhile."""
    prompt = [(seed * 7919 + i * 31) % (llm.model_config.vocab_size - 3) + 3 for i in range(prompt_len)]
    request: Request = llm.make_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), adapter)
    llm.core.add_request(request)
    while request.first_token_time is None:
        llm.core.step()
    return request.first_token_time - request.arrival_time
