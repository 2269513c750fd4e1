"""`loraplex bench table-deltas`: how a change of a large routing table reaches the readers, with the
table published as deltas over a snapshot (this tree) and as whole versions (the code of `--before`,
exported from git), in one run against one redis-server.

Each variant runs in its own driver process (with that variant's `loraplex`, `loraplex_router` and
`loraplex_agent` first on sys.path): it fills the pool's registry (`--servers` servers, `--adapters`
adapters, one location per route), publishes a table of `--adapters` adapters routed to `--routes`
of the servers each, starts `--routers` router table caches (TableCache, as `loraplex router` runs
it) and `--agents` agent table readers (ClusterMember's path: announcement or poll, current_version,
read_table, assignments) in processes of their own, then `--repeats` times publishes a change of
one adapter and a change of 10% of them. Per kind of change: the time from the publish call to the
last reader holding the new version (max over readers, median over repeats), the bytes Redis
received (the writer's change) and sent (the readers' reads) while it spread, the writer's time;
then Redis memory for the pool and the table's keys, and each reader's RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from loraplex.spec.errors import CommandError

POOL = "bench"
BEFORE_REV = "c67dbb4"  # the last commit that published whole table versions
ROUTER_POLL_S = 1.0
ADAPTERS_EVERY_S = 3600.0  # the registry is re-read on a table change; not also on a timer while measuring


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--servers", type=int, default=64)
    parser.add_argument("--routes", type=int, default=2, help="servers per adapter")
    parser.add_argument("--routers", type=int, default=3, help="router table caches, one process each")
    parser.add_argument("--agents", type=int, default=2, help="agent table readers, one process each")
    parser.add_argument("--repeats", type=int, default=5, help="changes of each kind")
    parser.add_argument("--before", default=BEFORE_REV,
                        help="git revision whose whole-version code is the baseline ('' : measure this tree only)")
    parser.add_argument("--out", default=None, help="also write the JSON result here")


def run(args: argparse.Namespace) -> int:
    from loraplex_local.processes import Child

    from loraplex_bench.router import start_redis

    if args.adapters < 10 or args.servers < args.routes or args.routes < 1:
        raise CommandError("need --adapters >= 10 and 1 <= --routes <= --servers")
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-deltas-"))
    children: list[Child] = []
    try:
        from loraplex.ports import free_port

        url = start_redis(workdir, free_port(), children)
        variants = {"before": _export(args.before, workdir / "before")} if args.before else {}
        variants["after"] = None
        config = {k: getattr(args, k) for k in ("adapters", "servers", "routes", "routers", "agents", "repeats")}
        result: dict = {"config": {**config, "before": args.before}, "machine": _machine()}
        for name, tree in variants.items():
            result[name] = _drive(url, tree, config, workdir)
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if "before" in result:
        result["after/before"] = _ratios(result["before"], result["after"])
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def _export(rev: str, dest: Path) -> Path:
    """The packages of revision `rev` of this repository, as files under `dest`."""
    root = Path(__file__).resolve().parents[2]
    dest.mkdir(parents=True)
    try:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev, "loraplex", "router/loraplex_router",
                                  "node_agent/loraplex_agent"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise CommandError(f"cannot export revision {rev!r} of {root} (a git checkout is needed for --before): "
                           f"{getattr(exc, 'stderr', b'') or exc}") from exc
    return dest


def _env(tree: Path | None) -> dict[str, str]:
    if tree is None:
        return dict(os.environ)
    paths = [str(tree), str(tree / "router"), str(tree / "node_agent"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _drive(url: str, tree: Path | None, config: dict, workdir: Path) -> dict:
    """Runs the driver with the variant's packages; its cwd is not a checkout (cwd lands on sys.path)."""
    code = "import sys, json; from loraplex_bench.table_deltas import drive; drive(sys.argv[1], json.loads(sys.argv[2]))"
    done = subprocess.run([sys.executable, "-c", code, url, json.dumps(config)], env=_env(tree),
                          capture_output=True, text=True, cwd=workdir)
    if done.returncode != 0:
        raise CommandError(f"the {'before' if tree else 'after'} driver failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratios(before: dict, after: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = _ratios(before.get(key, {}), value)
        elif isinstance(value, int | float) and before.get(key):
            out[key] = round(value / before[key], 4)
    return out


# ---- the driver: runs with one variant's packages first on sys.path --------------------------------


def drive(url: str, config: dict) -> None:
    import redis

    from loraplex.routing import redis_store
    from loraplex.routing.redis_store import RedisRoutingStore

    print(f"driver: {redis_store.__file__}", file=sys.stderr)

    client = redis.Redis.from_url(url, decode_responses=True)
    client.flushall()
    empty = _used_memory(client)
    store = RedisRoutingStore.from_url(url, POOL)
    rng = random.Random(0)
    servers = [f"server-{i:03d}" for i in range(config["servers"])]
    routes = _fill_registry(store, servers, config)
    table = _table(1, routes, rng)
    store.publish_table(table)
    readers = _Readers(url, config)
    try:
        readers.wait_for(1, timeout_s=120)
        result = {"registry+table_MiB": (_used_memory(client) - empty) / 2**20}
        for kind, share in (("one_change", 0.0), ("ten_percent", 0.1)):
            samples = []
            for _ in range(config["repeats"]):
                table = _changed(table, servers, rng, share)
                samples.append(_publish(client, store, table, readers))
            result[kind] = _summary(samples)
        result["pool_MiB"] = (_used_memory(client) - empty) / 2**20  # with the clients' buffers
        result["pool_keys_MiB"] = _keys_bytes(client, "*") / 2**20
        result["table_keys_MiB"] = _keys_bytes(client, "table:*") / 2**20
        result["reader_rss_MiB"] = readers.rss_mib()
    finally:
        readers.stop()
        store.close()
    print(json.dumps(result))


def _used_memory(client) -> int:
    return int(client.info("memory")["used_memory"])


def _keys_bytes(client, pattern: str) -> int:
    """MEMORY USAGE of the pool's keys matching `pattern`, counting every member (samples=0)."""
    keys = client.scan_iter(match=f"loraplex:{{{POOL}}}:{pattern}")
    return sum(client.memory_usage(k, samples=0) or 0 for k in keys)


def _fill_registry(store, servers: list[str], config: dict) -> dict[str, list[str]]:
    """Registers the servers and the adapters (one location per route); returns each adapter's servers."""
    from loraplex.routing.records import AdapterRecord, ServerRecord

    for sid in servers:
        store.register_server(ServerRecord(sid, f"http://{sid}:8000", 64, "base"), ttl_s=3600)
    routes = {}
    for i in range(config["adapters"]):
        name = f"adapter-{i:05d}"
        store.put_adapter(AdapterRecord(name, f"sha256:{i:064x}", 8 << (i % 4), 50_000_000,
                                        f"hf://bench/{name}", ("q_proj", "v_proj"), "base", 10.0))
        routes[name] = [servers[(i * 7 + k * 13) % len(servers)] for k in range(config["routes"])]
        for sid in routes[name]:
            store.add_location(name, sid)
    return routes


def _table(version: int, routes: dict[str, list[str]], rng: random.Random):
    from loraplex.routing.table import RoutingTable, make_entry

    entries = {name: make_entry(name, f"sha256:{i:064x}", 8 << (i % 4), [(s, rng.random() + 0.1) for s in servers])
               for i, (name, servers) in enumerate(routes.items())}
    return RoutingTable(version, time.time(), entries, "loraserve", len({s for r in routes.values() for s in r}))


def _changed(table, servers: list[str], rng: random.Random, share: float):
    """The next version, with one adapter (share 0) or `share` of them routed to other servers."""
    from dataclasses import replace

    from loraplex.routing.table import make_entry

    names = sorted(table.entries)
    entries = dict(table.entries)
    for name in rng.sample(names, max(1, int(share * len(names)))):
        old = entries[name]
        moved = rng.sample(servers, len(old.routes))
        entries[name] = make_entry(name, old.digest, old.rank, [(s, rng.random() + 0.1) for s in moved])
    return replace(table, version=table.version + 1, created_at=time.time(), entries=entries)


def _publish(client, store, table, readers: _Readers) -> dict:
    stats = client.info("stats")
    start = time.time()
    store.publish_table(table)
    published = time.time()
    seen = readers.wait_for(table.version, timeout_s=60)
    after = client.info("stats")
    return {"spread_s": max(seen) - start, "writer_s": published - start,
            "redis_in_KiB": (after["total_net_input_bytes"] - stats["total_net_input_bytes"]) / 1024,
            "redis_out_KiB": (after["total_net_output_bytes"] - stats["total_net_output_bytes"]) / 1024}


def _summary(samples: list[dict]) -> dict:
    out = {f"{k}_median": round(statistics.median(s[k] for s in samples), 4) for k in samples[0]}
    out["spread_s_max"] = round(max(s["spread_s"] for s in samples), 4)
    return out


class _Readers:
    """The reader processes; each prints `<version> <unix time>` when it holds a new version."""

    def __init__(self, url: str, config: dict) -> None:
        code = "import sys; from loraplex_bench.table_deltas import read; read(sys.argv[1], sys.argv[2])"
        roles = ["router"] * config["routers"] + ["agent"] * config["agents"]
        self.processes = [subprocess.Popen([sys.executable, "-c", code, url, role], stdout=subprocess.PIPE,
                                           text=True) for role in roles]
        self.seen: queue.Queue[tuple[int, int, float]] = queue.Queue()
        self.latest: dict[int, tuple[int, float]] = {}
        for index, process in enumerate(self.processes):
            threading.Thread(target=self._follow, args=(index, process), daemon=True).start()

    def _follow(self, index: int, process: subprocess.Popen) -> None:
        for line in process.stdout:
            version, at = line.split()
            self.seen.put((index, int(version), float(at)))

    def wait_for(self, version: int, timeout_s: float) -> list[float]:
        """When each reader first held `version` (or a later one)."""
        deadline = time.monotonic() + timeout_s
        while sum(1 for v, _ in self.latest.values() if v >= version) < len(self.processes):
            try:
                index, v, at = self.seen.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"readers did not all reach version {version} in {timeout_s} s") from None
            if v > self.latest.get(index, (0, 0.0))[0]:
                self.latest[index] = (v, at)
        return [at for _, at in self.latest.values()]

    def rss_mib(self) -> list[float]:
        from loraplex_bench.rss import vm_rss_kib

        return [round((vm_rss_kib(p.pid) or 0) / 1024, 1) for p in self.processes]

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(timeout=10)


def read(url: str, role: str) -> None:
    """One reader: a router's TableCache, or an agent's table path (ClusterMember.reconcile's)."""
    from loraplex.routing.redis_store import RedisRoutingStore

    store = RedisRoutingStore.from_url(url, POOL)
    held = [0]

    def report(table) -> None:
        if table is not None and table.version != held[0]:
            held[0] = table.version
            print(table.version, time.time(), flush=True)

    if role == "router":
        from loraplex_router.demand import DemandCounter
        from loraplex_router.metrics import RouterMetrics
        from loraplex_router.table_cache import TableCache

        TableCache(store, RouterMetrics(), DemandCounter(), poll_interval_s=ROUTER_POLL_S,
                   adapters_every_s=ADAPTERS_EVERY_S, on_table=report).start()
        threading.Event().wait()
    wake = threading.Event()
    store.watch_versions(lambda version: wake.set())
    while True:
        version = store.current_version()
        if version is not None and version != held[0]:
            table = store.read_table()
            if table is not None:
                table.assignments("server-000")
                report(table)
        wake.wait(ROUTER_POLL_S)
        wake.clear()
