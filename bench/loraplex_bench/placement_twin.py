"""`loraplex bench placement-twin`: max rps at the SLO per placement policy and rank skew, in the
cluster twin. Only argparse is imported here; `run` imports the simulator."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from loraplex.spec.engine_settings import add_engine_settings
from loraplex.spec.errors import CommandError
from loraplex_bench.output import add_plots_arg, stage
from loraplex_bench.report import plot_series

WORKLOADS = ("uniform", "power", "exponential", "shifting_skew")


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="cpu-tiny", help="profile file or shipped profile name")
    p.add_argument("--servers", type=int, default=4, help="twin servers (the paper's default cluster is 4)")
    p.add_argument("--policies", type=_csv(str), default=["loraserve", "random", "replicate-all"],
                   help="comma-separated placement policies")
    p.add_argument("--hysteresis", type=_csv(float), default=[0.0, 0.1],
                   help="loraserve and min-cost-flow hysteresis values, one contender each (0 = the paper)")
    p.add_argument("--workloads", type=_csv(str), default=list(WORKLOADS),
                   help=f"rank popularities, comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--alpha", type=float, default=1.0, help="power: rank share ~ i^-alpha")
    p.add_argument("--lam", type=float, default=0.5, help="exponential: rank share ~ exp(-lam i)")
    p.add_argument("--adapters", type=int, default=200)
    p.add_argument("--ranks", type=_csv(int), default=[8, 16, 32, 64, 128])
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals per probe")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between placements")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="P95 TTFT bound in seconds")
    p.add_argument("--rel-tol", type=float, default=0.1, help="bisection stops when high/low <= 1 + this")
    p.add_argument("--lengths", choices=["azure23_conv", "azure23_code", "fixed"], default="azure23_conv")
    p.add_argument("--length-scale", type=float, default=0.125, help="azure lengths x this (tiny CPU model)")
    p.add_argument("--prompt-len", type=int, default=128, help="--lengths fixed")
    p.add_argument("--output-len", type=int, default=32, help="--lengths fixed")
    add_engine_settings(p, "max_loras", max_loras={"default": None, "help": "override the profile's adapter slots"})
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces-dir", default=None, help="folder of the Azure 2023 CSVs (default: the ones shipped in the package)")
    p.add_argument("--out", default=None, help="write every probe and the table as JSON")
    add_plots_arg(p, "P95 TTFT at each rate probed, per placement policy, for each workload")


def run(args: argparse.Namespace) -> int:
    from loraplex_bench import placement_compare as pc

    setup, workloads, contenders, slo = _build(args)
    started = time.perf_counter()
    results = []
    for workload in workloads:
        try:
            results.append(pc.compare_workload(setup, workload, contenders, slo, args.rel_tol,
                                               progress=stage))
        except FileNotFoundError as exc:
            raise CommandError(str(exc)) from None
    table = pc.format_table(results, contenders)
    print(f"\nmax rps at P95 TTFT <= {slo.p95_ttft_s:g} s without starvation; {setup.servers} servers, "
          f"{args.adapters} adapters, ranks {args.ranks}, {args.duration:g} s per probe, profile {setup.profile.name}"
          f"{_rank_note(setup)}\n{table}\n\nat the highest rate that met the SLO:\n{pc.format_costs(results, contenders)}"
          f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.out:
        _write(args.out, results, table, {k: v for k, v in vars(args).items() if not callable(v)})
    if args.plots:
        plot_series([one for r in results for one in pc.search_series(
            f"placement-twin-{r.workload.rank_skew.mode}", f"placement, {r.workload.rank_skew.mode} ranks",
            r.searches, [("p95_ttft_s", "P95 TTFT (s)")])], Path(args.plots))
    return 0


def _build(args: argparse.Namespace):
    from loraplex.latency.profile import load_profile
    from loraplex.sim.lengths import Lengths
    from loraplex.sim.rank_skew import RankSkew, SkewedWorkload
    from loraplex_bench import placement_compare as pc

    try:
        profile = load_profile(args.profile)
        if args.servers < 1 or args.duration <= 0 or args.slo_ttft <= 0 or args.rel_tol <= 0:
            raise ValueError("--servers, --duration, --slo-ttft and --rel-tol must be positive")
        contenders = pc.make_contenders(args.policies, args.hysteresis)
        lengths = Lengths(profile=args.lengths, scale=1.0 if args.lengths == "fixed" else args.length_scale,
                          prompt_len=args.prompt_len, output_len=args.output_len,
                          max_model_len=int(profile.engine["max_model_len"]))
        workloads = [SkewedWorkload(RankSkew(mode, args.alpha, args.lam), args.adapters, tuple(sorted(set(args.ranks))),
                                    args.duration, lengths, seed=args.seed, traces_dir=args.traces_dir)
                     for mode in args.workloads]
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    # servers must hold the top rank: raise the profile's max_lora_rank to it (the latency model is
    # linear in rank, so ranks above the profiled ones are extrapolated; the note says so)
    overrides = {"max_lora_rank": max(int(profile.engine["max_lora_rank"]), max(args.ranks))}
    if args.max_loras:
        overrides["max_loras"] = args.max_loras
    setup = pc.TwinSetup(profile, args.servers, args.interval, args.seed, overrides)
    return setup, workloads, contenders, pc.SloTarget(args.slo_ttft)


def _rank_note(setup) -> str:
    profiled = int(setup.profile.engine["max_lora_rank"])
    used = setup.engine_overrides["max_lora_rank"]
    return "" if used == profiled else f" (max_lora_rank raised from the profiled {profiled} to {used})"


def _write(path: str, results, table: str, params: dict) -> None:
    from dataclasses import asdict

    doc = {"params": params, "table": table, "workloads": [
        {"workload": r.workload.header(None), "operating_points": r.operating_points.tokens_per_second,
         "searches": {label: asdict(s) for label, s in r.searches.items()}} for r in results]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
