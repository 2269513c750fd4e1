"""Arguments and entry points of `loraplex workload ...`, `loraplex sim ...` and `loraplex bench
serve|report`. Only argparse is imported here; each command imports its module when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.spec.engine_settings import add_engine_settings
from loraplex.spec.errors import CommandError
from loraplex.util.args import existing_dir, existing_file

if TYPE_CHECKING:  # the workload module loads only when a command runs
    from loraplex.sim.workload import WorkloadSpec


def read_mapping(path: str, flag: str) -> dict:
    """A YAML or JSON file of fields; CommandError (one line naming `flag`) when it is not a mapping."""
    import yaml

    from loraplex.spec.errors import one_line

    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        raise CommandError(f"{flag} {path}: {one_line(exc)}") from None
    if not isinstance(doc, dict):
        raise CommandError(f"{flag} {path}: expected a mapping of workload fields")
    return doc


def _load_spec(args: argparse.Namespace):
    from pydantic import ValidationError

    from loraplex.sim.workload import WorkloadSpec
    from loraplex.spec.errors import one_line, validation_line

    doc: dict = {}
    if args.spec:
        doc = read_mapping(args.spec, "--spec")
        doc = doc.get("workload", doc)
    for key, value in (("seed", args.seed), ("duration_s", args.duration), ("rps", args.rps)):
        if value is not None:
            doc[key] = value
    if args.adapters is not None:
        doc.setdefault("adapters", {})["count"] = args.adapters
    if args.max_model_len is not None:
        doc.setdefault("lengths", {})["max_model_len"] = args.max_model_len
    try:
        spec = WorkloadSpec.model_validate(doc)
    except ValidationError as exc:
        raise CommandError(f"invalid workload: {validation_line(exc)}") from None
    except ValueError as exc:
        raise CommandError(f"invalid workload: {one_line(exc)}") from None
    return spec if args.max_rank is None else _ranks_up_to(spec, args.max_rank)


def _ranks_up_to(spec: WorkloadSpec, max_rank: int) -> WorkloadSpec:
    """The spec with its adapters' ranks above `max_rank` left out (their weights with them)."""
    adapters = spec.adapters
    keep = [i for i, rank in enumerate(adapters.ranks) if rank <= max_rank]
    if not keep:
        raise CommandError(f"--max-rank {max_rank}: the workload has no adapter rank at or below it ({adapters.ranks})")
    weights = None if adapters.rank_weights is None else [adapters.rank_weights[i] for i in keep]
    return spec.model_copy(update={"adapters": adapters.model_copy(
        update={"ranks": [adapters.ranks[i] for i in keep], "rank_weights": weights})})


def workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", type=existing_file, default=None, help="workload YAML/JSON (docs/simulator.md); flags override it")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    p.add_argument("--rps", type=float, default=None, help="mean requests per second")
    p.add_argument("--adapters", type=int, default=None, help="number of adapters")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest request (prompt + output), e.g. a profile's max_model_len: longer ones are shaved")
    p.add_argument("--max-rank", type=int, default=None,
                   help="leave out adapter ranks above this, e.g. a profile's max_lora_rank")
    p.add_argument("--traces-dir", type=existing_dir, default=None, help="folder of the Azure 2023 CSVs (default: the ones shipped in the package)")


def generate_args(p: argparse.ArgumentParser) -> None:
    workload_args(p)
    p.add_argument("--out", required=True, help="trace file to write (JSONL)")


def run_generate(args: argparse.Namespace) -> int:
    from loraplex.sim.trace import write_trace
    from loraplex.sim.workload import generate

    spec = _load_spec(args)
    try:
        trace = generate(spec, args.traces_dir)
    except FileNotFoundError as exc:
        raise CommandError(str(exc)) from None
    write_trace(trace, args.out)
    print(f"wrote {len(trace.requests)} requests over {spec.duration_s:.0f} s to {args.out}")
    return 0


def stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=existing_file, help="trace file (JSONL)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON (default: a summary table)")


