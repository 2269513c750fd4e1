"""The agent through the real `openai` client: completions, chat, streaming, models, sampling."""

from __future__ import annotations

import math

PROMPT = "def fibonacci(n):\n    "
GREEDY = {"temperature": 0.0}


def test_models_lists_base_and_adapters_with_parent(agent):
    models = {m.id: m for m in agent.client().models.list().data}
    base = models[agent.base]
    assert base.owned_by == "loraplex"
    assert base.parent is None
    assert base.root == str(agent.tiny_model.base_dir)
    assert base.max_model_len == agent.max_model_len
    for name in agent.adapters:
        assert models[name].parent == agent.base
        assert models[name].root == str(agent.tiny_model.adapters[name])


def test_completion_returns_text_and_usage(agent):
    response = agent.client().completions.create(model=agent.base, prompt=PROMPT, max_tokens=12,
                                                 **_extra(GREEDY, ignore_eos=True))
    choice = response.choices[0]
    assert response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    assert choice.finish_reason == "length"
    assert choice.text
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_completion_accepts_token_ids_and_a_list_of_one(agent):
    client = agent.client()
    text = _greedy(client, agent.base, PROMPT)
    ids = agent.engine.llm.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=agent.base, prompt=ids, max_tokens=12, **_extra(GREEDY,
                                       ignore_eos=True)).choices[0].text
    by_list = client.completions.create(model=agent.base, prompt=[PROMPT], max_tokens=12,
                                        **_extra(GREEDY, ignore_eos=True)).choices[0].text
    assert by_ids == text
    assert by_list == text


def test_adapters_change_the_output(agent):
    client = agent.client()
    texts = {name: _greedy(client, name, PROMPT) for name in (agent.base, *agent.adapters)}
    assert len(set(texts.values())) == len(texts), texts


def test_chat_completion_uses_the_chat_template(agent):
    client = agent.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    response = client.chat.completions.create(model=agent.adapters[1], messages=messages,
                                              max_completion_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 10
    # The prompt is the rendered template, tokenized without adding a second BOS.
    tokenizer = agent.engine.llm.tokenizer
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert response.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    # The same tokens through /v1/completions give the same text.
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    completion = client.completions.create(model=agent.adapters[1], prompt=ids, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].text == response.choices[0].message.content


def test_chat_max_tokens_is_honoured(agent):
    response = agent.client().chat.completions.create(
        model=agent.base, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 3


def test_streaming_completion_matches_the_whole_response_and_ends_with_usage(agent):
    client = agent.client()
    whole = _greedy(client, agent.adapters[0], PROMPT)
    chunks = list(client.completions.create(model=agent.adapters[0], prompt=PROMPT, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True},
                                            **_extra(GREEDY, ignore_eos=True)))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat_sends_role_then_content_then_usage(agent):
    client = agent.client()
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=agent.adapters[2], messages=messages, max_tokens=15,
                                           temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=agent.adapters[2], messages=messages, max_tokens=15,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_without_include_usage_has_no_usage_chunk(agent):
    chunks = list(agent.client().completions.create(model=agent.base, prompt=PROMPT, max_tokens=4,
                                                    stream=True, **_extra(GREEDY, ignore_eos=True)))
    assert all(c.choices and c.usage is None for c in chunks)


def test_stop_string_truncates_the_text(agent):
    client = agent.client()
    text = _greedy(client, agent.adapters[0], PROMPT, max_tokens=20)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    expected = text[:text.index(stop)]
    for stream in (False, True):
        kwargs = {"model": agent.adapters[0], "prompt": PROMPT, "max_tokens": 20, "stop": [stop, "\x00never"]}
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs, **_extra(GREEDY, ignore_eos=True)))
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(**kwargs, **_extra(GREEDY, ignore_eos=True)).choices[0]
            got, reason = choice.text, choice.finish_reason
        assert (got, reason) == (expected, "stop"), f"stream={stream}"


def test_stop_token_ids_end_the_text_without_the_stop_token(agent):
    client = agent.client()
    vocab = agent.engine.llm.model_config.vocab_size
    first_two = _greedy(client, agent.base, PROMPT, max_tokens=2)
    response = client.completions.create(model=agent.base, prompt=PROMPT, max_tokens=10, temperature=0,
                                         extra_body={"stop_token_ids": list(range(vocab)), "min_tokens": 3})
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == 3
    assert response.choices[0].text == first_two


def test_completion_logprobs(agent):
    response = agent.client().completions.create(model=agent.base, prompt=PROMPT, max_tokens=6, logprobs=3,
                                                 **_extra(GREEDY, ignore_eos=True))
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset[0] == 0
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob <= 0
        assert 3 <= len(top) <= 4
        assert math.isclose(top[token], logprob)
        assert logprob >= max(top.values()) - 1e-6  # greedy picks the most likely token


def test_chat_logprobs(agent):
    response = agent.client().chat.completions.create(
        model=agent.adapters[3], messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-6)


def test_seed_makes_sampling_reproducible(agent):
    client = agent.client()

    def sample(seed: int) -> str:
        return client.completions.create(model=agent.adapters[0], prompt=PROMPT, max_tokens=16, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"top_k": 50, "ignore_eos": True}
                                         ).choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_health(agent):
    with agent.http() as http:
        assert http.get("/health").status_code == 200


def _greedy(client, model: str, prompt, max_tokens: int = 12) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     **_extra(GREEDY, ignore_eos=True)).choices[0].text


def _extra(params: dict, **extra_body) -> dict:
    """Standard parameters as keywords; vLLM-style extras (ignore_eos, top_k, ...) in extra_body."""
    return {**params, "extra_body": extra_body} if extra_body else dict(params)
