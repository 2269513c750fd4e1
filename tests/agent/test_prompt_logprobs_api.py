"""Prompt logprobs through the API: `echo` with `logprobs` scores the prompt's tokens in OpenAI's
legacy shape (streamed too), and vLLM's `prompt_logprobs` gives them in vLLM's shape, in
completions and chat."""

from __future__ import annotations

import math

PROMPT = "def fibonacci(n):\n    return"


def completion(agent, **body) -> dict:
    response = agent.http().post("/v1/completions", json={"model": agent.base, "prompt": PROMPT, "max_tokens": 3,
                                                          "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_logprobs_scores_the_prompt_like_prompt_logprobs(agent):
    echoed = completion(agent, echo=True, logprobs=2)
    scored = completion(agent, prompt_logprobs=2)
    num_prompt = echoed["usage"]["prompt_tokens"]
    logprobs = echoed["choices"][0]["logprobs"]
    vllm = scored["choices"][0]["prompt_logprobs"]
    assert len(vllm) == num_prompt and vllm[0] is None
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    prompt_ids = agent.engine.llm.tokenizer.encode(PROMPT)
    for position in range(1, num_prompt):
        entry = vllm[position][str(prompt_ids[position])]
        assert math.isclose(logprobs["token_logprobs"][position], entry["logprob"], abs_tol=1e-5)
        assert entry["rank"] >= 1 and entry["decoded_token"] == logprobs["tokens"][position]
        tops = sorted(vllm[position].values(), key=lambda e: e["logprob"], reverse=True)
        assert [e["rank"] for e in tops[:2]] == [1, 2] and 2 <= len(vllm[position]) <= 3
        assert len(logprobs["top_logprobs"][position]) >= 2
    assert echoed["choices"][0]["prompt_logprobs"] is None  # vLLM's list only when asked for
    assert scored["choices"][0]["logprobs"] is None and scored["choices"][0]["text"] == \
        echoed["choices"][0]["text"][len(PROMPT):]


def test_streamed_echo_carries_the_prompt_logprobs_in_the_first_chunk(agent):
    whole = agent.client().completions.create(model=agent.base, prompt=PROMPT, max_tokens=3, temperature=0,
                                              echo=True, logprobs=1)
    chunks = list(agent.client().completions.create(model=agent.base, prompt=PROMPT, max_tokens=3, temperature=0,
                                                    echo=True, logprobs=1, stream=True))
    first = chunks[0].choices[0].logprobs
    num_prompt = whole.usage.prompt_tokens
    assert first.tokens[:num_prompt] == whole.choices[0].logprobs.tokens[:num_prompt]
    assert first.token_logprobs[0] is None
    for streamed, collected in zip(first.token_logprobs[1:num_prompt],
                                   whole.choices[0].logprobs.token_logprobs[1:num_prompt], strict=True):
        assert math.isclose(streamed, collected, abs_tol=1e-5)


def test_every_choice_gets_the_prompt_logprobs(agent):
    response = completion(agent, echo=True, logprobs=0, n=2, temperature=1.0, seed=4)
    num_prompt = response["usage"]["prompt_tokens"]
    for choice in response["choices"]:
        numbers = choice["logprobs"]["token_logprobs"][:num_prompt]
        assert numbers[0] is None and all(isinstance(n, float) for n in numbers[1:])


def test_chat_prompt_logprobs(agent):
    response = agent.http().post("/v1/chat/completions", json={
        "model": agent.adapters[1], "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
        "prompt_logprobs": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    scored = body["prompt_logprobs"]
    assert len(scored) == body["usage"]["prompt_tokens"] and scored[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["logprob"] <= 0 for entry in scored[1:])


def test_bad_prompt_logprobs_are_400s(agent):
    for body in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1, "stream": True}):
        response = agent.http().post("/v1/completions", json={"model": agent.base, "prompt": PROMPT, **body})
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == "prompt_logprobs"
