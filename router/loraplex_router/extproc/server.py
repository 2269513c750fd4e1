"""The picker's gRPC server: Envoy's ExternalProcessor and gRPC health, on the router's event loop.

Health (GIE's three services): `liveness` serves as long as the process answers; `readiness` and
`envoy.service.ext_proc.v3.ExternalProcessor` serve once the routing table is read and a server's
address is known (what the router's `/ready` asks, plus the address the gateway needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from fastapi import FastAPI
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from loraplex_router.app import Service
from loraplex_router.auth import KeyRing
from loraplex_router.extproc.decision import Decider, PickerSettings
from loraplex_router.extproc.endpoints import Endpoints
from loraplex_router.extproc.exchange import Exchange, Refused
from loraplex_router.extproc.metrics import PickerMetrics
from loraplex_router.extproc.protocol import SERVICE
from loraplex_router.metrics import RouterMetrics
from loraplex_router.proxy import Proxy
from loraplex_router.snapshot import Snapshot

log = logging.getLogger("loraplex.router")
READY_SERVICES = ("readiness", SERVICE)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ExtProcConfig:
    host: str
    port: int
    picker: PickerSettings


class Processor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, decider: Decider, proxy: Callable[[], Proxy], metrics: PickerMetrics) -> None:
        self.decider, self.proxy, self.metrics = decider, proxy, metrics
        self.open: set[Exchange] = set()  # the streams open now (the leak test reads it)

    async def Process(self, requests: AsyncIterator[ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ProcessingResponse]:
        exchange = Exchange(self.decider, self.proxy(), self.metrics)
        self.open.add(exchange)
        self.metrics.streams.inc()
        try:
            async for request in requests:
                for response in exchange.handle(request):
                    yield response
        except Refused as refused:
            yield refused.args[0]
        finally:
            exchange.close()
            self.open.discard(exchange)
            self.metrics.streams.dec()


def picker_service(config: ExtProcConfig, keys: KeyRing, poll_interval_s: float) -> Service:
    """The picker as a service of the router app (`create_app(..., services=[...])`)."""

    @contextlib.asynccontextmanager
    async def serve(app: FastAPI) -> AsyncIterator[None]:
        picker = PickerServer(config, lambda: app.state.proxy, lambda: app.state.cache.snapshot, keys,
                              app.state.metrics, poll_interval_s)
        await picker.start()
        app.state.picker = picker
        try:
            yield
        finally:
            await picker.stop()

    return serve


class PickerServer:
    """Started and stopped in the router app's lifespan, beside the HTTP proxy it shares state with."""

    def __init__(self, config: ExtProcConfig, proxy: Callable[[], Proxy], snapshot: Callable[[], Snapshot],
                 keys: KeyRing, metrics: RouterMetrics, poll_interval_s: float) -> None:
        self.config, self.snapshot, self.poll_interval_s = config, snapshot, poll_interval_s
        self.metrics = PickerMetrics(metrics)
        self.endpoints = Endpoints()
        decider = Decider(proxy, snapshot, keys, self.endpoints, config.picker)
        self.processor = Processor(decider, proxy, self.metrics)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.processor, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        self.server.add_insecure_port(f"{address}:{self.config.port}")
        await self.health.set("liveness", SERVING)
        await self._follow()
        await self.server.start()
        self._watch = asyncio.ensure_future(self._watching())
        log.info("endpoint picker (ext_proc) listening on %s:%d", self.config.host, self.config.port)

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace_s)

    async def _watching(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self._follow()
            except Exception:  # a failed resolution must never stop the picker
                log.exception("endpoint picker: refreshing the servers' addresses failed")

    async def _follow(self) -> None:
        """Resolves the servers' addresses and sets readiness from the snapshot."""
        snapshot = self.snapshot()
        await self.endpoints.refresh(snapshot.servers)
        ready = len(self.endpoints.table(snapshot.servers))
        self.metrics.ready_endpoints.set(ready)
        status = SERVING if snapshot.taken_at > 0 and ready else NOT_SERVING
        for service in READY_SERVICES:
            await self.health.set(service, status)
