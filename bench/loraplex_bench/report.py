"""`loraplex bench report`: a percentile table of one or more results files, and optional plots
(latency CDFs and latency over time, PNG; matplotlib is imported only when plots are asked for)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from loraplex.sim.metrics import RequestResult, Slo, summarize
from loraplex.sim.results import read_results
from loraplex.spec.errors import CommandError

METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TBT"), ("e2e_s", "E2E"))


def table(runs: dict[str, list[RequestResult]], slo: Slo | None) -> str:
    head = f"{'run':<28} {'reqs':>6} {'done':>6} {'tok/s':>9}"
    head += "".join(f" {label + ' ' + p:>11}" for _, label in METRICS for p in ("p50", "p90", "p99"))
    head += f" {'SLO':>6}" if slo else ""
    lines = [head, "-" * len(head)]
    for name, results in runs.items():
        duration = max((r.arrival_s for r in results), default=0.0) or 1.0
        elapsed = max((r.arrival_s + (r.e2e_s or 0.0) for r in results), default=0.0)
        s = summarize(results, duration, elapsed, slo)
        row = f"{name[-28:]:<28} {s.requests:>6} {s.finished:>6} {s.throughput_tokens_per_s:>9.1f}"
        for key, _ in METRICS:
            stats = getattr(s, key)
            row += "".join(f" {stats.get(p, float('nan')) * 1000:>9.1f}ms" for p in ("p50", "p90", "p99"))
        if slo:
            row += f" {s.slo_attainment:>6.1%}"
        lines.append(row)
    return "\n".join(lines)


def plot(runs: dict[str, list[RequestResult]], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label in METRICS:
        fig, (cdf, over_time) = plt.subplots(1, 2, figsize=(11, 4))
        for name, results in runs.items():
            points = sorted((r.arrival_s, getattr(r, key)) for r in results if getattr(r, key) is not None)
            if not points:
                continue
            values = np.sort([v for _, v in points])
            cdf.plot(values, np.arange(1, len(values) + 1) / len(values), label=name)
            over_time.plot([t for t, _ in points], [v for _, v in points], ".", markersize=2, label=name)
        cdf.set(xlabel=f"{label} (s)", ylabel="fraction of requests", title=f"{label} CDF")
        over_time.set(xlabel="arrival (s)", ylabel=f"{label} (s)", title=f"{label} over time")
        cdf.legend(fontsize="small")
        fig.tight_layout()
        path = folder / f"{label.lower()}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def run(args: argparse.Namespace) -> int:
    runs = {}
    for path in args.results:
        try:
            _, results = read_results(path)
        except (OSError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        runs[Path(path).stem] = results
    slo = Slo(args.slo_ttft) if args.slo_ttft else None
    print(table(runs, slo))
    if args.plots:
        for path in plot(runs, Path(args.plots)):
            print(f"wrote {path}")
    return 0
