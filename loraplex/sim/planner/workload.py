"""What the planner is told about a workload: each adapter's rank and request rate, and mean lengths
(the paper's inputs; lengths enter only as averages)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from loraplex.sim.metrics import trace_duration
from loraplex.sim.trace import Trace


@dataclass(frozen=True)
class AdapterDemand:
    name: str
    rank: int
    rate_rps: float


LENGTH_SAMPLES = 2000


@dataclass(frozen=True)
class WorkloadSummary:
    adapters: tuple[AdapterDemand, ...]
    prompt_len: float
    output_len: float
    # (prompt, output) rows to draw request lengths from; empty: every request has the means.
    # The paper's surrogate sees only the means; the twin oracle uses the rows when it has them.
    length_rows: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.adapters:
            raise ValueError("a workload summary needs at least one adapter")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("mean prompt and output lengths must be at least 1")

    @classmethod
    def from_trace(cls, trace: Trace) -> WorkloadSummary:
        duration = trace_duration(trace)
        counts = Counter(r.adapter for r in trace.requests if r.adapter is not None)
        ranks = trace.adapters()
        n = len(trace.requests)
        step = max(1, n // LENGTH_SAMPLES)
        rows = tuple((r.prompt_len, r.output_len) for r in trace.requests[::step])
        return cls(tuple(AdapterDemand(a, ranks[a], c / duration) for a, c in sorted(counts.items())),
                   sum(r.prompt_len for r in trace.requests) / n, sum(r.output_len for r in trace.requests) / n, rows)
