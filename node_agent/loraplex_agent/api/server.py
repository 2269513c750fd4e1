"""`loraplex agent`: the engine behind an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Routes are thin: they parse, call the serving functions, and turn `LoraplexError`s into OpenAI's
error shape. Every error, including FastAPI's own validation and routing errors, leaves in the form
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from safetensors import SafetensorError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.spec.errors import AuthenticationError, CommandError, InvalidRequestError, LoraplexError
from loraplex.startup import listen_socket, open_store
from loraplex_agent.adapters.host import HostAdapter
from loraplex_agent.adapters.peft import load_peft_adapter
from loraplex_agent.api.metrics import CONTENT_TYPE, ServerMetrics
from loraplex_agent.api.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    LoadedAdapter,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoraAdapterRequest,
)
from loraplex_agent.api.serving import ServingContext, prompt_byte_limit
from loraplex_agent.api.serving_chat import create_chat_completion
from loraplex_agent.api.serving_completions import create_completion
from loraplex_agent.runtime.async_engine import AsyncEngine
from loraplex_agent.runtime.model.config import ModelConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class AgentConfig:
    max_request_bytes: int  # --max-request-bytes: a larger body is answered 413 unread
    api_key: str | None = None  # --api-key: required by every /v1 endpoint when set, as vLLM's
    admin_api_key: str | None = None  # --admin-api-key: required by the adapter load/unload endpoints only
    adapters: tuple[tuple[str, str], ...] = ()  # (name, path) loaded when the app starts

    @property
    def admin_key(self) -> str | None:
        """What the admin endpoints (adapter load/unload, peer fetches) require: the admin key, else the API key."""
        return self.admin_api_key or self.api_key


def build_app(engine: AsyncEngine, config: AgentConfig) -> FastAPI:
    """The app; its lifespan starts the engine thread, loads the start-up adapters and stops it."""
    core_config, served = engine.core.config, engine.llm.served_model_name
    metrics = ServerMetrics(served, engine.snapshot, core_config.max_loras, core_config.block_size,
                            engine.llm.executor.drain_load_seconds)
    ctx = ServingContext(engine, metrics, served, str(engine.llm.model_dir),
                         max_prompt_bytes=prompt_byte_limit(engine.llm.tokenizer, engine.max_model_len))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            for name, path in config.adapters:
                await engine.add_adapter(name, path)
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Loraplex node agent", lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    _add_error_handlers(app)
    _add_openai_routes(app, ctx, config.api_key, config.admin_key)
    _add_adapter_routes(app, ctx, config.admin_key)
    _add_ops_routes(app, ctx)
    return app


# ---- routes ---------------------------------------------------------------------------------


def _add_openai_routes(app: FastAPI, ctx: ServingContext, api_key: str | None, admin_key: str | None) -> None:
    # a dependency, checked before the body is validated; async: FastAPI runs a plain function on a
    # worker thread, a thread hop on every request for a header comparison
    async def authenticate(request: Request) -> None:
        if api_key is not None:  # the admin key is the more trusted one: it serves too
            _authenticate(request, api_key, admin_key)

    guarded = [Depends(authenticate)]

    @app.post("/v1/completions", responses={**_answer(CompletionResponse), **_errors(400, 401, 404, 413, 503)},
              dependencies=guarded)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _until_disconnect(raw, lambda: _respond(create_completion(ctx, body)))

    @app.post("/v1/chat/completions", dependencies=guarded,
              responses={**_answer(ChatCompletionResponse), **_errors(400, 401, 404, 413, 503)})
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _until_disconnect(raw, lambda: _respond(create_chat_completion(ctx, body)))

    @app.get("/v1/models", responses=_errors(401), dependencies=guarded)
    async def models() -> ModelList:
        base = ModelCard(id=ctx.served_model_name, root=ctx.model_path, max_model_len=ctx.max_model_len)
        adapters = [ModelCard(id=name, root=record.path, parent=ctx.served_model_name,
                              max_model_len=ctx.max_model_len)
                    for name, record in sorted(ctx.engine.adapters.items())]
        return ModelList(data=[base, *adapters])


def _add_adapter_routes(app: FastAPI, ctx: ServingContext, api_key: str | None) -> None:
    @app.post("/v1/load_lora_adapter", responses=_errors(400, 401, 404, 409, 413, 503))
    async def load_lora_adapter(body: LoadLoraAdapterRequest, raw: Request) -> LoadedAdapter:
        _authenticate(raw, api_key)
        if body.lora_name == ctx.served_model_name:
            raise InvalidRequestError("an adapter cannot take the base model's name", param="lora_name")
        info = await ctx.engine.add_adapter(body.lora_name, body.lora_path, pinned=body.pinned)
        log.info("loaded adapter %s (rank %d) from %s", info.id, info.rank, body.lora_path)
        return LoadedAdapter(lora_name=body.lora_name, digest=info.id.digest, rank=info.rank,
                             lora_path=body.lora_path)

    @app.post("/v1/unload_lora_adapter", responses=_errors(400, 401, 404, 413, 503))
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, raw: Request) -> LoadedAdapter:
        _authenticate(raw, api_key)
        info, draining = await ctx.engine.unload_adapter(body.lora_name)
        log.info("unloaded adapter %s (%d requests still running on it)", info.id, draining)
        return LoadedAdapter(lora_name=body.lora_name, digest=info.id.digest, rank=info.rank,
                             draining_requests=draining)


def _add_ops_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/health", responses=_errors(503))
    async def health() -> Response:
        problem = ctx.engine.health_problem()
        if problem is None:
            return Response(status_code=200)
        return _error_response(503, "service_unavailable", problem)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


async def _respond(result: Awaitable) -> Response | object:
    outcome = await result
    if isinstance(outcome, AsyncIterator):
        return StreamingResponse(outcome, media_type="text/event-stream")
    return outcome


async def _until_disconnect(request: Request, handler: Callable[[], Awaitable]) -> Response:
    """Run `handler`, cancelling it (and so aborting its engine request) if the client goes away."""
    work = asyncio.ensure_future(handler())
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        return Response(status_code=499)  # nobody reads it: the client is gone
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _authenticate(request: Request, api_key: str | None, *more: str | None) -> None:
    """AuthenticationError unless the bearer token is one of the keys (nothing is required without any)."""
    keys = [key for key in (api_key, *more) if key is not None]
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
        raise AuthenticationError("a valid API key is required: send 'Authorization: Bearer <key>'")


# ---- errors ---------------------------------------------------------------------------------

_ERROR_CASES = {
    400: "invalid request: malformed JSON, a missing, wrong or unsupported parameter, a prompt over the "
         "context length, a bad adapter",
    401: "missing or wrong API key",
    404: "unknown model, adapter or adapter path",
    409: "the adapter name is taken",
    413: "the request body is larger than --max-request-bytes",
    503: "the engine has failed",
}


def _answer(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for 200 of a route that answers JSON, or server-sent events with `stream`."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": f"a {model.__name__}; with \"stream\": true, server-sent events, each a "
                                 "chunk of it (`data: {json}`), then `data: [DONE]`"}}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the errors a route answers, all in OpenAI's error shape."""
    cases: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": _ERROR_CASES[status]} for status in statuses}
    return {**cases, "default": {"model": ErrorResponse, "description": "internal error"}}


