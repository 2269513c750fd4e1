"""The router refuses what the agents refuse, before choosing a server, in OpenAI's error format: a body
not sent as JSON, a `model` that is not a string, a `stream` that is not a boolean."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize(("headers", "body", "param", "fragment"), [
    ({}, b'{"model": "a", "prompt": "x"}', None, "must be JSON sent with Content-Type: application/json"),
    ({"content-type": "text/plain"}, b'{"model": "a", "prompt": "x"}', None, "not text/plain"),
    ({"content-type": "application/json"}, b'{"model": 5, "prompt": "x"}', "model", "'model' must be a string"),
    ({"content-type": "application/json"}, b'{"prompt": "x"}', "model", "'model' is required"),
    ({"content-type": "application/json"}, b'{"model": "a", "prompt": "x", "stream": "yes"}', "stream",
     "'stream' must be a boolean, not a string"),
])
def test_a_request_the_agents_would_refuse_is_400(router_env, headers, body, param, fragment) -> None:
    r = httpx.post(router_env.router.url + "/v1/completions", content=body, headers=headers)
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
    assert fragment in error["message"] and error["param"] == param


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "application/vnd.api+json"])
def test_json_content_types_and_a_null_stream_pass(router_env, content_type) -> None:
    r = httpx.post(router_env.router.url + "/v1/completions", headers={"content-type": content_type},
                   content=b'{"model": "a", "prompt": "x", "max_tokens": 1, "stream": null}')
    assert r.status_code == 200, r.text
