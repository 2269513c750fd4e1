"""The endpoint-picker protocol's names and messages (GIE proposal 004, v1.0.0), over ext_proc v3.

Pure message building and reading: no I/O. Header values are read from `raw_value` (what Envoy
sends) or `value`, and always written as `raw_value`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from loraplex.spec.errors import LoraplexError

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# The gateway (an auth filter, a payload processor) may name the model to send upstream; llm-d's new
# name first, GIE's older one second.
MODEL_REWRITE = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(message: HttpHeaders) -> dict[str, str]:
    """Header name (lower case) -> value; pseudo-headers (`:path`, `:status`) included."""
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in message.headers.headers}


def subset_hint(metadata: Metadata) -> frozenset[str] | None:
    """The endpoints the gateway allows (`envoy.lb.subset_hint`), None when it sets no hint. The list
    may come as a list of strings or one comma-separated string (declarative filters write that)."""
    hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return frozenset(item.strip() for item in items if item.strip())


def served_endpoint(metadata: Metadata) -> str | None:
    """The endpoint that served the request, as the gateway reports it with the response."""
    lb = metadata.filter_metadata.get(LB_NAMESPACE)
    if lb is None or SERVED not in lb.fields:
        return None
    return lb.fields[SERVED].string_value.strip() or None


def route_to(endpoints: list[str], content_length: int | None,
             upstream: Mapping[str, str] | None = None) -> ProcessingResponse:
    """The reply to the request headers: the chosen endpoints (primary first) in the header and in the
    dynamic metadata, the same value in both; the route cache cleared so the gateway routes on it.
    `upstream`: more headers for the request the gateway sends to the endpoint."""
    value = ",".join(endpoints)
    headers = [_header(DESTINATION, value)]
    if content_length is not None:  # the body was rewritten: its length changed
        headers.append(_header("content-length", str(content_length)))
    headers += [_header(k, v) for k, v in (upstream or {}).items()]
    metadata = Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION] = value
    common = CommonResponse(header_mutation=HeaderMutation(set_headers=headers), clear_route_cache=True)
    return ProcessingResponse(request_headers=HeadersResponse(response=common), dynamic_metadata=metadata)


def request_body(body: bytes, end_of_stream: bool = True) -> ProcessingResponse:
    return ProcessingResponse(request_body=BodyResponse(response=_streamed(body, end_of_stream)))


def response_body(body: bytes, end_of_stream: bool) -> ProcessingResponse:
    return ProcessingResponse(response_body=BodyResponse(response=_streamed(body, end_of_stream)))


def response_headers() -> ProcessingResponse:
    return ProcessingResponse(response_headers=HeadersResponse(response=CommonResponse()))


def request_trailers() -> ProcessingResponse:
    return ProcessingResponse(request_trailers=TrailersResponse())


def response_trailers() -> ProcessingResponse:
    return ProcessingResponse(response_trailers=TrailersResponse())


def refuse(exc: LoraplexError) -> ProcessingResponse:
    """An immediate response in the OpenAI error shape: the gateway answers the client with it."""
    body = json.dumps(exc.to_openai()).encode()
    mutation = HeaderMutation(set_headers=[_header("content-type", "application/json")])
    return ProcessingResponse(immediate_response=ImmediateResponse(
        status=HttpStatus(code=exc.status), headers=mutation, body=body, details=exc.code or exc.type))


def _streamed(body: bytes, end_of_stream: bool) -> CommonResponse:
    return CommonResponse(body_mutation=BodyMutation(
        streamed_response=StreamedBodyResponse(body=body, end_of_stream=end_of_stream)))


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=OVERWRITE)
