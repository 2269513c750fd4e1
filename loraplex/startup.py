"""Start-up checks the servers (agent, router) share, each failing with one clear line
(`CommandError`) before any model or app is built."""

from __future__ import annotations

import logging
import os
import socket

from loraplex.routing.redis_store import RedisRoutingStore
from loraplex.routing.store import StoreUnavailableError
from loraplex.spec.errors import CommandError


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now so that a port in use fails before anything loads. Its protocol
    is named: asyncio sets TCP_NODELAY only on connections of an IPPROTO_TCP socket, and without it
    every small response waits ~40 ms for the client's delayed ACK (Nagle)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def redis_password() -> str | None:
    """LORAPLEX_REDIS_PASSWORD, for a Redis that requires one (the chart sets it from a Secret)."""
    return os.environ.get("LORAPLEX_REDIS_PASSWORD") or None


def open_store(url: str, pool: str, required: bool = True) -> RedisRoutingStore:
    """The pool's store (the caller closes it). With `required`, only once Redis has answered;
    without, a Redis that is not up yet is logged and the caller reports not-ready until it is."""
    try:
        store = RedisRoutingStore.from_url(url, pool, password=redis_password())
    except ValueError as exc:
        raise CommandError(f"bad --redis-url or --pool: {exc}") from None
    try:
        store.current_version()
    except StoreUnavailableError as exc:
        if not required:
            logging.getLogger(__name__).warning("Redis is not reachable yet (%s); not ready until it is", exc)
            return store
        store.close()
        raise CommandError(f"cannot reach Redis (--redis-url): {exc}") from None
    return store
