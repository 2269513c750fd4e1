"""`response_format: {"type": "json_object"}` is enforced, through the real `openai` client against a
real agent: every choice that stops is a JSON object (sampled with many seeds, greedy, `n` > 1,
streamed, chat and completions); one cut by max_tokens is a prefix of one."""

from __future__ import annotations

import json

from loraplex_agent.api.generation import _text_ids

from loraplex.engine.messages import RequestOutput
from loraplex.engine.output.json_grammar import JsonPrefix
from loraplex.engine.request import NO_TOKEN, FinishReason

JSON = {"type": "json_object"}
MESSAGES = [{"role": "user", "content": "Answer in JSON"}]


def closer_bias(agent) -> dict[str, float]:
    """Random weights rarely close a string; a push towards closers makes them finish objects."""
    tokenizer = agent.engine.llm.tokenizer
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in ('"', '":', '",', "}", ' "', "1", "]")]
    return {str(token[0]): 6.0 for token in ids if len(token) == 1}


def check(text: str, finish_reason: str) -> bool:
    """True for a whole object; a choice cut by max_tokens must still be a prefix of one."""
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
        return True
    assert finish_reason == "length"
    assert JsonPrefix.start().feed(text) is not None, text
    return False


def test_sampled_chat_choices_are_json_objects(agent):
    client = agent.client()
    whole = 0
    for seed in range(6):
        response = client.chat.completions.create(
            model=agent.adapters[seed % 2], messages=MESSAGES, max_tokens=40, seed=seed, n=4, temperature=1.0,
            response_format=JSON, logit_bias=closer_bias(agent))
        whole += sum(check(c.message.content, c.finish_reason) for c in response.choices)
    assert whole >= 12  # most of the 24 finish their object


def test_streamed_chat_equals_the_whole_response(agent):
    client = agent.client()
    kwargs = {"model": agent.base, "messages": MESSAGES, "max_tokens": 40, "seed": 21, "n": 2,
              "temperature": 1.0, "response_format": JSON, "logit_bias": closer_bias(agent)}
    whole = client.chat.completions.create(**kwargs)
    texts, reasons = ["", ""], [None, None]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    for text, reason in zip(texts, reasons, strict=True):
        check(text, reason)


def test_greedy_chat_and_completions_are_json_objects(agent):
    client = agent.client()
    chat = client.chat.completions.create(model=agent.adapters[2], messages=MESSAGES, max_tokens=30,
                                          temperature=0, response_format=JSON)
    check(chat.choices[0].message.content, chat.choices[0].finish_reason)
    completion = client.completions.create(model=agent.base, prompt="The answer as JSON:", max_tokens=30,
                                           temperature=0, extra_body={"response_format": JSON})
    check(completion.choices[0].text, completion.choices[0].finish_reason)


def test_sampled_completions_with_echo_put_json_after_the_prompt(agent):
    prompt = "Reply with a JSON object:"
    response = agent.client().completions.create(
        model=agent.adapters[3], prompt=prompt, max_tokens=40, seed=5, n=3, temperature=1.0, echo=True,
        logit_bias=closer_bias(agent), extra_body={"response_format": JSON})
    for choice in response.choices:
        assert choice.text.startswith(prompt)
        check(choice.text[len(prompt):], choice.finish_reason)


def test_without_response_format_the_output_is_unchanged(agent):
    client = agent.client()
    kwargs = {"model": agent.base, "prompt": "def f(x):", "max_tokens": 12, "seed": 3, "temperature": 1.0,
              "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(**kwargs)
    text = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True,
                                                                "response_format": {"type": "text"}}})
    assert text.choices[0].text == plain.choices[0].text
    constrained = client.completions.create(**{**kwargs, "extra_body": {"response_format": JSON}})
    assert constrained.choices[0].text.startswith("{")


def test_json_schema_is_refused(agent):
    response = agent.http().post("/v1/chat/completions", json={
        "model": agent.base, "messages": MESSAGES,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format" and "json_object" in error["message"]


def test_no_token_is_left_out_of_the_text():
    cut = RequestOutput("r", [NO_TOKEN], [], 3, 5, finished=True, finish_reason=FinishReason.LENGTH)
    assert _text_ids(cut) == []
    assert _text_ids(RequestOutput("r", [7], [], 3, 5, finished=True, finish_reason=FinishReason.LENGTH)) == [7]
