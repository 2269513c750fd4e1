"""`loraplex bench reliability`: what a failure costs under load, through `loraplex up`.

Each scenario starts a fresh local stack with `loraplex up`'s defaults (redis-server, N agents on the
tiny model with one LoRADeployment per adapter — `--replicas` sets their replicas.min —, heartbeats
every 1 s with a 6 s TTL, the placement controller, the router polling every 0.5 s), puts `--clients` closed-loop clients on it (each sends
its next request when its last one is answered; streamed and not, every adapter and the base model),
and after a warm-up makes one thing go wrong:

    stop       SIGSTOP the busiest agent for --stop-seconds, then SIGCONT
    kill       SIGKILL the busiest agent (it is not restarted)
    redis      SIGKILL redis-server, start an empty one 5 s later (the stack applies its manifests
               again, the agents register again)

Reported per scenario: requests sent and lost (an error status or a transport error before any byte
of the answer), streams cut after their first bytes (committed to a server that died under them);
latency p50 / p99 / max of the requests answered before the event, and of those under way at the
event or sent in the window after it (the event's length plus --after seconds); throughput (answers
per second) in both, and the worst second of the window; apart, the streams already under way at the
event (their first bytes had reached the client: they are committed to their server);
for `stop`, when the agent served again after SIGCONT; the router's retry, abandon and ejection counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
from loraplex_local.stack import (
    DEFAULT_MODEL_DIR,
    LocalStack,
    StackConfig,
    ensure_tiny_model,
    running_stack,
)

from loraplex.ports import free_port_block
from loraplex.spec.crd import API_VERSION
from loraplex.spec.errors import CommandError
from loraplex_bench.closed_loop import ClosedLoop

SCENARIOS = ("stop", "kill", "redis")
REDIS_DOWN_S = 5.0
_RAW: dict[str, list[dict]] = {}
_ROUTER_COUNTERS = ("loraplex_router_retries_total", "loraplex_router_attempts_abandoned_total",
                    "loraplex_router_ejections_total", "loraplex_router_ejection_overflows_total",
                    "loraplex_router_servers_dropped_total")


@dataclass
class Sent:
    at: float       # seconds since the load started
    seconds: float
    ok: bool
    server: str
    error: str = ""
    first: float = 0.0  # seconds to the answer's first bytes (a non-streamed answer comes whole)


class Load(ClosedLoop):
    """Closed-loop clients through the router until stopped; every request is recorded."""

    def __init__(self, url: str, models: list[str], clients: int, max_tokens: int) -> None:
        super().__init__(clients)
        self.url = url
        self.models = models
        self.max_tokens = max_tokens
        self.sent: list[Sent] = []

    def served_by(self, server: str, since: float) -> bool:
        with self.lock:
            return any(s.server == server and s.ok and s.at >= since for s in self.sent)

    def session(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=300)

    def send(self, http: httpx.Client, i: int) -> None:
        body = {"model": self.models[i % len(self.models)], "prompt": "def add(a, b):",
                "max_tokens": self.max_tokens, "stream": i % 2 == 0}
        at = self.now()
        server, error, first = "", "", None
        try:
            with http.stream("POST", "/v1/completions", json=body) as r:
                chunks = []
                for chunk in r.iter_raw():
                    first = self.now() - at if first is None else first
                    chunks.append(chunk)
                content = b"".join(chunks)
                server = r.headers.get("x-loraplex-server", "")
                if r.status_code != 200:
                    error = f"{r.status_code} {content[:120]!r}"
                elif body["stream"] and b"[DONE]" not in content:
                    error = "the stream was cut"
        except httpx.HTTPError as exc:
            error = repr(exc)
        seconds = self.now() - at
        with self.lock:
            self.sent.append(Sent(at, seconds, not error, server, error, seconds if first is None else first))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown or not scenarios:
        raise CommandError(f"--scenarios: unknown {unknown}; choose from {', '.join(SCENARIOS)}")
    if args.clients < 1 or args.agents < 2 or args.stop_seconds <= 0 or args.warmup < 0 or args.after < 0:
        raise CommandError("--clients >= 1, --agents >= 2, --stop-seconds > 0, --warmup and --after >= 0")
    if args.replicas is not None and not 1 <= args.replicas <= args.agents:
        raise CommandError("--replicas must be between 1 and --agents")
    results = {"machine": machine(), "clients": args.clients, "agents": args.agents, "replicas": args.replicas,
               "max_tokens": args.max_tokens, "stop_seconds": args.stop_seconds, "scenarios": {}}
    for scenario in scenarios:
        results["scenarios"][scenario] = _scenario(args, scenario)
        print(json.dumps({scenario: results["scenarios"][scenario]}, indent=2), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if args.raw:
        Path(args.raw).write_text(json.dumps(_RAW, indent=1))
    print(_table(results))
    return 0


def _scenario(args: argparse.Namespace, scenario: str) -> dict:
    if args.workdir:
        workdir = Path(args.workdir) / scenario
        workdir.mkdir(parents=True, exist_ok=True)
        return _in(args, scenario, workdir)
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-reliability-") as workdir:
        return _in(args, scenario, Path(workdir))


def _in(args: argparse.Namespace, scenario: str, workdir: Path) -> dict:
    """The scenario on a stack whose logs and files go to `workdir`."""
    manifests = _manifests(args, workdir) if args.replicas else None
    first = free_port_block(args.agents + 2)  # redis, router, then the agents
    config = StackConfig(agents=args.agents, model=Path(args.model) if args.model else None, manifests=manifests,
                         router_port=first + 1, agent_base_port=first + 2,
                         redis_port=first, workdir=workdir, router_args=["--log-level", "warning"])
    with running_stack(config) as stack:
        return _measure(args, scenario, stack)


def _manifests(args: argparse.Namespace, workdir: Path) -> Path:
    """`loraplex up`'s default deployments (one per adapter of the model folder), with replicas.min set."""
    model = Path(args.model) if args.model else ensure_tiny_model(DEFAULT_MODEL_DIR, workdir / "logs")
    folder = workdir / "manifests"
    folder.mkdir()
    for adapter in sorted(p for p in (model / "adapters").iterdir() if (p / "adapter_config.json").is_file()):
        (folder / f"{adapter.name}.yaml").write_text(
            f"apiVersion: {API_VERSION}\nkind: LoRADeployment\nmetadata: {{name: {adapter.name}}}\n"
            f"spec:\n  pool: local\n  adapter: {{source: \"file://{adapter.resolve()}\"}}\n"
            f"  replicas: {{min: {args.replicas}}}\n")
    return folder


