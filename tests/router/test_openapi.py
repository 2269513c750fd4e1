"""The router's /openapi.json documents the request bodies it forwards and the errors each route
answers, in OpenAI's error shape; declaring them changes nothing in what the router accepts."""

from __future__ import annotations

import httpx
import pytest

ERROR_REF = "#/components/schemas/ErrorResponse"
PROXIED_ERRORS = {"400", "401", "403", "404", "413", "502", "503"}


@pytest.fixture
def schema(router_env) -> dict:
    response = httpx.get(router_env.router.url + "/openapi.json")
    assert response.status_code == 200
    return response.json()


@pytest.mark.parametrize(("path", "field"), [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_proxied_routes_declare_their_body_and_errors(schema, path, field):
    operation = schema["paths"][path]["post"]
    body = operation["requestBody"]
    assert body["required"] is True
    declared = body["content"]["application/json"]["schema"]
    assert set(declared["required"]) == {"model", field}
    assert {"model", field, "stream", "stream_options"} <= set(declared["properties"])
    assert declared["additionalProperties"] is True  # the other parameters go to the agent as sent
    responses = operation["responses"]
    assert PROXIED_ERRORS | {"default"} <= set(responses)
    assert "422" not in responses
    for status in PROXIED_ERRORS | {"default"}:
        assert responses[status]["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}


def test_other_routes_declare_their_errors(schema):
    assert schema["paths"]["/v1/models"]["get"]["responses"]["401"]["content"]["application/json"]["schema"] \
        == {"$ref": ERROR_REF}
    assert "503" in schema["paths"]["/ready"]["get"]["responses"]
    detail = schema["components"]["schemas"]["ErrorDetail"]
    assert set(detail["properties"]) == {"message", "type", "param", "code"}


def test_the_declared_body_does_not_change_validation(router_env):
    url = router_env.router.url + "/v1/completions"
    extra = httpx.post(url, json={"model": "a", "prompt": "x", "max_tokens": 1, "top_k": 3, "unknown": 1})
    assert extra.status_code == 200  # unknown fields pass through to the server
    missing = httpx.post(url, json={"prompt": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    no_prompt = httpx.post(url, json={"model": "a", "max_tokens": 1})
    assert no_prompt.status_code == 200  # the router checks `model` only; the agent checks the rest
