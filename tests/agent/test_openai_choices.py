"""The OpenAI parameters vLLM users send, through the real `openai` client against a real agent:
`n` (completions and chat, streamed or not), `best_of`, `echo`, penalties, `logit_bias`,
`response_format`; and `n` under every memory policy, with and without a prefix cache."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict

import pytest

PROMPT = "def fibonacci(n):\n    "
SAMPLED = {"temperature": 1.0, "top_p": 0.95}


def _texts(response) -> list[str]:
    assert [c.index for c in response.choices] == list(range(len(response.choices)))
    return [c.text for c in response.choices]


def _sample(client, model: str, seed: int, **params):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, seed=seed, **SAMPLED,
                                      extra_body={"ignore_eos": True}, **params)


def test_n_choices_are_the_singles_of_seed_plus_index(agent):
    client = agent.client()
    response = _sample(client, agent.adapters[0], 11, n=3)
    singles = [_sample(client, agent.adapters[0], 11 + i) for i in range(3)]
    assert _texts(response) == [s.choices[0].text for s in singles]
    assert len(set(_texts(response))) > 1  # siblings really sample on their own
    assert response.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counts once
    assert response.usage.completion_tokens == 3 * 8
    assert _texts(_sample(client, agent.adapters[0], 11, n=3)) == _texts(response)  # reproducible


def test_streamed_n_choices_equal_the_whole_response(agent):
    client = agent.client()
    whole = _sample(client, agent.base, 5, n=2)
    chunks = list(_sample(client, agent.base, 5, n=2, stream=True, stream_options={"include_usage": True}))
    texts, reasons = defaultdict(str), {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == _texts(whole)
    assert reasons == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * 8


def test_chat_n_choices_whole_and_streamed(agent):
    client = agent.client()
    kwargs = {"model": agent.adapters[1], "messages": [{"role": "user", "content": "Tell me a story"}],
              "max_tokens": 6, "seed": 3, "n": 3, **SAMPLED, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    roles, texts = set(), defaultdict(str)
    for chunk in chunks:
        [choice] = chunk.choices
        if choice.delta.role:
            roles.add(choice.index)
        texts[choice.index] += choice.delta.content or ""
    assert roles == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]


def test_siblings_share_the_prompt_prefill(agent):
    """A prompt of 70 tokens: prefilled once, then each sibling reuses its 4 full blocks of 16."""
    rng = random.Random(2024)
    prompt = [rng.randrange(100, 8000) for _ in range(70)]
    counts = agent.engine.core.memory.counts
    before = counts["prefix_hit_tokens"]
    response = agent.client().completions.create(model=agent.adapters[2], prompt=prompt, max_tokens=3, n=3,
                                                 temperature=0, extra_body={"ignore_eos": True})
    assert counts["prefix_hit_tokens"] - before == 3 * 64
    assert len(set(_texts(response))) == 1  # greedy siblings agree


def test_best_of_returns_the_n_of_highest_cumulative_logprob(agent):
    client = agent.client()
    singles = [_sample(client, agent.adapters[3], 40 + i, logprobs=0) for i in range(4)]
    scores = [sum(s.choices[0].logprobs.token_logprobs) for s in singles]
    ranked = sorted(range(4), key=lambda i: scores[i], reverse=True)
    response = _sample(client, agent.adapters[3], 40, n=2, best_of=4)
    assert _texts(response) == [singles[i].choices[0].text for i in ranked[:2]]
    assert all(c.logprobs is None for c in response.choices)  # ranked by logprobs nobody asked for
    assert response.usage.completion_tokens == 4 * 8  # every generated sequence is paid for


def test_echo_puts_the_prompt_first(agent):
    client = agent.client()
    plain = client.completions.create(model=agent.base, prompt=PROMPT, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    echoed = client.completions.create(model=agent.base, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                       logprobs=1, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    logprobs = echoed.choices[0].logprobs
    num_prompt = echoed.usage.prompt_tokens
    assert len(logprobs.tokens) == num_prompt + 5
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts it
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])  # the prompt's tokens too (prompt logprobs)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[num_prompt] == len(PROMPT)
    chunks = list(client.completions.create(model=agent.base, prompt=PROMPT, max_tokens=5, temperature=0,
                                            echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_logit_bias_and_penalties_reach_the_sampler(agent):
    client = agent.client()
    tokenizer = agent.engine.llm.tokenizer

    def greedy(**params) -> list[str]:
        response = client.completions.create(model=agent.base, prompt=PROMPT, max_tokens=6, temperature=0,
                                             logprobs=0, **params)
        return response.choices[0].logprobs.tokens

    plain = greedy(extra_body={"ignore_eos": True})
    forced = tokenizer.encode(" banana", add_special_tokens=False)[-1]
    assert greedy(logit_bias={str(forced): 100}, extra_body={"ignore_eos": True}) == \
        [tokenizer.decode([forced])] * 6
    assert greedy(presence_penalty=2, frequency_penalty=2, extra_body={"ignore_eos": True}) != plain
    assert greedy(extra_body={"ignore_eos": True, "repetition_penalty": 3.0}) != plain


def test_response_format_json_object_is_accepted(agent):
    response = agent.client().chat.completions.create(
        model=agent.base, messages=[{"role": "user", "content": "Answer in JSON"}], max_tokens=3,
        response_format={"type": "json_object"})
    assert response.choices[0].finish_reason in ("stop", "length")


# ---- n under every memory policy ----------------------------------------------------------------

POLICIES = {
    "unified": {},
    "unified-no-prefix-cache": {"prefix_cache": False},
    "lru-static": {"memory_policy": "lru-static"},
    "no-cache": {"memory_policy": "no-cache"},
}


@pytest.mark.parametrize("engine", POLICIES, ids=list(POLICIES))
def test_n_under_every_memory_policy(tiny_model, engine):
    from loraplex_agent.api.metrics import ServerMetrics
    from loraplex_agent.api.openai_protocol import CompletionRequest
    from loraplex_agent.api.serving import ServingContext
    from loraplex_agent.api.serving_completions import create_completion
    from loraplex_agent.cli import DEFAULT_STALL_TIMEOUT_S
    from loraplex_agent.runtime.async_engine import AsyncEngine
    from loraplex_agent.runtime.llm import LLM

    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", max_model_len=256, num_blocks=600,
              max_loras=2, served_model_name="tiny", **POLICIES[engine])
    prompt = [random.Random(7).randrange(100, 8000) for _ in range(40)]

    async def run() -> tuple[list[str], list[str], int]:
        engine_ = AsyncEngine(llm, DEFAULT_STALL_TIMEOUT_S)
        engine_.start()
        try:
            ctx = ServingContext(engine_, ServerMetrics("tiny", engine_.snapshot, 2, 16), "tiny", "")
            await engine_.add_adapter("a", tiny_model.adapters["lora00-r8"])

            async def texts(n: int, seed: int) -> list[str]:
                req = CompletionRequest(model="a", prompt=prompt, max_tokens=6, temperature=1.0, seed=seed, n=n,
                                        ignore_eos=True)
                return [c.text for c in (await create_completion(ctx, req)).choices]

            siblings = await texts(3, 21)
            hits = llm.core.memory.counts["prefix_hit_tokens"]
            singles = [(await texts(1, 21 + i))[0] for i in range(3)]
            return siblings, singles, hits
        finally:
            await asyncio.to_thread(engine_.shutdown)

    siblings, singles, hits = asyncio.run(run())
    assert siblings == singles
    shared = POLICIES[engine].get("prefix_cache", True) and engine != "no-cache"
    assert hits == (3 * 32 if shared else 0)  # 2 full blocks of 16 per sibling, or each recomputes


def test_hanging_up_on_a_stream_of_n_aborts_every_sibling(agent):
    def aborted() -> float:
        return _metric(agent.metrics(), 'vllm:request_success_total{finished_reason="abort"')

    before = aborted()
    body = {"model": agent.adapters[0], "prompt": PROMPT, "max_tokens": 400, "stream": True, "n": 3,
            "ignore_eos": True, "temperature": 0}
    with agent.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the siblings run; now hang up
    agent.wait_for(lambda: aborted() == before + 3, "every sibling to be aborted")
    agent.wait_for(lambda: _metric(agent.metrics(), "vllm:num_requests_running{") == 0, "an empty batch")


def _metric(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
