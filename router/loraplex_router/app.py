"""The router's OpenAI-compatible HTTP API: the FastAPI app and its request handling."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.routing.outliers import OutlierConfig
from loraplex.routing.pipeline import Profile
from loraplex.routing.store import RoutingStore
from loraplex.spec.errors import InvalidRequestError, LoraplexError, NotFoundError, OverloadedError
from loraplex_router.auth import KeyRing
from loraplex_router.cli import DEFAULT_MAX_REQUEST_BYTES
from loraplex_router.demand import DemandCounter
from loraplex_router.errors import ErrorDetail, ErrorResponse, RequestTooLargeError, error_response
from loraplex_router.metrics import RouterMetrics
from loraplex_router.profiles import ProfileSwitch
from loraplex_router.proxy import Forward, Proxy, ProxyConfig, prepare_body
from loraplex_router.snapshot import Snapshot
from loraplex_router.table_cache import TableCache

UNKNOWN_MODEL = "(unknown)"  # the model label of requests refused before naming a served model
# Something else the router process serves beside the HTTP API (the endpoint picker): entered once the
# proxy exists, left before the table cache stops; it reads app.state (proxy, cache, metrics).
Service = Callable[[FastAPI], AbstractAsyncContextManager[None]]


@dataclass
class RouterSettings:
    profile: Profile  # the flags' profile: used while the routing table names none
    keys: KeyRing
    profile_name: str = "loraserve"  # the flags' --profile (for the metrics)
    base_model: str | None = None
    poll_interval_s: float = 1.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    max_attempts: int = 3
    ttfb_deadline_s: float = 10.0  # streamed requests' first chunk; 0: no deadline
    outliers: OutlierConfig = field(default_factory=OutlierConfig)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body is answered 413, unread


def create_app(store: RoutingStore, settings: RouterSettings, services: Sequence[Service] = ()) -> FastAPI:
    metrics = RouterMetrics()
    demand = DemandCounter()
    profiles = ProfileSwitch(settings.profile, settings.profile_name, metrics)
    cache = TableCache(store, metrics, demand, settings.base_model, settings.poll_interval_s,
                       on_table=profiles.follow)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            config = ProxyConfig(settings.max_attempts, settings.ttfb_deadline_s, settings.outliers)
            app.state.proxy = Proxy(client, profiles.profile, metrics, demand, config, lambda: cache.snapshot,
                                    cache.clock, drop=cache.drop_server)
            profiles.attach(app.state.proxy)
            cache.start()
            try:
                async with AsyncExitStack() as stack:
                    for service in services:
                        await stack.enter_async_context(service(app))
                    yield
            finally:
                cache.stop()

    app = FastAPI(title="loraplex router", lifespan=lifespan)
    app.state.cache = cache
    app.state.metrics = metrics

    async def completions(request: Request) -> Response:
        return await _handle(request, "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await _handle(request, "/v1/chat/completions")

    async def _handle(request: Request, path: str) -> Response:
        label = UNKNOWN_MODEL  # the metrics' model label: a model the pool serves, never a client's free text
        try:
            key = settings.keys.authenticate(request.headers.get("authorization"))
            raw = await _read_body(request, settings.max_request_bytes)
            body = parse_body(raw, request.headers.get("content-type", ""))
            model = body["model"]
            snapshot = ready_snapshot(cache.snapshot)
            adapter = resolve_adapter(snapshot, model)
            label = model
            settings.keys.check(key, adapter, model)
            payload, stream, wants_usage = prepare_body(body, raw)
            proxy = request.app.state.proxy
            fwd = Forward(path, payload, model, adapter, stream, wants_usage, time.monotonic(),
                          proxy.prefix_keys(snapshot, adapter, body))
            return await proxy.forward(snapshot, fwd)
        except LoraplexError as exc:
            metrics.requests.labels(label, str(exc.status)).inc()
            return error_response(exc)

    async def models(request: Request) -> Response:
        try:
            key = settings.keys.authenticate(request.headers.get("authorization"))
        except LoraplexError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": _model_cards(cache.snapshot, key)})

    async def health() -> Response:
        return JSONResponse({"status": "ok", "routing_version": cache.snapshot.version})

    async def ready() -> Response:
        ok = cache.snapshot.taken_at > 0 and bool(cache.snapshot.servers)
        return JSONResponse({"ready": ok, "servers": len(cache.snapshot.servers)}, status_code=200 if ok else 503)

    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    proxied = _errors(400, 401, 403, 404, 413, 502, 503)
    app.add_api_route("/v1/completions", completions, methods=["POST"], responses=proxied,
                      openapi_extra=_json_body(RoutedCompletionRequest))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], responses=proxied,
                      openapi_extra=_json_body(RoutedChatCompletionRequest))
    app.add_api_route("/v1/models", models, methods=["GET"], responses=_errors(401))
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"], responses=_NOT_READY)
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    _add_http_error_handler(app)
    return app


def _add_http_error_handler(app: FastAPI) -> None:
    """Unknown routes (404) and wrong methods (405) in the OpenAI error shape, as the agent answers them."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = ErrorResponse(error=ErrorDetail(message=str(exc.detail), type=kind, code=exc.status_code))
        return JSONResponse(error.model_dump(), status_code=exc.status_code, headers=exc.headers)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused (413) as soon as it is known to be larger than `max_bytes`: from its
    Content-Length, else from the bytes read so far, so that a huge body is never read to the end."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLargeError(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestTooLargeError(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


_JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
               dict: "an object"}


def parse_body(raw: bytes, content_type: str) -> dict:
    """The request as JSON, refused (400) as the agents refuse it: a body not sent as JSON, not an
    object, without a string `model`, or with a `stream` that is not a boolean (it decides how the
    answer comes back, so the router reads it)."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise InvalidRequestError("the request body must be JSON sent with Content-Type: application/json, "
                                  f"not {media or 'no Content-Type'}")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is None or model == "":
        raise InvalidRequestError("'model' is required: an adapter name or the base model", param="model")
    if not isinstance(model, str):
        raise InvalidRequestError(f"'model' must be a string (an adapter name or the base model), not "
                                  f"{_JSON_TYPES.get(type(model), 'null')}", param="model")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise InvalidRequestError(f"'stream' must be a boolean, not {_JSON_TYPES.get(type(body['stream']))}",
                                  param="stream")
    return body


def ready_snapshot(snapshot: Snapshot) -> Snapshot:
    if snapshot.taken_at <= 0:
        raise OverloadedError("the router has not read the routing table yet", code="not_ready")
    return snapshot


def resolve_adapter(snapshot: Snapshot, model: str) -> str | None:
    """The adapter a model name means, or None for the base model."""
    if snapshot.knows(model):
        return model
    if model == snapshot.base_model:
        return None
    raise NotFoundError(f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _model_cards(snapshot: Snapshot, key) -> list[dict]:
    created = int(snapshot.table.created_at) if snapshot.table else 0
    cards = []
    if snapshot.base_model and (key is None or key.allows(None)):
        cards.append({"id": snapshot.base_model, "object": "model", "created": created, "owned_by": "loraplex",
                      "root": snapshot.base_model, "parent": None})
    for name in snapshot.adapter_names():
        if key is None or key.allows(name):
            record = snapshot.adapters.get(name)
            cards.append({"id": name, "object": "model", "created": created, "owned_by": "loraplex",
                          "root": record.source if record else name, "parent": snapshot.base_model})
    return cards


# ---- OpenAPI: the routes read raw JSON (the body is forwarded as sent), so these models only
# document what a request holds; the router itself checks `model` and leaves the rest to the agent.


class _RoutedRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # every other OpenAI or vLLM parameter goes to the agent

    model: str = Field(description="an adapter's name, or the base model's")
    stream: bool = False
    stream_options: dict[str, Any] | None = Field(default=None, description="include_usage: bool")


class RoutedCompletionRequest(_RoutedRequest):
    prompt: str | list[int] | list[str] | list[list[int]]


class RoutedChatCompletionRequest(_RoutedRequest):
    messages: list[dict[str, Any]] = Field(description="{role, content} objects")


_ERROR_CASES = {
    400: "malformed JSON, no `model`, or a parameter the agent refused",
    401: "missing or wrong API key (with --api-keys)",
    403: "this API key may not use the model",
    404: "unknown model",
    413: "the request body is larger than --max-request-bytes",
    502: "every server tried failed before answering",
    503: "the routing table is not read yet, or no healthy server can serve the model",
}
_NOT_READY = {503: {"description": "not ready: no routing table or no live server yet",
                    "content": {"application/json": {"example": {"ready": False, "servers": 0}}}}}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the errors a route answers, all in OpenAI's error shape."""
    cases: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": _ERROR_CASES[status]} for status in statuses}
    other = "another error: internal, or (proxied routes) the agent's answer, passed through unchanged"
    return {**cases, "default": {"model": ErrorResponse, "description": other}}


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring a JSON request body of `model` for a route that reads it raw."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
