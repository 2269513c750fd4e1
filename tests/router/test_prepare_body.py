"""What the router sends upstream: the client's bytes, with stream usage requested when needed."""

from __future__ import annotations

import json

from loraplex_router.proxy import prepare_body


def prepared(raw: bytes) -> tuple[dict, bytes, bool, bool]:
    payload, stream, wants_usage = prepare_body(json.loads(raw), raw)
    return json.loads(payload), payload, stream, wants_usage


def test_a_plain_request_goes_out_byte_for_byte():
    raw = b'{"model": "a", "prompt": "x",  "max_tokens": 3}'
    assert prepare_body(json.loads(raw), raw) == (raw, False, False)


def test_a_stream_gets_usage_spliced_in_without_reserialising():
    raw = b' \n{"model": "a", "prompt": "x", "stream": true, "max_tokens": 2}'
    doc, payload, stream, wants_usage = prepared(raw)
    assert (stream, wants_usage) == (True, False)
    assert doc == {"model": "a", "prompt": "x", "stream": True, "max_tokens": 2,
                   "stream_options": {"include_usage": True}}
    assert payload.endswith(b'"model": "a", "prompt": "x", "stream": true, "max_tokens": 2}')


def test_existing_stream_options_are_kept_and_completed():
    doc, _, _, wants_usage = prepared(b'{"model": "a", "stream": true, "stream_options": {"x": 1}}')
    assert doc["stream_options"] == {"x": 1, "include_usage": True} and not wants_usage
    raw = b'{"model": "a", "stream": true, "stream_options": {"include_usage": true}}'
    assert prepare_body(json.loads(raw), raw) == (raw, True, True)


def test_a_body_in_another_encoding_is_rewritten_not_spliced():
    raw = '{"model": "a", "stream": true}'.encode("utf-16")
    doc, _, _, _ = prepared(raw)
    assert doc == {"model": "a", "stream": True, "stream_options": {"include_usage": True}}
