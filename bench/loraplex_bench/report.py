"""`loraplex bench report`: a percentile table of one or more results files, and optional plots
(latency CDFs and latency over time, PNG; matplotlib is imported only when plots are asked for).
`plot_series` draws what the sweeping benchmarks (`--plots DIR`) measured: a metric against the
load, rate or size they swept, one figure per metric."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass
class Series:
    """One figure: `y` against the swept `x`, a line per system, policy or routing (`lines[label]` is
    its (x, y) points). `name` is the PNG's file stem and says what it shows."""

    name: str
    title: str
    x_label: str  # with its unit: "load (x FIFO's saturation)", "adapters"
    y_label: str  # with its unit: "P99 TTFT (s)"
    lines: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def slug(field: str) -> str:
    """A result field as part of a PNG's name: ttft_p99_s -> ttft-p99, goodput_tokens_per_s -> goodput-tokens-per-s."""
    return (field if field.endswith("_per_s") else field.removesuffix("_s")).replace("_", "-")


def group_points(rows: Sequence[Any], label: str | Callable[[Any], str], x: str,
                 y: str) -> dict[str, list[tuple[float, float]]]:
    """The lines of a Series from result rows (dataclasses): a line per value of the `label` field (or
    of `label(row)`), of (`x`, `y`) field points; a row whose `y` is None (not measured) is left out."""
    name = label if callable(label) else lambda row: str(getattr(row, label))
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        value = getattr(row, y)
        if value is not None:
            lines.setdefault(name(row), []).append((getattr(row, x), value))
    return lines


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, folder: Path, name: str) -> Path:
    fig.tight_layout()
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_series(series: Sequence[Series], folder: Path) -> list[Path]:
    """A PNG per series that has a point, in `folder`; prints and returns their paths."""
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for one in series:
        if not any(one.lines.values()):
            continue
        fig, axes = plt.subplots(figsize=(6, 4))
        for label, points in one.lines.items():
            points = sorted(points)
            axes.plot([x for x, _ in points], [y for _, y in points], "o-", label=label)
        axes.set(xlabel=one.x_label, ylabel=one.y_label, title=one.title)
        axes.legend(fontsize="small")
        written.append(_save(plt, fig, folder, one.name))
        print(f"wrote {written[-1]}")
    return written


def plot(runs: dict[str, list[RequestResult]], folder: Path) -> list[Path]:
    plt = _pyplot()
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
        written.append(_save(plt, fig, folder, label.lower()))
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