class RequestTooLargeError(InvalidRequestError):
    status = 413

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the request body is larger than this server's limit of {max_bytes} bytes "
                         "(--max-request-bytes)", code="request_too_large")


class _BodyTooLarge(Exception):
    """Raised into the app by `BodyLimit` when the body passes the limit."""


class BodyLimit:
    """ASGI middleware: a request body larger than `max_bytes` is answered 413 without being read to
    the end: at once when Content-Length says so, else (a chunked body) as soon as the bytes read pass
    the limit. What the app answered to the interrupted read is dropped for the 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.error = RequestTooLargeError(max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _content_length(scope) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        guard = _BodyGuard(receive, send, self.max_bytes)
        try:
            await self.app(scope, guard.receive, guard.send)
        except Exception:
            if not guard.over:
                raise  # a failure of its own; after the cut-off read, anything is a consequence of it
        if guard.over and not guard.started:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        await JSONResponse(self.error.to_openai(), status_code=self.error.status)(scope, receive, send)


class _BodyGuard:
    def __init__(self, receive: Receive, send: Send, max_bytes: int) -> None:
        self._receive, self._send, self.max_bytes = receive, send, max_bytes
        self.read = 0
        self.over = False
        self.started = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if self.read > self.max_bytes:
                self.over = True
                raise _BodyTooLarge
        return message

    async def send(self, message: Message) -> None:
        if self.over:
            return  # the app's answer to the interrupted read; BodyLimit answers instead
        self.started = True
        await self._send(message)


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0



def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LoraplexError)
    async def loraplex_error(_: Request, exc: LoraplexError) -> JSONResponse:
        return JSONResponse(exc.to_openai(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = _invalid_request(exc.errors())
        return JSONResponse(error.to_openai(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(exc.status_code, kind, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(500, "internal_error", f"internal error: {exc!r}")


def _invalid_request(errors: list[dict]) -> InvalidRequestError:
    """FastAPI's validation errors (422 by default) as one OpenAI 400 naming the first bad field."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return InvalidRequestError(f"the body is not valid JSON: {first.get('msg')}")
    message = "; ".join(f"{_field(e) or 'body'}: {e.get('msg')}" for e in errors)
    return InvalidRequestError(message or "invalid request", param=_field(first) or None)


