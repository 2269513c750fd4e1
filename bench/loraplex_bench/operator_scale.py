"""`loraplex bench operator-scale`: the operator at scale on a real Kubernetes API server.

A measurement, not a test: nothing here asserts a time. In a fresh namespace it starts a private
redis-server, the operator as a user starts it (`loraplex operator --standalone --namespace NS
--redis-url URL`, or `--operator-cmd`), one AdapterPool of two fixed CPU servers and K heartbeating
test agents (threads of this process: each waits for its StatefulSet pod, marks it Ready through the
pod's status subresource, since no kubelet runs it (its nodeSelector matches no node), and
heartbeats a ServerRecord that reports the adapters the current routing table assigns to it). Then
N LoRADeployments are created with one `kubectl create -f`, and single and bulk changes, a quiet
minute and a restart of the operator follow; one more adapter is created as the operator restarts
(how soon it watches again and turns a new adapter Ready). Each phase reports the operator's peak
resident memory.

How the operator is told apart:
- API requests: the operator runs with its own ServiceAccount token (a kubeconfig written for it,
  cluster-admin), so the API server's audit log names it exactly (`user.username`); kubectl and this
  process run as the caller's user, the controller manager as itself.
- Redis commands: the operator's Redis URL carries `client_name=loraplex-operator`; every connection
  of this process names itself `loraplex-bench*`; a MONITOR connection attributes each command to its
  connection (commands that Lua scripts run inside Redis are not counted again).

Heavy imports (kubernetes, redis) happen inside `run`: `configure` is called by every `loraplex` run.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import re
import resource
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from loraplex.ports import free_port
from loraplex.spec.errors import CommandError
from loraplex_bench.rss import cpu_seconds

GROUP, VERSION = "loraplex.io", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
BENCH_AGENT = "loraplex-bench/operator-scale"
OPERATOR_SA = "loraplex-operator"
OPERATOR_REDIS_NAME = "loraplex-operator"
BENCH_REDIS_NAME = "loraplex-bench"
RANKS = (8, 16, 32)
HEARTBEAT_S = 1.0
HEARTBEAT_TTL_S = 5.0
POD_CHECK_S = 5.0

# kopf's peering resources, for operators that run without --standalone (as the chart installs them).
PEERING_CRDS = [
    {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
     "metadata": {"name": f"{plural}.kopf.dev"},
     "spec": {"scope": scope, "group": "kopf.dev",
              "names": {"kind": kind, "plural": plural, "singular": plural[:-1]},
              "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                  "type": "object", "properties": {
                      "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]}}
    for kind, plural, scope in (("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
                                ("KopfPeering", "kopfpeerings", "Namespaced"))
]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", type=int, default=100, metavar="N", help="LoRADeployments to create (default 100)")
    p.add_argument("--agents", type=int, default=2, metavar="K",
                   help="heartbeating test agents = fixed servers of the pool (default 2)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting a private redis-server")
    p.add_argument("--operator-cmd", default=None,
                   help="the command that stands for `loraplex` (e.g. to run an older checkout); "
                        "`operator --namespace NS --redis-url URL ...` is appended")
    p.add_argument("--no-standalone", dest="standalone", action="store_false",
                   help="run the operator with kopf peering (applies kopf's peering CRDs when missing)")
    p.add_argument("--crds", default="crds", metavar="DIR",
                   help="CRDs to apply when the loraplex.io CRDs are missing (default: crds/)")
    p.add_argument("--audit-log", default="/tmp/kcluster/audit.log",
                   help="the API server's audit log (metadata level, JSON lines)")
    p.add_argument("--quiet-seconds", type=float, default=5.0,
                   help="the operator is quiet after this long without an API write (default 5)")
    p.add_argument("--rest-seconds", type=float, default=60.0, help="length of the at-rest window (default 60)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="give up waiting for a phase's end state after this many seconds (default 900)")
    p.add_argument("--pool", default="scale", help="AdapterPool name (default scale)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--work-dir", default=None, help="keep logs and manifests here (default: a temp folder)")


# ----------------------------------------------------------------------------------------- helpers


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _parse_ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _with_query(url: str, **params: str) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + "&".join(f"{k}={v}" for k, v in params.items())


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


# ------------------------------------------------------------------------------------- audit log


@dataclass(frozen=True)
class ApiRequest:
    t: float
    verb: str
    resource: str  # resource[/subresource], or the URI path for non-resource requests
    code: int
    agent: str


class AuditTail:
    """Follows the API server's audit log from now on and keeps the requests of one user."""

    def __init__(self, path: str, username: str) -> None:
        self.path, self.username = path, username
        self._needle = username.encode()
        self._lock = threading.Lock()
        self.requests: list[ApiRequest] = []
        self.last_write = 0.0
        self.caught_up_at = 0.0
        self.lines_read = 0
        self._seen_watches: set[str] = set()
        self._stop = threading.Event()
        self._file = open(path, "rb")  # noqa: SIM115 (kept open while the thread follows it)
        self._file.seek(0, os.SEEK_END)
        self._partial = b""
        self._thread = threading.Thread(target=self._run, name="audit-tail", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read_available()
            try:  # rotated (lumberjack renames the file and starts a new one)?
                if os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino:
                    self._read_available()
                    self._file.close()
                    self._file = open(self.path, "rb")  # noqa: SIM115
                    self._partial = b""
                    continue
            except FileNotFoundError:
                pass
            self._stop.wait(0.2)

    def _read_available(self) -> None:
        while True:
            chunk = self._file.read(1 << 20)
            if not chunk:
                self.caught_up_at = time.time()
                return
            data = self._partial + chunk
            lines = data.split(b"\n")
            self._partial = lines.pop()
            for line in lines:
                self.lines_read += 1
                if self._needle in line:
                    self._take(line)

    def _take(self, line: bytes) -> None:
        try:
            ev = json.loads(line)
        except ValueError:
            return
        if ev.get("user", {}).get("username") != self.username:
            return
        verb = ev.get("verb", "")
        if verb == "watch" or ev.get("stage") == "ResponseStarted":  # long-running: count it once
            if ev["auditID"] in self._seen_watches:
                return
            self._seen_watches.add(ev["auditID"])
        ref = ev.get("objectRef") or {}
        res = ref.get("resource") or ev.get("requestURI", "").split("?")[0]
        if ref.get("subresource"):
            res += "/" + ref["subresource"]
        req = ApiRequest(_parse_ts(ev["requestReceivedTimestamp"]), verb, res,
                         int((ev.get("responseStatus") or {}).get("code") or 0), ev.get("userAgent", ""))
        with self._lock:
            self.requests.append(req)
            if verb in WRITE_VERBS:
                self.last_write = max(self.last_write, req.t)

    def between(self, t0: float, t1: float) -> list[ApiRequest]:
        with self._lock:
            return [r for r in self.requests if t0 <= r.t < t1]

    def fresh(self, within: float = 1.0) -> bool:
        return time.time() - self.caught_up_at < within

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._file.close()


def summarize_requests(reqs: Iterable[ApiRequest]) -> dict[str, Any]:
    reqs = list(reqs)
    writes = [r for r in reqs if r.verb in WRITE_VERBS]
    return {
        "total": len(reqs),
        "writes": len(writes),
        "by_verb": dict(Counter(r.verb for r in reqs).most_common()),
        "writes_by_resource": dict(Counter(f"{r.verb} {r.resource}" for r in writes).most_common()),
        "errors": dict(Counter(f"{r.verb} {r.resource} {r.code}" for r in reqs if r.code >= 400).most_common()),
        "user_agents": dict(Counter(r.agent.split(" ")[0] for r in reqs).most_common()),
    }


# ----------------------------------------------------------------------------------- redis MONITOR


class RedisMonitor:
    """A MONITOR connection: every command a client sends, with the client's address. Names come
    from CLIENT SETNAME seen in the stream (redis-py sends it first on each connection) and from
    CLIENT LIST for connections older than the monitor."""

    def __init__(self, host: str, port: int, names: dict[str, str]) -> None:
        self._sock = socket.create_connection((host, port))
        self._sock.sendall(b"MONITOR\r\n")
        self._reader = self._sock.makefile("rb", buffering=1 << 20)
        if not self._reader.readline().startswith(b"+OK"):
            raise RuntimeError("redis refused MONITOR")
        self._lock = threading.Lock()
        self.names: dict[str, str] = dict(names)
        self.commands: dict[str, list[tuple[float, str]]] = {}
        self._thread = threading.Thread(target=self._run, name="redis-monitor", daemon=True)
        self._thread.start()

    _LINE = re.compile(rb'^\+(\d+\.\d+) \[\d+ ([^\]]+)\] "([^"]*)"(?: "([^"]*)")?(?: "([^"]*)")?')

    def _run(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self._reader:
                m = self._LINE.match(line)
                if m is None:
                    continue
                addr = m.group(2).decode()
                if addr == "lua":
                    continue  # run by a script: its EVAL/EVALSHA was counted
                cmd = m.group(3).decode().upper()
                if cmd == "CLIENT" and m.group(4) and m.group(4).upper() == b"SETNAME" and m.group(5):
                    self.names[addr] = m.group(5).decode()
                with self._lock:
                    self.commands.setdefault(addr, []).append((float(m.group(1)), cmd))

    def operator_commands(self, t0: float, t1: float) -> Counter[str]:
        """Commands of every connection not named loraplex-bench*: the operator's (named by its URL),
        or unnamed ones (a private Redis has no other clients)."""
        out: Counter[str] = Counter()
        with self._lock:
            for addr, cmds in self.commands.items():
                if self.names.get(addr, "").startswith(BENCH_REDIS_NAME):
                    continue
                out.update(c for t, c in cmds if t0 <= t < t1)
        return out

    def client_names(self) -> dict[str, int]:
        with self._lock:
            return dict(Counter(self.names.get(a, "(unnamed)") for a in self.commands))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


# --------------------------------------------------------------------------------- status watcher


@dataclass
class AdapterState:
    generation: int = 0
    observed: int | None = None
    phase: str = ""
    reason: str = ""


class StatusWatcher:
    """Watches the LoRADeployments of the namespace: current phase per adapter, and every
    (phase, reason) any adapter ever reported."""

    def __init__(self, custom: Any, namespace: str) -> None:
        self._custom, self._ns = custom, namespace
        self._lock = threading.Lock()
        self.adapters: dict[str, AdapterState] = {}
        self.ever: dict[tuple[str, str], set[str]] = {}
        self.events_seen = 0
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-watch", daemon=True)
        self._thread.start()

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        meta, status = obj.get("metadata", {}), obj.get("status") or {}
        name = meta.get("name", "")
        with self._lock:
            self.events_seen += 1
            if kind == "DELETED":
                self.adapters.pop(name, None)
                return
            st = AdapterState(int(meta.get("generation") or 0), status.get("observedGeneration"),
                              status.get("phase") or "", status.get("reason") or "")
            self.adapters[name] = st
            if st.phase:
                self.ever.setdefault((st.phase, st.reason), set()).add(name)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    listed = self._custom.list_namespaced_custom_object(GROUP, VERSION, self._ns, "loradeployments")
                    with self._lock:
                        self.adapters.clear()
                    for obj in listed.get("items", []):
                        self._apply("ADDED", obj)
                    rv = listed["metadata"]["resourceVersion"]
                w = watch.Watch()
                for ev in w.stream(self._custom.list_namespaced_custom_object, GROUP, VERSION, self._ns,
                                   "loradeployments", resource_version=rv, timeout_seconds=120,
                                   allow_watch_bookmarks=True):
                    if self._stop.is_set():
                        w.stop()
                        break
                    obj = ev["object"]
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._apply(ev["type"], obj)
                    elif ev["type"] == "ERROR":
                        rv = None
                        break
            except ApiException as exc:
                self.restarts += 1
                if exc.status == 410:
                    rv = None
                self._stop.wait(1.0)
            except Exception:  # noqa: BLE001 (the connection dropped: list again)
                self.restarts += 1
                rv = None
                self._stop.wait(1.0)

    def count_where(self, names: Iterable[str], pred: Callable[[str, AdapterState], bool]) -> int:
        with self._lock:
            return sum(1 for n in names if (s := self.adapters.get(n)) is not None and pred(n, s))

    def generations(self, names: Iterable[str]) -> dict[str, int]:
        with self._lock:
            return {n: self.adapters[n].generation for n in names if n in self.adapters}

    def exists(self, name: str) -> bool:
        with self._lock:
            return name in self.adapters

    def ever_counts(self) -> dict[str, int]:
        with self._lock:
            return {f"{p}/{r}": len(names) for (p, r), names in sorted(self.ever.items())}

    def close(self) -> None:
        self._stop.set()


def ready_now(s: AdapterState) -> bool:
    return s.phase == "Ready" and s.observed == s.generation


# ------------------------------------------------------------------------------------- test agents


class TestAgent:
    """A heartbeating test agent for server `<pool>-<i>`: no engine. Once its pod exists it marks the
    pod Ready (phase Running, condition Ready=True on the status subresource) and, every second,
    registers a ServerRecord (TTL 5 s) whose host adapters are those the current routing table
    assigns to it (the first maxLoras of them also as GPU-resident), as an agent that fetched its
    adapters would report. Every 5 s it checks that the pod is still Ready, and marks it again if not."""

    def __init__(self, index: int, pool: str, namespace: str, redis_url: str, core: Any, max_rank: int,
                 max_loras: int, base_model: str) -> None:
        from loraplex.routing.redis_store import RedisRoutingStore

        self.server_id = f"{pool}-{index}"
        self._ns, self._core = namespace, core
        self._store = RedisRoutingStore.from_url(
            _with_query(redis_url, client_name=f"{BENCH_REDIS_NAME}-agent-{index}"), pool)
        self._max_rank, self._max_loras, self._base = max_rank, max_loras, base_model
        self._url = f"http://{self.server_id}.{pool}.{namespace}.svc:8000"
        self.beats = 0
        self.errors: Counter[str] = Counter()
        self.pod_ready_marks = 0
        self.pod_ready_at: float | None = None
        self.assigned = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"agent-{index}", daemon=True)
        self._thread.start()

    def _pod_ready(self) -> bool | None:
        """True/False: the pod's Ready condition; None: there is no pod."""
        from kubernetes.client.exceptions import ApiException

        try:
            pod = self._core.read_namespaced_pod_status(self.server_id, self._ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        conds = pod.status.conditions or []
        return pod.status.phase == "Running" and any(c.type == "Ready" and c.status == "True" for c in conds)

    def _mark_ready(self) -> None:
        now = datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ")
        conds = [{"type": t, "status": "True", "lastTransitionTime": now}
                 for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
        self._core.patch_namespaced_pod_status(self.server_id, self._ns,
                                               {"status": {"phase": "Running", "conditions": conds,
                                                           "startTime": now}})
        self.pod_ready_marks += 1

    def _beat(self) -> None:
        from loraplex.routing.records import ServerRecord

        table = self._store.read_table()
        assigned = sorted(table.assignments(self.server_id)) if table is not None else []
        self.assigned = len(assigned)
        record = ServerRecord(id=self.server_id, url=self._url, max_rank=self._max_rank, base_model=self._base,
                              gpu_adapters=tuple(assigned[:self._max_loras]), host_adapters=tuple(assigned),
                              heartbeat_at=time.time())
        self._store.register_server(record, HEARTBEAT_TTL_S)
        self.beats += 1

    def _run(self) -> None:
        next_check, has_pod = 0.0, False
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_check:
                    ready = self._pod_ready()
                    has_pod = ready is not None
                    if ready is False:
                        self._mark_ready()
                        if self._pod_ready() and self.pod_ready_at is None:
                            self.pod_ready_at = time.time()
                    elif ready and self.pod_ready_at is None:
                        self.pod_ready_at = time.time()
                    next_check = now + (POD_CHECK_S if has_pod else 1.0)
                if has_pod:
                    self._beat()
            except Exception as exc:  # noqa: BLE001 (an agent keeps going; the error is counted)
                self.errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
            self._stop.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self._store.deregister_server(self.server_id)
        with contextlib.suppress(Exception):
            self._store.close()


# ------------------------------------------------------------------------------------ the operator


class OperatorProcess:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.cpu_done = 0.0  # CPU seconds of operator processes that have exited

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps it)
        log.write(f"\n===== {time.strftime('%H:%M:%S')} start: {shlex.join(self.argv)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def cpu(self) -> float:
        live = cpu_seconds(self.proc.pid) if self.proc is not None and self.proc.poll() is None else None
        return self.cpu_done + (live or 0.0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def peak_rss_mb(self) -> float | None:
        """The running operator's peak resident memory (VmHWM) so far, in MB."""
        if not self.alive():
            return None
        assert self.proc is not None
        try:
            text = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        kb = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("VmHWM:")), None)
        return None if kb is None else round(kb / 1024, 1)

    def stop(self, grace_s: float = 30.0) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                self.cpu_done += usage.ru_utime + usage.ru_stime
                return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        self.cpu_done += usage.ru_utime + usage.ru_stime

    def log_position(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_count(self, text: str, start: int = 0) -> int:
        """How often `text` occurs in the log after byte `start`."""
        if not self.log_path.exists():
            return 0
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace").count(text)

    def log_problems(self, start: int = 0) -> dict[str, Any]:
        if not self.log_path.exists():
            return {"error_lines": 0, "tracebacks": 0, "top_errors": {}}
        with open(self.log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        errors = [ln for ln in text.splitlines() if re.search(r"\bERROR\b", ln)]
        top = Counter(re.sub(r"^\S+ \S+ ERROR ", "", ln)[:160] for ln in errors)
        return {"error_lines": len(errors), "tracebacks": text.count("Traceback (most recent call last)"),
                "top_errors": dict(top.most_common(5))}


def operator_prefix(cmd: str | None) -> list[str]:
    if cmd:
        return shlex.split(cmd)
    script = Path(sys.executable).with_name("loraplex")
    return [str(script)] if script.exists() else [shutil.which("loraplex") or "loraplex"]


def inspect_operator(prefix: list[str], env: dict[str, str]) -> tuple[bool, list[str]]:
    """Runs `<prefix> operator --help` verbosely: whether it knows --liveness, and which loraplex
    source files it actually imported (so that an older checkout is what runs)."""
    proc = subprocess.run([*prefix, "operator", "--help"], env={**env, "PYTHONVERBOSE": "1"},
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise CommandError(f"`{shlex.join(prefix)} operator --help` failed: {proc.stderr.strip()[-400:]}")
    paths = sorted(set(re.findall(r"(/\S*?(?:loraplex_operator|loraplex)/cli\.py)\b", proc.stderr)))
    return "--liveness" in proc.stdout, paths


# ---------------------------------------------------------------------------------------- manifests


def adapter_name(i: int) -> str:
    return f"lora-{i:05d}"


def adapter_doc(name: str, pool: str, rank: int, tps: float) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "LoRADeployment", "metadata": {"name": name},
            "spec": {"pool": pool,
                     "adapter": {"source": f"file:///adapters/{name}",
                                 "sha256": hashlib.sha256(name.encode()).hexdigest(), "rank": rank},
                     "traffic": {"expectedTokensPerSecond": tps}}}


def pool_doc(pool: str, servers: int) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "AdapterPool", "metadata": {"name": pool},
            "spec": {"baseModel": {"name": "tiny", "source": "file:///models/tiny"},
                     # A label no node has: a real kubelet never runs (or reports on) the pods, so the
                     # test agents' Ready marks stand.
                     "servers": {"minReplicas": servers, "maxReplicas": servers, "gpusPerServer": 0,
                                 "nodeSelector": {"loraplex.io/bench": "stand-in-agents"}},
                     "engine": {"maxLoraRank": 64, "maxLoras": 8},
                     "placement": {"autoscale": False}}}


def write_docs(path: Path, docs: Iterable[dict[str, Any]]) -> Path:
    with open(path, "w") as f:
        for doc in docs:
            f.write("---\n")
            f.write(json.dumps(doc))  # JSON is YAML
            f.write("\n")
    return path


# ------------------------------------------------------------------------------------------ the run


@dataclass
class Phase:
    name: str
    t0: float
    cpu0: float
    log0: int
    events0: int
    values: dict[str, Any] = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ns = f"lpx-scale-{secrets.token_hex(3)}"
        self.pool = args.pool
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="lpx-scale-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {"namespace": self.ns, "adapters": args.adapters, "agents": args.agents,
                                        "test_agents": "heartbeating test agents (no engine)", "notes": [],
                                        "phases": []}
        self.kubectl_flags: list[str] = []
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.operator: OperatorProcess | None = None
        self.agents: list[TestAgent] = []
        self.audit: AuditTail | None = None
        self.monitor: RedisMonitor | None = None
        self.watcher: StatusWatcher | None = None
        self.expected: set[str] = set()
        self.redis_client: Any = None
        self.crb = f"loraplex-bench-{self.ns}"
        self._cleanup_done = False

    # ---- setup
    def connect(self) -> None:
        from kubernetes import client, config

        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise CommandError("KUBECONFIG is not set: point it at the API server to measure against")
        config.load_kube_config()
        self.api_client = client.ApiClient()
        self.api_client.user_agent = BENCH_AGENT
        self.core = client.CoreV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.apix = client.ApiextensionsV1Api(self.api_client)
        self.rbac = client.RbacAuthorizationV1Api(self.api_client)
        self.kubectl = shutil.which("kubectl") or "/usr/bin/kubectl"
        version = client.VersionApi(self.api_client).get_code()
        self.results["server_version"] = f"{version.git_version} ({version.major}.{version.minor})"

    def run_kubectl(self, *argv: str, timeout: float = 3600) -> float:
        t0 = time.time()
        proc = subprocess.run([self.kubectl, *argv, *self.kubectl_flags], capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(argv[:3])} failed: {proc.stderr.strip()[-600:]}")
        return time.time() - t0

    def ensure_crds(self) -> None:
        from kubernetes.client.exceptions import ApiException

        def missing(names: list[str]) -> list[str]:
            out = []
            for n in names:
                try:
                    self.apix.read_custom_resource_definition(n)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                    out.append(n)
            return out

        # kubectl's client-side validation needs the server's OpenAPI; some builds cannot serve it.
        probe = subprocess.run([self.kubectl, "apply", "--server-side", "--dry-run=server", "-f", "-"],
                               input=json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                                                 "metadata": {"name": "probe", "namespace": "default"}}),
                               capture_output=True, text=True)
        if "failed to download openapi" in probe.stderr:
            self.kubectl_flags = ["--validate=false"]
            self.results["notes"].append("kubectl could not download the server's OpenAPI: ran with --validate=false")
        crds = missing([f"adapterpools.{GROUP}", f"loradeployments.{GROUP}"])
        if crds:
            _log(f"applying the CRDs from {self.args.crds} ({', '.join(crds)} missing)")
            self.run_kubectl("apply", "--server-side", "-f", self.args.crds)
            self.results["notes"].append(f"applied CRDs from {self.args.crds}")
        if not self.args.standalone and missing(["kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"]):
            path = write_docs(self.work / "peering-crds.yaml", PEERING_CRDS)
            self.run_kubectl("apply", "--server-side", "-f", str(path))
            self.results["notes"].append("applied kopf's peering CRDs (operator run without --standalone)")
        for name in (f"adapterpools.{GROUP}", f"loradeployments.{GROUP}"):
            self._wait(lambda n=name: self._crd_established(n), 60, f"CRD {name} established")

    def _crd_established(self, name: str) -> bool:
        crd = self.apix.read_custom_resource_definition(name)
        return any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or []))

    def start_redis(self) -> str:
        if self.args.redis_url:
            self.results["notes"].append("external Redis: its other clients' commands count as the operator's")
            return str(self.args.redis_url)
        server = shutil.which("redis-server")
        if server is None:
            raise CommandError("redis-server not found (scripts/setup.sh installs it), or pass --redis-url")
        port = free_port()
        log = open(self.work / "redis.log", "wb")  # noqa: SIM115
        self.redis_proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                            "--appendonly", "no", "--dir", str(self.work)],
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        url = f"redis://127.0.0.1:{port}/0"
        self._wait(lambda: self._redis_ping(url), 20, "redis-server up")
        return url

    def _redis_ping(self, url: str) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    def operator_kubeconfig(self) -> Path:
        """A kubeconfig with the token of the operator's own ServiceAccount (cluster-admin), so that
        the audit log names its requests."""
        from kubernetes import client

        self.core.create_namespaced_service_account(self.ns, {"metadata": {"name": OPERATOR_SA}})
        self.rbac.create_cluster_role_binding({
            "metadata": {"name": self.crb},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": self.ns}]})
        resp = self.core.create_namespaced_service_account_token(
            OPERATOR_SA, self.ns, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                   "spec": {"expirationSeconds": 86400}}, _preload_content=False)
        token = json.loads(resp.data)["status"]["token"]
        cfg = client.Configuration.get_default_copy()
        cluster: dict[str, Any] = {"server": cfg.host}
        if cfg.ssl_ca_cert:
            cluster["certificate-authority-data"] = base64.b64encode(Path(cfg.ssl_ca_cert).read_bytes()).decode()
        if not cfg.verify_ssl:
            cluster["insecure-skip-tls-verify"] = True
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "op",
               "clusters": [{"name": "c", "cluster": cluster}],
               "users": [{"name": OPERATOR_SA, "user": {"token": token}}],
               "contexts": [{"name": "op", "context": {"cluster": "c", "user": OPERATOR_SA, "namespace": self.ns}}]}
        path = self.work / "operator.kubeconfig"
        path.write_text(json.dumps(doc))
        path.chmod(0o600)
        return path

    def setup(self) -> None:
        import redis

        self.connect()
        self.ensure_crds()
        _log(f"namespace {self.ns}; work folder {self.work}")
        self.core.create_namespace({"metadata": {"name": self.ns, "labels": {"loraplex.io/bench": "operator-scale"}}})
        self._wait(lambda: self._has_default_sa(), 60, "default ServiceAccount")
        kubeconfig = self.operator_kubeconfig()
        self.audit = AuditTail(self.args.audit_log, f"system:serviceaccount:{self.ns}:{OPERATOR_SA}")
        url = self.start_redis()
        self.redis_url = url
        self.redis_client = redis.Redis.from_url(_with_query(url, client_name=BENCH_REDIS_NAME), decode_responses=True)
        conn = self.redis_client.connection_pool.connection_kwargs
        existing = {c["addr"]: c.get("name", "") for c in self.redis_client.client_list()}
        self.monitor = RedisMonitor(conn.get("host", "127.0.0.1"), int(conn.get("port", 6379)), existing)

        prefix = operator_prefix(self.args.operator_cmd)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        liveness, paths = inspect_operator(prefix, env)
        argv = [*prefix, "operator", "--namespace", self.ns,
                "--redis-url", _with_query(url, client_name=OPERATOR_REDIS_NAME)]
        if self.args.standalone:
            argv.append("--standalone")
        if liveness:
            argv += ["--liveness", f"http://127.0.0.1:{free_port()}/healthz"]
        self.results["operator"] = {"argv": argv, "code": paths, "standalone": self.args.standalone}
        _log(f"operator: {shlex.join(argv)}")
        _log(f"operator code loaded from: {', '.join(paths) or '(unknown: not a Python command?)'}")
        self.operator = OperatorProcess(argv, env, self.work / "operator.log")
        self.watcher = StatusWatcher(self.custom, self.ns)

    def _has_default_sa(self) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.read_namespaced_service_account("default", self.ns)
            return True
        except ApiException:
            return False

    # ---- measuring
    def events_count(self) -> int:
        from kubernetes.client.exceptions import ApiException

        total, cont = 0, None
        while True:
            try:
                resp = self.core.list_namespaced_event(self.ns, limit=500, _continue=cont)
            except ApiException:
                return -1
            total += len(resp.items)
            cont = resp.metadata._continue
            if not cont:
                return total

    def pool_keys(self) -> dict[str, Any]:
        pattern = f"loraplex:{{{self.pool}}}:*"
        keys = list(self.redis_client.scan_iter(match=pattern, count=1000))
        total = 0
        for i in range(0, len(keys), 500):
            with self.redis_client.pipeline(transaction=False) as pipe:
                for k in keys[i:i + 500]:
                    pipe.memory_usage(k, samples=0)
                total += sum(x or 0 for x in pipe.execute())
        kinds = Counter(re.sub(r"\d+$", "N", k.split("}:", 1)[1].split(":")[0]) for k in keys)
        return {"keys": len(keys), "bytes": total, "mb": round(total / 1e6, 2), "by_kind": dict(kinds.most_common())}

    def begin(self, name: str) -> Phase:
        _log(f"phase {name}")
        assert self.operator is not None
        return Phase(name, time.time(), self.operator.cpu(), self.operator.log_position(), self.events_count())

    def end(self, ph: Phase, t1: float | None = None) -> dict[str, Any]:
        assert self.audit and self.monitor and self.operator
        t1 = t1 or time.time()
        reqs = summarize_requests(self.audit.between(ph.t0, t1))
        cmds = self.monitor.operator_commands(ph.t0, t1)
        events = self.events_count()
        row = {"phase": ph.name, **ph.values, "wall_s": _r(t1 - ph.t0), "api": reqs,
               "redis_commands": {"total": sum(cmds.values()), "by_command": dict(cmds.most_common(12))},
               "operator_cpu_s": _r(self.operator.cpu() - ph.cpu0, 2),
               "operator_peak_rss_mb": self.operator.peak_rss_mb(),
               "events_total": events, "events_new": events - ph.events0,
               "log": self.operator.log_problems(ph.log0),
               "agents_assigned": [a.assigned for a in self.agents]}
        self.results["phases"].append(row)
        parts = [f"{k}={row[k]}" for k in ("kubectl_s", "phase_s", "ready_s", "quiet_s") if row.get(k) is not None]
        parts += [f"api={reqs['total']} (writes {reqs['writes']})", f"redis={row['redis_commands']['total']}",
                  f"cpu={row['operator_cpu_s']}s", f"rss={row['operator_peak_rss_mb']}MB",
                  f"events+={row['events_new']}",
                  f"errors={row['log']['error_lines']}"]
        _log(f"  {ph.name}: " + ", ".join(parts))
        return row

    def _wait(self, cond: Callable[[], bool], timeout: float, what: str, poll: float = 0.2) -> float | None:
        """Waits for cond(); returns the time it held, or None after the timeout (recorded as a note)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return time.time()
            if self.operator is not None and self.operator.proc is not None and not self.operator.alive():
                raise RuntimeError(f"the operator exited ({self.operator.proc.returncode}) while waiting for "
                                   f"{what}; see {self.operator.log_path}")
            time.sleep(poll)
        self.results["notes"].append(f"timed out after {timeout:.0f} s waiting for {what}")
        _log(f"  timed out waiting for {what}")
        return None

    def wait_quiet(self, since: float) -> float | None:
        """Waits until the operator made no API write for --quiet-seconds (after `since`); returns the
        time of its last write before that gap (or `since`)."""
        assert self.audit
        q = self.args.quiet_seconds

        def quiet() -> bool:
            return self.audit.fresh() and time.time() - max(since, self.audit.last_write) >= q

        if self._wait(quiet, self.args.timeout, "the operator to be quiet", poll=0.25) is None:
            return None
        return max(since, self.audit.last_write)

    def wait_started(self, t0: float) -> float | None:
        """Until the (re)started operator watches LoRADeployments (kopf lists, then watches); returns
        the seconds after t0 of its first watch request, None if it did not come within the timeout."""
        assert self.audit

        def first_watch() -> float | None:
            return next((r.t for r in self.audit.between(t0, time.time() + 1)
                         if r.verb == "watch" and r.resource == "loradeployments"), None)

        if self._wait(lambda: first_watch() is not None, self.args.timeout, "the operator to watch LoRADeployments"):
            return _r((first_watch() or t0) - t0, 2)
        return None

    def all_ready(self, names: Iterable[str], newer_than: dict[str, int] | None = None) -> Callable[[], bool]:
        """Every named adapter Ready for its current generation (and, for a change, for a generation
        newer than the one it had before: the watch may not have seen the change yet)."""
        names = list(names)
        before = newer_than or {}
        assert self.watcher

        def ok(n: str, s: AdapterState) -> bool:
            return ready_now(s) and s.generation > before.get(n, 0)

        return lambda: self.watcher.count_where(names, ok) == len(names)

    def settle(self, ph: Phase, t_ref: float, cond: Callable[[], bool] | None, what: str,
               first: Callable[[], bool] | None = None) -> None:
        """Waits for `first` (its time goes to phase_s), then `cond` (ready_s), then the operator to be
        quiet (quiet_s: its last write before the quiet gap), all in seconds after t_ref."""
        if first is not None:
            t_first = self._wait(first, self.args.timeout, "every adapter to have a phase")
            ph.values["phase_s"] = _r(t_first - t_ref, 2) if t_first else None
        t_ready = self._wait(cond, self.args.timeout, what) if cond is not None else time.time()
        if cond is not None:
            ph.values["ready_s"] = _r(t_ready - t_ref, 2) if t_ready else None
        t_quiet = self.wait_quiet(t_ref)
        ph.values["quiet_s"] = _r(t_quiet - t_ref, 2) if t_quiet else None
        # The phase's counters run until it is both done and quiet (a restart that writes nothing
        # is quiet at once, and done only when every object is resumed).
        done = max(t for t in (t_ready, t_quiet, t_ref) if t)
        self.end(ph, done + self.args.quiet_seconds)

    def apply_changes(self, names: list[str], tps: float) -> float:
        docs = [adapter_doc(n, self.pool, RANKS[self.ranks[n]], tps) for n in names]
        path = write_docs(self.work / f"change-{len(names)}.yaml", docs)
        return self.run_kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=loraplex-bench",
                                "-n", self.ns, "-f", str(path))

    # ---- the phases
    def run_phases(self) -> None:
        assert self.operator and self.watcher and self.audit
        n = self.args.adapters
        names = [adapter_name(i) for i in range(n)]
        self.ranks = {nm: i % len(RANKS) for i, nm in enumerate(names)}

        ph = self.begin("setup")
        self.operator.start()
        self.wait_started(ph.t0)
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, "adapterpools",
                                                    pool_doc(self.pool, self.args.agents))
        _log(f"starting {self.args.agents} heartbeating test agents (no engine; they report the adapters "
             "the routing table assigns them)")
        self.agents = [TestAgent(i, self.pool, self.ns, self.redis_url, self.core, 64, 8, "tiny")
                       for i in range(self.args.agents)]
        self._wait(lambda: all(a.pod_ready_at for a in self.agents) and self._pool_ready_replicas()
                   >= self.args.agents, 180, "pods Ready and the pool's readyReplicas")
        ph.values["pods_ready_s"] = _r(max((a.pod_ready_at or 0) for a in self.agents) - ph.t0, 2)
        self.settle(ph, ph.t0, None, "")

        ph = self.begin("create")
        path = write_docs(self.work / "adapters.yaml", (adapter_doc(nm, self.pool, RANKS[self.ranks[nm]], 10.0)
                                                        for nm in names))
        ph.values["kubectl_s"] = _r(self.run_kubectl("create", "-n", self.ns, "-f", str(path)), 2)
        self.expected = set(names)
        self.settle(ph, time.time(), self.all_ready(names), f"{n} adapters Ready",
                    first=lambda: self.watcher.count_where(names, lambda _, st: bool(st.phase)) == n)
        self.results["redis_after_create"] = self.pool_keys()
        _log(f"  redis after create: {self.results['redis_after_create']}")

        ph = self.begin("add one")
        extra = "lora-extra"
        self.ranks[extra] = 1
        path = write_docs(self.work / "extra.yaml", [adapter_doc(extra, self.pool, RANKS[1], 10.0)])
        ph.values["kubectl_s"] = _r(self.run_kubectl("create", "-n", self.ns, "-f", str(path)), 2)
        self.expected.add(extra)
        self.settle(ph, time.time(), self.all_ready([extra]), "the added adapter Ready")

        ph = self.begin("change one")
        gens = self.watcher.generations([names[0]])
        ph.values["kubectl_s"] = _r(self.apply_changes([names[0]], 20.0), 2)
        self.settle(ph, time.time(), self.all_ready([names[0]], gens), "the changed adapter Ready")

        ph = self.begin("delete one")
        victim = names[-1]
        ph.values["kubectl_s"] = _r(self.run_kubectl("delete", "loradeployment", victim, "-n", self.ns,
                                                     "--wait=false"), 2)
        self.expected.discard(victim)
        self.settle(ph, time.time(), lambda: not self.watcher.exists(victim), "the deleted adapter gone")

        ph = self.begin("change 10%")
        changed = names[1:-1:10][: max(1, n // 10)]
        ph.values["changed"] = len(changed)
        gens = self.watcher.generations(changed)
        ph.values["kubectl_s"] = _r(self.apply_changes(changed, 30.0), 2)
        self.settle(ph, time.time(), self.all_ready(changed, gens), f"{len(changed)} changed adapters Ready")

        ph = self.begin("at rest")
        time.sleep(self.args.rest_seconds)
        row = self.end(ph)
        minutes = self.args.rest_seconds / 60.0
        row["api_per_min"] = _r(row["api"]["total"] / minutes)
        row["api_writes_per_min"] = _r(row["api"]["writes"] / minutes)
        row["redis_per_min"] = _r(row["redis_commands"]["total"] / minutes)
        _log(f"  at rest: {row['api_per_min']} API requests/min, {row['redis_per_min']} Redis commands/min")

        ph = self.begin("restart")
        self.operator.stop()
        # kopf resumes every object (each LoRADeployment and the pool) whether or not it writes.
        resumed = len(self.expected) + 1
        t_start, position = time.time(), self.operator.log_position()
        self.operator.start()
        # One adapter created as the operator starts: how soon a restarted operator serves a change.
        fresh = "lora-after-restart"
        self.ranks[fresh] = 0
        path = write_docs(self.work / "after-restart.yaml", [adapter_doc(fresh, self.pool, RANKS[0], 10.0)])
        self.run_kubectl("create", "-n", self.ns, "-f", str(path))
        ph.values["watching_s"] = self.wait_started(t_start)
        t_new = self._wait(self.all_ready([fresh]), self.args.timeout, "the adapter created at the restart Ready")
        ph.values["new_ready_s"] = _r(t_new - t_start, 2) if t_new else None
        _log(f"  restart: watching after {ph.values['watching_s']} s, the new adapter Ready after "
             f"{ph.values['new_ready_s']} s")
        self.expected.add(fresh)
        self.settle(ph, t_start, lambda: self.all_ready(self.expected)() and
                    self.operator.log_count("Resuming is processed", position) >= resumed,
                    "every object resumed and every adapter Ready after the restart")

        self.results["redis_at_end"] = self.pool_keys()
        self.results["adapter_phases_ever"] = self.watcher.ever_counts()
        self.results["ever_pending_store_unavailable"] = len(self.watcher.ever.get(("Pending", "StoreUnavailable"),
                                                                                   ()))
        self.results["operator_log"] = {**self.operator.log_problems(0), "path": str(self.operator.log_path)}
        self.results["events_total"] = self.events_count()
        self.results["redis_clients"] = self.monitor.client_names() if self.monitor else {}
        self.results["agents"] = [{"server": a.server_id, "beats": a.beats, "pod_ready_marks": a.pod_ready_marks,
                                   "errors": dict(a.errors)} for a in self.agents]
        self.results["bench_cpu_s"] = _r(resource.getrusage(resource.RUSAGE_SELF).ru_utime
                                         + resource.getrusage(resource.RUSAGE_SELF).ru_stime, 1)
        self.results["audit_lines_read"] = self.audit.lines_read

    def _pool_ready_replicas(self) -> int:
        try:
            obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, "adapterpools", self.pool)
        except Exception:  # noqa: BLE001
            return 0
        return int((obj.get("status") or {}).get("readyReplicas") or 0)

    # ---- cleanup
    def cleanup(self) -> None:
        if self._cleanup_done:
            return
        self._cleanup_done = True
        _log("cleaning up")
        for a in self.agents:
            a.stop()
        if self.operator is not None:
            with contextlib.suppress(Exception):
                self.operator.stop(grace_s=10)
        if self.watcher is not None:
            self.watcher.close()
        if hasattr(self, "custom"):
            with contextlib.suppress(Exception):
                self._drop_finalizers()
            with contextlib.suppress(Exception):
                self.core.delete_namespace(self.ns)
            with contextlib.suppress(Exception):
                self.rbac.delete_cluster_role_binding(self.crb)
        if self.monitor is not None:
            self.monitor.close()
        if self.audit is not None:
            self.audit.close()
        if self.redis_client is not None:
            with contextlib.suppress(Exception):
                self.redis_client.close()
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            try:
                self.redis_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.redis_proc.kill()

    def _drop_finalizers(self) -> None:
        """With the operator stopped, its finalizers would hold the namespace's deletion forever."""
        from concurrent.futures import ThreadPoolExecutor

        jobs = []
        for plural in ("loradeployments", "adapterpools"):
            items = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, plural).get("items", [])
            jobs += [(plural, o["metadata"]["name"]) for o in items if o["metadata"].get("finalizers")]

        def drop(job: tuple[str, str]) -> None:
            with contextlib.suppress(Exception):
                self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, job[0], job[1],
                                                           {"metadata": {"finalizers": None}})

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(drop, jobs))


