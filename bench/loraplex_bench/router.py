"""`loraplex bench router`: what the router adds on top of calling a server directly, in one run.

Setup: a redis-server, one upstream (the echo server, or a real agent on the tiny model) and the
router, each in its own process; the router is pinned to one CPU core. The table routes the bench
adapter to the upstream with φ = 1, so every routed request takes the full path: auth, snapshot
lookup, filters -> scorers -> picker, forwarding, usage accounting.

1. Latency: sequential requests alternating direct / routed; added latency = routed - direct
   (p50 and p99 of each, and the median of the paired differences).
2. Throughput: `--concurrency` clients through the router for `--requests` requests (requests/s),
   and the same load sent directly to the upstream for reference.
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
from importlib.util import find_spec
from pathlib import Path

import httpx
from loraplex_local.processes import LORAPLEX, Child, wait_http, wait_port

from loraplex.ports import free_port_block
from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.redis_store import RedisRoutingStore
from loraplex.routing.table import RoutingTable, make_entry
from loraplex.spec.errors import CommandError

POOL = "bench"
ADAPTER = "bench-adapter"


def run(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-router-"))
    children: list[Child] = []
    try:
        result = _bench(args, workdir, children)
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _bench(args: argparse.Namespace, workdir: Path, children: list[Child]) -> dict:
    first = free_port_block(3)
    ports = [first, first + 1, first + 2]
    redis_url = start_redis(workdir, ports[0], children)
    upstream_url, model = _start_upstream(args, workdir, ports[1], redis_url, children)
    store = RedisRoutingStore.from_url(redis_url, POOL)
    _publish(store, upstream_url, model, args)
    cpu = router_cpu()
    router_argv = [*LORAPLEX, "router", "--redis-url", redis_url, "--pool", POOL, "--port", str(ports[2]),
                   "--log-level", "warning"]
    if cpu is not None:
        router_argv = ["taskset", "-c", str(cpu), *router_argv]
    router = Child("router", router_argv, workdir).start()
    children.append(router)
    router_url = f"http://127.0.0.1:{ports[2]}"
    wait_http(router_url + "/ready", router, 60)
    body = _body(args, model)
    latency = asyncio.run(_latency(upstream_url, router_url, body, args.requests))
    throughput = asyncio.run(_throughput(upstream_url, router_url, body, args.requests, args.concurrency))
    store.close()
    return {"upstream": args.upstream, "stream": args.stream, "max_tokens": args.max_tokens,
            "requests": args.requests, "concurrency": args.concurrency, "router_cpu": cpu,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
                       f"{platform.python_version()}",
            # uvicorn uses these when they are installed; they change the numbers a lot
            "uvloop": find_spec("uvloop") is not None, "httptools": find_spec("httptools") is not None,
            **latency, **throughput}


def start_redis(workdir: Path, port: int, children: list[Child]) -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise CommandError("the router benchmark needs redis-server (apt-get install redis-server)")
    child = Child("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--dir", str(workdir)], workdir).start()
    children.append(child)
    wait_port(port, child, 20)
    return f"redis://127.0.0.1:{port}/0"


def _start_upstream(args: argparse.Namespace, workdir: Path, port: int, redis_url: str,
                    children: list[Child]) -> tuple[str, str]:
    """(URL, base model name) of the upstream server."""
    url = f"http://127.0.0.1:{port}"
    if args.upstream == "echo":
        return start_echo("upstream", workdir, port, children), "echo-base"
    from loraplex_local.stack import DEFAULT_MODEL_DIR, ensure_tiny_model

    folder = Path(args.model) if args.model else ensure_tiny_model(DEFAULT_MODEL_DIR, workdir)
    base = folder / "base" if (folder / "base").is_dir() else folder
    adapter = next(p for p in sorted((folder / "adapters").iterdir()) if p.is_dir())
    child = Child("upstream", [*LORAPLEX, "agent", "--model", str(base), "--port", str(port), "--device", "cpu",
                               "--num-blocks", "256", "--max-model-len", "512",
                               "--adapter", f"{ADAPTER}={adapter}"], workdir).start()
    children.append(child)
    wait_http(url + "/health", child, 180)
    return url, base.name


def start_echo(name: str, workdir: Path, port: int, children: list[Child]) -> str:
    """The echo server in a process of its own; its URL."""
    code = ("import uvicorn; from loraplex_bench.echo_server import EchoServer; "
            f"uvicorn.run(EchoServer({name!r}), host='127.0.0.1', port={port}, log_level='warning', "
            "access_log=False)")
    child = Child(name, [LORAPLEX[0], "-c", code], workdir).start()
    children.append(child)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", child, 60)
    return url


def _publish(store: RedisRoutingStore, upstream_url: str, model: str, args: argparse.Namespace) -> None:
    digest = "sha256:" + "0" * 64
    store.put_adapter(AdapterRecord(ADAPTER, digest, 8, 0, "file:///bench"))
    store.register_server(ServerRecord("upstream", upstream_url, max_rank=64, base_model=model), ttl_s=3600)
    store.publish_table(RoutingTable(1, time.time(), {ADAPTER: make_entry(ADAPTER, digest, 8, [("upstream", 1.0)])}))


def router_cpu() -> int | None:
    """The last CPU this process may use (the client and upstream are left the others)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None
    return cpus[-1] if len(cpus) > 1 and shutil.which("taskset") else None


def _body(args: argparse.Namespace, model: str) -> dict:
    body = {"model": ADAPTER, "prompt": "def add(a, b):", "max_tokens": args.max_tokens, "temperature": 0}
    if args.stream:
        body["stream"] = True
    return body


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> float:
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        async for _ in response.aiter_raw():
            pass
        if response.status_code != 200:
            raise CommandError(f"{url} answered {response.status_code}: {await response.aread()!r}")
    return time.perf_counter() - start


async def _latency(direct: str, routed: str, body: dict, n: int) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(20):  # warm up connections and caches on both paths
            await _one(client, direct, body)
            await _one(client, routed, body)
        pairs = [(await _one(client, direct, body), await _one(client, routed, body)) for _ in range(n)]
    d, r = [p[0] for p in pairs], [p[1] for p in pairs]
    ms = 1000.0
    return {"direct_p50_ms": pct(d, 50) * ms, "direct_p99_ms": pct(d, 99) * ms,
            "routed_p50_ms": pct(r, 50) * ms, "routed_p99_ms": pct(r, 99) * ms,
            "added_p50_ms": (pct(r, 50) - pct(d, 50)) * ms, "added_p99_ms": (pct(r, 99) - pct(d, 99)) * ms,
            "added_median_of_pairs_ms": statistics.median(b - a for a, b in pairs) * ms}


async def _throughput(direct: str, routed: str, body: dict, n: int, concurrency: int) -> dict:
    return {"routed_requests_per_s": await _rate(routed, body, n, concurrency),
            "direct_requests_per_s": await _rate(direct, body, n, concurrency)}


async def _rate(url: str, body: dict, n: int, concurrency: int) -> float:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        remaining = n

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await _one(client, url, body)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
