"""What a trace contains: rate, burstiness, lengths and adapter skew (`loraplex workload stats`)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from loraplex.sim.trace import Trace


def trace_stats(trace: Trace) -> dict:
    if not trace.requests:
        return {"requests": 0}
    arrivals = np.asarray([r.arrival_s for r in trace.requests])
    gaps = np.diff(arrivals)
    counts = Counter(r.adapter for r in trace.requests)
    top5 = sum(n for _, n in counts.most_common(5)) / len(trace.requests)

    def quantiles(values: list[int]) -> dict:
        return {f"p{q}": float(np.percentile(values, q)) for q in (10, 50, 90, 99)} | {"mean": float(np.mean(values))}

    return {
        "requests": len(trace.requests),
        "duration_s": float(arrivals[-1]),
        "rps": len(arrivals) / max(float(arrivals[-1]), 1e-9),
        "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else None,
        "prompt_len": quantiles([r.prompt_len for r in trace.requests]),
        "output_len": quantiles([r.output_len for r in trace.requests]),
        "adapters": len(counts),
        "top5_share": top5,
        "ranks": dict(sorted(Counter(r.rank for r in trace.requests).items())),
    }