def run_stats(args: argparse.Namespace) -> int:
    from loraplex.sim.console import emit, show_stats
    from loraplex.sim.trace_stats import trace_stats

    emit(trace_stats(_read(args.trace)), args.json, show_stats)
    return 0


def _read(path: str):
    from loraplex.sim.trace import read_trace

    try:
        return read_trace(path)
    except (OSError, ValueError) as exc:
        raise CommandError(str(exc)) from None


def sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=existing_file, required=True, help="trace file (JSONL)")
    p.add_argument("--profile", default="cpu-tiny", help="profile file or shipped profile name")
    p.add_argument("--servers", type=int, default=1, help="servers; more than 1 runs the cluster mode")
    p.add_argument("--placement", default="loraserve", help="cluster: placement policy")
    p.add_argument("--routing", default="loraserve",
                   help="cluster: router profile (loraserve, load-aware, least-loaded, rank-aware)")
    p.add_argument("--interval", type=float, default=60.0, help="cluster: seconds between placements")
    p.add_argument("--max-requests", type=int, default=None)
    add_engine_settings(p, "max_loras", "max_num_seqs", "scheduler",
                        max_loras={"default": None, "help": "override the profile's adapter slots"},
                        max_num_seqs={"default": None, "help": None},
                        scheduler={"default": None, "choices": None,
                                   "help": "engine scheduler: fifo, sjf, vtc or chameleon (default: the profile's)"})
    p.add_argument("--scheduler-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a knob of the scheduler, e.g. refresh_s=60 (repeatable; docs/engine.md)")
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="time-per-output-token SLO in seconds")
    p.add_argument("--exact", action="store_true",
                   help="run every engine step one by one (the reference; default: spans of plain decode "
                        "steps between two events at once, docs/simulator.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write per-request results (JSONL, header = workload + summary)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON (default: a summary table)")


def run_sim(args: argparse.Namespace) -> int:
    import time

    from loraplex.latency.profile import load_profile
    from loraplex.sim.metrics import Slo
    from loraplex.sim.results import write_results

    trace = _read(args.trace)
    if args.max_requests:
        trace = trace.head(args.max_requests)
    try:
        profile = load_profile(args.profile)
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    overrides: dict = {k: v for k, v in (("max_loras", args.max_loras), ("max_num_seqs", args.max_num_seqs),
                                         ("scheduler", args.scheduler)) if v}
    if args.scheduler_option:
        from loraplex.engine.scheduling.schedulers import parse_scheduler_options

        try:
            overrides["scheduler_options"] = parse_scheduler_options(args.scheduler_option)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    from loraplex.sim.console import emit, progress, show_sim

    slo = Slo(args.slo_ttft, args.slo_tpot) if args.slo_ttft or args.slo_tpot else None  # None: no attainment
    started = time.perf_counter()
    try:
        with progress("sim run") as say:
            say(f"replaying {len(trace.requests)} requests on {args.servers} simulated server(s)")
            results, summary, extra = _simulate(args, trace, profile, overrides, slo, _reporter(say, trace))
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    wall = time.perf_counter() - started
    doc = {"summary": summary.to_json(), "wall_s": wall, "speedup": summary.elapsed_s / max(wall, 1e-9)} | extra
    emit(doc, args.json, show_sim)
    if args.out:
        write_results(args.out, trace.workload, results, {"profile": profile.name, **doc})
    return 1 if summary.starved else 0


def _reporter(say, trace):
    """Progress for the spinner: trace time simulated, the pace against real time and the wall time left."""
    import time

    from loraplex.sim.metrics import trace_duration

    started, duration = time.monotonic(), trace_duration(trace)

    def report(t: float) -> None:
        wall = time.monotonic() - started
        if t <= 0 or wall <= 0:
            return
        say(f"simulated {t:.0f} of {duration:.0f} s of arrivals, {t / wall:.1f}x real time, "
            f"about {wall * (duration - t) / t:.0f} s left")
    return report


