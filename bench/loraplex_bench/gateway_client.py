"""A gateway's side of the endpoint-picker protocol, for tests and benchmarks where no Envoy can run.

It behaves as Envoy's ext_proc filter does in FULL_DUPLEX_STREAMED mode with GIE's settings: the
request headers, then the body in many chunks without waiting for replies; it routes to the endpoint
list the picker returns (going down the list on a refused connection or a 502/503/504, as a retry
policy does) with the request headers the picker set, reports the endpoint that served in the
response's metadata, and streams the response through the picker chunk by chunk, handing the client
what the picker sends back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import httpx
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from google.protobuf.struct_pb2 import Struct

DESTINATION = "x-gateway-destination-endpoint"
RETRY_STATUSES = (502, 503, 504)


@dataclass
class Exchange:
    """What one request went through: the picker's replies in order, and what the client got."""

    replies: list[str] = field(default_factory=list)   # the kinds of the picker's replies, in order
    status: int = 0                                    # the client's status (an immediate one included)
    immediate: bool = False
    destination: str = ""                              # the header's value
    metadata: str = ""                                 # the dynamic metadata's value
    request_headers: dict[str, str] = field(default_factory=dict)  # headers the picker set
    sent_body: bytes = b""                             # the body the picker sent upstream
    served: str = ""                                   # the endpoint that answered
    body: bytes = b""                                  # what the client received
    decision_s: float = 0.0                            # from the body's last chunk to the header reply


def headers_message(headers: dict[str, str], end_of_stream: bool = False) -> HttpHeaders:
    return HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                                                  for k, v in headers.items()]), end_of_stream=end_of_stream)


def subset_metadata(subset: list[str] | str | None) -> Metadata:
    metadata = Metadata()
    if subset is not None:
        hint = Struct()
        hint["x-gateway-destination-endpoint-subset"] = subset
        metadata.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return metadata


def served_metadata(endpoint: str) -> Metadata:
    metadata = Metadata()
    metadata.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": endpoint})
    return metadata


def chunks_of(body: bytes, pieces: int) -> list[bytes]:
    size = max(1, -(-len(body) // max(1, pieces)))
    return [body[i:i + size] for i in range(0, len(body), size)] or [b""]


class Gateway:
    def __init__(self, target: str, http: httpx.AsyncClient | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = ExternalProcessorStub(self.channel)
        self.http = http or httpx.AsyncClient(timeout=60)

    async def close(self) -> None:
        await self.channel.close()
        await self.http.aclose()

    async def send(self, body: bytes | None, headers: dict[str, str] | None = None, pieces: int = 8,
                   subset: list[str] | str | None = None, path: str = "/v1/completions",
                   forward: bool = True) -> Exchange:
        """One request through the picker and (with `forward`) the chosen server."""
        call = self.stub.Process()
        try:
            return await self._exchange(call, body, headers or {}, pieces, subset, path, forward)
        finally:
            call.cancel()  # a no-op once the stream is done

    async def send_and_cancel(self, body: bytes, after_chunks: int, pieces: int = 8) -> None:
        """Sends the headers and `after_chunks` body chunks, then cancels the stream (the client left)."""
        call = self.stub.Process()
        await call.write(ProcessingRequest(request_headers=headers_message(_request_headers("/v1/completions"))))
        for chunk in chunks_of(body, pieces)[:after_chunks]:
            await call.write(ProcessingRequest(request_body=HttpBody(body=chunk)))
        call.cancel()

    async def _exchange(self, call, body: bytes | None, headers: dict[str, str], pieces: int,
                        subset, path: str, forward: bool) -> Exchange:
        ex = Exchange()
        head = {**_request_headers(path), **headers}
        await call.write(ProcessingRequest(request_headers=headers_message(head, end_of_stream=body is None),
                                           metadata_context=subset_metadata(subset)))
        last = time.perf_counter()
        for i, chunk in enumerate(chunks := chunks_of(body or b"", pieces) if body is not None else []):
            end = i == len(chunks) - 1
            await call.write(ProcessingRequest(request_body=HttpBody(body=chunk, end_of_stream=end)))
            last = time.perf_counter()
        reply = await call.read()
        ex.decision_s = time.perf_counter() - last
        if reply.HasField("immediate_response"):
            return self._immediate(ex, reply)
        self._routed(ex, reply)
        if body is not None:
            ex.sent_body = await self._streamed(call, ex, "request_body")
        if forward:
            await self._forward(call, ex, path)
        await call.done_writing()
        while await call.read() != grpc.aio.EOF:  # the picker has settled the request when its stream ends
            pass
        return ex

    @staticmethod
    def _immediate(ex: Exchange, reply) -> Exchange:
        ex.replies.append("immediate_response")
        ex.immediate, ex.status, ex.body = True, reply.immediate_response.status.code, reply.immediate_response.body
        return ex

    @staticmethod
    def _routed(ex: Exchange, reply) -> None:
        ex.replies.append(reply.WhichOneof("response"))
        mutation = reply.request_headers.response.header_mutation
        ex.request_headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
        ex.destination = ex.request_headers.get(DESTINATION, "")
        ex.metadata = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value

    async def _forward(self, call, ex: Exchange, path: str) -> None:
        upstream = await self._open(ex, path)
        if upstream is None:
            ex.status = 503
            return
        try:
            head = {":status": str(upstream.status_code),
                    "content-type": upstream.headers.get("content-type", "")}
            await call.write(ProcessingRequest(response_headers=headers_message(head),
                                               metadata_context=served_metadata(ex.served)))
            reply = await call.read()
            ex.replies.append(reply.WhichOneof("response"))
            ex.status = upstream.status_code
            reader = asyncio.ensure_future(self._streamed(call, ex, "response_body"))
            async for chunk in upstream.aiter_raw():
                await call.write(ProcessingRequest(response_body=HttpBody(body=chunk)))
            await call.write(ProcessingRequest(response_body=HttpBody(body=b"", end_of_stream=True)))
            ex.body = await reader
        finally:
            await upstream.aclose()

    async def _open(self, ex: Exchange, path: str) -> httpx.Response | None:
        """The first endpoint of the list that answers (the retry policy's walk)."""
        endpoints = ex.destination.split(",")
        for i, endpoint in enumerate(endpoints):
            headers = {"content-type": "application/json", **ex.request_headers}  # with the picker's mutations
            headers.pop("content-length", None)  # the client sets it from the body
            request = self.http.build_request("POST", f"http://{endpoint}{path}", content=ex.sent_body,
                                              headers=headers)
            try:
                upstream = await self.http.send(request, stream=True)
            except httpx.TransportError:
                continue
            if upstream.status_code in RETRY_STATUSES and i + 1 < len(endpoints):
                await upstream.aclose()
                continue
            ex.served = endpoint
            return upstream
        return None

    @staticmethod
    async def _streamed(call, ex: Exchange, kind: str) -> bytes:
        """The body the picker sends back in its replies of `kind` (request_body or response_body)."""
        out = b""
        while True:
            reply = await call.read()
            ex.replies.append(reply.WhichOneof("response"))
            streamed = getattr(reply, kind).response.body_mutation.streamed_response
            out += streamed.body
            if streamed.end_of_stream:
                return out


def _request_headers(path: str) -> dict[str, str]:
    return {":method": "POST", ":path": path, ":authority": "gateway", "content-type": "application/json"}
