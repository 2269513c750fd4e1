"""Forwarding one request: pick a server with the routing profile, send, stream the answer back.

A request is sent again to another server when the attempt fails before the first byte of the
answer: nothing has reached the client yet, so nothing is lost or duplicated. Once the first byte is
through, the answer is committed to that server. An attempt fails before its first byte when

- the connection fails or breaks, or the server answers 502/503/504;
- it is *given up* (abandoned there: the server sees the client go away), which happens when a
  streamed request got no first chunk within the time-to-first-byte deadline, when the server was
  ejected meanwhile, when the server's heartbeat is late and the attempt has waited as long (the
  process has stopped: it neither answers nor heartbeats), when the server left the registry (an
  agent whose engine stalls leaves it), or when a non-streamed request has waited past the deadline
  and the server's `/health` does not answer 200 within `probe_timeout_s` (a non-streamed answer's
  first byte comes only at its end, so the deadline alone cannot tell a long generation from a hung
  server; the probe can, and is repeated every deadline while the request waits). A
  request's last allowed attempt is never given up, nor one with no other server left to try:
  waiting beats failing.

With a prefix-aware profile the proxy keeps the router's prefix index (`loraplex.routing.prefix`):
each pick reads how many leading prefix blocks of the request every candidate holds, and records
the request's blocks for the server it chose. The prompt tokens the server reports cached
(`usage.prompt_tokens_details.cached_tokens`), else the blocks matched on the server that answers,
are taken out of the request's demand (`loraplex.routing.demand.demand_tokens`): that prefill is cached.

Deadline misses and failed connections feed the outlier detector (`loraplex.routing.outliers`);
no request picks an ejected server until its ejection ends. A server ejected for silence is also
dropped from the registry at once (`TableCache.drop_server`), not when its heartbeat TTL runs out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
from fastapi.responses import Response, StreamingResponse

from loraplex.routing.demand import demand_tokens
from loraplex.routing.outliers import Failure, Outcome, OutlierConfig, OutlierDetector, TtfbDeadline
from loraplex.routing.pipeline import Candidate, NoCandidateError, Profile, prefix_config
from loraplex.routing.prefix import (
    PrefixConfig,
    PrefixIndex,
    adapter_seed,
    alora_body_keys,
    body_keys,
    chunk_tokens,
)
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
CHECK_INTERVAL_S = 0.25  # how often an attempt waiting for its first byte looks at its server
PROBE_TIMEOUT_S = 2.0  # a live server answers /health at once, however busy its engine is
DROP_WAIT_S = 2.0  # how long attempts given up on a silent server wait for its drop before retrying

log = logging.getLogger("loraplex.router")


class _AttemptFailed(Exception):
    """This server failed before the first byte; try another one."""


@dataclass(frozen=True)
class ProxyConfig:
    max_attempts: int = 3          # servers tried per request
    ttfb_deadline_s: float = 10.0  # for a streamed request's first chunk (at least: see TtfbDeadline); 0: none
    outliers: OutlierConfig = field(default_factory=OutlierConfig)
    check_interval_s: float = CHECK_INTERVAL_S
    probe_timeout_s: float = PROBE_TIMEOUT_S


@dataclass
class _Opened:
    """An attempt past its first byte: the response and, for a stream, its first chunk and the rest."""

    upstream: httpx.Response
    first: bytes | None = None
    chunks: AsyncIterator[bytes] | None = None


@dataclass
class _Attempt:
    server: str
    tried: set[str]       # the servers this request has tried, this one included
    last: bool            # the request's last allowed attempt: never given up
    stream: bool
    started: float = field(default_factory=time.monotonic)
    silence_reported: bool = False
    probes: int = 0       # liveness probes of a non-streamed attempt so far (one per deadline waited)


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
    prefix: list[int] = field(default_factory=list)  # the prompt's prefix keys (prefix-aware profiles)
    cached_blocks: int = 0    # of them, matched on the server last picked (predicted cached there)
    block_tokens: int = 0     # tokens a prefix block stands for


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
    def __init__(self, client: httpx.AsyncClient, profile: Profile, metrics: RouterMetrics, demand: DemandCounter,
                 config: ProxyConfig, view: Callable[[], Snapshot], wall: Callable[[], float] = time.time,
                 detector: OutlierDetector | None = None,
                 drop: Callable[[str, float], object] | None = None) -> None:
        """`view` gives the router's current snapshot (fresher than a request's own after a long wait);
        `wall` is the clock of the snapshots' read times; `drop(server, heartbeat_at)` removes a silent
        server from the registry (blocking: it runs in a worker thread)."""
        self.client = client
        self.profile = profile
        self.metrics = metrics
        self.demand = demand
        self.config = config
        self.view = view
        self.wall = wall
        self.detector = detector or OutlierDetector(config.outliers)
        self.drop = drop
        self._dropping: dict[str, asyncio.Future] = {}  # silent servers being dropped from the registry
        self.deadline = TtfbDeadline(config.ttfb_deadline_s)
        self.in_flight: dict[str, int] = {}
        self.metrics.ttfb_deadline.set(self.deadline.current())
        self._prefixes: PrefixIndex | None = None

    def prefix_keys(self, snapshot: Snapshot, adapter: str | None, body: dict) -> list[int]:
        """The request's prefix keys when the profile in use reads prefixes, else none."""
        index = self._prefix_index()
        if index is None:
            return []
        record = snapshot.adapters.get(adapter) if adapter is not None else None
        if record is not None and record.is_alora:
            return alora_body_keys(record.invocation_tokens, body, index.config.chunk_chars)
        return body_keys(adapter_seed(adapter, record.digest if record else ""), body, index.config.chunk_chars)

    def _prefix_index(self) -> PrefixIndex | None:
        """The index, made when a prefix-aware profile comes into use; its keys are kept across a
        change of the profile's knobs unless the chunk size changes (then they no longer match)."""
        config = prefix_config(self.profile)
        if config is None:
            self._prefixes = None  # a profile without prefixes: the memory goes back
            return None
        if self._prefixes is None or self._prefixes.config.chunk_chars != config.chunk_chars:
            self._prefixes = PrefixIndex(config)
        self._prefixes.config = config
        return self._prefixes

    async def forward(self, snapshot: Snapshot, fwd: Forward) -> Response:
        tried: set[str] = set()
        for attempt in range(self.config.max_attempts):
            server = self.pick(snapshot, fwd, tried)
            tried.add(server)
            if attempt:
                self.metrics.retries.inc()
            last = attempt + 1 == self.config.max_attempts
            try:
                return await self._attempt(snapshot, fwd, _Attempt(server, tried, last, fwd.stream))
            except _AttemptFailed:
                self.metrics.upstream_failures.labels(server).inc()
        raise UpstreamError(f"{len(tried)} servers failed before answering: {sorted(tried)}")

    def pick(self, snapshot: Snapshot, fwd: Forward, tried: set[str]) -> str:
        """The server for the request's next attempt (never one of `tried`); with a prefix index,
        `fwd.cached_blocks` is set to what it predicts that server holds, and the request's blocks are
        recorded for it."""
        server, candidates, index, now = self._choose(snapshot, fwd, tried)
        self.metrics.picks.labels(server).inc()
        if index is not None:
            matched = next(c.prefix_blocks for c in candidates if c.server_id == server)  # as it counts
            fwd.cached_blocks, fwd.block_tokens = matched, chunk_tokens(index.config.chunk_chars)
            self._record_prefix(index, snapshot, server, fwd.prefix, matched, now)
        return server

    def fallback(self, snapshot: Snapshot, fwd: Forward, tried: set[str]) -> str | None:
        """The server the request's next attempt would go to, recording nothing; None when no server
        is left (the endpoint picker's ordered fallback list)."""
        try:
            return self._choose(snapshot, fwd, tried)[0]
        except OverloadedError:
            return None

    def _choose(self, snapshot: Snapshot, fwd: Forward,
                tried: set[str]) -> tuple[str, list[Candidate], PrefixIndex | None, float]:
        adapter, prefix = fwd.adapter, fwd.prefix
        ejected = self.detector.ejected(self.view().servers)
        self.metrics.ejected.set(len(ejected))
        index = self._prefix_index() if prefix else None
        now = time.monotonic()
        matches = index.matches(snapshot.servers, prefix, now) if index is not None else {}
        chunk_chars = index.config.chunk_chars if index is not None else PrefixConfig.chunk_chars
        candidates = snapshot.candidates(adapter, tried | ejected, self.in_flight, matches, chunk_chars)
        try:
            server = self.profile.pick(snapshot.route_request(adapter, prefix_blocks=len(prefix)),
                                       candidates).server_id
        except NoCandidateError as exc:
            raise OverloadedError(f"no healthy server can serve this model ({exc.reason})",
                                  code="no_healthy_server") from exc
        return server, candidates, index, now

    def _record_prefix(self, index: PrefixIndex, snapshot: Snapshot, server: str, prefix: list[int], matched: int,
                       now: float) -> None:
        if not index.servers.keys() <= snapshot.servers.keys():
            index.retain(snapshot.servers)
        index.record(server, prefix, now)
        self.metrics.prefix_blocks.labels("requested").inc(len(prefix))
        self.metrics.prefix_blocks.labels("matched").inc(matched)
        self.metrics.prefix_index_keys.set(index.size)

    async def _attempt(self, snapshot: Snapshot, fwd: Forward, attempt: _Attempt) -> Response:
        server = attempt.server
        url = snapshot.servers[server].url.rstrip("/") + fwd.path
        headers = {"content-type": "application/json"}
        if fwd.adapter is not None:
            headers[ADAPTER_HEADER] = fwd.adapter  # lets the agent fetch a missing adapter first
        request = self.client.build_request("POST", url, content=fwd.payload, headers=headers)
        self.enter(server)
        try:
            opened = await self._open(request, attempt)
            if opened.first is not None:
                return self._stream(server, opened, fwd)  # takes over the in-flight count
            response = await self._whole(server, opened.upstream, fwd)
        except BaseException:
            self.leave(server)
            raise
        self.leave(server)
        return response

    # ---- up to the first byte ---------------------------------------------------------------

    async def _open(self, request: httpx.Request, attempt: _Attempt) -> _Opened:
        """The attempt past its first byte; _AttemptFailed (the failure counted) if it does not get there."""
        task = asyncio.ensure_future(self._send(request, attempt.stream))
        try:
            opened = await self._watch(task, attempt)
        except httpx.TransportError as exc:
            connect = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
            self.failed(attempt.server, Failure.CONNECT if connect else Failure.TRANSPORT)
            raise _AttemptFailed(attempt.server) from exc
        if opened.upstream.status_code in RETRY_STATUSES:
            await opened.upstream.aclose()
            raise _AttemptFailed(attempt.server)  # it answered, so it runs: not an outlier
        self.detector.record_success(attempt.server)
        if opened.first is not None:
            self.deadline.observe(time.monotonic() - attempt.started)
            self.metrics.ttfb_deadline.set(self.deadline.current())
        return opened

    async def _send(self, request: httpx.Request, stream: bool) -> _Opened:
        upstream = await self.client.send(request, stream=True)
        if not stream or upstream.status_code != 200:
            return _Opened(upstream)
        chunks = upstream.aiter_raw()
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            await upstream.aclose()
            raise httpx.RemoteProtocolError("the server closed the stream before sending anything") from None
        except BaseException:
            await upstream.aclose()
            raise
        return _Opened(upstream, first, chunks)

    async def _watch(self, task: asyncio.Future, attempt: _Attempt) -> _Opened:
        """Waits for the first byte, looking at the server every check interval."""
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self._next_check(attempt))
                if done:
                    return task.result()
                reason = self._give_up_reason(attempt)
                if reason is None and self._probe_due(attempt):
                    reason = await self._probe(attempt)
                if reason is not None:
                    await self._dropped(attempt.server)
                    return await self._abandon(task, attempt.server, reason)
        except BaseException:
            task.cancel()  # the client went away, or the attempt failed: stop sending there
            raise

    def _next_check(self, attempt: _Attempt) -> float | None:
        if attempt.last:
            return None  # never given up: wait for the answer (bounded by the client's read timeout)
        check = self.config.check_interval_s
        to_deadline = attempt.started + self.deadline.current() - time.monotonic()
        return min(check, to_deadline) if attempt.stream and to_deadline > 0 else check

    def _give_up_reason(self, attempt: _Attempt) -> str | None:
        """Why to give the attempt up now, or None to go on waiting."""
        view = self.view()
        ejected = self.detector.ejected(view.servers)
        if self._nowhere_else(view, attempt, ejected):
            return None
        server, waited = attempt.server, time.monotonic() - attempt.started
        if server not in view.servers:
            return "gone"
        if server in ejected:
            return "ejected"
        if attempt.stream and waited >= self.deadline.current():
            self.failed(server, Failure.DEADLINE)
            return "deadline"
        return "silent" if self._silent(view, attempt, waited) else None

    @staticmethod
    def _nowhere_else(view: Snapshot, attempt: _Attempt, ejected: frozenset[str]) -> bool:
        return all(s in attempt.tried or s in ejected for s in view.servers)

    def _probe_due(self, attempt: _Attempt) -> bool:
        """A non-streamed attempt is probed once for every deadline it has waited, while another
        server could take it."""
        if attempt.stream or attempt.last:
            return False
        if time.monotonic() - attempt.started < (attempt.probes + 1) * self.deadline.current():
            return False
        view = self.view()
        return not self._nowhere_else(view, attempt, self.detector.ejected(view.servers))

    async def _probe(self, attempt: _Attempt) -> str | None:
        """'unresponsive' (the failure counted) when the server's /health does not answer 200 in time."""
        attempt.probes += 1
        server = self.view().servers.get(attempt.server)
        if server is None:
            return None  # left the registry meanwhile: the next check gives the attempt up as gone
        try:
            response = await self.client.get(server.url.rstrip("/") + "/health",
                                             timeout=self.config.probe_timeout_s)
            if response.status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        self.failed(attempt.server, Failure.UNRESPONSIVE)
        return "unresponsive"

    def _silent(self, view: Snapshot, attempt: _Attempt, waited: float) -> bool:
        """True when the server neither answered nor heartbeat for as long as its heartbeat may be late
        (the process has stopped) and it could be ejected for it (then every attempt there is given up).
        Not while more servers are late than may be ejected: a cause they share (Redis, the network,
        the machine) singles none of them out."""
        late_after = view.late_after_s(attempt.server)
        if attempt.silence_reported or late_after is None or waited <= late_after:
            return False
        now = self.wall()
        if not view.heartbeat_late(attempt.server, now):
            return False
        if view.late_heartbeats(now) > self.config.outliers.limit(len(view.servers)):
            return False
        attempt.silence_reported = True
        if self.failed(attempt.server, Failure.SILENT) is not Outcome.EJECTED:
            return False
        self._start_drop(attempt.server, view.servers[attempt.server].heartbeat_at)
        return True

    def _start_drop(self, server: str, heartbeat_at: float) -> None:
        """Drops the silent server from the registry, in a worker thread (the store blocks)."""
        if self.drop is None:
            return
        dropping = asyncio.ensure_future(asyncio.to_thread(self.drop, server, heartbeat_at))
        self._dropping[server] = dropping
        dropping.add_done_callback(lambda done: self._drop_done(server, done))

    def _drop_done(self, server: str, done: asyncio.Future) -> None:
        if self._dropping.get(server) is done:
            del self._dropping[server]
        if not done.cancelled() and done.exception() is not None:
            log.warning("dropping server %s from the registry failed: %r", server, done.exception())

    async def _dropped(self, server: str) -> None:
        """Until the server's drop from the registry (if one is under way) is done: a request sent
        elsewhere before it could find that server asks it for an adapter copy."""
        dropping = self._dropping.get(server)
        if dropping is not None:
            await asyncio.wait({dropping}, timeout=DROP_WAIT_S)

    async def _abandon(self, task: asyncio.Future, server: str, reason: str) -> _Opened:
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is None:
            return task.result()  # it answered just now: take it
        self.metrics.abandoned.labels(server, reason).inc()
        raise _AttemptFailed(server)

    def failed(self, server: str, failure: Failure) -> Outcome:
        outcome = self.detector.record_failure(server, failure, self.view().servers)
        if outcome is Outcome.EJECTED:
            self.metrics.ejections.labels(server, failure.value).inc()
            log.warning("server %s ejected (%s) for %.0f s at most", server, failure.value,
                        self.detector.ejection_ends_in(server) or 0.0)
        elif outcome is Outcome.OVERFLOW:
            self.metrics.ejection_overflows.inc()
        return outcome

    # ---- the answer -------------------------------------------------------------------------

    async def _whole(self, server: str, upstream: httpx.Response, fwd: Forward) -> Response:
        try:
            body = await upstream.aread()
        finally:
            await upstream.aclose()
        self.metrics.time_to_first_byte.observe(time.monotonic() - fwd.arrived_at)
        if upstream.status_code == 200:
            self._count(fwd, usage_of(body))
        self._finish(fwd, upstream.status_code)
        return Response(body, status_code=upstream.status_code, headers={SERVER_HEADER: server},
                        media_type=upstream.headers.get("content-type", "application/json"))

    def _stream(self, server: str, opened: _Opened, fwd: Forward) -> StreamingResponse:
        self.metrics.time_to_first_byte.observe(time.monotonic() - fwd.arrived_at)
        tap = UsageTap(forward_usage_chunk=fwd.client_wants_usage)
        upstream = opened.upstream
        return StreamingResponse(self._relay(server, upstream, opened.first, opened.chunks, tap, fwd),
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
            self.leave(server)
            self._count(fwd, tap.usage)
            self._finish(fwd, status)

    def settle(self, fwd: Forward, usage: Usage | None, status: int) -> None:
        """Counts an answered request as the proxy counts its own: tokens, demand, status, duration
        (the endpoint picker's requests, which the gateway forwards)."""
        self._count(fwd, usage)
        self._finish(fwd, status)

    def _count(self, fwd: Forward, usage: Usage | None) -> None:
        if usage is None:
            return
        label = fwd.model
        self.metrics.tokens.labels(label, "prompt").inc(usage.prompt_tokens)
        self.metrics.tokens.labels(label, "completion").inc(usage.completion_tokens)
        if fwd.adapter is not None:
            self.demand.add(fwd.adapter, demand_tokens(usage.prompt_tokens, usage.completion_tokens,
                                                       fwd.cached_blocks, fwd.block_tokens, usage.cached_tokens))

    def _finish(self, fwd: Forward, status: int) -> None:
        self.metrics.requests.labels(fwd.model, str(status)).inc()
        self.metrics.duration.observe(time.monotonic() - fwd.arrived_at)

    def enter(self, server: str) -> None:
        self.in_flight[server] = self.in_flight.get(server, 0) + 1
        self.metrics.in_flight.labels(server).set(self.in_flight[server])

    def leave(self, server: str) -> None:
        self.in_flight[server] = max(0, self.in_flight.get(server, 1) - 1)
        self.metrics.in_flight.labels(server).set(self.in_flight[server])


def usage_of(body: bytes) -> Usage | None:
    try:
        return Usage.from_body(json.loads(body))
    except ValueError:
        return None
