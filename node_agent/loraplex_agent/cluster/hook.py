"""Joining the agent's app to its pool: one call from `loraplex agent` when --redis-url is given.

It adds the peer route, a middleware that loads a missing adapter before a request needs it, and
wraps the app's lifespan so the member starts after the engine and stops before it.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from loraplex.routing.redis_store import RedisRoutingStore
from loraplex.routing.store import StoreUnavailableError
from loraplex.spec.errors import LoraplexError, OverloadedError
from loraplex_agent.cluster.fetcher import AdapterFetcher
from loraplex_agent.cluster.member import ClusterMember
from loraplex_agent.cluster.peer import add_peer_routes
from loraplex_agent.cluster.settings import ClusterSettings

log = logging.getLogger("loraplex.agent.cluster")
ADAPTER_HEADER = b"x-loraplex-adapter"  # set by the router: the adapter a request needs


def attach_cluster(app: FastAPI, engine, args: argparse.Namespace, api_key: str | None) -> ClusterMember:
    settings = ClusterSettings.from_args(args)
    store = RedisRoutingStore.from_url(settings.redis_url, settings.pool)
    fetcher = AdapterFetcher(settings.adapter_store, settings.sources, api_key)
    member = ClusterMember(settings, store, engine, fetcher, engine.core.config.max_lora_rank,
                           engine.llm.served_model_name)
    add_peer_routes(app, engine, api_key)
    app.add_middleware(EnsureAdapterMiddleware, member=member)
    _wrap_lifespan(app, member, store)
    log.info("joining pool %s as %s (%s)", settings.pool, settings.server_id, settings.advertise_url)
    return member


def _wrap_lifespan(app: FastAPI, member: ClusterMember, store: RedisRoutingStore) -> None:
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[None]:
        async with inner(a):
            await member.start()
            try:
                yield
            finally:
                await member.stop()
                store.close()

    app.router.lifespan_context = lifespan


class EnsureAdapterMiddleware:
    """A request naming an adapter this agent does not hold yet waits for it to be fetched and
    loaded (from a peer, else the source) instead of failing with 404."""

    def __init__(self, app, member: ClusterMember) -> None:
        self.app = app
        self.member = member

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            name = dict(scope["headers"]).get(ADAPTER_HEADER)
            if name:
                with self.member.pinned(name.decode()):  # from before the load until the response ends
                    try:
                        await self.member.ensure(name.decode())
                    except LoraplexError as exc:
                        await _send_error(send, exc)
                        return
                    except StoreUnavailableError as exc:  # 503 lets the router try another server
                        await _send_error(send, OverloadedError(f"cannot load adapter now: {exc}"))
                        return
                    await self.app(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _send_error(send, exc: LoraplexError) -> None:
    body = json.dumps(exc.to_openai()).encode()
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
