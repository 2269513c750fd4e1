"""`loraplex sim plan`: plan a trace, check the plan in the twin, optionally find the servers the
baselines need at the same SLO (arguments are defined in loraplex/sim/commands.py)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from loraplex.cli import CommandError
from loraplex.sim.metrics import Slo
from loraplex.sim.operating_points import operating_points
from loraplex.sim.planner.compare import baseline_json, check_plan, compare_baselines
from loraplex.sim.planner.greedy import PlanError, plan
from loraplex.sim.planner.oracle import TwinOracle
from loraplex.sim.planner.workload import WorkloadSummary
from loraplex.sim.profile import load_profile
from loraplex.sim.trace import read_trace


def run(args: argparse.Namespace) -> int:
    try:
        trace, profile = read_trace(args.trace), load_profile(args.profile)
    except (OSError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    slots = args.max_loras or int(profile.engine["max_loras"])
    started = time.perf_counter()
    try:
        result = plan(WorkloadSummary.from_trace(trace), profile, TwinOracle(profile, args.oracle_duration),
                      max_slots=slots)
    except PlanError as exc:
        raise CommandError(str(exc)) from None
    plan_s = time.perf_counter() - started
    slo = Slo(args.slo_ttft)
    verdict = check_plan(result, trace, profile, slo)
    doc = {"workload": trace.workload, "profile": profile.name, "max_loras": slots, "slo_ttft_s": args.slo_ttft,
           "planner": {"gpus": result.num_gpus, "a_max": result.a_max, "starved_in_twin": verdict.starved,
                       "slo_attainment": verdict.slo_attainment, "plan_s": round(plan_s, 2),
                       "adapters_per_gpu": [len(result.gpu_adapters(g)) for g in range(result.num_gpus)]}}
    if args.compare:
        points = operating_points(profile, sorted(set(trace.adapters().values())), trace,
                                  profile.engine_config(max_loras=slots))
        target = min(args.slo_target, verdict.slo_attainment)
        doc["slo_target"] = target
        doc["baselines"] = {b.policy: baseline_json(b) for b in compare_baselines(
            trace, profile, slo, target, slots, start=result.num_gpus, random_seeds=args.random_seeds, points=points)}
    if not args.compare or args.assignment:
        doc["assignment"] = result.assignment
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if verdict.starved else 0
