"""`loraplex bench placement`: time each placement policy on a synthetic pool (default 10,000 adapters
on 256 servers, Zipf demand, five ranks) — a first placement and a re-placement after demand drifts,
which adds the churn-minimising permutation against the previous table."""

from __future__ import annotations

import argparse
import math
import random
import time

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
    parser.add_argument("--seed", type=int, default=0)


def synthetic_input(adapters: int, servers: int, utilization: float, cold_fraction: float,
                    rng: random.Random) -> PlacementInput:
    """Zipf(1) demand over adapters in random order, uniform ranks, scaled so Σ load = utilization · servers."""
    weights = [0.0 if rng.random() < cold_fraction else 1.0 / (i + 1) for i in range(adapters)]
    rng.shuffle(weights)
    ranks = [rng.choice(RANKS) for _ in range(adapters)]
    capacity = sum(w / DEFAULT_GPU.tps(r) for w, r in zip(weights, ranks, strict=True)) or 1.0
    scale = utilization * servers / capacity
    pool = [PlacementAdapter(f"adapter-{i:05d}", f"sha256:{i:064x}", r, w * scale)
            for i, (w, r) in enumerate(zip(weights, ranks, strict=True))]
    return PlacementInput([PlacementServer(f"server-{i:03d}", 128) for i in range(servers)], pool, DEFAULT_GPU)


def drifted(inp: PlacementInput, placement: Placement, rng: random.Random) -> PlacementInput:
    adapters = [PlacementAdapter(a.name, a.digest, a.rank, a.demand_tps * rng.uniform(0.9, 1.1))
                for a in inp.adapters]
    return PlacementInput(inp.servers, adapters, inp.operating_points, placement.to_table(1, 0.0, inp.adapters))


def _best_time(policy_name: str, seed: int, inp: PlacementInput, repeat: int) -> tuple[float, Placement]:
    best, placement = math.inf, None
    for _ in range(repeat):
        policy = make_policy(policy_name, random.Random(seed))
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
    rng = random.Random(args.seed)
    inp = synthetic_input(args.adapters, args.servers, args.utilization, args.cold_fraction, rng)
    print(f"placement of {args.adapters} adapters on {args.servers} servers "
          f"(utilization {args.utilization}, cold {args.cold_fraction}, best of {args.repeat})")
    print(f"{'policy':<14} {'first s':>8} {'replace s':>9} {'max load/target':>15} {'copies':>7} "
          f"{'moved':>6} {'required':>8}")
    for name in args.policies.split(","):
        first_s, first = _best_time(name, args.seed, inp, args.repeat)
        again = drifted(inp, first, random.Random(args.seed + 1))
        next_s, second = _best_time(name, args.seed, again, args.repeat)
        copies = sum(len(r) for r in first.weights.values()) / max(1, len(first.weights))
        print(f"{name:<14} {first_s:>8.3f} {next_s:>9.3f} {_max_load_ratio(inp, first):>15.2f} {copies:>7.2f} "
              f"{_moved(first, second):>6.1%} {first.required_servers:>8}")
    return 0
