"""Oversized requests: a body over --max-request-bytes is answered 413 before it is read to the end,
and a prompt that cannot fit in the context by its bytes alone is refused without tokenizing it."""

from __future__ import annotations

import json.decoder
from pathlib import Path

import httpx
import openai
import pytest
import raw_http
from loraplex_agent.api.serving import longest_token_bytes
from loraplex_agent.cli import DEFAULT_MAX_REQUEST_BYTES
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

MIB = 1 << 20


def assert_too_large(response: raw_http.RawResponse) -> None:
    assert response.status == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert str(DEFAULT_MAX_REQUEST_BYTES) in error["message"]


def assert_still_serving(agent) -> None:
    assert httpx.get(f"{agent.url}/health", timeout=30).status_code == 200
    done = agent.client().completions.create(model=agent.base, prompt="def", max_tokens=2)
    assert done.usage.completion_tokens == 2


def test_a_declared_oversized_body_is_refused_before_it_is_sent(agent):
    # 10 GiB announced, not one byte of it sent: the answer can only come from the header.
    response = raw_http.post(f"{agent.url}/v1/completions", {"Content-Length": str(10 << 30)})
    assert_too_large(response)
    assert_still_serving(agent)


def test_a_chunked_body_is_refused_once_it_passes_the_limit(agent):
    pieces = [b"x" * MIB] * (DEFAULT_MAX_REQUEST_BYTES // MIB + 1)  # the body never ends
    response = raw_http.post(f"{agent.url}/v1/chat/completions", {"Transfer-Encoding": "chunked"},
                             raw_http.chunked(pieces))
    assert_too_large(response)
    assert_still_serving(agent)


def test_the_openai_client_gets_413_for_a_huge_prompt(agent):
    with pytest.raises(openai.APIStatusError) as err:
        agent.client().completions.create(model=agent.base, prompt="x" * (DEFAULT_MAX_REQUEST_BYTES + 1),
                                          max_tokens=1)
    assert err.value.status_code == 413 and err.value.body["code"] == "request_too_large"
    assert_still_serving(agent)


@pytest.fixture
def encode_calls(agent, monkeypatch) -> list[str]:
    """Texts the agent's tokenizer encodes during the test (the real encode still runs)."""
    tokenizer = agent.engine.llm.tokenizer
    calls, encode = [], tokenizer.encode

    def counting_encode(text, *args, **kwargs):
        calls.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting_encode)
    return calls


def test_a_prompt_too_long_in_bytes_is_refused_without_tokenizing(agent, encode_calls):
    longest = longest_token_bytes(agent.engine.llm.tokenizer)
    assert longest is not None  # the tiny model's tokenizer is byte-level BPE
    prompt = "x" * (agent.max_model_len * longest + 1)
    client = agent.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=agent.base, prompt=prompt, max_tokens=1)
    assert (err.value.body["code"], err.value.body["param"]) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=agent.adapters[0], messages=[{"role": "user", "content": prompt}])
    assert (err.value.body["code"], err.value.body["param"]) == ("context_length_exceeded", "messages")
    assert encode_calls == []


def test_a_prompt_under_the_byte_bound_is_still_counted_in_tokens(agent, encode_calls):
    prompt = "def f():\n    return 1\n" * 200  # 4,400 bytes, far under the bound, but ~1,400 tokens
    with pytest.raises(openai.BadRequestError) as err:
        agent.client().completions.create(model=agent.base, prompt=prompt, max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded"
    assert encode_calls == [prompt]


def test_no_token_covers_more_bytes_than_the_bound_assumes(agent):
    tokenizer = agent.engine.llm.tokenizer
    text = Path(json.decoder.__file__).read_text()  # ASCII Python, like the tiny tokenizer's corpus
    spans = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert max(end - start for start, end in spans) <= longest_token_bytes(tokenizer)


@pytest.mark.parametrize("change", ["normalizer", "stripping added token", "removing split"])
def test_tokenizers_that_can_shrink_text_give_no_bound(agent, change):
    tokenizer = Tokenizer.from_str(agent.engine.llm.tokenizer.backend_tokenizer.to_str())
    if change == "normalizer":
        tokenizer.normalizer = normalizers.NFC()  # "e" + U+0301 (3 bytes) becomes "é" (2 bytes)
    elif change == "stripping added token":
        tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # swallows any run of spaces
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert longest_token_bytes(PreTrainedTokenizerFast(tokenizer_object=tokenizer)) is None
