"""A minimal OpenAI-shaped server that answers instantly: `max_tokens` copies of one token.

`loraplex bench router` puts it behind the router to measure the router's own cost with nothing
else in the way, and the router's tests use it as a fast upstream. It is a plain ASGI app, so its
own overhead stays small next to the router's.
"""

from __future__ import annotations

import json
import time

TOKEN = "tok"


class EchoServer:
    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self.requests = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            body = json.loads(await _read_body(receive) or b"{}")
            self.requests += 1
            await self._complete(body, path.endswith("chat/completions"), send)
        elif method == "GET" and path == "/health":
            await _send_json(send, 200, {"status": "ok"})
        else:
            await _send_json(send, 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})

    async def _complete(self, body: dict, chat: bool, send) -> None:
        n = int(body.get("max_tokens") or 1)
        prompt = body.get("messages") if chat else body.get("prompt", "")
        usage = {"prompt_tokens": len(json.dumps(prompt).split()), "completion_tokens": n}
        usage["total_tokens"] = usage["prompt_tokens"] + n
        base = {"id": f"cmpl-{self.requests}", "created": int(time.time()), "model": body.get("model")}
        if not body.get("stream"):
            text = " ".join([TOKEN] * n)
            choice = {"index": 0, "finish_reason": "length",
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            kind = "chat.completion" if chat else "text_completion"
            await _send_json(send, 200, {**base, "object": kind, "choices": [choice], "usage": usage},
                             {"x-echo-server": self.server_id})
            return
        await _start(send, 200, "text/event-stream", {"x-echo-server": self.server_id})
        kind = "chat.completion.chunk" if chat else "text_completion"
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        for i in range(n):
            delta = {"delta": {"content": TOKEN}} if chat else {"text": TOKEN}
            chunk = {**base, "object": kind, "choices": [{"index": 0, **delta,
                                                          "finish_reason": "length" if i == n - 1 else None}]}
            if with_usage:
                chunk["usage"] = None
            await _event(send, chunk)
        if with_usage:
            await _event(send, {**base, "object": kind, "choices": [], "usage": usage})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _start(send, status: int, content_type: str, headers: dict[str, str]) -> None:
    raw = [(b"content-type", content_type.encode())] + [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})


async def _send_json(send, status: int, doc: dict, headers: dict[str, str] | None = None) -> None:
    await _start(send, status, "application/json", headers or {})
    await send({"type": "http.response.body", "body": json.dumps(doc).encode()})


async def _event(send, doc: dict) -> None:
    payload = b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": payload, "more_body": True})


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
