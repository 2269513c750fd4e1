"""`loraplex bench placement`: time each placement policy on a synthetic pool (default 10,000 adapters
on 256 servers, Zipf demand, five ranks) — a first placement, then `--rounds` re-placements, each
after every adapter's demand drifts by ±10 % (the churn-minimising steps against the previous table)."""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import replace

from loraplex.placement.loraserve import DEFAULT_HYSTERESIS
from loraplex.placement.operating_points import DEFAULT_GPU
from loraplex.placement.policy import POLICY_NAMES, make_policy
from loraplex.placement.snapshot import Placement, PlacementAdapter, PlacementInput, PlacementServer

RANKS = (8, 16, 32, 64, 128)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--servers", type=int, default=256)
    parser.add_argument("--utilization", type=float, default=0.8, help="forecast load / cluster capacity")
    parser.add_argument("--cold-fraction", type=float, default=0.3, help="adapters with zero demand")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best is reported")
    parser.add_argument("--rounds", type=int, default=1, help="re-placements, each after a ±10%% demand drift")
    parser.add_argument("--hysteresis", type=float, default=DEFAULT_HYSTERESIS,
                        help="loraserve's and min-cost-flow's tolerance above targetUtil for keeping adapters in place (0: the paper)")
    parser.add_argument("--max-ranks", default="128", help="server max ranks, cycled over the servers (e.g. 64,128)")
    parser.add_argument("--min-replicas", type=int, default=1, help="replicas.min of every adapter")
    parser.add_argument("--seed", type=int, default=0)


def synthetic_input(adapters: int, servers: int, utilization: float, cold_fraction: float,
                    rng: random.Random, max_ranks: tuple[int, ...] = (128,), min_replicas: int = 1) -> PlacementInput:
    """Zipf(1) demand over adapters in random order, uniform ranks (up to the largest server max rank),
    scaled so Σ load = utilization · servers."""
    weights = [0.0 if rng.random() < cold_fraction else 1.0 / (i + 1) for i in range(adapters)]
    rng.shuffle(weights)
    ranks = [rng.choice([r for r in RANKS if r <= max(max_ranks)]) for _ in range(adapters)]
    capacity = sum(w / DEFAULT_GPU.tps(r) for w, r in zip(weights, ranks, strict=True)) or 1.0
    scale = utilization * servers / capacity
    pool = [PlacementAdapter(f"adapter-{i:05d}", f"sha256:{i:064x}", r, w * scale, min_replicas=min_replicas)
            for i, (w, r) in enumerate(zip(weights, ranks, strict=True))]
    fleet = [PlacementServer(f"server-{i:03d}", max_ranks[i % len(max_ranks)]) for i in range(servers)]
    return PlacementInput(fleet, pool, DEFAULT_GPU)


def drifted(inp: PlacementInput, placement: Placement, rng: random.Random) -> PlacementInput:
    adapters = [replace(a, demand_tps=a.demand_tps * rng.uniform(0.9, 1.1)) for a in inp.adapters]
    return PlacementInput(inp.servers, adapters, inp.operating_points, placement.to_table(1, 0.0, inp.adapters))


def _best_time(policy_name: str, args: argparse.Namespace, inp: PlacementInput) -> tuple[float, Placement]:
    best, placement = math.inf, None
    for _ in range(args.repeat):
        policy = make_policy(policy_name, random.Random(args.seed), hysteresis=args.hysteresis)
        start = time.perf_counter()
        placement = policy.place(inp)
        best = min(best, time.perf_counter() - start)
    assert placement is not None
    return best, placement


def _moved(before: Placement, after: Placement) -> float:
    """Fraction of adapters whose set of servers changed."""
    changed = sum(1 for name, routes in after.weights.items() if set(routes) != set(before.weights.get(name, {})))
    return changed / max(1, len(after.weights))


def _max_load_ratio(inp: PlacementInput, placement: Placement) -> float:
    loads: dict[str, float] = {}
    for a in inp.adapters:
        for server, phi in placement.weights.get(a.name, {}).items():
            loads[server] = loads.get(server, 0.0) + phi * inp.load(a)
    target = sum(loads.values()) / len(inp.servers)
    return max(loads.values()) / target if target > 0 else 0.0


def run(args: argparse.Namespace) -> int:
    max_ranks = tuple(int(r) for r in args.max_ranks.split(","))
    inp = synthetic_input(args.adapters, args.servers, args.utilization, args.cold_fraction, random.Random(args.seed),
                          max_ranks, args.min_replicas)
    print(f"placement of {args.adapters} adapters on {args.servers} servers (max ranks {args.max_ranks}, "
          f"utilization {args.utilization}, cold {args.cold_fraction}, min replicas {args.min_replicas}, "
          f"loraserve hysteresis {args.hysteresis}, {args.rounds} drift rounds, best of {args.repeat})")
    print(f"{'policy':<14} {'first s':>8} {'replace s':>9} {'max load/target':>15} {'after drift':>11} "
          f"{'copies':>7} {'moved':>6} {'overloaded':>10} {'required':>8}")
    for name in args.policies.split(","):
        first_s, first = _best_time(name, args, inp)
        drift = random.Random(args.seed + 1)
        current, placement, times, moved, ratios = inp, first, [], [], []
        for _ in range(args.rounds):
            current = drifted(current, placement, drift)
            seconds, again = _best_time(name, args, current)
            times.append(seconds)
            moved.append(_moved(placement, again))
            ratios.append(_max_load_ratio(current, again))
            placement = again
        copies = sum(len(r) for r in placement.weights.values()) / max(1, len(placement.weights))
        print(f"{name:<14} {first_s:>8.3f} {max(times, default=0):>9.3f} {_max_load_ratio(inp, first):>15.2f} "
              f"{max(ratios, default=0):>11.2f} {copies:>7.2f} {sum(moved) / max(1, len(moved)):>6.1%} "
              f"{len(placement.overloaded):>10} {first.required_servers:>8}")
    return 0
