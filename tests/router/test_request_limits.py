"""A body over --max-request-bytes is answered 413 by the router before it is read to the end, and
never reaches a server."""

from __future__ import annotations

import httpx
import openai
import pytest
import raw_http
from loraplex_router.cli import DEFAULT_MAX_REQUEST_BYTES

MIB = 1 << 20


def assert_too_large(response: raw_http.RawResponse) -> None:
    assert response.status == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"


def served(env) -> int:
    return sum(echo.server.config.app.requests for echo in env.echoes.values())


def assert_still_routing(env) -> None:
    done = openai.OpenAI(base_url=env.router.url + "/v1", api_key="none", max_retries=0).completions.create(
        model="a", prompt="x", max_tokens=1)
    assert done.choices[0].text == "tok"


def test_a_declared_oversized_body_is_refused_before_it_is_sent(router_env):
    response = raw_http.post(f"{router_env.router.url}/v1/completions", {"Content-Length": str(10 << 30)})
    assert_too_large(response)
    assert served(router_env) == 0
    assert_still_routing(router_env)


def test_a_chunked_body_is_refused_once_it_passes_the_limit(router_env):
    pieces = [b"x" * MIB] * (DEFAULT_MAX_REQUEST_BYTES // MIB + 1)  # the body never ends
    response = raw_http.post(f"{router_env.router.url}/v1/chat/completions", {"Transfer-Encoding": "chunked"},
                             raw_http.chunked(pieces))
    assert_too_large(response)
    assert served(router_env) == 0
    assert_still_routing(router_env)


def test_the_openai_client_gets_413_and_the_metrics_count_it(router_env):
    client = openai.OpenAI(base_url=router_env.router.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="a", prompt="x" * DEFAULT_MAX_REQUEST_BYTES, max_tokens=1)
    assert err.value.status_code == 413 and err.value.body["code"] == "request_too_large"
    assert served(router_env) == 0
    metrics = httpx.get(router_env.router.url + "/metrics").text
    assert any(line.startswith("loraplex_router_requests_total") and 'code="413"' in line
               for line in metrics.splitlines())


def test_a_body_at_the_limit_is_forwarded(make_router_env):
    env = make_router_env()
    prefix, suffix = b'{"model": "a", "max_tokens": 1, "prompt": "', b'"}'
    body = prefix + b"x" * (DEFAULT_MAX_REQUEST_BYTES - len(prefix) - len(suffix)) + suffix
    response = httpx.post(env.router.url + "/v1/completions", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 200 and served(env) == 1
