"""Part 7 of the GPU run: the device's latency profile and the twin's error against parts 3 and 6.

Every engine the run builds has its steps recorded (`record_steps`: features as `loraplex profile`
records them, wall time of the whole step, synchronised with the device). Part 7 fits the twin's
step-latency model on those steps (`loraplex.sim.fit.fit_latency`), writes it in the shipped profile
format (the JSON's `profile`; ship it as loraplex/latency/profiles/<name>.json), and says the twin's
error: per decode point of part 3 (predicted step time against measured), and on part 6's session
workload and scheduler runs replayed in the twin with this profile (mean and P99 TTFT).
"""

from __future__ import annotations

import datetime
import re
import statistics
from dataclasses import asdict
from typing import Any

import torch
from loraplex_agent.runtime.device import (
    adapter_bytes_per_rank,
    kv_token_bytes,
    kv_tokens_per_slot_rank,
    num_kv_blocks,
)

from loraplex.latency.features import StepFeatures
from loraplex.latency.profile import PROFILE_VERSION, Memory, Profile
from loraplex.sim.fit import fit_latency
from loraplex_bench import memory_compare, scheduler_compare
from loraplex_bench.gpu import RANKS
from loraplex_bench.gpu_state import GpuRun

BLOCK = 16


def run_part(run: GpuRun, out: dict[str, Any]) -> None:
    if not run.samples:
        raise RuntimeError("no engine steps were recorded: part 7 fits on the steps of parts 3-6 run in the same "
                           "invocation (e.g. --parts 3,4,5,6,7)")
    profile = device_profile(run)
    out["steps_by_part"] = dict(run.steps_recorded)  # what the fit saw: parts of this invocation only
    out["profile"] = profile.model_dump(mode="json")
    print(f"profile {profile.name}: {profile.fit.samples} steps, R^2 {profile.fit.r2:.3f}, step MAPE "
          f"{profile.fit.mape:.1%}, total-time error {profile.fit.total_time_error:+.1%}", flush=True)
    out["decode_error"] = decode_errors(profile, run.results.get(3, {}))
    if out["decode_error"]:
        errors = [abs(e["error"]) for e in out["decode_error"]]
        out["decode_mean_abs_error"] = statistics.mean(errors)
        print(f"twin vs part 3: mean |error| of the decode step time {out['decode_mean_abs_error']:.1%}", flush=True)
    if "sessions" in run.shared:
        out["memory_error"] = memory_errors(run, profile)
    if "block" in run.shared:
        out["scheduler_error"] = scheduler_errors(run, profile)


def device_profile(run: GpuRun) -> Profile:
    """The fitted profile of this device and shape, its memory sized as the agent sizes its pool."""
    coefficients, fit = fit_latency(run.samples)
    config, dtype, device = run.config, run.dtype, run.device
    engine = {"block_size": BLOCK, "max_lora_rank": max(RANKS), "scheduler": "fifo", "memory_policy": "unified",
              **{k: v for k, v in run.shared.get("engine", {}).items() if k != "num_host_blocks"}}
    engine.setdefault("max_model_len", run.sizes.max_model_len)
    blocks = num_kv_blocks(config, device, dtype, block_size=BLOCK, max_model_len=engine["max_model_len"],
                           max_num_seqs=engine.get("max_num_seqs", 256))
    part5 = run.results.get(5, {})  # the rate of the memory the engine copies adapters from
    h2d = part5.get("h2d_gbps", {}).get(part5.get("engine_copies_from", "pageable"))
    memory = Memory(kv_tokens_base=blocks * BLOCK,
                    kv_tokens_per_slot_rank=kv_tokens_per_slot_rank(config, dtype, max(RANKS)),
                    kv_token_bytes=kv_token_bytes(config, dtype),
                    adapter_bytes_per_rank=adapter_bytes_per_rank(config, dtype), h2d_gbps=h2d)
    where = torch.cuda.get_device_name(device) if run.cuda else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", where.lower()).removeprefix("nvidia-").strip("-")
    name = f"{slug}-{run.shape}" + ("" if run.cuda else "-rehearsal")
    return Profile(
        profile_version=PROFILE_VERSION, name=name, engine=engine, memory=memory, coefficients=coefficients, fit=fit,
        model=f"random weights of the {run.shape} shape (hidden {config.hidden_size}, "
              f"{config.num_hidden_layers} layers, vocab {config.vocab_size}, {dtype})",
        hardware=f"{where}, torch {torch.__version__}; measured by `loraplex bench gpu --all` on "
                 f"{datetime.date.today().isoformat()}: wall time of whole engine steps of parts 3-6")


