"""Forwarding one request: pick a server with the routing profile, send, stream the answer back.

A request is sent again to another server when the attempt fails before the first byte of the
answer (connection refused or reset, server gone, 502/503/504 from the server): nothing has reached
the client yet, so nothing is lost or duplicated. Once the first byte is through, the answer is
committed to that server. A server that failed is avoided for `cooldown_s` so that requests do not
keep hitting a dead agent before its heartbeat expires.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from loraplex.routing.pipeline import NoCandidateError, Profile
from loraplex.spec.errors import OverloadedError
from loraplex_router.demand import DemandCounter
from loraplex_router.errors import UpstreamError
from loraplex_router.metrics import RouterMetrics
from loraplex_router.snapshot import Snapshot
from loraplex_router.sse import Usage, UsageTap

RETRY_STATUSES = frozenset({502, 503, 504})
SERVER_HEADER = "x-loraplex-server"
ADAPTER_HEADER = "x-loraplex-adapter"
_USAGE_OPTION = b'{"stream_options":{"include_usage":true},'  # opens the object it is spliced into


class _AttemptFailed(Exception):
    """This server failed before the first byte; try another one."""


@dataclass
class Forward:
    """One client request, parsed enough to route it."""

    path: str                 # e.g. /v1/chat/completions
    payload: bytes            # the body to send (usage requested in streams)
    model: str
    adapter: str | None       # None: the base model
    stream: bool
    client_wants_usage: bool  # the client itself asked for stream usage
    arrived_at: float


def prepare_body(body: dict, raw: bytes) -> tuple[bytes, bool, bool]:
    """(payload, stream, client_wants_usage): streams always ask the server for usage; any other
    body goes out as the client sent it."""
    stream = bool(body.get("stream"))
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    wants_usage = bool(options.get("include_usage"))
    if not stream or wants_usage:
        return raw, stream, wants_usage
    text = raw.lstrip()
    if "stream_options" not in body and text.startswith(b"{"):  # UTF-8 without BOM, the usual case:
        return _USAGE_OPTION + text[1:], stream, wants_usage   # splice the option in, no re-serialising
    body = {**body, "stream_options": {**options, "include_usage": True}}
    return json.dumps(body, separators=(",", ":")).encode(), stream, wants_usage


class Proxy:
    def __init__(self, client: httpx.AsyncClient, profile: Profile, metrics: RouterMetrics,
                 demand: DemandCounter, max_attempts: int = 3, cooldown_s: float = 5.0) -> None:
        self.client = client
        self.profile = profile
        self.metrics = metrics
        self.demand = demand
        self.max_attempts = max_attempts
        self.cooldown_s = cooldown_s
        self.in_flight: dict[str, int] = {}
        self._down_until: dict[str, float] = {}

    async def forward(self, snapshot: Snapshot, fwd: Forward) -> Response:
        tried: set[str] = set()
        for attempt in range(self.max_attempts):
            server = self._pick(snapshot, fwd.adapter, tried)
            tried.add(server)
            if attempt:
                self.metrics.retries.inc()
            try:
                return await self._attempt(snapshot, server, fwd)
            except _AttemptFailed:
                self.metrics.upstream_failures.labels(server).inc()
        raise UpstreamError(f"{len(tried)} servers failed before answering: {sorted(tried)}")

    def _pick(self, snapshot: Snapshot, adapter: str | None, tried: set[str]) -> str:
        now = time.monotonic()
        down = tried | {s for s, until in self._down_until.items() if until > now}
        candidates = snapshot.candidates(adapter, down, self.in_flight)
        try:
            server = self.profile.pick(snapshot.route_request(adapter), candidates).server_id
        except NoCandidateError as exc:
            raise OverloadedError(f"no healthy server can serve this model ({exc.reason})",
                                  code="no_healthy_server") from exc
        self.metrics.picks.labels(server).inc()
        return server

    async def _attempt(self, snapshot: Snapshot, server: str, fwd: Forward) -> Response:
        url = snapshot.servers[server].url.rstrip("/") + fwd.path
        headers = {"content-type": "application/json"}
        if fwd.adapter is not None:
            headers[ADAPTER_HEADER] = fwd.adapter  # lets the agent fetch a missing adapter first
        request = self.client.build_request("POST", url, content=fwd.payload, headers=headers)
        self._enter(server)
        try:
            upstream = await self.client.send(request, stream=True)
            if upstream.status_code in RETRY_STATUSES:
                await upstream.aclose()
                raise _AttemptFailed(server)
            if fwd.stream and upstream.status_code == 200:
                return await self._stream(server, upstream, fwd)  # takes over the in-flight count
            response = await self._whole(server, upstream, fwd)
        except httpx.TransportError as exc:
            self._mark_down(server)
            self._leave(server)
            raise _AttemptFailed(server) from exc
        except BaseException:
            self._leave(server)
            raise
        self._leave(server)
        return response

    async def _whole(self, server: str, upstream: httpx.Response, fwd: Forward) -> Response:
        try:
            body = await upstream.aread()
        finally:
            await upstream.aclose()
        self.metrics.time_to_first_byte.observe(time.monotonic() - fwd.arrived_at)
        if upstream.status_code == 200:
            self._count(fwd, _usage_of(body))
        self._finish(fwd, upstream.status_code)
        return Response(body, status_code=upstream.status_code, headers={SERVER_HEADER: server},
                        media_type=upstream.headers.get("content-type", "application/json"))

    async def _stream(self, server: str, upstream: httpx.Response, fwd: Forward) -> StreamingResponse:
        chunks = upstream.aiter_raw()
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            await upstream.aclose()
            raise httpx.RemoteProtocolError("the server closed the stream before sending anything") from None
        except BaseException:
            await upstream.aclose()
            raise
        self.metrics.time_to_first_byte.observe(time.monotonic() - fwd.arrived_at)
        tap = UsageTap(forward_usage_chunk=fwd.client_wants_usage)
        return StreamingResponse(self._relay(server, upstream, first, chunks, tap, fwd),
                                 media_type=upstream.headers.get("content-type", "text/event-stream"),
                                 headers={SERVER_HEADER: server, "cache-control": "no-cache"})

    async def _relay(self, server: str, upstream: httpx.Response, first: bytes, chunks: AsyncIterator[bytes],
                     tap: UsageTap, fwd: Forward) -> AsyncIterator[bytes]:
        status = 200
        try:
            if out := tap.feed(first):
                yield out
            async for chunk in chunks:
                if out := tap.feed(chunk):
                    yield out
            if out := tap.flush():
                yield out
        except httpx.TransportError:
            status = 502  # the server died mid-stream: the client sees a truncated stream
            raise
        finally:
            await upstream.aclose()
            self._leave(server)
            self._count(fwd, tap.usage)
            self._finish(fwd, status)

    def _count(self, fwd: Forward, usage: Usage | None) -> None:
        if usage is None:
            return
        label = fwd.model
        self.metrics.tokens.labels(label, "prompt").inc(usage.prompt_tokens)
        self.metrics.tokens.labels(label, "completion").inc(usage.completion_tokens)
        if fwd.adapter is not None:
            self.demand.add(fwd.adapter, usage.prompt_tokens + usage.completion_tokens)

    def _finish(self, fwd: Forward, status: int) -> None:
        self.metrics.requests.labels(fwd.model, str(status)).inc()
        self.metrics.duration.observe(time.monotonic() - fwd.arrived_at)

    def _enter(self, server: str) -> None:
        self.in_flight[server] = self.in_flight.get(server, 0) + 1
        self.metrics.in_flight.labels(server).set(self.in_flight[server])

    def _leave(self, server: str) -> None:
        self.in_flight[server] = max(0, self.in_flight.get(server, 1) - 1)
        self.metrics.in_flight.labels(server).set(self.in_flight[server])

    def _mark_down(self, server: str) -> None:
        self._down_until[server] = time.monotonic() + self.cooldown_s


def _usage_of(body: bytes) -> Usage | None:
    try:
        return Usage.from_body(json.loads(body))
    except ValueError:
        return None
