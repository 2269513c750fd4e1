"""What `sim run`, `sim plan` and `workload stats` print for a person: a short table of the answer
(`--json` prints the whole document instead, for machines), and, on stderr, a spinner that names
the stage and the elapsed time while a long job runs. rich is imported only here, when printing."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def emit(doc: dict[str, Any], as_json: bool, show: Callable[[dict[str, Any]], None]) -> None:
    print(json.dumps(doc, indent=2)) if as_json else show(doc)


@contextmanager
def progress(what: str) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr, `what: <stage> (12 s)`; yields a function that names the next stage. What the
    job prints meanwhile passes above the spinner when stdout is the same terminal, else into stdout's
    file (not onto stderr)."""
    from rich.console import Console
    from rich.live import Live
    from rich.spinner import Spinner

    started, stage = time.monotonic(), ["starting"]
    console = Console(stderr=True)
    spinner = Spinner("dots", style="status.spinner")

    def render() -> Spinner:  # at every refresh: the elapsed time counts on between stages
        spinner.update(text=f"{what}: {stage[0]} ({time.monotonic() - started:.0f} s)")
        return spinner

    def say(text: str) -> None:
        stage[0] = text

    with Live(console=console, get_renderable=render, refresh_per_second=12.5, transient=True,
              redirect_stdout=sys.stdout.isatty()):
        yield say
    console.print(f"{what}: done in {time.monotonic() - started:.0f} s", style="dim")


def show_sim(doc: dict[str, Any]) -> None:
    s = doc["summary"]
    rows = [("requests", f"{s['finished']} of {s['requests']} finished" + ("  [red]STARVED[/red]" if s["starved"] else "")),
            ("simulated", f"{s['elapsed_s']:.0f} s in {doc['wall_s']:.1f} s wall ({doc['speedup']:.0f}x real time)"),
            ("throughput", f"{s['throughput_tokens_per_s']:.0f} tok/s of {s['offered_tokens_per_s']:.0f} offered, "
                           f"{s['requests_per_s']:.1f} req/s")]
    if s["slo_attainment"] is not None:
        rows.append(("SLO attainment", f"{s['slo_attainment']:.1%}"))
    if "servers" in doc:
        rows.append(("servers", f"{doc['servers']} ({doc.get('placement')}, {doc.get('placements')} placements, "
                                f"requests per server {doc.get('requests_per_server')})"))
    _print(_pairs("sim run", rows), _percentiles(s, ("ttft_s", "TTFT (s)"), ("tpot_s", "TPOT (s)"), ("e2e_s", "end to end (s)")))


def show_plan(doc: dict[str, Any]) -> None:
    p = doc["planner"]
    rows = [("GPUs", f"[bold]{p['gpus']}[/bold]"),
            ("adapters per GPU", f"{p['adapters_per_gpu']} (A_max {p['a_max']}, largest rank per GPU {p['s_max']})"),
            ("in the twin", ("[red]starves[/red]" if p["starved_in_twin"] else "does not starve")
             + f", SLO attainment {p['slo_attainment']:.1%} at TTFT <= {doc['slo_ttft_s']:g} s"),
            ("planned with", f"oracle {doc['oracle']}, slots {doc['max_loras']}, {p['plan_s']:.0f} s")]
    for policy, baseline in (doc.get("baselines") or {}).items():
        rows.append((f"baseline {policy}", _brief(baseline)))
    footer = "the adapter -> GPU map: --json (or --out FILE)" if "assignment" in doc else ""
    _print(_pairs("sim plan", rows), footer=footer)


def show_session_plan(doc: dict[str, Any]) -> None:
    rows = [(f"routing {name}", f"[bold]{p['servers']}[/bold] servers (A_max {p['slots']}): SLO attainment "
             f"{p['slo_attainment']:.1%}, prefix hits {p['prefix_hit_rate']:.0%}, P99 TTFT {p['ttft_p99_s'] * 1e3:.0f} ms; "
             f"searched from {p['placement_estimate']} (the placement's estimate)")
            for name, p in doc["routings"].items()]
    rows += [("workload", f"{doc['num_sessions']} sessions, {doc['turns']} turns; placement {doc['placement']}, "
                          f">= {doc['replicas']} servers per adapter"),
             ("SLO", f"TTFT <= {doc['slo_ttft_s']:g} s for {doc['slo_target']:.0%} of turns, no server starving"),
             ("slots", f"{doc['max_loras']}")]
    _print(_pairs("sim plan --sessions", rows), footer="every twin run of each search: --json (or --out FILE)")


def show_stats(stats: dict[str, Any]) -> None:
    rows = [("requests", f"{stats['requests']} over {stats['duration_s']:.0f} s ({stats['rps']:.2f} req/s, "
                         f"inter-arrival CV {stats['interarrival_cv']:.2f})"),
            ("adapters", f"{stats['adapters']} (top 5 take {stats['top5_share']:.1%} of requests)"),
            ("ranks", ", ".join(f"r{rank}: {n}" for rank, n in stats["ranks"].items()))]
    _print(_pairs("workload stats", rows), _percentiles(stats, ("prompt_len", "prompt tokens"),
                                                       ("output_len", "output tokens")))


def _pairs(title: str, rows: list[tuple[str, str]]):
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def _percentiles(doc: dict[str, Any], *series: tuple[str, str]):
    from rich.table import Table

    present = [(key, label) for key, label in series if doc.get(key)]
    columns = list(doc[present[0][0]]) if present else []
    table = Table("", *columns)
    for key, label in present:
        table.add_row(label, *(f"{doc[key].get(c, float('nan')):.3g}" for c in columns))
    return table


def _brief(baseline: dict[str, Any]) -> str:
    """`N GPUs, SLO attainment 98.0%` (one figure per seed of a random baseline)."""
    attainment = baseline.get("slo_attainment")
    figures = attainment if isinstance(attainment, list) else [attainment] if attainment is not None else []
    text = f"{baseline.get('gpus', '?')} GPUs"
    return text + (f", SLO attainment {', '.join(f'{a:.1%}' for a in figures)}" if figures else "")


def _print(*parts, footer: str = "") -> None:
    from rich.console import Console

    console = Console()
    for part in parts:
        console.print(part)
    if footer:
        console.print(footer, style="dim")
