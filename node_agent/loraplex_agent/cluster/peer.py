"""Serving this agent's adapters to its peers: GET /v1/adapters/{name}/files is a tar of the
adapter's two files, with the digest of the weights in the `x-loraplex-digest` header.

When the agent has an API key, peers must send it (they share the pool's key)."""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from loraplex.spec.errors import AuthenticationError, NotFoundError
from loraplex_agent.cluster.fetcher import DIGEST_HEADER
from loraplex_agent.cluster.files import ADAPTER_FILES, tar_chunks


def add_peer_routes(app: FastAPI, engine, api_key: str | None) -> None:
    @app.get("/v1/adapters/{name:path}/files")
    async def adapter_files(name: str, request: Request) -> Response:
        if api_key is not None and not _authorized(request, api_key):
            error = AuthenticationError("a valid API key is required to fetch adapters")
            return JSONResponse(error.to_openai(), status_code=error.status)
        loaded = engine.adapters.get(name)
        folder = Path(loaded.path) if loaded and loaded.path else None  # None: made in memory
        if folder is None or not all((folder / f).is_file() for f in ADAPTER_FILES):
            error = NotFoundError(f"adapter {name!r} is not held here", param="name")
            return JSONResponse(error.to_openai(), status_code=error.status)
        return StreamingResponse(iterate_in_threadpool(tar_chunks(folder)), media_type="application/x-tar",
                                 headers={DIGEST_HEADER: loaded.info.id.digest})


def _authorized(request: Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())
