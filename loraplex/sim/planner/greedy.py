"""The paper's caching greedy (Algorithms 1 and 2): first-fit decreasing with testing points.

Adapters are sorted by rank (largest first) and, within a rank, by rate in a zigzag (high, low,
high, ...). One GPU is filled at a time: adapters are added provisionally up to the next testing
point, where the oracle is asked whether the GPU still does not starve and whether the next A_max
gives more throughput; the batch is committed, or rolled back and the GPU closed. Our additions: a
batch that starves the GPU is retried with half as many adapters, down to one; an adapter that does
not fit on its own is passed over (it heads the next GPU) and the adapters behind it are tried, up
to `MAX_SKIPS` of them, before the GPU closes; at the end, the last GPU's adapters are moved to
earlier GPUs that still pass with them, when all of them can be. The paper closes at the first failed point, which
leaves up to half of a GPU's capacity unused when the batch that fails is large, and the zigzag
order puts a cold adapter that would still fit right behind a hot one that does not. An adapter that
starves an empty GPU is split into two halves of its rate that must land on different GPUs (again,
up to `MAX_SPLITS` times): the plan then gives it a share of its requests on each, as the routing
table's φ does; the paper has no replicas and gives up.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from loraplex.latency.profile import Profile
from loraplex.sim.planner.oracle import GpuLoad, Oracle, TwinOracle, fits_memory
from loraplex.sim.planner.workload import AdapterDemand, WorkloadSummary

TESTING_POINTS = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 576)
# adapters that do not fit a GPU on their own, passed over before the GPU closes (each costs a few
# oracle calls; the paper closes at the first)
MAX_SKIPS = 4
# an adapter that starves an empty GPU is split in halves, each half on its own GPU, at most this often
MAX_SPLITS = 6


class PlanError(RuntimeError):
    """No starvation-free plan exists within the limits (e.g. one adapter alone overloads a GPU)."""


@dataclass(frozen=True)
class Plan:
    assignment: dict[str, dict[int, float]]  # adapter -> {GPU index: share of its requests}
    a_max: list[int]  # adapter slots per GPU
    throughput: list[float]  # the oracle's throughput per GPU (tokens/s)

    @property
    def num_gpus(self) -> int:
        return len(self.a_max)

    @property
    def replicated(self) -> list[str]:
        """Adapters split over more than one GPU."""
        return sorted(a for a, gpus in self.assignment.items() if len(gpus) > 1)

    def gpu_adapters(self, gpu: int) -> list[str]:
        return sorted(a for a, gpus in self.assignment.items() if gpu in gpus)


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
    rates = {a.name: a.rate_rps for a in workload.adapters}
    queue = deque(priority_sort(workload.adapters))
    gpus: list[Gpu] = []
    while queue:
        if max_gpus is not None and len(gpus) >= max_gpus:
            raise PlanError(f"{len(queue)} adapters left over after {max_gpus} GPUs")
        gpus.append(_fill_gpu(queue, workload, profile, oracle, max_slots, rates))
    while len(gpus) > 1 and _empty_last(gpus, workload, profile, oracle, max_slots):
        gpus.pop()
    assignment: dict[str, dict[int, float]] = {}
    for index, gpu in enumerate(gpus):
        for part in gpu.adapters:
            assignment.setdefault(part.name, {})[index] = part.rate_rps / rates[part.name]
    return Plan(assignment, [g.slots for g in gpus], [g.throughput for g in gpus])


@dataclass
class Gpu:
    adapters: list[AdapterDemand]
    slots: int
    throughput: float


def _empty_last(gpus: list[Gpu], workload: WorkloadSummary, profile: Profile, oracle: Oracle,
                max_slots: int | None) -> bool:
    """Moves every adapter of the last GPU to an earlier one that still passes with it (first fit,
    hottest first), or moves none: True when the last GPU is left empty. First-fit decreasing
    leaves its last GPU with whatever remained, often a few adapters that earlier GPUs can take."""
    earlier = [Gpu(list(g.adapters), g.slots, g.throughput) for g in gpus[:-1]]
    for adapter in sorted(gpus[-1].adapters, key=lambda a: -a.rate_rps):
        for gpu in earlier:
            if any(a.name == adapter.name for a in gpu.adapters):
                continue  # parts of one adapter stay on different GPUs
            grown = gpu.adapters + [adapter]
            point = next((p for p in TESTING_POINTS if p >= len(grown)), len(grown))
            ok, slots, tps = _test(grown, gpu.slots, point, workload, profile, oracle, max_slots)
            if ok:
                gpu.adapters, gpu.slots, gpu.throughput = grown, slots, tps
                break
        else:
            return False
    gpus[:-1] = earlier
    return True


def _fill_gpu(queue: deque[AdapterDemand], workload: WorkloadSummary, profile: Profile, oracle: Oracle,
              max_slots: int | None, rates: dict[str, float]) -> Gpu:
    committed: list[AdapterDemand] = []
    skipped: list[AdapterDemand] = []
    slots, tps = 0, 0.0
    for point in TESTING_POINTS:
        take = point - len(committed)
        while queue and len(committed) < point and len(skipped) < MAX_SKIPS:
            take = min(take, point - len(committed))
            provisional = _pop_distinct(queue, take, {a.name for a in committed})
            if not provisional:
                break  # only other parts of adapters already on this GPU are left
            ok, new_slots, new_tps = _test(committed + provisional, slots, point, workload, profile, oracle,
                                           max_slots)
            if ok:
                committed += provisional
                slots, tps = new_slots, new_tps
                continue
            queue.extendleft(reversed(provisional))  # back to the front, order kept
            if take > 1:
                take //= 2
            elif committed:
                skipped.append(queue.popleft())  # left for the next GPU; smaller ones behind it may still fit
                take = point - len(committed)
            else:
                _split(queue, rates)
        if not queue or len(skipped) >= MAX_SKIPS:
            break
    queue.extendleft(reversed(skipped))
    return Gpu(committed, slots, tps)


def _pop_distinct(queue: deque[AdapterDemand], count: int, on_gpu: set[str]) -> list[AdapterDemand]:
    """Up to `count` adapters from the front of the queue, passing over parts of an adapter that is
    already on this GPU (its parts must land on different GPUs); those keep their place."""
    taken: list[AdapterDemand] = []
    passed: list[AdapterDemand] = []
    names = set(on_gpu)
    while queue and len(taken) < count:
        adapter = queue.popleft()
        (passed if adapter.name in names else taken).append(adapter)
        names.add(adapter.name)
    queue.extendleft(reversed(passed))
    return taken


def _split(queue: deque[AdapterDemand], rates: dict[str, float]) -> None:
    """The adapter at the front starves an empty GPU: replace it by two halves of its rate."""
    adapter = queue.popleft()
    if adapter.rate_rps < rates[adapter.name] / 2 ** (MAX_SPLITS - 1):
        raise PlanError(f"adapter {adapter.name} (rank {adapter.rank}, {rates[adapter.name]:.3g} req/s) does not fit "
                        f"a GPU even with 1/{2 ** MAX_SPLITS} of its requests (the GPU starves or runs out of memory)")
    half = replace(adapter, rate_rps=adapter.rate_rps / 2)
    queue.extendleft([half, half])


def _test(adapters: list[AdapterDemand], slots: int, point: int, workload: WorkloadSummary, profile: Profile,
          oracle: Oracle, max_slots: int | None) -> tuple[bool, int, float]:
    """Algorithm 2: keep A_max or step it up one position, whichever gives more throughput; then
    ask whether the GPU starves."""
    candidates = [p for p in _next_slots(slots, point, max_slots)
                  if fits_memory(profile, p, max(a.rank for a in adapters))]
    if not candidates:
        return False, slots, 0.0
    loads = [GpuLoad.of(workload, tuple(adapters), p) for p in candidates]
    scored = [(oracle.throughput(g), g) for g in loads]
    tps, best = max(scored, key=lambda s: (s[0], -s[1].a_max))
    if oracle.starves(best):
        return False, slots, 0.0
    return True, best.a_max, tps


def _next_slots(slots: int, point: int, max_slots: int | None) -> list[int]:
    bigger = [p for p in TESTING_POINTS if p > slots]
    step = [min(bigger[0], point, max_slots or point)] if bigger else []
    return ([slots] if slots else []) + [p for p in step if p != slots]

