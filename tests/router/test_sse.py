"""Reading usage out of an SSE stream that arrives in arbitrary pieces."""

from __future__ import annotations

import json

from loraplex_router.sse import UsageTap


def event(doc: dict | str) -> bytes:
    return b"data: " + (doc if isinstance(doc, str) else json.dumps(doc)).encode() + b"\n\n"


STREAM = (event({"choices": [{"text": "a"}], "usage": None}) + event({"choices": [{"text": "b"}], "usage": None})
          + event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}) + event("[DONE]"))


def feed_in_pieces(tap: UsageTap, data: bytes, size: int) -> bytes:
    out = b"".join(tap.feed(data[i:i + size]) for i in range(0, len(data), size))
    return out + tap.flush()


def test_usage_is_read_and_the_usage_chunk_dropped_whatever_the_chunking():
    for size in (1, 7, 64, len(STREAM)):
        tap = UsageTap(forward_usage_chunk=False)
        out = feed_in_pieces(tap, STREAM, size)
        assert (tap.usage.prompt_tokens, tap.usage.completion_tokens) == (5, 2)
        assert b'"choices": []' not in out and out.endswith(event("[DONE]"))
        assert out.count(b"data: ") == 3


def test_the_usage_chunk_is_kept_when_the_client_asked_for_it():
    tap = UsageTap(forward_usage_chunk=True)
    assert feed_in_pieces(tap, STREAM, 10) == STREAM


def test_the_reported_cached_tokens_are_read():
    cached = event({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 2,
                                             "prompt_tokens_details": {"cached_tokens": 32}}})
    tap = UsageTap(forward_usage_chunk=False)
    feed_in_pieces(tap, cached, 5)
    assert tap.usage.cached_tokens == 32
    tap = UsageTap(forward_usage_chunk=False)
    feed_in_pieces(tap, STREAM, 5)
    assert tap.usage.cached_tokens is None  # a server that does not report it: the index's guess stands