def _measure(args: argparse.Namespace, scenario: str, stack: LocalStack) -> dict:
    table = stack.store.read_table()
    victim = max(table.servers(), key=lambda s: len(table.assignments(s)))
    models = [*sorted(table.entries), stack.store.healthy_servers()[0].base_model]
    window = (args.stop_seconds if scenario == "stop" else 0.0) + args.after
    extra: dict = {}
    _prime(stack.router_url, models)
    with Load(stack.router_url, models, args.clients, args.max_tokens) as load:
        time.sleep(args.warmup)
        event = load.now()
        if scenario == "stop":
            extra = _stop(stack, victim, args.stop_seconds, load)
        elif scenario == "kill":
            stack.agents[victim].kill()
        else:
            stack.redis.kill()
            time.sleep(REDIS_DOWN_S)
            stack.start_redis()
        time.sleep(max(0.0, event + window - load.now()))
        end = load.now()
    _RAW[scenario] = [vars(s) for s in load.sent]
    return {"event_at_s": round(event, 2), "window_s": window, "victim": victim if scenario != "redis" else None,
            **_summary(load.sent, event, end), **extra, "router": _router_counters(stack.router_url)}


def _prime(url: str, models: list[str]) -> None:
    """One request per model and stream mode first: the first answer of an adapter on an agent loads it."""
    with httpx.Client(base_url=url, timeout=300) as http:
        for model in models:
            for stream in (False, True):
                http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1, "stream": stream})