def _simulate(args: argparse.Namespace, trace, profile, overrides: dict, slo, report):
    if args.servers == 1:
        from loraplex.sim.server import simulate_server

        run = simulate_server(trace, profile, profile.engine_config(**overrides), slo, exact=args.exact,
                              progress=report)
        return run.results, run.summary, {}
    from loraplex.sim.cluster import ClusterConfig, simulate_cluster

    cluster = ClusterConfig(servers=args.servers, placement=args.placement, routing=args.routing,
                            interval_s=args.interval, seed=args.seed, engine_overrides=overrides, exact=args.exact,
                            keep_results=bool(args.out), progress=report)
    run = simulate_cluster(trace, profile, cluster, slo)
    return run.results, run.summary, run.info


def plan_args(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=existing_file, help="trace file (JSONL): the workload to plan for")
    source.add_argument("--sessions", type=existing_file,
                        help="or multi-turn chat sessions (YAML/JSON of session workload fields, docs/simulator.md): "
                             "the fewest servers each --routing needs, found in the session cluster twin")
    p.add_argument("--profile", default="cpu-tiny", help="profile file or shipped profile name")
    add_engine_settings(p, "max_loras", max_loras={"default": None,
                        "help": "adapter slots per server for every policy; the planner's A_max may be lower. Default: "
                        "each policy chooses its own when the profile's slots cost KV memory, else the "
                        "profile's max_loras"})
    p.add_argument("--compare", action="store_true",
                   help="also find the servers replicate-all and random need at the same SLO (slow)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds (--compare, --slo-aware, --sessions)")
    p.add_argument("--slo-target", type=float, default=0.95,
                   help="--compare: baselines must reach min(this, the plan's SLO attainment); --sessions: "
                        "each routing must reach it")
    p.add_argument("--slo-aware", action=argparse.BooleanOptionalAction, default=True,
                   help="the planner also closes a GPU before its SLO attainment (--slo-ttft) falls below "
                        "--slo-target, not only before it starves (default; --no-slo-aware: the paper's "
                        "starvation rule alone, whose plans can starve, docs/benchmarks.md)")
    p.add_argument("--random-seeds", type=int, default=3, help="--compare: seeds of random placement (median)")
    p.add_argument("--oracle-duration", type=float, default=120.0, help="seconds of twin run per question")
    p.add_argument("--oracle", choices=["twin", "forest", "tree"], default="twin",
                   help="who answers the planner's questions: the twin itself, or the paper's surrogate "
                        "trained on twin runs (random forests, or one shallow tree each)")
    p.add_argument("--surrogate-samples", type=int, default=200,
                   help="--oracle forest|tree: twin runs to train on")
    p.add_argument("--assignment", action="store_true", help="print the adapter -> GPU map with --compare too")
    s = p.add_argument_group("--sessions (the oracle, surrogate and --compare flags are for --trace)")
    s.add_argument("--routing", default="loraserve",
                   help="router profiles to size the pool for, comma-separated (e.g. loraserve,prefix-aware)")
    s.add_argument("--placement", default="loraserve", help="placement policy")
    s.add_argument("--replicas", type=int, default=3, help="servers each adapter is placed on, at least")
    s.add_argument("--max-servers", type=int, default=64, help="give up on a routing that fails with this many")
    p.add_argument("--out", default=None, help="also write the JSON result here")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON (default: a summary table)")


def run_plan(args: argparse.Namespace) -> int:
    if args.sessions:
        from loraplex.sim.planner.session_cli import run_session_plan

        return run_session_plan(args, read_mapping(args.sessions, "--sessions"))
    from loraplex.sim.planner.cli import run

    return run(args)


def whatif_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="profile file to write (JSON)")
    add_engine_settings(p, "max_loras", "max_lora_rank",
                        max_loras={"default": 32, "help": "the profile's default adapter slots"},
                        max_lora_rank={"default": 32, "help": "slot size (the published constants cover <= 32)"})


def run_whatif(args: argparse.Namespace) -> int:
    from loraplex.sim.whatif import whatif_profile

    try:
        profile = whatif_profile(args.max_loras, args.max_lora_rank)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    profile.save(args.out)
    print(f"wrote {args.out}: {profile.hardware}")
    return 0
