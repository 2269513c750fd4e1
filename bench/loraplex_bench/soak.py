"""`loraplex bench soak`: whether the stack's processes hold their memory under steady traffic.

Starts `loraplex up`'s stack (redis-server, --agents agents on the tiny model with one LoRADeployment per
adapter, the placement controller, the router) and drives it for --minutes with --clients clients of the
openai client at --rate requests/s in all (soak_traffic.py: completions and chats, streamed and not, over
every adapter and the base model; every --bad-every-th request is bad on purpose: an unknown adapter, a
prompt longer than the context, malformed JSON). Meanwhile it reads VmRSS of the router, every agent and
redis-server from /proc/PID/status every --sample-s seconds.

Growth is measured from the first sample at the end of the warm-up (--warmup-minutes: caches, the
allocator's pools and the adapters' copies fill first) to the mean of the last few samples, so that no
single sample decides it.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import mean

from loraplex_local.stack import LocalStack, StackConfig, running_stack

from loraplex.ports import free_port_block
from loraplex.spec.errors import CommandError
from loraplex_bench.output import stage
from loraplex_bench.reliability import machine
from loraplex_bench.report import Series, plot_series
from loraplex_bench.rss import RssSampler

END_SAMPLES = 5  # the end's RSS: the mean of this many last samples
PROGRESS_S = 60.0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_args(args)
    with _workdir(args.workdir) as workdir:
        try:
            report = _soak(args, workdir)
        except RuntimeError as exc:  # a process of the stack did not start; the message holds its log
            raise CommandError(str(exc)) from exc
    print(_report_text(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plots:
        plot_series([rss_series(report["samples_kib"])], Path(args.plots))
    return 0


def rss_series(samples: list[dict]) -> Series:
    """RSS against the time since traffic began, a line per process (a sample it missed is left out)."""
    names = [name for name in (samples[0] if samples else {}) if name != "t"]
    return Series("soak-rss-vs-time", "resident memory under traffic", "time (s)", "RSS (MiB)",
                  {name: [(s["t"], s[name] / 1024) for s in samples if s.get(name) is not None] for name in names})


def _check_args(args: argparse.Namespace) -> None:
    if args.clients < 1 or args.agents < 1 or args.sample_s <= 0 or args.rate < 0 or args.max_tokens < 1:
        raise CommandError("--clients, --agents and --max-tokens >= 1, --sample-s > 0, --rate >= 0")
    if args.bad_every == 1 or args.bad_every < 0:
        raise CommandError("--bad-every: 0 (no bad requests) or at least 2")
    if args.warmup_minutes < 0 or (args.minutes - args.warmup_minutes) * 60 < 2 * args.sample_s:
        raise CommandError("--minutes must leave at least two --sample-s intervals after --warmup-minutes")


@contextmanager
def _workdir(kept: str | None) -> Iterator[Path]:
    if kept:
        Path(kept).mkdir(parents=True, exist_ok=True)
        yield Path(kept)
        return
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-soak-") as workdir:
        yield Path(workdir)


def _soak(args: argparse.Namespace, workdir: Path) -> dict:
    traffic_class = _traffic_class()
    first = free_port_block(args.agents + 2)  # redis, router, then the agents
    config = StackConfig(agents=args.agents, model=Path(args.model) if args.model else None,
                         router_port=first + 1, agent_base_port=first + 2,
                         redis_port=first, workdir=workdir, router_args=["--log-level", "warning"])
    with running_stack(config) as stack:
        models = [*sorted(stack.store.read_table().entries), stack.store.healthy_servers()[0].base_model]
        traffic = traffic_class(stack.router_url, models, args.clients, args.rate or None, args.max_tokens,
                                args.bad_every)
        with RssSampler(_pids(stack), args.sample_s) as rss, traffic:
            _keep_running(args.minutes * 60, stack, traffic, rss)
        seconds = traffic.now()
    return {"machine": machine(), "settings": {**_settings(args), "models": models},
            "growth_basis": _growth_basis(args), "processes": _processes(rss, args.warmup_minutes * 60),
            "requests": {**traffic.summary(), "seconds": round(seconds, 1)}, "samples_kib": rss.samples}


def _traffic_class() -> type:
    # Imported here: the openai client is a development dependency, not the router's.
    try:
        from loraplex_bench.soak_traffic import Traffic
    except ImportError as exc:
        raise CommandError(f"loraplex bench soak drives the router with the openai client: {exc}") from exc
    return Traffic


def _pids(stack: LocalStack) -> dict[str, int]:
    children = [stack.router, *stack.agents.values(), stack.redis]
    return {child.name: child.process.pid for child in children}


def _keep_running(seconds: float, stack: LocalStack, traffic, rss: RssSampler) -> None:
    """Until `seconds` have passed, with a line of progress every PROGRESS_S."""
    while (left := seconds - rss.now()) > 0:
        time.sleep(min(PROGRESS_S, left))
        stack.check_children()  # logs a process that exited (it is not restarted)
        stage(_progress(rss.now(), traffic.summary(), rss.latest()))


def _progress(t: float, requests: dict, latest: dict) -> str:
    rss = ", ".join(f"{name} {_mib(kib)}" for name, kib in latest.items() if name != "t")
    return (f"[{t / 60:5.1f} min] {requests['sent']} sent, {requests['ok']} answered, "
            f"{requests['expected_4xx']} refused as expected, {requests['unexpected']} unexpected; RSS MiB: {rss}")


def _settings(args: argparse.Namespace) -> dict:
    names = ("minutes", "warmup_minutes", "sample_s", "clients", "rate", "agents", "max_tokens", "bad_every")
    return {name: getattr(args, name) for name in names}


def _growth_basis(args: argparse.Namespace) -> str:
    return (f"growth: from the first sample at or after the warm-up's end ({args.warmup_minutes:g} min) to the "
            f"mean of the last {END_SAMPLES} samples; max: over the whole run")


def _processes(rss: RssSampler, warmup_s: float) -> dict[str, dict]:
    after = [s for s in rss.samples if s["t"] >= warmup_s]
    return {name: _growth(pid, [s[name] for s in rss.samples], [s[name] for s in after])
            for name, pid in rss.pids.items()}


def _growth(pid: int, everything: list[int | None], after: list[int | None]) -> dict:
    seen = [kib for kib in everything if kib is not None]
    warm, end = after[0], [kib for kib in after[-END_SAMPLES:] if kib is not None]
    result = {"pid": pid, "exited": None in everything, "max_kib": max(seen, default=None),
              "warmup_end_kib": warm, "end_kib": round(mean(end)) if end else None, "growth_pct": None}
    if warm and end:
        result["growth_pct"] = round(100 * (mean(end) - warm) / warm, 2)
    return result


def _report_text(report: dict) -> str:
    """The report as a heading, a table of the processes and the requests' counts."""
    s, r = report["settings"], report["requests"]
    rate = f"{s['rate']:g} req/s" if s["rate"] else "as fast as answered"
    lines = [f"loraplex bench soak: {s['agents']} agents + router + redis-server, {s['clients']} clients at {rate} "
             f"({r['sent'] / max(r['seconds'], 1e-9):.1f} req/s achieved) for {s['minutes']:g} min, warm-up "
             f"{s['warmup_minutes']:g} min, RSS every {s['sample_s']:g} s; {report['machine']}",
             report["growth_basis"], "",
             "| process | pid | RSS at warm-up end (MiB) | RSS at end (MiB) | growth | max (MiB) |",
             "|---|---|---|---|---|---|"]
    for name, p in report["processes"].items():
        growth = "n/a" if p["growth_pct"] is None else f"{p['growth_pct']:+.2f}%"
        cells = [name + (" (EXITED)" if p["exited"] else ""), p["pid"], _mib(p["warmup_end_kib"]),
                 _mib(p["end_kib"]), growth, _mib(p["max_kib"])]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    refused = ", ".join(f"{k}: {n}" for k, n in sorted(r["expected_4xx_by_kind"].items()))
    lines += ["", f"requests: {r['sent']} sent, {r['ok']} answered, {r['expected_4xx']} refused as expected "
              f"({refused or 'none'}), {r['unexpected']} unexpected (5xx, transport errors, wrong answers)"]
    lines += [f"  unexpected {n}x {error}" for error, n in r["unexpected_by_error"].items()]
    return "\n".join(lines)


def _mib(kib: float | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f}"