def _stop(stack: LocalStack, victim: str, seconds: float, load: Load) -> dict:
    process = stack.agents[victim].process
    process.send_signal(signal.SIGSTOP)
    time.sleep(seconds)
    process.send_signal(signal.SIGCONT)
    continued = load.now()
    deadline = time.monotonic() + 60
    while not load.served_by(victim, continued) and time.monotonic() < deadline:
        time.sleep(0.1)
    back = next((s.at + s.seconds - continued for s in load.sent if s.server == victim and s.ok and s.at >= continued),
                None)
    return {"back_in_rotation_after_sigcont_s": round(back, 2) if back is not None else None}


def _summary(sent: list[Sent], event: float, end: float) -> dict:
    """`before`: requests answered before the event; `window`: those under way at the event or sent
    before `end` (a request stuck on a stopped agent counts where it suffers), except `committed`: streams
    whose first bytes had reached the client before the event (they are its server's to finish)."""
    before = [s for s in sent if s.at + s.seconds < event]
    committed = [s for s in sent if s.at + s.first < event <= s.at + s.seconds]
    under_way = {id(s) for s in committed}
    during = [s for s in sent if s.at < end and s.at + s.seconds >= event and id(s) not in under_way]
    cut = [s for s in sent if not s.ok and _cut(s.error)]
    lost = [s for s in sent if not s.ok and not _cut(s.error)]
    per_second = Counter(int(s.at + s.seconds) for s in sent if s.ok)
    window_seconds = range(int(event), max(int(event) + 1, int(end)))
    return {"requests": len(sent), "lost": len(lost), "lost_errors": sorted({s.error for s in lost})[:5],
            "cut_streams": len(cut),
            "before": {**_stats(before), "rps": _rate(sent, 0.0, event)},
            "window": {**_stats(during), "rps": _rate(sent, event, end)}, "committed": _stats(committed),
            "worst_second_in_window_rps": min((per_second.get(t, 0) for t in window_seconds), default=0)}


def _cut(error: str) -> bool:
    """A stream that broke after its first bytes reached the client: committed to its server, which
    died under it; no router can send it elsewhere."""
    return "incomplete chunked read" in error or error == "the stream was cut"


def _stats(sent: list[Sent]) -> dict:
    times = sorted(s.seconds for s in sent if s.ok)
    if not times:
        return {"requests": len(sent)}
    return {"requests": len(sent), "p50_s": round(_pct(times, 50), 3), "p99_s": round(_pct(times, 99), 3),
            "max_s": round(times[-1], 3)}


def _rate(sent: list[Sent], start: float, end: float) -> float:
    """Answers per second that arrived between `start` and `end`."""
    answered = sum(1 for s in sent if s.ok and start <= s.at + s.seconds < end)
    return round(answered / (end - start), 1) if end > start else 0.0


def _pct(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _router_counters(url: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _ROUTER_COUNTERS:
            labels = line[len(name):].rsplit(" ", 1)[0]
            totals[name.removeprefix("loraplex_router_") + labels] = float(line.rsplit(" ", 1)[1])
    return totals


def _table(results: dict) -> str:
    rows = ["| scenario | requests | lost | cut streams | p99 before (s) | p99 window (s) | max window (s) | "
            "req/s before | req/s window | worst second (req/s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["scenarios"].items():
        b, w = r["before"], r["window"]
        cells = [name, r["requests"], r["lost"], r["cut_streams"], b.get("p99_s"), w.get("p99_s"), w.get("max_s"),
                 b.get("rps"), w.get("rps"), r["worst_second_in_window_rps"]]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


def machine() -> str:
    """The machine a benchmark ran on, in one line."""
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"{platform.python_implementation()} {platform.python_version()}")
