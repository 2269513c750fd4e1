"""What the planner is told about a workload: each adapter's rank and request rate, and mean lengths
(the paper's inputs; lengths enter only as averages)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

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
    # Inter-arrival coefficient of variation of the whole workload (1: Poisson). Not one of the
    # paper's inputs; the twin oracle draws each GPU's arrivals as a share of such a process.
    arrival_cv: float = 1.0

    @property
    def total_rate_rps(self) -> float:
        return sum(a.rate_rps for a in self.adapters)

    def __post_init__(self) -> None:
        if not self.adapters:
            raise ValueError("a workload summary needs at least one adapter")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("mean prompt and output lengths must be at least 1")
        if not self.arrival_cv > 0:
            raise ValueError(f"arrival_cv must be positive, got {self.arrival_cv}")

    @classmethod
    def from_trace(cls, trace: Trace) -> WorkloadSummary:
        duration = trace_duration(trace)
        counts = Counter(r.adapter for r in trace.requests if r.adapter is not None)
        ranks = trace.adapters()
        n = len(trace.requests)
        step = max(1, n // LENGTH_SAMPLES)
        rows = tuple((r.prompt_len, r.output_len) for r in trace.requests[::step])
        return cls(tuple(AdapterDemand(a, ranks[a], c / duration) for a, c in sorted(counts.items())),
                   sum(r.prompt_len for r in trace.requests) / n, sum(r.output_len for r in trace.requests) / n, rows,
                   arrival_cv(trace))


def arrival_cv(trace: Trace) -> float:
    """The coefficient of variation of the trace's inter-arrival gaps, rounded to 0.1 so that a
    Poisson trace (measured within sampling noise of 1) is planned as Poisson."""
    gaps = np.diff(np.asarray([r.arrival_s for r in trace.requests]))
    if len(gaps) < 2 or gaps.mean() <= 0:
        return 1.0
    return max(0.1, round(float(gaps.std() / gaps.mean()), 1))
