"""Passing an OpenAI SSE stream through while reading the token usage out of it.

The router asks servers for usage in streams (`stream_options.include_usage`) so it can count
demand. The final usage-only chunk (`"choices": []`) is passed on only if the client asked for it.
Events are forwarded as soon as they are complete; nothing waits for the end of the stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # prompt_tokens_details.cached_tokens, when the server reports it

    @classmethod
    def from_body(cls, doc: object) -> Usage | None:
        usage = doc.get("usage") if isinstance(doc, dict) else None
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                   cached if isinstance(cached, int) and not isinstance(cached, bool) else None)


class UsageTap:
    """Splits raw stream bytes into events, notes the usage, drops the usage chunk if unwanted."""

    def __init__(self, forward_usage_chunk: bool) -> None:
        self.forward_usage_chunk = forward_usage_chunk
        self.usage: Usage | None = None
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        """Bytes to send to the client now: the complete events in `data` plus what was pending."""
        self._pending += data
        head, sep, tail = self._pending.rpartition(b"\n\n")
        if not sep:
            return b""
        self._pending = tail
        events = head.split(b"\n\n")
        return b"".join(e + b"\n\n" for e in events if self._keep(e))

    def flush(self) -> bytes:
        """What is left when the server closes the stream (normally nothing)."""
        rest, self._pending = self._pending, b""
        if rest.strip() and not self._keep(rest):
            return b""
        return rest

    def _keep(self, event: bytes) -> bool:
        # Only the usage chunk has a usage object; every other chunk has "usage": null or none.
        if b'"usage"' not in event or b'"usage":null' in event or b'"usage": null' in event:
            return True
        doc = _event_json(event)
        usage = Usage.from_body(doc)
        if usage is None:
            return True
        self.usage = usage
        return self.forward_usage_chunk or bool(doc.get("choices"))


def _event_json(event: bytes) -> dict | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return None
            try:
                doc = json.loads(payload)
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None
    return None
