"""`loraplex bench memory`, real-engine side: the memory policies on the tiny model, made locally.

The command itself (arguments, the twin side, tables, JSON) is `loraplex_bench.memory_compare`;
this module runs the same session workload on the real engine: a fresh tiny Llama, one random
PEFT adapter per workload adapter (ranks as the workload drew them, all seven target modules,
fp32), and for every policy a fresh `LLM` with the same page pool, driven in wall time by
`loraplex.sim.sessions.run_sessions`.

Copy cost. On a CPU host and device memory are the same RAM, so a copy costs next to nothing and
no policy could show its worth; the engine's `emulate_h2d_gbps` then charges each copied byte at
a stated bandwidth (an EMULATION, printed as such). Unless told otherwise the bandwidth is chosen
so that copying an adapter costs the same multiple of a decode step as on the what-if H100 /
Llama-3.1-8B profile: gbps = 25 GB/s x (tiny bytes per rank / Llama-8B bytes per rank) x
(H100 decode step / measured tiny decode step). On CUDA the copies are real and nothing is emulated.

Pool size. Every policy gets the same pool of pages (`lru-static` carves its slots out of it). By
default it is the twin's pool scaled so that an adapter takes the same share of it as on the H100.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from loraplex_agent.runtime.model.config import ModelConfig

from loraplex.engine.output.sampling import SamplingParams
from loraplex.latency.features import StepFeatures
from loraplex.latency.profile import Profile, load_profile
from loraplex.sim.sessions import (
    PromptTokens,
    SessionSummary,
    SessionWorkload,
    make_sessions,
    run_sessions,
    summarize_sessions,
)
from loraplex.spec.errors import CommandError
from loraplex_bench.memory_compare import PolicyResult, SideReport, Variant, session_spec
from loraplex_bench.output import stage

if TYPE_CHECKING:
    from loraplex_agent.runtime.llm import LLM

REFERENCE_PROFILE = "whatif-h100-llama8b"  # the GPU whose copy-to-decode ratio the emulation keeps
DTYPE_BYTES = 4  # fp32
CALIBRATION_TOKENS = 48  # decode steps timed per calibration pass
CALIBRATION_PASSES = 3


def model_bytes(config: ModelConfig, dtype_bytes: int = DTYPE_BYTES) -> tuple[int, int]:
    """(bytes of one KV token over all layers, bytes of one adapter rank over all layers and the
    seven target modules): what the paged layout stores (an A row and a B column per module)."""
    h, inter = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    dims = ((h, q_out), (h, kv_out), (h, kv_out), (q_out, h), (h, inter), (h, inter), (inter, h))
    kv_token = 2 * config.num_hidden_layers * kv_out * dtype_bytes
    per_rank = config.num_hidden_layers * dtype_bytes * sum(i + o for i, o in dims)
    return kv_token, per_rank


def run_engine(args: argparse.Namespace, chosen: list[Variant]) -> SideReport:
    from loraplex_agent.tools.tiny_model import make_tiny_model
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    reference = reference_profile(args.profile)
    args = argparse.Namespace(**vars(args))  # the slot count defaults to the twin's, as a copy
    args.max_loras = args.max_loras or int(reference.engine["max_loras"])
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-memory-") as tmp:
        base_dir = make_tiny_model(Path(tmp) / "tiny", num_adapters=0, seed=args.seed).base_dir
        config = ModelConfig.from_dir(base_dir)
        workload = make_sessions(session_spec(args, "engine", config.max_position_embeddings))
        stage(f"engine: writing {len(workload.adapters)} adapters ...")
        adapters = _write_adapters(base_dir, workload, Path(tmp) / "adapters", args.seed)
        kv_token, per_rank = model_bytes(config)
        num_blocks = args.engine_num_blocks or scaled_pool(reference, kv_token, per_rank)
        gbps, calibration = calibrated_bandwidth(args, base_dir, adapters, reference, per_rank)
        report = SideReport("engine", _settings(args, reference, workload, num_blocks, gbps, calibration))
        for variant in chosen:
            stage(f"engine: {variant.name} ...")
            summary = _run_policy(args, base_dir, adapters, workload, variant, num_blocks, gbps, config.vocab_size)
            report.results.append(PolicyResult(variant.name, variant.policy, variant.prefix_cache, summary))
    return report


def reference_profile(name: str) -> Profile:
    """The twin's profile when it knows copy bandwidth and adapter bytes, else the what-if H100."""
    try:
        profile = load_profile(name)
    except (FileNotFoundError, ValueError):
        profile = None
    if profile is None or profile.memory.h2d_gbps is None or profile.memory.adapter_bytes_per_rank is None:
        profile = load_profile(REFERENCE_PROFILE)
    return profile


def scaled_pool(reference: Profile, kv_token_bytes: int, rank_bytes: int) -> int:
    """The reference pool in pages, scaled so that one adapter rank takes the same share of it."""
    ref = reference.memory
    ref_pages_per_rank = ref.adapter_bytes_per_rank / ref.kv_token_bytes
    pages = ref.kv_tokens_base / int(reference.engine["block_size"])
    return max(1, round(pages * (rank_bytes / kv_token_bytes) / ref_pages_per_rank))


