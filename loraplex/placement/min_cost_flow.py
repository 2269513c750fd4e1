"""NVIDIA Dynamo's LoRA allocator, modelled as a policy of ours (docs/cluster.md, "min-cost-flow"):
adapters with no demand go where rendezvous hashing puts them (or stay where they were); the others
are one min-cost flow (OR-Tools' SimpleMinCostFlow) from adapters to servers whose per-unit costs
weigh rank (distance to the server's preferred rank), new load (above targetUtil, then above
targetUtil · (1 + hysteresis)) and churn (load on a server that did not route the adapter before),
with the rendezvous order breaking ties. Each adapter gets a replica count from its demand (at least
`min_replicas`); an arc cap of load / replicas spreads it over that many servers. Scale-down
hysteresis: the previous share of every route is an arc without churn cost, so when demand falls an
adapter keeps its replicas while their servers stay within targetUtil · (1 + hysteresis)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType

import numpy as np

from loraplex.placement.loraserve import DEFAULT_HYSTERESIS
from loraplex.placement.rendezvous import positions
from loraplex.placement.snapshot import (
    EPS,
    Placement,
    PlacementAdapter,
    PlacementError,
    PlacementInput,
    PlacementServer,
    check_hysteresis,
    demand_of,
    previous_routes,
    server_loads,
)

UNITS_PER_TARGET = 10_000  # flow units in one server's targetUtil
# Per-unit costs, times the server count N so the rendezvous tie-break (a position < N) never
# outweighs them. Churn beats load up to the hysteresis limit (previous routes stay while their
# server is within it); a full rank mismatch (128 vs 8: 4 steps) still costs less than going over target.
RANK_STEP = 2     # per factor of 2 between the adapter's rank and the server's preferred rank
OVER_TARGET = 10  # load between targetUtil and targetUtil · (1 + hysteresis)
CHURN = 16        # load on a server that did not route the adapter in the previous table
RESHARE = 1       # load beyond the previous share on a server that did route it (keeps φ stable)
OVER_LIMIT = 1000  # load above targetUtil · (1 + hysteresis): only when nothing else fits


class MinCostFlowPolicy:
    name = "min-cost-flow"

    def __init__(self, hysteresis: float = DEFAULT_HYSTERESIS) -> None:
        self.hysteresis = check_hysteresis("min-cost-flow", hysteresis)

    def place(self, inp: PlacementInput) -> Placement:
        d = demand_of(inp)
        servers, adapters, loads, hot, total, target = d.servers, d.adapters, d.loads, d.hot, d.total, d.target
        stats = {"total_util": total, "target_util": target}
        weights: dict[str, dict[str, float]] = {}
        overloaded: tuple[str, ...] = ()
        if hot:
            flow = _FlowProblem(inp, hot, servers, loads, target, self.hysteresis)
            weights, overloaded, stats["kept_fraction"] = flow.solve()
        weights.update(_cold_routes(inp, [a for a in adapters if loads[a.name] <= EPS], servers))
        per_server = server_loads(weights, loads)
        stats["max_load_ratio"] = max(per_server.values(), default=0.0) / target if target > 0 else 0.0
        return Placement(self.name, weights, inp.required_servers(), d.unplaceable, stats, overloaded)


class _FlowProblem:
    """Nodes: hot adapters 0..H-1, servers H..H+N-1, the sink H+N. Adapter -> capable server arcs
    (together at most units / replicas per pair): where the previous table routed the adapter, one
    arc for its previous share at no churn cost and one for more at RESHARE; elsewhere one at CHURN.
    Then three arcs per server to the sink: up to targetUtil free, up to the hysteresis limit at
    OVER_TARGET, the rest at OVER_LIMIT."""

    def __init__(self, inp: PlacementInput, hot: Sequence[PlacementAdapter], servers: Sequence[PlacementServer],
                 loads: Mapping[str, float], target: float, hysteresis: float) -> None:
        self.names = [a.name for a in hot]
        self.ids = [s.id for s in servers]
        u = np.array([loads[n] for n in self.names])
        ranks = np.array([a.rank for a in hot])
        self.capable = np.array([s.max_rank for s in servers])[None, :] >= ranks[:, None]
        replicas = _replicas(u / target, np.array([a.min_replicas for a in hot]), self.capable.sum(axis=1))
        units = np.maximum(1, np.rint(u / target * UNITS_PER_TARGET)).astype(np.int64)
        self.arc_cap = -(-units // replicas)
        self.units = self.arc_cap * replicas  # a multiple of replicas: no fewer arcs can carry it
        phi_prev = np.where(self.capable, _previous(inp, self.names, self.ids), 0.0)
        self.kept_cap = np.minimum(np.rint(phi_prev * self.units[:, None]).astype(np.int64), self.arc_cap[:, None])
        self.hysteresis = hysteresis
        n = len(servers)
        rank_gap = np.abs(np.log2(ranks)[:, None] - np.log2(_preferred_ranks(ranks, u, servers))[None, :])
        self.cost = positions(self.names, self.ids) + np.rint(n * RANK_STEP * rank_gap).astype(np.int64)
        self.move_cost = np.where(phi_prev > 0, n * RESHARE, n * CHURN)

    def _adapter_arcs(self) -> tuple[np.ndarray, ...]:
        """(rows, cols, capacities, costs): the kept arcs, then one arc per capable pair."""
        kr, kc = np.nonzero(self.kept_cap > 0)
        rows, cols = np.nonzero(self.capable)
        return (np.concatenate([kr, rows]), np.concatenate([kc, cols]),
                np.concatenate([self.kept_cap[kr, kc], self.arc_cap[rows] - self.kept_cap[rows, cols]]),
                np.concatenate([self.cost[kr, kc], self.cost[rows, cols] + self.move_cost[rows, cols]]))

    def solve(self) -> tuple[dict[str, dict[str, float]], tuple[str, ...], float]:
        min_cost_flow = _solver_module()
        h, n = len(self.names), len(self.ids)
        rows, cols, caps, costs = self._adapter_arcs()
        total = int(self.units.sum())
        tier = [-(-total // n), int(total / n * self.hysteresis), total]
        solver = min_cost_flow.SimpleMinCostFlow()
        arcs = solver.add_arcs_with_capacity_and_unit_cost(
            np.concatenate([rows, np.repeat(h + np.arange(n), 3)]), np.concatenate([h + cols, np.full(3 * n, h + n)]),
            np.concatenate([caps, np.tile(tier, n)]), np.concatenate([costs, np.tile([0, n * OVER_TARGET, n * OVER_LIMIT], n)]))
        solver.set_nodes_supplies(np.arange(h + n + 1), np.concatenate([self.units, np.zeros(n, np.int64), [-total]]))
        if solver.solve() != solver.OPTIMAL:
            raise PlacementError("min-cost-flow: the solver found no optimal flow")
        flows = solver.flows(arcs)
        flow = np.zeros(self.capable.shape, dtype=np.int64)
        np.add.at(flow, (rows, cols), flows[:len(rows)])
        kept = float(np.minimum(flow, self.kept_cap).sum() / total)
        return self._weights(flow), self._overloaded(flows[len(rows):]), kept

    def _weights(self, flow: np.ndarray) -> dict[str, dict[str, float]]:
        weights: dict[str, dict[str, float]] = {}
        for i, j in zip(*(x.tolist() for x in np.nonzero(flow)), strict=True):
            weights.setdefault(self.names[i], {})[self.ids[j]] = int(flow[i, j]) / int(self.units[i])
        return weights

    def _overloaded(self, sink_flows: np.ndarray) -> tuple[str, ...]:
        return tuple(sorted(self.ids[j] for j in np.flatnonzero(sink_flows.reshape(-1, 3)[:, 2] > 0)))


def _solver_module() -> ModuleType:
    try:
        from ortools.graph.python import min_cost_flow
    except ImportError as exc:  # the `sim` and `operator` extras carry it; the core does not
        raise PlacementError("the min-cost-flow placement needs OR-Tools: pip install 'loraplex[operator]' "
                             "(or 'loraplex[sim]', or ortools)") from exc
    return min_cost_flow


def _previous(inp: PlacementInput, names: Sequence[str], ids: Sequence[str]) -> np.ndarray:
    """φ of the previous table, adapters x servers (0 where it had no route)."""
    phi = np.zeros((len(names), len(ids)))
    if inp.previous is not None:
        column = {s: j for j, s in enumerate(ids)}
        for i, name in enumerate(names):
            for route in inp.previous.routes(name):
                if route.server in column:
                    phi[i, column[route.server]] = route.weight
    return phi


def _replicas(load: np.ndarray, minimum: np.ndarray, capable: np.ndarray) -> np.ndarray:
    """Servers per adapter: ceil(load / targetUtil) (load in targets), at least `minimum`, at most
    the capable servers. Scaling down is not decided here: a smaller count only raises the arc cap,
    and the kept arcs hold the adapter on its previous servers while those stay within the limit."""
    need = np.maximum(1, np.ceil(load - 1e-9)).astype(np.int64)
    return np.minimum(np.maximum(need, minimum), capable)


def _preferred_ranks(ranks: np.ndarray, load: np.ndarray, servers: Sequence[PlacementServer]) -> np.ndarray:
    """Each server's preferred rank, LoRAServe's rank budgets as a linear cost: servers in
    (max_rank, id) order take the ranks ascending, each rank as many servers as its share of the
    load; never above what the server can hold."""
    levels = np.unique(ranks)
    share = np.cumsum([load[ranks == r].sum() for r in levels]) / load.sum()
    n = len(servers)
    picked = levels[np.minimum(np.searchsorted(share, (np.arange(n) + 0.5) / n), len(levels) - 1)]
    order = sorted(range(n), key=lambda j: (servers[j].max_rank, servers[j].id))
    preferred = np.empty(n, dtype=np.int64)
    preferred[order] = picked
    return np.minimum(preferred, [s.max_rank for s in servers])


def _cold_routes(inp: PlacementInput, cold: Sequence[PlacementAdapter], servers: Sequence[PlacementServer]
                 ) -> dict[str, dict[str, float]]:
    """No demand: the previous routes when they still give `min_replicas` servers, else the first
    capable servers in rendezvous order (previous ones first), φ even."""
    if not cold:
        return {}
    by_id = {s.id: s for s in servers}
    ids = [s.id for s in servers]
    order = np.argsort(positions([a.name for a in cold], ids), axis=1)
    routes = {}
    for a, row in zip(cold, order, strict=True):
        capable = [ids[j] for j in row if by_id[ids[j]].max_rank >= a.rank]
        kept = previous_routes(inp, a, by_id)
        want = min(a.min_replicas, len(capable))
        if len(kept) >= want:
            routes[a.name] = kept
        else:
            chosen = [*kept, *(s for s in capable if s not in kept)][:want]
            routes[a.name] = dict.fromkeys(chosen, 1.0 / want)
    return routes

