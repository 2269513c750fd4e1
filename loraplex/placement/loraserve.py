"""LoRAServe's placement (Algorithm 1, paper notes §3.4-3.6): per-rank server budgets from
operating-point-normalised demand, fractional bin packing per rank, leftovers on high-max-rank
servers with a capacity check, a churn-minimising bin -> server permutation, φ = share / load."""

from __future__ import annotations

from loraplex.placement.binpack import Bin, pack_ranks, place_leftovers, rank_budgets
from loraplex.placement.cold import place_cold
from loraplex.placement.permute import map_bins_to_servers
from loraplex.placement.snapshot import EPS, Placement, PlacementInput, split_placeable


class LoRAServePolicy:
    name = "loraserve"

    def place(self, inp: PlacementInput) -> Placement:
        servers = inp.healthy_servers()
        adapters, unplaceable = split_placeable(inp, servers)
        loads = {a.name: inp.load(a) for a in adapters}
        hot = [a for a in adapters if loads[a.name] > EPS]
        rank_util: dict[int, float] = {}
        for a in hot:
            rank_util[a.rank] = rank_util.get(a.rank, 0.0) + loads[a.name]
        total = sum(rank_util.values())
        target = total / len(servers)
        stats = {"total_util": total, "target_util": target}
        bins: list[Bin] = []
        if hot:
            budgets = rank_budgets(rank_util, target, len(servers))
            bins, remainder = pack_ranks(hot, loads, budgets, target)
            bins.extend(Bin() for _ in range(len(servers) - len(bins)))
            leftovers = [a for a in hot if remainder[a.name] > EPS]
            place_leftovers(bins, leftovers, remainder, target)
            stats.update({f"budget_r{r}": float(b) for r, b in budgets.items()})
        else:
            bins = [Bin() for _ in servers]
        weights: dict[str, dict[str, float]] = {}
        for b, server in zip(bins, map_bins_to_servers(bins, servers, loads, inp.previous), strict=True):
            for name, share in b.shares.items():
                weights.setdefault(name, {})[server] = share / loads[name]
        cold = [a for a in adapters if loads[a.name] <= EPS]
        place_cold(inp, cold, servers, weights, {a.name: a.rank for a in adapters})
        return Placement(self.name, weights, inp.required_servers(), unplaceable, stats)