def _field(error: dict) -> str:
    return ".".join(str(part) for part in error.get("loc", ()) if part != "body")


def _error_response(status: int, kind: str, message: str) -> JSONResponse:
    error = {"message": message, "type": kind, "param": None, "code": status}
    return JSONResponse({"error": error}, status_code=status)


# ---- `loraplex agent` ----------------------------------------------------------------------

DEFAULT_MAX_LORA_RANK = 64  # without --max-lora-rank and without start-up adapters
# What a bad model folder raises while it loads (missing files, bad config, corrupt or mismatched
# weights, no tokenizer); anything else is a bug and keeps its traceback.
MODEL_ERRORS = (LoraplexError, ValueError, KeyError, OSError, RuntimeError, SafetensorError)


def parse_adapters(specs: list[str]) -> tuple[tuple[str, str], ...]:
    pairs: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CommandError(f"--adapter expects NAME=DIR, got {spec!r}")
        if name in pairs:
            raise CommandError(f"--adapter {name} is given twice")
        pairs[name] = path
    return tuple(pairs.items())


def run(args: argparse.Namespace) -> int:
    """Serve until stopped. Whatever can fail at start (arguments, the port, Redis, the model, the
    adapters) is checked before uvicorn starts and fails with one line, never a traceback."""
    adapters = parse_adapters(args.adapter)
    if not Path(args.model).is_dir():
        raise CommandError(f"--model {args.model!r} is not a folder")
    if args.max_request_bytes < 1:
        raise CommandError("--max-request-bytes must be at least 1")
    if not args.stall_timeout >= 0:
        raise CommandError("--stall-timeout must be >= 0 (0: never)")
    import uvicorn

    with listen_socket(args.host, args.port) as sock:
        if args.redis_url:
            check_redis(args.redis_url, args.pool)
        engine = load_engine(args, adapters)
        config = AgentConfig(api_key=args.api_key, admin_api_key=args.admin_api_key,
                             max_request_bytes=args.max_request_bytes)
        app = build_app(engine, config)
        if args.redis_url:  # pool membership (loraplex_agent.cluster, issue 4)
            from loraplex_agent.cluster.hook import attach_cluster
            attach_cluster(app, engine, args, config.admin_key)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        log.info("serving %s on http://%s:%d", engine.llm.served_model_name, args.host, args.port)
        uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])
    return 0


def check_redis(url: str, pool: str) -> None:
    """Fail now when the pool's Redis cannot be reached, rather than serve outside the pool."""
    open_store(url, pool).close()


def load_engine(args: argparse.Namespace, adapters: tuple[tuple[str, str], ...]) -> AsyncEngine:
    """The engine with the start-up adapters in it. They are read first, so that without
    --max-lora-rank the engine takes the largest of them, at least DEFAULT_MAX_LORA_RANK."""
    from loraplex_agent.runtime.llm import LLM

    model_config = _load_model(f"{Path(args.model) / 'config.json'}", lambda: ModelConfig.from_dir(args.model))
    loaded = [(path, _read_adapter(name, path, model_config, args)) for name, path in adapters]
    # Adapters page into the pool by their own rank, so a high limit costs nothing until one is loaded
    # (vLLM's default of 16 refuses most runtime loads); larger start-up adapters raise it.
    rank = args.max_lora_rank or max([DEFAULT_MAX_LORA_RANK, *(h.info.rank for _, h in loaded)])
    sized = argparse.Namespace(**{**vars(args), "max_lora_rank": rank})
    llm = _load_model(f"the model from {args.model}", lambda: LLM.from_args(sized))
    for path, host in loaded:
        try:
            llm.register(host, path=path)
        except LoraplexError as exc:
            raise CommandError(f"--adapter {host.info.id.name}: {_one_line(exc)}") from None
    return AsyncEngine(llm, args.stall_timeout)  # after the adapters: its first snapshot counts them


def _load_model(what: str, load: Callable[[], T]) -> T:
    try:
        return load()
    except MODEL_ERRORS as exc:
        raise CommandError(f"cannot load {what}: {_one_line(exc)}") from None


def _read_adapter(name: str, path: str, model_config: ModelConfig, args: argparse.Namespace) -> HostAdapter:
    if name == (args.served_model_name or Path(args.model).name):
        raise CommandError(f"--adapter {name}: an adapter cannot take the base model's name")
    try:
        return load_peft_adapter(name, path, model_config, args.max_lora_rank or sys.maxsize,
                                 base_model_aliases=[args.served_model_name])
    except (LoraplexError, OSError) as exc:
        raise CommandError(f"--adapter {name}={path}: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, LoraplexError) else str(exc)
    if isinstance(exc, KeyError):
        text = f"missing {text}"
    return " ".join(text.split()) or type(exc).__name__
