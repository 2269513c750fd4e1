"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter while the server serves requests."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

PROMPT = "class Parser:\n    def "


def _load(agent, name: str, path, headers=None):
    with agent.http() as http:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                         headers=agent.admin_headers() if headers is None else headers)


def _unload(agent, name: str, headers=None):
    with agent.http() as http:
        return http.post("/v1/unload_lora_adapter", json={"lora_name": name},
                         headers=agent.admin_headers() if headers is None else headers)


def _model_ids(agent) -> set[str]:
    return {m.id for m in agent.client().models.list().data}


def _greedy(agent, model: str, max_tokens: int = 8) -> str:
    return agent.client().completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text


def test_load_serve_and_unload(agent):
    path = agent.tiny_model.adapters["lora04-r8"]
    loaded = _load(agent, "runtime-a", path)
    assert loaded.status_code == 200, loaded.text
    body = loaded.json()
    assert body["lora_name"] == "runtime-a" and body["rank"] == 8 and body["digest"].startswith("sha256:")
    model = next(m for m in agent.client().models.list().data if m.id == "runtime-a")
    assert (model.parent, model.root) == (agent.base, str(path))
    assert _greedy(agent, "runtime-a") != _greedy(agent, agent.base)

    assert _unload(agent, "runtime-a").status_code == 200
    assert "runtime-a" not in _model_ids(agent)
    with agent.http() as http:
        response = http.post("/v1/completions", json={"model": "runtime-a", "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 404


def test_load_and_unload_need_the_api_key(agent):
    path = agent.tiny_model.adapters["lora05-r16"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-admin-key"}):
        response = _load(agent, "runtime-auth", path, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert "runtime-auth" not in _model_ids(agent)
    assert _load(agent, "runtime-auth", path).status_code == 200
    assert _unload(agent, "runtime-auth", headers={}).status_code == 401
    assert _unload(agent, "runtime-auth").status_code == 200


def test_loading_an_existing_name_is_a_conflict(agent):
    response = _load(agent, agent.adapters[0], agent.tiny_model.adapters["lora06-r32"])
    assert response.status_code == 409
    assert "already loaded" in response.json()["error"]["message"]
    assert _load(agent, agent.base, agent.tiny_model.adapters["lora06-r32"]).status_code == 400


def test_missing_path_is_404_and_unknown_unload_is_404(agent, tmp_path):
    response = _load(agent, "runtime-missing", tmp_path / "does-not-exist")
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "lora_path"
    assert _unload(agent, "never-loaded").status_code == 404


@pytest.mark.parametrize("damage", ["truncated weights", "wrong base model", "rank above the maximum",
                                    "bad name"])
def test_corrupt_or_incompatible_adapter_is_refused_while_others_are_served(agent, tmp_path, damage):
    folder = tmp_path / "adapter"
    shutil.copytree(agent.tiny_model.adapters["lora07-r64"], folder)
    name = "runtime-corrupt"
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    if damage == "truncated weights":
        weights = folder / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "wrong base model":
        config["base_model_name_or_path"] = "some-other-model"
    elif damage == "rank above the maximum":
        config["r"] = 128
    else:
        name = "bad name with spaces"
    config_path.write_text(json.dumps(config))

    before = _greedy(agent, agent.adapters[1], max_tokens=24)
    results = {}
    running = threading.Thread(target=lambda: results.update(text=_greedy(agent, agent.adapters[1], 24)))
    running.start()
    response = _load(agent, name, folder)
    running.join()
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
    assert results["text"] == before
    assert name not in _model_ids(agent)
    with agent.http() as http:
        assert http.get("/health").status_code == 200


def test_unload_while_a_request_runs_lets_it_finish(agent):
    assert _load(agent, "runtime-busy", agent.tiny_model.adapters["lora05-r16"]).status_code == 200
    # Long enough (hundreds of engine steps) to still run when the unload arrives.
    expected = _greedy(agent, "runtime-busy", max_tokens=400)
    stream = agent.client().completions.create(model="runtime-busy", prompt=PROMPT, max_tokens=400, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    unloaded = _unload(agent, "runtime-busy")
    assert unloaded.status_code == 200
    assert unloaded.json()["draining_requests"] == 1
    # Refused at once for new requests, while the running one completes with the adapter's weights.
    with agent.http() as http:
        refused = http.post("/v1/completions", json={"model": "runtime-busy", "prompt": PROMPT, "max_tokens": 2})
    assert refused.status_code == 404
    again = _load(agent, "runtime-busy", agent.tiny_model.adapters["lora06-r32"])  # the name is not free yet
    assert again.status_code == 409 and "still being unloaded" in again.json()["error"]["message"], again.text
    rest = list(chunks)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    assert text == expected
    assert rest[-1].choices[0].finish_reason == "length"
    # Once it finished, the name can be loaded again.
    agent.wait_for(lambda: _load(agent, "runtime-busy", agent.tiny_model.adapters["lora06-r32"]).status_code == 200,
                   "the adapter name to be free again")
    assert _unload(agent, "runtime-busy").status_code == 200


def test_the_api_key_guards_every_v1_endpoint_and_the_admin_key_only_adapters(agent):
    """--api-key means what it means in vLLM: inference too; --admin-api-key guards load/unload only."""
    from fastapi.testclient import TestClient
    from loraplex_agent.api.server import AgentConfig, build_app
    from loraplex_agent.cli import DEFAULT_MAX_REQUEST_BYTES

    client = TestClient(build_app(agent.engine, AgentConfig(DEFAULT_MAX_REQUEST_BYTES, api_key="infer", admin_api_key="admin")))  # no lifespan
    bearer = lambda key: {"Authorization": f"Bearer {key}"}  # noqa: E731
    completion = {"model": agent.base, "prompt": PROMPT, "max_tokens": 1}
    assert client.get("/v1/models").status_code == 401
    assert client.post("/v1/completions", json=completion).status_code == 401
    assert client.post("/v1/chat/completions", json={**completion, "messages": []}).status_code == 401
    assert client.get("/v1/models", headers=bearer("infer")).status_code == 200
    assert client.get("/v1/models", headers=bearer("admin")).status_code == 200
    load = {"lora_name": "guarded", "lora_path": str(agent.tiny_model.adapters["lora05-r16"])}
    assert client.post("/v1/load_lora_adapter", json=load, headers=bearer("infer")).status_code == 401
    open_inference = TestClient(build_app(agent.engine, AgentConfig(DEFAULT_MAX_REQUEST_BYTES, admin_api_key="admin")))
    assert open_inference.get("/v1/models").status_code == 200
    assert open_inference.post("/v1/load_lora_adapter", json=load).status_code == 401
