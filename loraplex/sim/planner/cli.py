"""`loraplex sim plan`: plan a trace, check the plan in the twin, optionally find the servers the
baselines need at the same SLO (arguments are defined in loraplex/sim/commands.py).

Slots: `--max-loras N` gives every policy N (the planner at most N per GPU). Without it, a profile
whose slots cost KV memory lets each policy choose (the planner per GPU, a baseline the best of
`SLOT_CHOICES` that fits); a profile whose slots are free gives everyone its own `max_loras`."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from loraplex.latency.profile import Profile, load_profile
from loraplex.sim.console import emit, progress, show_plan
from loraplex.sim.metrics import Slo
from loraplex.sim.operating_points import operating_points
from loraplex.sim.planner.compare import baseline_json, check_plan, compare_baselines, slot_choices
from loraplex.sim.planner.floor import server_floor
from loraplex.sim.planner.greedy import PlanError, plan
from loraplex.sim.planner.oracle import Oracle, TwinOracle
from loraplex.sim.planner.surrogate import distill, train_surrogate, twin_dataset
from loraplex.sim.planner.workload import WorkloadSummary
from loraplex.sim.trace import read_trace
from loraplex.spec.errors import CommandError

MIN_SURROGATE_SAMPLES = 10


def make_oracle(args: argparse.Namespace, profile: Profile, summary: WorkloadSummary) -> Oracle:
    """The twin itself, or the paper's surrogate (random forests, or one shallow tree each) trained
    on `--surrogate-samples` twin runs at the workload's mean lengths."""
    slo = Slo(args.slo_ttft) if args.slo_aware else None
    if args.oracle == "twin":
        return TwinOracle(profile, args.oracle_duration, slo=slo, slo_target=args.slo_target)
    if args.surrogate_samples < MIN_SURROGATE_SAMPLES:
        raise CommandError(f"--surrogate-samples must be at least {MIN_SURROGATE_SAMPLES}")
    data = twin_dataset(profile, args.surrogate_samples, summary.prompt_len, summary.output_len,
                        duration_s=args.oracle_duration, slo=slo, slo_target=args.slo_target)
    return train_surrogate(*data) if args.oracle == "forest" else distill(*data)


def run(args: argparse.Namespace) -> int:
    try:
        trace, profile = read_trace(args.trace), load_profile(args.profile)
    except (OSError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    searched, slots, choices = slot_settings(args, profile, max(trace.adapters().values()))
    with progress("sim plan") as say:
        doc, starved = _run(args, trace, profile, searched, slots, choices, say)
    text = json.dumps(doc, indent=2)
    emit(doc, args.json, show_plan)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if starved else 0


def slot_settings(args: argparse.Namespace, profile: Profile, max_rank: int) -> tuple[bool, int, list[int]]:
    """Whether each policy chooses its own slots, the slots it starts from, and the counts it may try."""
    searched = args.max_loras is None and profile.memory.kv_tokens_per_slot_rank > 0
    slots = args.max_loras or int(profile.engine["max_loras"])
    try:
        return searched, slots, slot_choices(profile, max_rank) if searched else [slots]
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _run(args, trace, profile: Profile, searched: bool, slots: int, choices, say) -> tuple[dict, bool]:
    """The plan's document, and whether the plan starves in the twin."""
    started = time.perf_counter()
    try:
        summary = WorkloadSummary.from_trace(trace)
        say(f"the planner asks the {args.oracle} how many adapters a GPU serves ({args.oracle_duration:g} s runs)")
        result = plan(summary, profile, make_oracle(args, profile, summary), max_slots=None if searched else slots)
    except PlanError as exc:
        raise CommandError(str(exc)) from None
    plan_s = time.perf_counter() - started
    slo = Slo(args.slo_ttft)
    say(f"checking the plan ({result.num_gpus} GPUs) in the twin on the whole trace")
    verdict = check_plan(result, trace, profile, slo)
    ranks = trace.adapters()
    doc = {"workload": trace.workload, "profile": profile.name, "max_loras": "searched" if searched else slots,
           "slo_ttft_s": args.slo_ttft, "slo_aware": args.slo_aware, "oracle": args.oracle,
           "planner": {"gpus": result.num_gpus, "a_max": result.a_max,
                       "s_max": [max(ranks[a] for a in result.gpu_adapters(g)) for g in range(result.num_gpus)],
                       "starved_in_twin": verdict.starved,
                       "slo_attainment": verdict.slo_attainment, "plan_s": round(plan_s, 2),
                       "adapters_per_gpu": [len(result.gpu_adapters(g)) for g in range(result.num_gpus)],
                       "replicated": result.replicated}}
    if args.compare:
        points = operating_points(profile, sorted(set(trace.adapters().values())), trace,
                                  profile.engine_config(max_loras=slots))
        say("--compare: finding the servers replicate-all and random need at the same SLO")
        target = min(args.slo_target, verdict.slo_attainment)
        doc["slo_target"] = target
        doc["server_floor"] = server_floor(summary, profile, slo, target, args.oracle_duration)
        try:
            baselines = compare_baselines(trace, profile, slo, target, choices, start=result.num_gpus,
                                          random_seeds=args.random_seeds, points=points)
        except RuntimeError as exc:  # a baseline that no server count up to MAX_SERVERS serves
            raise CommandError(str(exc)) from None
        doc["baselines"] = {b.policy: baseline_json(b) for b in baselines}
    if not args.compare or args.assignment:
        doc["assignment"] = result.assignment
    return doc, verdict.starved
