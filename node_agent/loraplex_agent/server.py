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
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.cli import CommandError
from loraplex.spec.errors import AuthenticationError, InvalidRequestError, LoraplexError
from loraplex_agent.async_engine import AsyncEngine
from loraplex_agent.metrics import CONTENT_TYPE, ServerMetrics
from loraplex_agent.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadedAdapter,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoraAdapterRequest,
)
from loraplex_agent.serving import ServingContext
from loraplex_agent.serving_chat import create_chat_completion
from loraplex_agent.serving_completions import create_completion

log = logging.getLogger(__name__)
API_KEY_ENV = "LORAPLEX_API_KEY"


@dataclass
class AgentConfig:
    api_key: str | None = None  # required by the adapter load/unload endpoints when set
    adapters: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start


def build_app(engine: AsyncEngine, config: AgentConfig) -> FastAPI:
    """The app; its lifespan starts the engine thread, loads the start-up adapters and stops it."""
    core_config, served = engine.core.config, engine.llm.served_model_name
    metrics = ServerMetrics(served, engine.snapshot, core_config.max_loras, core_config.block_size,
                            engine.llm.executor.drain_load_seconds)
    ctx = ServingContext(engine, metrics, served, str(engine.llm.model_dir))

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
    _add_error_handlers(app)
    _add_openai_routes(app, ctx)
    _add_adapter_routes(app, ctx, config.api_key)
    _add_ops_routes(app, ctx)
    return app


# ---- routes ---------------------------------------------------------------------------------


def _add_openai_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _until_disconnect(raw, lambda: _respond(create_completion(ctx, body)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _until_disconnect(raw, lambda: _respond(create_chat_completion(ctx, body)))

    @app.get("/v1/models")
    async def models() -> ModelList:
        base = ModelCard(id=ctx.served_model_name, root=ctx.model_path, max_model_len=ctx.max_model_len)
        adapters = [ModelCard(id=name, root=record.path, parent=ctx.served_model_name,
                              max_model_len=ctx.max_model_len)
                    for name, record in sorted(ctx.engine.adapters.items())]
        return ModelList(data=[base, *adapters])


def _add_adapter_routes(app: FastAPI, ctx: ServingContext, api_key: str | None) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest, raw: Request) -> LoadedAdapter:
        _authenticate(raw, api_key)
        if body.lora_name == ctx.served_model_name:
            raise InvalidRequestError("an adapter cannot take the base model's name", param="lora_name")
        info = await ctx.engine.add_adapter(body.lora_name, body.lora_path, pinned=body.pinned)
        log.info("loaded adapter %s (rank %d) from %s", info.id, info.rank, body.lora_path)
        return LoadedAdapter(lora_name=body.lora_name, digest=info.id.digest, rank=info.rank,
                             lora_path=body.lora_path)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, raw: Request) -> LoadedAdapter:
        _authenticate(raw, api_key)
        info, draining = await ctx.engine.unload_adapter(body.lora_name)
        log.info("unloaded adapter %s (%d requests still running on it)", info.id, draining)
        return LoadedAdapter(lora_name=body.lora_name, digest=info.id.digest, rank=info.rank,
                             draining_requests=draining)


def _add_ops_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        if ctx.engine.healthy:
            return Response(status_code=200)
        return _error_response(503, "service_unavailable", f"the engine is down: {ctx.engine.error!r}")

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


def _authenticate(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
        raise AuthenticationError("a valid API key is required: send 'Authorization: Bearer <key>'")


# ---- errors ---------------------------------------------------------------------------------


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


def parse_adapters(specs: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CommandError(f"--adapter expects NAME=DIR, got {spec!r}")
        pairs.append((name, path))
    return tuple(pairs)


def run(args: argparse.Namespace) -> int:
    adapters = parse_adapters(args.adapter)
    if not Path(args.model).is_dir():
        raise CommandError(f"--model {args.model!r} is not a folder")
    import uvicorn

    from loraplex_agent.llm import LLM

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        llm = LLM.from_args(args)
    except (LoraplexError, ValueError) as exc:  # a bad model folder or engine setting
        raise CommandError(str(exc)) from exc
    config = AgentConfig(api_key=args.api_key or os.environ.get(API_KEY_ENV), adapters=adapters)
    engine = AsyncEngine(llm)
    app = build_app(engine, config)
    if getattr(args, "redis_url", None):  # pool membership (loraplex_agent.cluster, issue 4)
        from loraplex_agent.cluster.hook import attach_cluster
        attach_cluster(app, engine, args, config.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
