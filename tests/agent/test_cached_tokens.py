"""`usage.prompt_tokens_details.cached_tokens` on every response (streamed too), and an activated
LoRA checker served from the KV its conversation left in the prefix cache as the base model's."""

from __future__ import annotations

import pytest
from loraplex_agent.tools.tiny_model import INVOCATION, invocation_tokens

from loraplex.spec.alora import invocation_start

BLOCK = 16  # the engine's default block size
STORY = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 6


def test_every_response_reports_cached_tokens(agent):
    client = agent.client()
    prompt = "def parse(text):\n" + STORY
    first = client.completions.create(model=agent.adapters[1], prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=agent.adapters[1], prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    usable = (again.usage.prompt_tokens - 1) // BLOCK * BLOCK  # one prompt token is always computed
    assert again.usage.prompt_tokens_details.cached_tokens == usable
    chunks = list(client.completions.create(model=agent.adapters[1], prompt=prompt, max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == usable
    other = client.completions.create(model=agent.adapters[2], prompt=prompt, max_tokens=2, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another adapter's KV differs


@pytest.fixture
def checker(agent, tiny_alora_model):
    headers = agent.admin_headers()
    with agent.http() as http:
        loaded = http.post("/v1/load_lora_adapter", headers=headers,
                           json={"lora_name": "checker", "lora_path": str(tiny_alora_model.adapters["alora00-r8"])})
        assert loaded.status_code == 200, loaded.text
    yield "checker"
    with agent.http() as http:
        http.post("/v1/unload_lora_adapter", json={"lora_name": "checker"}, headers=headers)


def test_an_alora_checker_reuses_the_base_conversation(agent, checker, tiny_alora_model):
    client = agent.client()
    conversation = [{"role": "user", "content": "Summarise: " + STORY}]
    answer = client.chat.completions.create(model=agent.base, messages=conversation, max_tokens=8, temperature=0)
    base_prompt = answer.usage.prompt_tokens
    check = [*conversation, {"role": "assistant", "content": answer.choices[0].message.content},
             {"role": "user", "content": INVOCATION + "Is the summary supported?"}]
    chunks = list(client.chat.completions.create(model=checker, messages=check, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(agent.tiny_model.base_dir).apply_chat_template(
        check, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(tokens) == usage.prompt_tokens
    start = invocation_start(tokens, invocation_tokens(tiny_alora_model.base_dir))
    cached = usage.prompt_tokens_details.cached_tokens
    assert start is not None and cached % BLOCK == 0
    assert base_prompt // BLOCK * BLOCK <= cached <= start  # the base's blocks, none from the invocation on