def decode_errors(profile: Profile, part3: dict[str, Any]) -> list[dict[str, Any]]:
    """The twin's decode step time against each of part 3's points (requests cycle over the adapters,
    whose ranks cycle over RANKS; the context is the middle of the timed steps)."""
    context = part3.get("prompt_len", 0) + part3.get("timed_steps", 0) // 2
    rows = []
    for point in part3.get("decode", []):
        batch, adapters = point["batch"], point["adapters"]
        ranks = [RANKS[(i % adapters) % len(RANKS)] for i in range(batch)] if adapters else []
        features = StepFeatures(batch=batch, adapters=adapters, rank_sum=sum(ranks), max_rank=max(ranks, default=0),
                                context_tokens=batch * context, decodes=batch, max_decode_context=context)
        predicted = profile.step_seconds(features)
        rows.append({"batch": batch, "adapters": adapters, "cuda_graphs": point["cuda_graphs"],
                     "measured_s": point["step_s"], "twin_s": predicted,
                     "error": (predicted - point["step_s"]) / point["step_s"]})
    return rows


def at_pool(profile: Profile, pages: int) -> Profile:
    """The profile with part 6's page pool (the twin sizes the pool from the profile's memory)."""
    return profile.model_copy(update={"memory": profile.memory.model_copy(update={"kv_tokens_base": pages * BLOCK})})


def memory_errors(run: GpuRun, profile: Profile) -> list[dict[str, Any]]:
    """Part 6's session workload in the twin, per memory policy: mean and P99 TTFT against the engine's."""
    pool, engine, workload = run.shared["pool"], run.shared["engine"], run.shared["sessions"]
    twin = at_pool(profile, pool)
    rows = []
    for real in run.results.get(6, {}).get("memory", {}).get("results", []):
        # as `bench memory`'s twin: lru-static's slots come out of the profile's KV, the others get the pool
        whole = {} if real["policy"] == "lru-static" else {"num_blocks": pool}
        config = twin.engine_config(memory_policy=real["policy"], prefix_cache=real["prefix_cache"],
                                    num_host_blocks=engine["num_host_blocks"], **whole)
        summary = memory_compare.twin_summary(twin, config, workload)
        rows.append(_errors(real["variant"], real["summary"], asdict(summary), ("ttft_mean_s", "ttft_p99_s")))
    return rows


def scheduler_errors(run: GpuRun, profile: Profile) -> list[dict[str, Any]]:
    """Part 6's scheduler runs in the twin at the same rates: P50 and P99 TTFT against the engine's."""
    trace, block = run.shared["trace"], run.shared["block"]
    args = run.shared["scheduler_args"]
    args.host_blocks = run.shared["engine"]["num_host_blocks"]
    twin = scheduler_compare.TwinSide(at_pool(profile, run.shared["pool"]), args, block.memory_policy)
    run_at = twin.run_at(trace)

    def in_twin(real: scheduler_compare.RunResult) -> dict[str, Any]:
        return asdict(scheduler_compare.measure([run_at(real.scheduler, real.rps)], real.scheduler, real.rps,
                                                block.slo_ttft_s))

    return [_errors(real.scheduler, asdict(real), in_twin(real), ("ttft_p50_s", "ttft_p99_s"))
            for real in block.runs]


def _errors(name: str, real: dict[str, Any], twin: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    row: dict[str, Any] = {"run": name}
    for key in keys:
        row[f"real_{key}"], row[f"twin_{key}"] = real[key], twin[key]
        row[f"{key}_error"] = (twin[key] - real[key]) / real[key] if real[key] else None
    print(f"twin vs part 6, {name}: " + ", ".join(
        f"{k} {row[f'real_{k}'] * 1e3:.1f} ms real, {row[f'twin_{k}'] * 1e3:.1f} ms twin" for k in keys), flush=True)
    return row
