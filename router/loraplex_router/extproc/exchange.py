"""One ext_proc `Process` stream: one HTTP request through the gateway, from its headers to the end
of its response.

Full-duplex streamed (the mode GIE's gateways configure): body chunks arrive without waiting for
replies. The reply to the request headers is held until the body's last chunk (the adapter is the
body's `model`), then the replies go out in the order the gateway expects: headers (the endpoint),
body (the whole body, rewritten when the model is rewritten or a stream's usage is asked for),
trailers. Response chunks pass straight back; a stream's usage-only chunk is dropped unless the
client asked for it, as the HTTP router does. Whatever ends the stream (its end, the gateway
cancelling it, an error), `close` settles the request exactly once: in-flight count, tokens, demand,
status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from loraplex.routing.outliers import Failure
from loraplex.spec.errors import LoraplexError
from loraplex_router.app import UNKNOWN_MODEL
from loraplex_router.extproc import protocol
from loraplex_router.extproc.decision import Decider, Decision
from loraplex_router.extproc.metrics import PickerMetrics
from loraplex_router.proxy import ADAPTER_HEADER, RETRY_STATUSES, Proxy, usage_of
from loraplex_router.sse import Usage, UsageTap

log = logging.getLogger("loraplex.router")
CLIENT_CLOSED = 499  # the status counted for a request routed but never answered (nginx's convention)


class Refused(Exception):
    """The stream ends with an immediate response."""


class Exchange:
    def __init__(self, decider: Decider, proxy: Proxy, metrics: PickerMetrics) -> None:
        self.decider, self.proxy, self.metrics = decider, proxy, metrics
        self.started = time.monotonic()
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None  # the gateway's subset hint (it comes with the headers)
        self.body: list[bytes] = []
        self.size = 0
        self.decision: Decision | None = None
        self.server: str | None = None        # the server the request is counted on now
        self.status: int | None = None        # the response's status
        self.tap: UsageTap | None = None      # a streamed response's usage reader
        self.answer: list[bytes] | None = []  # a whole response's bytes (for its usage); None: too large
        self.answer_size = 0
        self.usage: Usage | None = None
        self.last_chunk_at = 0.0              # when the request body's last chunk arrived (the benchmark reads it)
        self.closed = False

    def handle(self, request: ProcessingRequest) -> Iterator[ProcessingResponse]:
        """The replies to one message of the stream, in order; raises Refused after an immediate response."""
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            yield from self._request_headers(request)
        elif kind == "request_body":
            yield from self._request_body(request.request_body.body, request.request_body.end_of_stream, request)
        elif kind == "request_trailers":
            if self.decision is None:  # the body ended with the trailers
                yield from self._decide(request, end_of_stream=False)
            yield protocol.request_trailers()
        elif kind == "response_headers":
            yield from self._response_headers(request)
        elif kind == "response_body":
            yield from self._response_body(request.response_body.body, request.response_body.end_of_stream)
        elif kind == "response_trailers":
            self._response_done()
            yield protocol.response_trailers()

    # ---- the request ------------------------------------------------------------------------

    def _request_headers(self, request: ProcessingRequest) -> Iterator[ProcessingResponse]:
        self.headers = protocol.headers_of(request.request_headers)
        self.subset = protocol.subset_hint(request.metadata_context)
        if request.request_headers.end_of_stream:  # no body (a GET): routed now
            self.last_chunk_at = time.monotonic()
            yield from self._decide(request, end_of_stream=True, bodiless=True)

    def _request_body(self, chunk: bytes, end_of_stream: bool,
                      request: ProcessingRequest) -> Iterator[ProcessingResponse]:
        self.size += len(chunk)
        try:
            self.decider.check_size(self.size)
        except LoraplexError as exc:
            raise self._refused(exc) from exc
        self.body.append(chunk)
        if end_of_stream:
            self.last_chunk_at = time.monotonic()
            yield from self._decide(request, end_of_stream=True)

    def _decide(self, request: ProcessingRequest, end_of_stream: bool,
                bodiless: bool = False) -> Iterator[ProcessingResponse]:
        raw = None if bodiless else b"".join(self.body)
        self.body = []
        started = time.perf_counter()
        try:
            hint = protocol.subset_hint(request.metadata_context)  # a later message may carry it instead
            decision = self.decider.decide(self.headers, raw, self.subset if hint is None else hint, self.started)
        except LoraplexError as exc:
            self.metrics.attempts.labels("failure").inc()
            raise self._refused(exc) from exc
        self.metrics.decision.observe(time.perf_counter() - started)
        self.metrics.attempts.labels("success").inc()
        self.decision, self.server = decision, decision.servers[0]
        self.proxy.enter(self.server)
        fwd = decision.fwd
        self.metrics.running.labels(fwd.model).inc()
        self.metrics.request_size.labels(fwd.model, fwd.model).observe(len(fwd.payload))
        length = len(fwd.payload) if decision.rewritten else None
        # the adapter in the header the HTTP router sets too: an agent that does not hold it yet loads it
        # before it serves the request, instead of answering 404
        upstream = {ADAPTER_HEADER: fwd.adapter} if fwd.adapter is not None else None
        yield protocol.route_to(decision.endpoints, length, upstream)
        if not bodiless:
            yield protocol.request_body(fwd.payload, end_of_stream)

    def _refused(self, exc: LoraplexError) -> Refused:
        """The immediate response that answers the request in the gateway (counted as the HTTP router
        counts its refusals)."""
        self.proxy.metrics.requests.labels(UNKNOWN_MODEL, str(exc.status)).inc()
        self.metrics.errors.labels(UNKNOWN_MODEL, UNKNOWN_MODEL, str(exc.status)).inc()
        return Refused(protocol.refuse(exc))

    # ---- the response -----------------------------------------------------------------------

    def _response_headers(self, request: ProcessingRequest) -> Iterator[ProcessingResponse]:
        headers = protocol.headers_of(request.response_headers)
        status = headers.get(":status", "200")
        self.status = int(status) if status.isdigit() else 502
        if self.decision is not None:
            self._served(protocol.served_endpoint(request.metadata_context))
            if self.status == 200 and "text/event-stream" in headers.get("content-type", ""):
                self.tap = UsageTap(forward_usage_chunk=self.decision.fwd.client_wants_usage)
        yield protocol.response_headers()
        if request.response_headers.end_of_stream:
            self._response_done()

    def _served(self, endpoint: str | None) -> None:
        """Reads which endpoint served: those listed before it failed before answering (the gateway
        went down the list), and the request's in-flight count moves to it."""
        decision = self.decision
        index = decision.endpoints.index(endpoint) if endpoint in decision.endpoints else 0
        for failed in decision.servers[:index]:
            self.proxy.metrics.upstream_failures.labels(failed).inc()
            self.proxy.metrics.retries.inc()
            self.proxy.failed(failed, Failure.TRANSPORT)
        served = decision.servers[index]
        if served != self.server:
            self.proxy.leave(self.server)
            self.proxy.enter(served)
            self.server = served
        if self.status not in RETRY_STATUSES:
            self.proxy.detector.record_success(served)
        self.proxy.metrics.time_to_first_byte.observe(time.monotonic() - self.started)

    def _response_body(self, chunk: bytes, end_of_stream: bool) -> Iterator[ProcessingResponse]:
        if self.tap is not None:
            out = self.tap.feed(chunk) + (self.tap.flush() if end_of_stream else b"")
        else:
            out = chunk
            if self.answer is not None:
                self.answer.append(chunk)
                self.answer_size += len(chunk)
                if self.answer_size > self.decider.settings.max_request_bytes:
                    self.answer = None  # too large to be an OpenAI JSON answer worth reading
        if out or end_of_stream:
            yield protocol.response_body(out, end_of_stream)
        if end_of_stream:
            self._response_done()

    def _response_done(self) -> None:
        if self.tap is not None:
            self.usage = self.tap.usage
        elif self.status == 200 and self.answer:
            self.usage = usage_of(b"".join(self.answer))
        self.close()

    # ---- the end ----------------------------------------------------------------------------

    def close(self) -> None:
        """Settles the request once, however the stream ended."""
        if self.closed:
            return
        self.closed = True
        decision = self.decision
        if decision is None:
            return
        fwd, status = decision.fwd, self.status if self.status is not None else CLIENT_CLOSED
        if self.usage is None and self.tap is not None:
            self.usage = self.tap.usage  # a stream cut short: what it reported so far
        self.proxy.leave(self.server)
        self.proxy.settle(fwd, self.usage, status)
        labels = (fwd.model, fwd.model)
        self.metrics.running.labels(fwd.model).dec()
        self.metrics.requests.labels(*labels).inc()
        self.metrics.duration.labels(*labels).observe(time.monotonic() - self.started)
        if status >= 500 or status == CLIENT_CLOSED:
            self.metrics.errors.labels(*labels, str(status)).inc()
        if self.usage is not None:
            self.metrics.input_tokens.labels(*labels).observe(self.usage.prompt_tokens)
            self.metrics.output_tokens.labels(*labels).observe(self.usage.completion_tokens)
