"""`loraplex bench picker`: the router as a GIE endpoint picker, driven as a gateway drives it.

Setup: a redis-server, four echo servers and routers (`loraplex router --extproc-port`), each in a
process of its own, the router under test pinned to one CPU; the gateway's side is
`loraplex_bench.gateway_client` (Envoy's ext_proc filter in FULL_DUPLEX_STREAMED mode: body in
chunks, forwarding to the chosen endpoint). Three parts, each optional:

1. Latency: sequential requests in rounds of three, direct to an echo server / through the HTTP
   router / through the picker (then forwarded to the chosen echo server). The picker's decision as
   the gateway sees it is the time from writing the request body's last chunk to reading the header
   reply (gRPC both ways included); its own share, from its histogram, the time to decide once the
   last chunk is read. Beside them, the HTTP router's added latency (routed - direct), as `loraplex
   bench router` measures it.
2. Shares: `--decisions` requests of a replayed Azure 2023 trace (its order and prompt lengths; the
   adapter is the prompt length mod 5), per routing profile, every one through the HTTP router and
   through the picker, the two paths interleaved in one run of one router process, `--concurrency`
   requests on each at a time: both paths read and feed the same in-flight counts, and the gateway
   forwards what the picker routes, so a request counts on its server until its answer is through on
   either path. Per adapter, each server's share of the requests on each path (the server that
   answered) and the table's φ. Then `--identical` requests one at a time through both, seeded alike
   with one server per request (no fallbacks drawn): the picks must agree request by request.
3. Leak: `--leak-requests` requests at `--concurrency`, every tenth cancelled (alternately before the
   body ends and after the routing reply); afterwards the picker's open streams, running requests and
   in-flight counts must be zero, and its RSS is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
from loraplex_local.processes import LORAPLEX, Child, wait_http

from loraplex.ports import free_port_block
from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.redis_store import RedisRoutingStore
from loraplex.routing.table import RoutingTable, make_entry
from loraplex.sim.azure import load_azure
from loraplex.spec.errors import CommandError
from loraplex_bench.gateway_client import Gateway
from loraplex_bench.router import pct, router_cpu, start_echo, start_redis

POOL = "bench-picker"
DIGEST = "sha256:" + "0" * 64
SERVERS = ("s0", "s1", "s2", "s3")
PHI = {"a0": {"s0": 0.5, "s1": 0.5}, "a1": {"s0": 0.2, "s1": 0.3, "s2": 0.5}, "a2": {"s1": 0.7, "s3": 0.3},
       "a3": {"s2": 0.4, "s3": 0.6}, "a4": {"s0": 0.25, "s1": 0.25, "s2": 0.25, "s3": 0.25}}
SEED = 7


class Bench:
    def __init__(self, workdir: Path) -> None:
        self.workdir, self.children = workdir, []
        first = free_port_block(2 + len(SERVERS))
        self.redis_url = start_redis(workdir, first, self.children)
        self.urls = {sid: start_echo(sid, workdir, first + 1 + i, self.children) for i, sid in enumerate(SERVERS)}
        self.by_endpoint = {url.removeprefix("http://"): sid for sid, url in self.urls.items()}
        store = RedisRoutingStore.from_url(self.redis_url, POOL)
        for sid, url in self.urls.items():
            store.register_server(ServerRecord(sid, url, max_rank=64, base_model="echo-base"), ttl_s=3600)
        for name in PHI:
            store.put_adapter(AdapterRecord(name, DIGEST, 8, 0, f"file:///{name}"))
        entries = {name: make_entry(name, DIGEST, 8, phis.items()) for name, phis in PHI.items()}
        store.publish_table(RoutingTable(1, time.time(), entries))
        store.close()

    def router(self, name: str, *args: str) -> tuple[Child, str, str]:
        """A router (pinned to one CPU when the machine has several) with the picker on; (child, HTTP URL,
        picker target)."""
        http = free_port_block(2)
        grpc_port = http + 1
        argv = [*LORAPLEX, "router", "--redis-url", self.redis_url, "--pool", POOL, "--port", str(http),
                "--extproc-port", str(grpc_port), "--log-level", "warning", *args]
        cpu = router_cpu()
        if cpu is not None:
            argv = ["taskset", "-c", str(cpu), *argv]
        child = Child(name, argv, self.workdir).start()
        self.children.append(child)
        url = f"http://127.0.0.1:{http}"
        wait_http(url + "/ready", child, 60)
        time.sleep(1.5)  # the picker resolves the servers' addresses and turns ready
        return child, url, f"127.0.0.1:{grpc_port}"

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


def run(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-picker-"))
    bench = None
    try:
        bench = Bench(workdir)
        result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
                             f"{platform.python_version()}", "router_cpu": router_cpu()}
        if args.latency_requests:
            result["latency"] = asyncio.run(_latency(bench, args.latency_requests))
        if args.decisions:
            requests = _replay(args.trace, args.decisions)
            result["shares"] = {p: asyncio.run(_shares(bench, p, requests, args.concurrency, args.identical,
                                                         args.control))
                                for p in args.profiles.split(",")}
        if args.leak_requests:
            result["leak"] = asyncio.run(_leak(bench, args.leak_requests, args.concurrency))
    finally:
        if bench is not None:
            bench.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if result.get("leak", {}).get("left"):
        raise CommandError(f"the picker left requests open: {json.dumps(result['leak'])}")
    return 0


def _replay(trace: str, n: int) -> list[bytes]:
    """Request bodies from the trace's first `n` requests: the adapter is the prompt length mod 5, the
    prompt that many words (at most 64: the picker's cost does not grow with it, the echo servers' does)."""
    azure = load_azure(trace)
    if len(azure) < n:
        raise CommandError(f"the {trace} trace has {len(azure)} requests, fewer than --decisions {n}")
    bodies = []
    for i in range(n):
        length = int(azure.prompt_len[i])
        prompt = f"request {i}: " + " ".join(f"w{j}" for j in range(min(length, 64)))
        bodies.append(json.dumps({"model": f"a{length % len(PHI)}", "prompt": prompt, "max_tokens": 1}).encode())
    return bodies


async def _direct(client: httpx.AsyncClient, url: str, body: bytes) -> tuple[float, str]:
    start = time.perf_counter()
    response = await client.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    if response.status_code != 200:
        raise CommandError(f"{url} answered {response.status_code}: {response.text[:200]}")
    return time.perf_counter() - start, response.headers.get("x-loraplex-server", "")


async def _latency(bench: Bench, n: int) -> dict:
    child, url, target = bench.router("router-latency")
    body = json.dumps({"model": "a1", "prompt": "def add(a, b):", "max_tokens": 8}).encode()
    direct, routed, decisions = [], [], []
    gateway = Gateway(target)
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(n + 50):  # 50 rounds of warm-up
            d, _ = await _direct(client, bench.urls["s0"], body)
            r, _ = await _direct(client, url, body)
            ex = await gateway.send(body, pieces=8)
            if ex.status != 200:
                raise CommandError(f"the picker's request failed: {ex}")
            if i >= 50:
                direct.append(d)
                routed.append(r)
                decisions.append(ex.decision_s)
    await gateway.close()
    inside = _decision_buckets(httpx.get(url + "/metrics").text)
    child.stop()
    ms = 1000.0
    return {"rounds": n, "body_chunks": 8, "picker_decide_within_s": inside,
            "picker_decision_p50_ms": pct(decisions, 50) * ms, "picker_decision_p99_ms": pct(decisions, 99) * ms,
            "direct_p50_ms": pct(direct, 50) * ms, "routed_p50_ms": pct(routed, 50) * ms,
            "router_added_p50_ms": (pct(routed, 50) - pct(direct, 50)) * ms,
            "router_added_p99_ms": (pct(routed, 99) - pct(direct, 99)) * ms,
            "router_added_median_of_pairs_ms": statistics.median(b - a for a, b in zip(direct, routed, strict=True)) * ms}


async def _shares(bench: Bench, profile: str, requests: list[bytes], concurrency: int, identical: int,
                  control: bool) -> dict:
    """Per adapter and server: the picker's share, the HTTP router's, φ; the largest differences (and,
    with `control`, those between two HTTP paths of the same run: the noise of a load-dependent pick).
    Then `identical` requests one at a time through both, seeded alike: how many picks agree."""
    flags = ("--profile", profile, "--seed", str(SEED))
    paths = ("router", "picker", "router_again") if control else ("router", "picker")
    served, seconds, moved = await _at_once(bench, profile, flags, requests, concurrency, paths)
    shares = {path: _by_adapter(requests, served[path]) for path in paths}
    result = _compare(shares["picker"], shares["router"], len(requests), len(paths) * len(requests) / seconds,
                      concurrency)
    result["moved_off_first_pick"] = moved
    if control:
        again = _compare(shares["router_again"], shares["router"], len(requests), 0.0, concurrency)
        result["control_router_vs_router_max"] = again["picker_vs_router_max"]
        for adapter, row in again["per_adapter"].items():
            result["per_adapter"][adapter]["control_router_vs_router"] = row["picker_vs_router"]
    if identical:  # one server per request: no fallback drawn from the random source, no retry
        router, picker = await _one_at_a_time(bench, profile, (*flags, "--max-attempts", "1"), requests[:identical])
        result["sequential_identical_picks"] = f"{sum(a == b for a, b in zip(router, picker, strict=True))}" \
                                               f"/{identical}"
    return result


async def _at_once(bench: Bench, profile: str, flags: tuple[str, ...], requests: list[bytes], concurrency: int,
                   paths: tuple[str, ...]) -> tuple[dict[str, list[str]], float, dict[str, float]]:
    """Every request through each path ("router": the HTTP router, "picker": the gateway with the
    picker; a path named again is another client of the same kind) in one run of one router process,
    the paths interleaved, `concurrency` requests on each at a time: all read and feed the same
    in-flight counts, and the gateway forwards each picked request to its server, so a request counts
    on its server until its answer has passed back (through the picker, as a gateway streams it). Path
    k takes the replay k/len(paths) of the trace later (request i beside request i + k·n/len(paths)),
    so a request's trips never read each other's count, and each path's prompts begin with its name,
    so no trip finds another's prefix cached (a prefix-aware pick would follow it). The servers that
    answered on each path, in the requests' order, and the seconds taken."""
    child, url, target = bench.router(f"router-{profile}", *flags)
    n = len(requests)
    trips = [(k, (i + k * n // len(paths)) % n) for i in range(n) for k in range(len(paths))]
    bodies = [[_tagged(body, path) for body in requests] for path in paths]
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client, \
            httpx.AsyncClient(timeout=60, limits=limits) as again, \
            httpx.AsyncClient(timeout=60, limits=limits) as upstream:
        gateway = Gateway(target, upstream)
        clients = {"router": client, "router_again": again}

        async def trip(path_and_request: tuple[int, int]) -> str:
            k, i = path_and_request
            if paths[k] == "picker":
                return await _picked(bench, gateway, bodies[k][i])
            return (await _direct(clients[paths[k]], url, bodies[k][i]))[1]

        served, seconds = await _each(trip, trips, len(paths) * concurrency)
        await gateway.close()
    metrics = httpx.get(url + "/metrics").text
    child.stop()
    by_path = {path: [""] * n for path in paths}
    for (k, i), server in zip(trips, served, strict=True):
        by_path[paths[k]][i] = server
    # what moved requests off their first pick, on either path: a share is the answering server's
    return by_path, seconds, {"retries": _sum(metrics, "loraplex_router_retries_total"),
                              "ejections": _sum(metrics, "loraplex_router_ejections_total")}


def _tagged(body: bytes, tag: str) -> bytes:
    doc = json.loads(body)
    return json.dumps({**doc, "prompt": f"{tag} {doc['prompt']}"}).encode()


async def _one_at_a_time(bench: Bench, profile: str, flags: tuple[str, ...],
                         requests: list[bytes]) -> tuple[list[str], list[str]]:
    """The server each request went to, one request at a time, through an HTTP router and then through
    a picker, each a fresh router process seeded alike."""
    child, url, _ = bench.router(f"router-{profile}-sequential", *flags)
    async with httpx.AsyncClient(timeout=60) as client:
        router = [(await _direct(client, url, body))[1] for body in requests]
    child.stop()
    child, _, target = bench.router(f"picker-{profile}-sequential", *flags)
    gateway = Gateway(target)
    picker = [await _picked(bench, gateway, body) for body in requests]
    await gateway.close()
    child.stop()
    return router, picker


async def _picked(bench: Bench, gateway: Gateway, body: bytes) -> str:
    """The server that answered a request the gateway routed with the picker."""
    ex = await gateway.send(body, pieces=4)
    if ex.immediate or ex.status != 200:
        raise CommandError(f"the picker's request failed: {ex.status} {ex.body[:200]!r}")
    return bench.by_endpoint[ex.served]


async def _each(call, items: list, concurrency: int) -> tuple[list, float]:
    """`call` on every item, `concurrency` at a time, results in the items' order; and the seconds."""
    out: list = [None] * len(items)
    queue = iter(range(len(items)))

    async def worker() -> None:
        for i in queue:
            out[i] = await call(items[i])

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out, time.perf_counter() - started


def _by_adapter(requests: list[bytes], servers: list[str]) -> dict[str, Counter]:
    picks: dict[str, Counter] = defaultdict(Counter)
    for body, server in zip(requests, servers, strict=True):
        picks[json.loads(body)["model"]][server] += 1
    return picks


def _compare(picker: dict[str, Counter], router: dict[str, Counter], n: int, requests_per_s: float,
             concurrency: int) -> dict:
    """The shares side by side; per adapter the largest difference picker - HTTP router, picker - φ and
    HTTP router - φ (a profile that reads load leaves φ on both paths alike); and the sampling noise:
    the 95% band of the difference of two independent shares of the adapter's requests at p = 0.5."""
    table = {}
    for adapter in sorted(PHI):
        p_total, r_total = sum(picker[adapter].values()), sum(router[adapter].values())
        rows, worst = {}, {"picker_vs_router": 0.0, "picker_vs_phi": 0.0, "router_vs_phi": 0.0}
        for server in SERVERS:
            p = picker[adapter][server] / p_total if p_total else 0.0
            r = router[adapter][server] / r_total if r_total else 0.0
            phi = PHI[adapter].get(server, 0.0)
            rows[server] = {"picker": round(p, 4), "router": round(r, 4), "phi": phi}
            for key, diff in (("picker_vs_router", p - r), ("picker_vs_phi", p - phi), ("router_vs_phi", r - phi)):
                worst[key] = max(worst[key], abs(diff))
        noise = 1.96 * (0.25 / p_total + 0.25 / r_total) ** 0.5 if p_total and r_total else 1.0
        table[adapter] = {"requests": p_total, **{k: round(v, 4) for k, v in worst.items()},
                          "noise_95_difference": round(noise, 4), "shares": rows}
    return {"decisions": n, "concurrency": concurrency, "paths": "interleaved in one router process",
            "requests_per_s": requests_per_s,
            **{f"{k}_max": max(t[k] for t in table.values()) for k in ("picker_vs_router", "picker_vs_phi",
                                                                      "router_vs_phi")},
            "noise_95_difference": max(t["noise_95_difference"] for t in table.values()), "per_adapter": table}


async def _leak(bench: Bench, n: int, concurrency: int) -> dict:
    child, url, target = bench.router("router-leak")
    rss_before = _rss_kib(child)
    gateway = Gateway(target)
    body = json.dumps({"model": "a4", "prompt": "def add(a, b):", "max_tokens": 4}).encode()
    stream_body = json.dumps({"model": "a4", "prompt": "x", "max_tokens": 4, "stream": True}).encode()
    failed = Counter()
    queue = iter(range(n))

    async def worker() -> None:
        for i in queue:
            if i % 10 == 0:
                await gateway.send_and_cancel(body, after_chunks=1 if i % 20 == 0 else 4, pieces=4)
                continue
            ex = await gateway.send(stream_body if i % 2 else body, pieces=4)
            failed[ex.status] += ex.status != 200

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    await gateway.close()
    await asyncio.sleep(2.0)  # the last cancellations reach the picker
    metrics = httpx.get(url + "/metrics").text
    left = {name: _sum(metrics, name) for name in ("loraplex_picker_streams_open", "llm_d_epp_request_running",
                                                   "loraplex_router_requests_in_flight")}
    result = {"requests": n, "cancelled": n // 10, "concurrency": concurrency, "requests_per_s": n / seconds,
              "failed": sum(failed.values()), "left": {k: v for k, v in left.items() if v},
              "open_at_end": left, "rss_kib_before": rss_before, "rss_kib_after": _rss_kib(child)}
    child.stop()
    return result


def _decision_buckets(metrics: str) -> dict[str, float]:
    """The share of the picker's own decisions (its llm_d_epp_scheduler_e2e_duration_seconds: from the
    body's last chunk read to the decision made, without the gRPC transport) within each bucket bound."""
    name = "llm_d_epp_scheduler_e2e_duration_seconds"
    count = _sum(metrics, name + "_count")
    buckets = {line.split('le="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line.startswith(name + "_bucket")}
    return {le: round(v / count, 4) for le, v in buckets.items() if le in ("0.00025", "0.0005", "0.001", "0.0025")}


def _sum(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _rss_kib(child: Child) -> int:
    """The router's resident memory (its own process; under taskset the child execs into it)."""
    try:
        status = Path(f"/proc/{child.process.pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
