"""`loraplex sim plan --sessions SPEC`: the fewest servers a multi-turn chat workload needs with each
`--routing` (arguments in loraplex/sim/commands.py, the search in planner/sessions.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields
from pathlib import Path

from loraplex.latency.profile import Profile, load_profile
from loraplex.placement import POLICY_NAMES
from loraplex.routing.pipeline import PROFILES
from loraplex.sim.console import emit, progress, show_session_plan
from loraplex.sim.metrics import Slo
from loraplex.sim.planner.cli import slot_settings
from loraplex.sim.planner.oracle import fits_memory
from loraplex.sim.planner.sessions import plan_sessions
from loraplex.sim.sessions import SessionSpec, make_sessions
from loraplex.spec.errors import CommandError


def read_session_spec(doc: dict, path: str, profile: Profile) -> SessionSpec:
    """The session workload fields read from `path`; `max_model_len` defaults to the profile's."""
    from pydantic import TypeAdapter, ValidationError

    unknown = sorted(str(key) for key in set(doc) - {f.name for f in fields(SessionSpec)})
    if unknown:
        raise CommandError(f"--sessions {path}: unknown field(s) {', '.join(unknown)}; known: "
                           f"{', '.join(f.name for f in fields(SessionSpec))}")
    try:
        return TypeAdapter(SessionSpec).validate_python({"max_model_len": int(profile.engine["max_model_len"])} | doc)
    except ValidationError as exc:
        problems = (f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors())
        raise CommandError(f"--sessions {path}: {'; '.join(problems)}") from None


def _check(args: argparse.Namespace, routings: list[str]) -> None:
    unknown = sorted(set(routings) - set(PROFILES))
    if unknown or not routings:
        raise CommandError(f"--routing: unknown profile(s) {', '.join(unknown) or '(none given)'}; "
                           f"known: {', '.join(PROFILES)}")
    if args.placement not in POLICY_NAMES:
        raise CommandError(f"--placement: unknown policy {args.placement}; known: {', '.join(POLICY_NAMES)}")
    if args.replicas < 1 or args.max_servers < 1:
        raise CommandError("--replicas and --max-servers must be at least 1")
    if args.compare:
        raise CommandError("--compare is for --trace: with --sessions, compare routings with --routing a,b")


def run_session_plan(args: argparse.Namespace, fields_read: dict) -> int:
    """`fields_read`: the --sessions file's mapping."""
    routings = [r for r in args.routing.split(",") if r]
    _check(args, routings)
    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    spec = read_session_spec(fields_read, args.sessions, profile)
    if spec.max_model_len > int(profile.engine["max_model_len"]):
        raise CommandError(f"--sessions {args.sessions}: max_model_len {spec.max_model_len} is above profile "
                           f"{profile.name}'s {profile.engine['max_model_len']}")
    workload = make_sessions(spec)
    if not workload.sessions:
        raise CommandError(f"--sessions {args.sessions}: no session arrives within duration_s")
    max_rank = max(workload.adapters.values())
    searched, slots, choices = slot_settings(args, profile, max_rank)
    if not fits_memory(profile, slots, max_rank):
        raise CommandError(f"--max-loras {slots}: slots of rank {max_rank} leave profile {profile.name} "
                           "no KV cache for one full-length request")
    slo = Slo(args.slo_ttft)
    with progress("sim plan --sessions") as say:
        try:
            plans = plan_sessions(workload, profile, routings, slo, args.slo_target, choices, args.placement,
                                         args.replicas, limit=args.max_servers, say=say)
        except RuntimeError as exc:  # a routing that no count up to --max-servers serves
            raise CommandError(str(exc)) from None
    doc = {"sessions": asdict(spec), "num_sessions": len(workload.sessions), "turns": workload.num_turns,
           "profile": profile.name, "placement": args.placement, "replicas": args.replicas,
           "max_loras": "searched" if searched else slots, "slo_ttft_s": args.slo_ttft,
           "slo_target": args.slo_target,
           "routings": {p.routing: {k: v for k, v in asdict(p).items() if k != "routing"} for p in plans}}
    emit(doc, args.json, show_session_plan)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0