# --------------------------------------------------------------------------------------- reporting


def markdown(results: dict[str, Any]) -> str:
    head = ("| phase | kubectl s | all phased s | Ready s | quiet s | API requests | API writes | adapter status "
            "PATCHes | writes by verb | operator CPU s | operator peak RSS MB | Redis cmds | new Events | ERROR lines |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def cell(x: Any) -> str:
        return "—" if x is None else str(x)

    for row in results["phases"]:
        writes = Counter(v.split(" ")[0] for v in row["api"]["writes_by_resource"]
                         for _ in range(row["api"]["writes_by_resource"][v]))
        lines.append("| " + " | ".join(cell(x) for x in (
            row["phase"], row.get("kubectl_s"), row.get("phase_s"), row.get("ready_s"), row.get("quiet_s"),
            row["api"]["total"], row["api"]["writes"],
            row["api"]["writes_by_resource"].get("patch loradeployments/status", 0),
            ", ".join(f"{k} {v}" for k, v in writes.most_common()) or "0",
            row["operator_cpu_s"], row.get("operator_peak_rss_mb"), row["redis_commands"]["total"], row["events_new"],
            row["log"]["error_lines"])) + " |")
    rest = next((r for r in results["phases"] if r["phase"] == "at rest"), None)
    restart = next((r for r in results["phases"] if r["phase"] == "restart"), None)
    extra = []
    if restart:
        extra.append(f"Restart: watching LoRADeployments {restart.get('watching_s')} s after the operator started; "
                     f"an adapter created then Ready after {restart.get('new_ready_s')} s.")
    if rest:
        extra.append(f"At rest: {rest['api_per_min']} API requests/min ({rest['api_writes_per_min']} writes), "
                     f"{rest['redis_per_min']} Redis commands/min.")
    for key in ("redis_after_create", "redis_at_end"):
        if key in results:
            r = results[key]
            extra.append(f"Redis keys of the pool {key.removeprefix('redis_').replace('_', ' ')}: {r['keys']} keys, "
                         f"{r['mb']} MB ({r['by_kind']}).")
    if "operator_log" in results:
        log = results["operator_log"]
        extra.append(f"Operator log: {log['error_lines']} ERROR lines, {log['tracebacks']} tracebacks.")
    if "ever_pending_store_unavailable" in results:
        extra.append(f"Adapters that ever reported Pending/StoreUnavailable: "
                     f"{results['ever_pending_store_unavailable']}; Events in the namespace: "
                     f"{results.get('events_total')}.")
    return "\n".join(lines + [""] + extra)


def run(args: argparse.Namespace) -> int:
    if not os.environ.get("KUBECONFIG"):
        raise CommandError("KUBECONFIG is not set: point it at the API server to measure against")
    if not Path(args.audit_log).exists():
        raise CommandError(f"no audit log at {args.audit_log} (the API server's --audit-log-path; see --audit-log)")
    bench = Bench(args)

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    failed: BaseException | None = None
    try:
        bench.setup()
        _log(f"{args.adapters} adapters, {args.agents} heartbeating test agents, pool {args.pool}")
        bench.run_phases()
    except (Exception, KeyboardInterrupt) as exc:
        failed = exc
        bench.results["failed"] = f"{type(exc).__name__}: {exc}"
        _log(f"stopped: {type(exc).__name__}: {exc}")
    finally:
        bench.cleanup()
        signal.signal(signal.SIGTERM, old)
    if bench.results["phases"]:
        print()
        print(f"Operator at scale: {args.adapters} LoRADeployments, {args.agents} heartbeating test agents, "
              f"API server {bench.results.get('server_version')}")
        print()
        print(markdown(bench.results))
        for note in bench.results["notes"]:
            print(f"note: {note}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(bench.results, indent=1, default=str))
        print(f"wrote {args.out}")
    if isinstance(failed, CommandError):
        raise failed
    return 1 if failed else 0
