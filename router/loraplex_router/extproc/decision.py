"""One request's routing decision: the same checks and the same pick as the HTTP router's, over the
gateway's view of the request (its headers, its whole body, the subset it allows)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.spec.errors import LoraplexError, OverloadedError
from loraplex_router.app import parse_body, ready_snapshot, resolve_adapter
from loraplex_router.auth import KeyRing
from loraplex_router.errors import RequestTooLargeError
from loraplex_router.extproc.endpoints import Endpoints
from loraplex_router.extproc.protocol import MODEL_REWRITE
from loraplex_router.proxy import Forward, Proxy, prepare_body
from loraplex_router.snapshot import Snapshot


class ShedError(LoraplexError):
    """Every server the request may go to is at the picker's queue limit: the request is dropped (429)."""

    status = 429
    type = "rate_limit_error"


@dataclass(frozen=True)
class PickerSettings:
    max_request_bytes: int
    fallbacks: int = 2          # endpoints listed after the primary for the gateway's retries
    shed_queue_depth: int = 0   # shed when every allowed server has this many open requests; 0: never


@dataclass
class Decision:
    fwd: Forward
    servers: list[str]     # the primary first, then the fallbacks
    endpoints: list[str]   # the same, as `ip:port`
    rewritten: bool        # the body sent upstream differs from the client's


class Decider:
    def __init__(self, proxy: Callable[[], Proxy], snapshot: Callable[[], Snapshot], keys: KeyRing,
                 endpoints: Endpoints, settings: PickerSettings) -> None:
        self.proxy, self.snapshot, self.keys = proxy, snapshot, keys
        self.endpoints, self.settings = endpoints, settings

    def check_size(self, size: int) -> None:
        if size > self.settings.max_request_bytes:
            raise RequestTooLargeError(self.settings.max_request_bytes)

    def decide(self, headers: dict[str, str], raw: bytes | None, subset: frozenset[str] | None,
               arrived_at: float) -> Decision:
        """Raises LoraplexError with the status the gateway should answer. `raw` None: a request without
        a body (it goes to a server of the base model)."""
        key = self.keys.authenticate(headers.get("authorization"))
        snapshot = ready_snapshot(self.snapshot())
        proxy = self.proxy()
        fwd, rewritten = self._forward(snapshot, proxy, headers, raw, arrived_at)
        self.keys.check(key, fwd.adapter, fwd.model)
        endpoints = self.endpoints.table(snapshot.servers)
        excluded = {s for s in snapshot.servers
                    if s not in endpoints or (subset is not None and endpoints[s] not in subset)}
        if subset is not None and len(excluded) == len(snapshot.servers):
            raise OverloadedError("no server of the gateway's endpoint subset can serve this request",
                                  code="no_eligible_endpoint")
        self._shed(snapshot, proxy, excluded)
        servers = [proxy.pick(snapshot, fwd, excluded)]
        while len(servers) <= self.settings.fallbacks:
            server = proxy.fallback(snapshot, fwd, excluded | set(servers))
            if server is None:
                break
            servers.append(server)
        return Decision(fwd, servers, [endpoints[s] for s in servers], rewritten)

    def _forward(self, snapshot: Snapshot, proxy: Proxy, headers: dict[str, str], raw: bytes | None,
                 arrived_at: float) -> tuple[Forward, bool]:
        path = headers.get(":path", "/v1/completions").split("?")[0]
        if raw is None:
            model = snapshot.base_model or ""
            return Forward(path, b"", model, None, False, False, arrived_at), False
        original, body = raw, parse_body(raw, headers.get("content-type", ""))
        rewrite = next((headers[h] for h in MODEL_REWRITE if headers.get(h)), None)
        if rewrite is not None and rewrite != body["model"]:
            body = {**body, "model": rewrite}
            raw = json.dumps(body, separators=(",", ":")).encode()
        adapter = resolve_adapter(snapshot, body["model"])
        payload, stream, wants_usage = prepare_body(body, raw)
        fwd = Forward(path, payload, body["model"], adapter, stream, wants_usage, arrived_at,
                      proxy.prefix_keys(snapshot, adapter, body))
        return fwd, payload is not original

    def _shed(self, snapshot: Snapshot, proxy: Proxy, excluded: set[str]) -> None:
        limit = self.settings.shed_queue_depth
        if limit <= 0:
            return
        down = excluded | proxy.detector.ejected(snapshot.servers)
        open_ = [c.queue_depth for c in snapshot.candidates(None, down, proxy.in_flight) if c.healthy]
        if open_ and min(open_) >= limit:
            raise ShedError(f"every server has {limit} or more open requests (--extproc-shed-queue-depth)",
                            code="shed")
