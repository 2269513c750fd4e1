"""The paper's caching greedy (Algorithms 1 and 2): first-fit decreasing with testing points.

Adapters are sorted by rank (largest first) and, within a rank, by rate in a zigzag (high, low,
high, ...). One GPU is filled at a time: adapters are added provisionally up to the next testing
point, where the oracle is asked whether the GPU still does not starve and whether the next A_max
gives more throughput; the batch is committed, or rolled back and the GPU closed. Our additions: a
batch that starves the GPU is retried with half as many adapters, down to one; an adapter that does
not fit on its own is passed over (it heads the next GPU) and the adapters behind it are tried, up
to `MAX_SKIPS` of them, before the GPU closes. The paper closes at the first failed point, which
leaves up to half of a GPU's capacity unused when the batch that fails is large, and the zigzag
order puts a cold adapter that would still fit right behind a hot one that does not.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from loraplex.sim.planner.oracle import GpuLoad, Oracle, TwinOracle, fits_memory
from loraplex.sim.planner.workload import AdapterDemand, WorkloadSummary
from loraplex.sim.profile import Profile

TESTING_POINTS = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 576)
# adapters that do not fit a GPU on their own, passed over before the GPU closes (each costs a few
# oracle calls; the paper closes at the first)
MAX_SKIPS = 4


class PlanError(RuntimeError):
    """No starvation-free plan exists within the limits (e.g. one adapter alone overloads a GPU)."""


@dataclass(frozen=True)
class Plan:
    assignment: dict[str, int]  # adapter -> GPU index
    a_max: list[int]  # adapter slots per GPU
    throughput: list[float]  # the oracle's throughput per GPU (tokens/s)

    @property
    def num_gpus(self) -> int:
        return len(self.a_max)

    def gpu_adapters(self, gpu: int) -> list[str]:
        return sorted(a for a, g in self.assignment.items() if g == gpu)


def priority_sort(adapters: tuple[AdapterDemand, ...]) -> list[AdapterDemand]:
    out: list[AdapterDemand] = []
    for rank in sorted({a.rank for a in adapters}, reverse=True):
        group = deque(sorted((a for a in adapters if a.rank == rank), key=lambda a: (a.rate_rps, a.name)))
        high = True
        while group:
            out.append(group.pop() if high else group.popleft())
            high = not high
    return out


def plan(workload: WorkloadSummary, profile: Profile, oracle: Oracle | None = None,
         max_gpus: int | None = None, max_slots: int | None = None) -> Plan:
    """The fewest GPUs (and each GPU's A_max) on which no GPU starves, by the oracle's answers.
    `max_slots` caps A_max (the adapter slots a GPU's memory holds) on top of the profile's memory model."""
    if max_slots is not None and max_slots < 1:
        raise ValueError(f"max_slots must be at least 1, got {max_slots}")
    oracle = oracle or TwinOracle(profile)
    queue = deque(priority_sort(workload.adapters))
    assignment: dict[str, int] = {}
    a_max: list[int] = []
    throughput: list[float] = []
    while queue:
        if max_gpus is not None and len(a_max) >= max_gpus:
            raise PlanError(f"{len(queue)} adapters left over after {max_gpus} GPUs")
        committed, slots, tps = _fill_gpu(queue, workload, profile, oracle, max_slots)
        for adapter in committed:
            assignment[adapter.name] = len(a_max)
        a_max.append(slots)
        throughput.append(tps)
    return Plan(assignment, a_max, throughput)


def _fill_gpu(queue: deque[AdapterDemand], workload: WorkloadSummary, profile: Profile, oracle: Oracle,
              max_slots: int | None) -> tuple[list[AdapterDemand], int, float]:
    committed: list[AdapterDemand] = []
    skipped: list[AdapterDemand] = []
    slots, tps = 0, 0.0
    for point in TESTING_POINTS:
        take = point - len(committed)
        while queue and len(committed) < point and len(skipped) < MAX_SKIPS:
            take = min(take, point - len(committed))
            provisional = [queue.popleft() for _ in range(min(take, len(queue)))]
            ok, new_slots, new_tps = _test(committed + provisional, slots, point, workload, profile, oracle,
                                           max_slots)
            if ok:
                committed += provisional
                slots, tps = new_slots, new_tps
                continue
            queue.extendleft(reversed(provisional))  # back to the front, order kept
            if take > 1:
                take //= 2
                continue
            if not committed:
                raise PlanError(f"adapter {queue[0].name} (rank {queue[0].rank}, {queue[0].rate_rps:.3g} req/s) "
                                "starves a GPU on its own; it would need replicas, which this planner does not make")
            skipped.append(queue.popleft())  # left for the next GPU; smaller ones behind it may still fit
            take = point - len(committed)
        if not queue or len(skipped) >= MAX_SKIPS:
            break
    queue.extendleft(reversed(skipped))
    return committed, slots, tps


def _test(adapters: list[AdapterDemand], slots: int, point: int, workload: WorkloadSummary, profile: Profile,
          oracle: Oracle, max_slots: int | None) -> tuple[bool, int, float]:
    """Algorithm 2: keep A_max or step it up one position, whichever gives more throughput; then
    ask whether the GPU starves."""
    candidates = [p for p in _next_slots(slots, point, max_slots)
                  if fits_memory(profile, p, max(a.rank for a in adapters))]
    if not candidates:
        return False, slots, 0.0
    loads = [GpuLoad(tuple(adapters), p, workload.prompt_len, workload.output_len, workload.length_rows)
             for p in candidates]
    scored = [(oracle.throughput(g), g) for g in loads]
    tps, best = max(scored, key=lambda s: (s[0], -s[1].a_max))
    if oracle.starves(best):
        return False, slots, 0.0
    return True, best.a_max, tps


def _next_slots(slots: int, point: int, max_slots: int | None) -> list[int]:
    bigger = [p for p in TESTING_POINTS if p > slots]
    step = [min(bigger[0], point, max_slots or point)] if bigger else []
    return ([slots] if slots else []) + [p for p in step if p != slots]