def _write_adapters(base_dir: Path, workload: SessionWorkload, out: Path, seed: int) -> dict[str, Path]:
    from loraplex_agent.tools.tiny_model import BASE_DIR_NAME, write_random_adapters
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    dirs = write_random_adapters(model, out, len(workload.adapters), list(workload.adapters.values()), seed,
                                 BASE_DIR_NAME)
    return dict(zip(workload.adapters, dirs.values(), strict=True))


def _make_llm(args: argparse.Namespace, base_dir: Path, num_blocks: int, gbps: float | None,
              variant: Variant | None = None) -> LLM:
    from loraplex_agent.runtime.llm import LLM

    variant = variant or Variant("unified", "unified")
    try:
        return LLM(base_dir, dtype="float32", device=args.device, num_blocks=num_blocks,
                   max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                   memory_policy=variant.policy, prefix_cache=variant.prefix_cache,
                   num_host_blocks=args.host_blocks, emulate_h2d_gbps=gbps, threads=args.threads)
    except ValueError as exc:
        raise CommandError(f"engine, {variant.name}: {exc}") from None


# ---- the emulated bandwidth -------------------------------------------------------------------

def calibrated_bandwidth(args: argparse.Namespace, base_dir: Path, adapters: dict[str, Path], reference: Profile,
                         rank_bytes: int) -> tuple[float | None, dict[str, float]]:
    """The emulated bandwidth and how it was chosen; warms the process up (kernels, threads) too."""
    llm = _make_llm(args, base_dir, 256, None)
    name, path = next(iter(adapters.items()))
    llm.add_adapter(name, path)
    llm.generate([[5] * 16], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), adapters=[name])
    decode_s = decode_step_seconds(llm)
    if llm.executor.device.type == "cuda" and args.emulate_h2d_gbps is None:
        return None, {"decode_step_s": decode_s}
    ref_decode_s = reference.step_seconds(StepFeatures(batch=1, adapters=1, decodes=1))
    ref = reference.memory
    calibrated = ref.h2d_gbps * (rank_bytes / ref.adapter_bytes_per_rank) * (ref_decode_s / decode_s)
    gbps = args.emulate_h2d_gbps or calibrated
    return gbps, {"decode_step_s": decode_s, "reference_decode_step_s": ref_decode_s,
                  "reference_h2d_gbps": ref.h2d_gbps, "calibrated_gbps": calibrated}


def decode_step_seconds(llm: LLM) -> float:
    """Median seconds per output token of one base-model request (batch 1), over a few passes."""
    sampling = SamplingParams(max_tokens=CALIBRATION_TOKENS, ignore_eos=True, temperature=0.0)
    per_token = []
    for i in range(CALIBRATION_PASSES):
        [request] = llm.generate([[7 + i] * 16], sampling)
        per_token.append((request.finished_time - request.first_token_time) / (CALIBRATION_TOKENS - 1))
    return statistics.median(per_token)


def _settings(args: argparse.Namespace, reference: Profile, workload: SessionWorkload, num_blocks: int,
              gbps: float | None, calibration: dict[str, float]) -> dict[str, Any]:
    if gbps is None:
        print("engine: CUDA, host->device copies are real (no emulation)")
    else:
        how = "given by --emulate-h2d-gbps" if args.emulate_h2d_gbps else (
            f"calibrated: an adapter copy costs the same multiple of a decode step as on {reference.name} "
            f"({calibration['reference_decode_step_s'] * 1e3:.1f} ms there, {calibration['decode_step_s'] * 1e3:.2f} ms "
            f"here, {calibration['reference_h2d_gbps']:g} GB/s there)")
        print(f"engine: EMULATED host->device bandwidth {gbps:.3g} GB/s ({how}); copies on this machine are "
              "otherwise free, so this is an emulation, not a measurement")
    return {"model": "tiny Llama (hidden 256, 4 layers, fp32)", "device": args.device, "num_pages": num_blocks,
            "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
            "emulated_h2d_gbps": gbps, "sessions": len(workload.sessions), "turns": workload.num_turns,
            "calibration": calibration, "spec": workload.spec}


# ---- one policy -----------------------------------------------------------------------------------

def _run_policy(args: argparse.Namespace, base_dir: Path, adapters: dict[str, Path], workload: SessionWorkload,
                variant: Variant, num_blocks: int, gbps: float | None, vocab_size: int) -> SessionSummary:
    llm = _make_llm(args, base_dir, num_blocks, gbps, variant)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    clock = llm.core.clock

    def sleep_until(t: float) -> None:
        time.sleep(max(0.0, t - clock.now()))

    run = run_sessions(llm.core, workload, sleep_until, PromptTokens(vocab_size, seed=workload.spec.seed))
    return summarize_sessions(run)
