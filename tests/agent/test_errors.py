"""Bad input gets OpenAI's error shape and the right status, and the server keeps serving."""

from __future__ import annotations

import openai
import pytest

PROMPT = "import os\n"


def _error(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def test_unknown_model_is_404(agent):
    with pytest.raises(openai.NotFoundError) as raised:
        agent.client().completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    error = _error(raised.value.response)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        agent.client().chat.completions.create(model="no-such-adapter", max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])


def test_prompt_longer_than_the_model_allows_is_400(agent):
    long_prompt = list(range(10, 10 + agent.max_model_len))
    with pytest.raises(openai.BadRequestError) as raised:
        agent.client().completions.create(model=agent.base, prompt=long_prompt, max_tokens=1)
    error = _error(raised.value.response)
    assert error["code"] == "context_length_exceeded"
    assert str(agent.max_model_len) in error["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        agent.client().chat.completions.create(
            model=agent.adapters[0], max_tokens=1,
            messages=[{"role": "user", "content": "word " * agent.max_model_len}])
    assert _error(raised.value.response)["code"] == "context_length_exceeded"


def test_prompt_plus_max_tokens_beyond_the_context_is_400(agent):
    with pytest.raises(openai.BadRequestError) as raised:
        agent.client().completions.create(model=agent.base, prompt=PROMPT, max_tokens=agent.max_model_len)
    error = _error(raised.value.response)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")


@pytest.mark.parametrize(("params", "param"), [
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 17}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"logprobs": 50}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "much"}}, "logit_bias.5"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"extra_body": {"min_tokens": 9, "max_tokens": 3}}, "min_tokens"),
    ({"stop": [""]}, "stop"),
])
def test_invalid_completion_parameters_are_400(agent, params, param):
    params = {"max_tokens": 4, **params}
    with pytest.raises(openai.BadRequestError) as raised:
        agent.client().completions.create(model=agent.base, prompt=PROMPT, **params)
    error = _error(raised.value.response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


@pytest.mark.parametrize(("params", "param"), [
    ({"n": 17}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"logit_bias": {"1.5": 2}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
])
def test_invalid_chat_parameters_are_400(agent, params, param):
    params = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **params}
    with pytest.raises(openai.BadRequestError) as raised:
        agent.client().chat.completions.create(model=agent.base, **params)
    error = _error(raised.value.response)
    assert error["param"] == param, error


def test_bad_prompts_are_400(agent):
    vocab = agent.engine.llm.model_config.vocab_size
    for prompt, fragment in ((["a", "b"], "one prompt"), ("", "empty"), ([vocab + 5], "vocabulary")):
        with pytest.raises(openai.BadRequestError) as raised:
            agent.client().completions.create(model=agent.base, prompt=prompt, max_tokens=2)
        assert fragment in _error(raised.value.response)["message"]


def test_malformed_json_and_missing_fields_are_400_not_422(agent):
    with agent.http() as http:
        broken = http.post("/v1/completions", content=b'{"model": "x", "prompt": ',
                           headers={"content-type": "application/json"})
        assert broken.status_code == 400
        assert "JSON" in _error(broken)["message"]
        missing = http.post("/v1/chat/completions", json={"model": agent.base})
        assert missing.status_code == 400
        assert _error(missing)["param"] == "messages"


def test_unknown_route_is_404_in_openai_shape(agent):
    with agent.http() as http:
        response = http.get("/v1/nothing-here")
    assert response.status_code == 404
    assert _error(response)["type"] == "not_found_error"


def test_server_still_serves_after_errors(agent):
    response = agent.client().completions.create(model=agent.base, prompt=PROMPT, max_tokens=3)
    assert response.usage.completion_tokens >= 1
