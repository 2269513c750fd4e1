"""Loraplex's plug-in for an unmodified vLLM OpenAI server, loaded with vLLM's own extension point:

    python -m vllm.entrypoints.openai.api_server ... --middleware loraplex_vllm.LoraplexMiddleware

This file runs inside vLLM's interpreter, so it uses the standard library only (no loraplex import).
The agent copies it into a folder on vLLM's PYTHONPATH; in Kubernetes the operator mounts it from
the pool's ConfigMap. It does two things:

- Runtime LoRA updating stays on the loopback: `/v1/load_lora_adapter` and
  `/v1/unload_lora_adapter` (switched on with VLLM_ALLOW_RUNTIME_LORA_UPDATING) answer 403 to any
  client that is not on 127.0.0.1 / ::1. The agent, in the same pod, is the only one that loads.
- A request the router tags with `x-loraplex-adapter` waits until the agent beside this server holds
  that adapter (POST $LORAPLEX_AGENT_URL/internal/ensure): fetched from a peer or its source,
  digest-checked and loaded into vLLM. As with Loraplex's own engine, a request that arrives before
  the prefetch is served instead of answered 404. An adapter the pool does not know, or an agent that
  cannot be reached, is answered 503, so the router tries another server.
- The agent keeps that adapter pinned until vLLM's answer has ended (POST .../internal/release), as
  Loraplex's own engine pins it: an adapter evicted in between would be answered 404, or, once vLLM
  had queued the request, reloaded by vLLM's engine from a folder that is gone, which kills it.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request

AGENT_URL_ENV = "LORAPLEX_AGENT_URL"
ENSURE_TIMEOUT_ENV = "LORAPLEX_ENSURE_TIMEOUT_S"
RELEASE_TIMEOUT_S = 10.0  # a release the agent misses leaves the adapter pinned: loaded, never lost
ADAPTER_HEADER = b"x-loraplex-adapter"
RUNTIME_UPDATE_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})


def is_loopback(scope: dict) -> bool:
    client = scope.get("client")
    return bool(client) and client[0] in LOOPBACK


def error_body(status: int, kind: str, message: str, code: str | None = None) -> bytes:
    """OpenAI's error shape, as the rest of the pool answers."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code if code is not None else status}}).encode()


def call_agent(agent_url: str, action: str, name: str, timeout_s: float) -> tuple[int, bytes]:
    """POST /internal/<action> (ensure, release) for adapter `name` to the agent (blocking; run in a
    thread). (status, body)."""
    request = urllib.request.Request(f"{agent_url}/internal/{action}", method="POST",
                                     data=json.dumps({"adapter": name}).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError) as exc:
        return 503, error_body(503, "service_unavailable",
                               f"the Loraplex agent beside this vLLM server cannot be reached: {exc}",
                               "agent_unreachable")


class LoraplexMiddleware:
    """ASGI middleware (vLLM's `--middleware` adds it with the app as its only argument)."""

    def __init__(self, app) -> None:
        self.app = app
        self.agent_url = os.environ.get(AGENT_URL_ENV, "").rstrip("/")
        self.timeout_s = float(os.environ.get(ENSURE_TIMEOUT_ENV, "300"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "").rstrip("/")
        if path in RUNTIME_UPDATE_PATHS and not is_loopback(scope):
            await _reply(send, 403, error_body(403, "permission_error", "runtime LoRA updating is only "
                                               "open to the Loraplex agent on this pod's loopback"))
            return
        adapter = dict(scope.get("headers") or ()).get(ADAPTER_HEADER)
        if not (adapter and self.agent_url and scope.get("method") == "POST"):
            await self.app(scope, receive, send)
            return
        name = adapter.decode("utf-8", "replace")
        status, body = await asyncio.to_thread(call_agent, self.agent_url, "ensure", name, self.timeout_s)
        if status != 200:
            await _reply(send, status, body)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            await asyncio.to_thread(call_agent, self.agent_url, "release", name, RELEASE_TIMEOUT_S)


async def _reply(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
