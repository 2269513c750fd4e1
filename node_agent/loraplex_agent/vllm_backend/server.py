"""`loraplex agent --backend vllm`: the agent beside an unmodified vLLM OpenAI server.

The vLLM server is the agent's child (started here with the pool's settings, stopped with the agent),
or, with `--vllm-url`, a server already running beside it (the pod's second container). Either way
the agent:

- registers the vLLM server in the pool (the routing table sends requests straight to it) and
  heartbeats while it is healthy, with its queue depth and resident adapters read from its metrics,
  its max LoRA rank and its adapter slots (max_cpu_loras) for the placement;
- prefetches the adapters assigned to it through the distributed adapter pool (peer first, then the
  source, digest-checked) into its adapter store, loads and unloads them through vLLM's runtime
  endpoints on the loopback, and serves them to peers (GET /v1/adapters/{name}/files);
- answers the vLLM middleware's `POST /internal/ensure` (loopback only) before vLLM sees a request: the
  adapter is loaded if it is not yet, and pinned (never evicted) until `POST /internal/release` at
  the end of the answer.

A child that exits takes the agent down with it (exit status 1, one line); an external server that
stops answering takes the server out of the registry until it answers again, and the agent then loads
its adapters into it again.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel

from loraplex.backends.loraplex_vllm import LOOPBACK
from loraplex.backends.vllm import VllmLaunch
from loraplex.routing.redis_store import RedisRoutingStore
from loraplex.routing.store import StoreUnavailableError
from loraplex.spec.crd import VLLM_LORA_RANKS
from loraplex.spec.errors import CommandError, LoraplexError, OverloadedError, PermissionDeniedError
from loraplex.startup import listen_socket, open_store
from loraplex_agent.cluster.fetcher import AdapterFetcher
from loraplex_agent.cluster.member import ClusterMember
from loraplex_agent.cluster.peer import add_peer_routes
from loraplex_agent.cluster.settings import ClusterSettings
from loraplex_agent.vllm_backend.engine import VllmEngine
from loraplex_agent.vllm_backend.process import VllmProcess

log = logging.getLogger("loraplex.agent.vllm")
DEFAULT_MAX_LORA_RANK = 64
STARTUP_TIMEOUT_S = 900.0  # a large model on a cold disk; the tiny one takes 30-90 s on two cores
WATCH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class VllmOptions:
    """The vLLM side of `loraplex agent`, checked."""

    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int
    local_url: str                 # where the agent reaches vLLM (the loopback)
    advertise_url: str             # where the router reaches it
    launch: VllmLaunch | None      # None: an external server (--vllm-url)
    log_path: Path | None


def options_from_args(args: argparse.Namespace) -> VllmOptions:
    """Every check that needs no process, each failing with one line."""
    if not args.redis_url:
        raise CommandError("--backend vllm serves as a member of a pool: give --redis-url (or LORAPLEX_REDIS_URL)")
    if args.adapter:
        raise CommandError("--adapter is not used with --backend vllm: adapters come from the pool's "
                           "LoRADeployments")
    if args.api_key:
        raise CommandError("--api-key is not used with --backend vllm: inference is the vLLM server's own (the "
                           "router's --api-keys guard it in a pool); --admin-api-key guards the agent's endpoints")
    rank = args.max_lora_rank or DEFAULT_MAX_LORA_RANK
    if rank not in VLLM_LORA_RANKS:
        raise CommandError(f"--max-lora-rank {rank}: vLLM accepts one of {', '.join(map(str, VLLM_LORA_RANKS))}")
    cpu_loras = args.max_cpu_loras or args.max_loras
    if args.max_loras < 1 or cpu_loras < args.max_loras:
        raise CommandError(f"--max-cpu-loras ({cpu_loras}) must be at least --max-loras ({args.max_loras}), "
                           "which must be at least 1")
    if args.vllm_url:
        url = args.vllm_url.rstrip("/")
        return VllmOptions(rank, args.max_loras, cpu_loras, url, (args.vllm_advertise_url or url).rstrip("/"),
                           None, None)
    launch = _launch(args, rank, cpu_loras)
    log_path = Path(args.vllm_log) if args.vllm_log else Path(tempfile.gettempdir()) / f"loraplex-vllm-{launch.port}.log"
    return VllmOptions(rank, args.max_loras, cpu_loras, launch.url,
                       (args.vllm_advertise_url or launch.url).rstrip("/"), launch, log_path)


def _launch(args: argparse.Namespace, rank: int, cpu_loras: int) -> VllmLaunch:
    if not Path(args.model).is_dir():
        raise CommandError(f"--model {args.model!r} is not a folder")
    port = args.vllm_port or args.port + 1
    if port == args.port:
        raise CommandError("--vllm-port must differ from --port")
    agent_host = "127.0.0.1" if args.host in ("0.0.0.0", "127.0.0.1") else args.host
    return VllmLaunch(python=args.vllm_python or os.environ.get("LORAPLEX_VLLM_PYTHON") or _default_python(),
                      model=str(args.model), served_model_name=args.served_model_name or Path(args.model).name,
                      host=args.vllm_host or args.host, port=port, agent_url=f"http://{agent_host}:{args.port}",
                      dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      max_loras=args.max_loras, max_lora_rank=rank, max_cpu_loras=cpu_loras,
                      extra_args=tuple(args.vllm_arg), scheduler_cls=args.vllm_scheduler_cls)


def _default_python() -> str:
    """./.venv-vllm (scripts/setup-vllm.sh) when it is there, else this interpreter."""
    local = Path(".venv-vllm/bin/python")
    return str(local.absolute()) if local.is_file() else sys.executable


# ---- the app ----------------------------------------------------------------------------------


class AdapterRequest(BaseModel):
    adapter: str


@dataclass
class Sidecar:
    """What the app's lifespan runs: the engine view, the member, and the child when there is one."""

    engine: VllmEngine
    member: ClusterMember
    store: RedisRoutingStore
    process: VllmProcess | None
    failure: str | None = None
    shutdown: Callable[[], None] = lambda: None  # asks the HTTP server to stop

    async def watch(self) -> None:
        """Refresh the view every second; a child that exited stops the agent."""
        while True:
            await self.engine.refresh()
            if self.process is not None and not self.process.alive:
                self.failure = f"{self.process.exit_reason()} (log: {self.process.log_path})"
                log.error("%s", self.failure)
                self.engine.healthy = False
                await self.member.stop()  # leaves the registry now, not at the heartbeat TTL
                self.shutdown()
                return
            await asyncio.sleep(WATCH_INTERVAL_S)


