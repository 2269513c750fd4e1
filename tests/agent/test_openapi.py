"""The agent's /openapi.json documents every request body and the errors each route answers, all in
OpenAI's error shape (and never FastAPI's 422, which the agent does not send)."""

from __future__ import annotations

import httpx
import pytest

ERROR_REF = "#/components/schemas/ErrorResponse"
ROUTES = {  # (method, path): (request body schema, error statuses)
    ("post", "/v1/completions"): ("CompletionRequest", {"400", "404", "413", "503"}),
    ("post", "/v1/chat/completions"): ("ChatCompletionRequest", {"400", "404", "413", "503"}),
    ("post", "/v1/load_lora_adapter"): ("LoadLoraAdapterRequest", {"400", "401", "404", "409", "413", "503"}),
    ("post", "/v1/unload_lora_adapter"): ("UnloadLoraAdapterRequest", {"400", "401", "404", "413", "503"}),
    ("get", "/health"): (None, {"503"}),
}


@pytest.fixture(scope="module")
def schema(agent) -> dict:
    response = httpx.get(f"{agent.url}/openapi.json", timeout=30)
    assert response.status_code == 200
    return response.json()


@pytest.mark.parametrize(("method", "path"), list(ROUTES))
def test_each_route_declares_its_body_and_errors(schema, method, path):
    body, errors = ROUTES[(method, path)]
    operation = schema["paths"][path][method]
    if body is not None:
        declared = operation["requestBody"]
        assert declared["required"] is True
        assert declared["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{body}"}
    responses = operation["responses"]
    assert errors | {"default"} <= set(responses)
    assert "422" not in responses
    for status in errors | {"default"}:
        assert responses[status]["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}
        assert responses[status]["description"]


def test_the_error_model_is_openais(schema):
    components = schema["components"]["schemas"]
    assert components["ErrorResponse"]["required"] == ["error"]
    detail = components["ErrorDetail"]
    assert set(detail["properties"]) == {"message", "type", "param", "code"}
    assert set(detail["required"]) == {"message", "type"}


def test_request_models_carry_their_fields(schema):
    components = schema["components"]["schemas"]
    assert {"model", "prompt"} <= set(components["CompletionRequest"]["required"])
    assert {"model", "messages"} <= set(components["ChatCompletionRequest"]["required"])
    assert set(components["LoadLoraAdapterRequest"]["required"]) == {"lora_name", "lora_path"}
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert completions["application/json"]["schema"] == {"$ref": "#/components/schemas/CompletionResponse"}
    assert "text/event-stream" in completions