def build_app(sidecar: Sidecar, api_key: str | None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await sidecar.member.start()
        watcher = asyncio.create_task(sidecar.watch(), name="loraplex-vllm-watch")
        try:
            yield
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            if sidecar.failure is None:
                await sidecar.member.stop()
            sidecar.store.close()
            await sidecar.engine.aclose()

    app = FastAPI(title="Loraplex node agent (vLLM backend)", lifespan=lifespan)
    add_peer_routes(app, sidecar.engine, api_key)
    _add_routes(app, sidecar)
    return app


def _add_routes(app: FastAPI, sidecar: Sidecar) -> None:
    engine, member = sidecar.engine, sidecar.member

    @app.get("/health")
    async def health() -> Response:
        if not engine.healthy:
            error = OverloadedError(f"the vLLM server at {engine.url} is not healthy: {engine.error}")
            return JSONResponse(error.to_openai(), status_code=error.status)
        return JSONResponse({"backend": "vllm", "vllm_url": engine.url,
                             "vllm_pid": sidecar.process.pid if sidecar.process else None,
                             "adapters": sorted(engine.adapters)})

    @app.post("/internal/ensure")
    async def ensure(body: AdapterRequest, raw: Request) -> Response:
        """The vLLM middleware's call before vLLM sees a request: hold this adapter, pinned until the
        middleware's /internal/release at the end of the answer (loopback only). vLLM loads a LoRA
        from its folder whenever it is not in its cache, so neither the adapter nor its folder may go
        while a request for it is in vLLM: without its folder, vLLM's engine dies."""
        try:
            _check_loopback(raw, "/internal/ensure")
            member.pin(body.adapter)
            try:
                await member.ensure(body.adapter)
            except BaseException:
                member.unpin(body.adapter)
                raise
        except LoraplexError as exc:
            return JSONResponse(exc.to_openai(), status_code=exc.status)
        except StoreUnavailableError as exc:
            error = OverloadedError(f"cannot load adapter now: {exc}")
            return JSONResponse(error.to_openai(), status_code=error.status)
        return JSONResponse({"adapter": body.adapter, "loaded": True})

    @app.post("/internal/release")
    async def release(body: AdapterRequest, raw: Request) -> Response:
        """The vLLM middleware's call when vLLM's answer has ended: the pin of /internal/ensure goes."""
        try:
            _check_loopback(raw, "/internal/release")
        except LoraplexError as exc:
            return JSONResponse(exc.to_openai(), status_code=exc.status)
        member.unpin(body.adapter)
        return JSONResponse({"adapter": body.adapter, "released": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(_render_metrics(sidecar), media_type=CONTENT_TYPE_LATEST)


def _check_loopback(request: Request, path: str) -> None:
    if not request.client or request.client.host not in LOOPBACK:
        raise PermissionDeniedError(f"{path} is only open to the vLLM server on this pod's loopback")


def _render_metrics(sidecar: Sidecar) -> bytes:
    """The agent's own series under the names our engine's agent uses, so the dashboard's adapter panels
    read both backends; vLLM's vllm:* series are on the vLLM server's /metrics (scraped too)."""
    registry = CollectorRegistry()
    registry.register(_AgentCollector(sidecar))
    return generate_latest(registry)


class _AgentCollector(Collector):
    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def collect(self) -> Iterator[Metric]:
        engine, labels = self.sidecar.engine, [self.sidecar.member.base_model]
        _, resident, _ = engine.cluster_report()
        for family, value in (
            (CounterMetricFamily("loraplex:adapter_loads", "Adapters loaded into the vLLM server.",
                                 labels=["model_name"]), engine.adapter_loads),
            (GaugeMetricFamily("loraplex:resident_adapters", "Adapters of the vLLM server's running requests "
                               "(they hold its LoRA slots).", labels=["model_name"]), len(resident)),
            (GaugeMetricFamily("loraplex:host_adapters", "Adapters this agent holds and has loaded into vLLM.",
                               labels=["model_name"]), len(engine.adapters)),
            (GaugeMetricFamily("loraplex:backend_up", "1 while the vLLM server beside this agent answers.",
                               labels=["model_name"]), int(engine.healthy))):
            family.add_metric(labels, value)
            yield family


# ---- `loraplex agent --backend vllm` ----------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Start (or find) the vLLM server, join the pool, serve until stopped or the server dies."""
    options = options_from_args(args)
    import uvicorn

    with listen_socket(args.host, args.port) as sock:
        open_store(args.redis_url, args.pool).close()
        settings = ClusterSettings.from_args(args)
        process = _start_child(options)
        try:
            engine = _wait_ready(options, process)
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            logging.getLogger("httpx").setLevel(logging.WARNING)
            sidecar = _sidecar(args, settings, options, engine, process)
            server = uvicorn.Server(uvicorn.Config(build_app(sidecar, _api_key(args)), log_level="info"))
            sidecar.shutdown = lambda: setattr(server, "should_exit", True)
            log.info("serving the vLLM server at %s (pid %s, log %s) for pool %s as %s; agent on http://%s:%d",
                     options.advertise_url, process.pid if process else "-", options.log_path, settings.pool,
                     settings.server_id, args.host, args.port)
            server.run(sockets=[sock])
        finally:
            if process is not None:
                process.stop()
                shutil.rmtree(process.plugin_dir, ignore_errors=True)
    if sidecar.failure:
        raise CommandError(sidecar.failure)
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """The admin key of the sidecar's own endpoints (--admin-api-key, env LORAPLEX_API_KEY). vLLM itself
    serves inference: --api-key would not reach it, so it is refused (`_launch`)."""
    return args.admin_api_key


def _start_child(options: VllmOptions) -> VllmProcess | None:
    if options.launch is None:
        return None
    plugin_dir = Path(tempfile.mkdtemp(prefix="loraplex-vllm-plugin-"))
    return VllmProcess(options.launch, plugin_dir, options.log_path).start()


def _wait_ready(options: VllmOptions, process: VllmProcess | None) -> VllmEngine:
    """The engine view once the server answers; one line if the child exits or time runs out."""
    async def wait() -> VllmEngine:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        engine = VllmEngine(options.local_url, max_lora_rank=options.max_lora_rank, max_loras=options.max_loras,
                            max_cpu_loras=options.max_cpu_loras)
        while not await engine.refresh():
            if process is not None and not process.alive:
                await engine.aclose()
                raise CommandError(f"{process.exit_reason()} while starting (log: {process.log_path})")
            if time.monotonic() > deadline:
                await engine.aclose()
                raise CommandError(f"the vLLM server at {options.local_url} did not become healthy within "
                                   f"{STARTUP_TIMEOUT_S:.0f} s: {engine.error}")
            await asyncio.sleep(1.0)
        await engine.aclose()  # its connections belong to this loop; the server's loop opens its own
        return engine

    return asyncio.run(wait())


def _sidecar(args: argparse.Namespace, settings: ClusterSettings, options: VllmOptions, engine: VllmEngine,
             process: VllmProcess | None) -> Sidecar:
    store = RedisRoutingStore.from_url(settings.redis_url, settings.pool)
    fetcher = AdapterFetcher(settings.adapter_store, settings.sources, _api_key(args))
    base_model = args.served_model_name or engine.served_model_name or Path(args.model).name
    member = ClusterMember(settings, store, engine, fetcher, options.max_lora_rank, base_model, backend="vllm",
                           serving_url=options.advertise_url, max_adapters=options.max_cpu_loras)
    return Sidecar(engine, member, store, process)
