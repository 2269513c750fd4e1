"""Prompt logprobs (`SamplingParams.prompt_logprobs`, echo with logprobs) against the HF + peft oracle
(fp32, CPU): every prompt position's logprob, rank and top k, in one batch of mixed adapters,
through chunked prefill, with the prompt already in the prefix cache, and across preemptions;
requests beside them keep their logits bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from loraplex_agent.runtime.llm import LLM
from oracle_cases import GREEDY, MIX, prompts

from loraplex.engine.output.sampling import SamplingParams

TOP = 3
SCORED = replace(GREEDY, prompt_logprobs=TOP)
ENGINES = {
    "one-batch": dict(num_blocks=400),
    "chunked-prefill": dict(num_blocks=400, max_num_batched_tokens=12),
    "preemption": dict(max_model_len=64, block_size=4, num_blocks=1432, memory_policy="lru-static", max_lora_rank=64),
}


def make_llm(tiny_model, **engine) -> LLM:
    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", **{"max_model_len": 128, "max_loras": 4, **engine})
    for name in sorted({m for m in MIX if m}):
        llm.add_adapter(name, tiny_model.adapters[name])
    llm.executor.capture_logits = True
    return llm


def check_prompt_logprobs(request, oracle, atol: float = 1e-4) -> None:
    adapter = request.adapter.name if request.adapter else None
    prompt = request.prompt_token_ids
    expected = torch.log_softmax(oracle.logits(prompt, adapter), dim=-1)[:-1]  # row p predicts token p + 1
    entries = request.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None, request.request_id
    for position, entry in enumerate(entries[1:], start=1):
        row = expected[position - 1]
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - row[prompt[position]].item()) <= atol, (request.request_id, position)
        close = int(((row - row[prompt[position]]).abs() <= atol).sum())  # ties within the tolerance
        assert abs(entry.rank - (int((row > row[prompt[position]]).sum()) + 1)) < close
        values, _ = row.topk(TOP)
        assert entry.top_logprobs[0][0] == int(row.argmax())
        assert max(abs(lp - v) for (_, lp), v in zip(entry.top_logprobs, values.tolist(), strict=True)) <= atol


@pytest.mark.parametrize("engine", ENGINES, ids=list(ENGINES))
def test_prompt_logprobs_match_hf_peft(tiny_model, hf_oracle, assert_matches_oracle, engine):
    llm = make_llm(tiny_model, **ENGINES[engine])
    requests = llm.generate(prompts([7, 23, 16, 30, 5, 11]), SCORED, MIX)
    if engine == "preemption":
        assert llm.core.stats().num_preemptions > 0
    for request in requests:
        check_prompt_logprobs(request, hf_oracle)
    assert_matches_oracle(llm, requests)  # and the generated tokens are still the oracle's


def test_a_cached_prefix_is_computed_again_for_its_logprobs(tiny_model, hf_oracle):
    llm = make_llm(tiny_model, num_blocks=400, block_size=4)
    [prompt] = prompts([29], seed=5)
    llm.generate([prompt], GREEDY, ["lora01-r16"])  # its full blocks join the prefix cache
    hits = llm.core.memory_stats().prefix_hit_tokens
    [again] = llm.generate([prompt], SCORED, ["lora01-r16"])
    assert llm.core.memory_stats().prefix_hit_tokens == hits  # computed, not taken from the cache
    check_prompt_logprobs(again, hf_oracle)
    [cached] = llm.generate([prompt], GREEDY, ["lora01-r16"])
    assert llm.core.memory_stats().prefix_hit_tokens > hits  # without prompt logprobs the cache serves
    assert cached.output_token_ids == again.output_token_ids


def test_requests_beside_prompt_logprobs_keep_their_logits_bit_for_bit(tiny_model):
    """On the base model alone: adapter loads finish in the background, so with adapters two runs
    may batch differently (and round differently) whatever the requests ask."""
    batch = prompts([9, 14, 21], seed=7)
    adapters = [None] * 3
    plain_llm = make_llm(tiny_model, num_blocks=400)
    plain = plain_llm.generate(batch, GREEDY, adapters)
    mixed_llm = make_llm(tiny_model, num_blocks=400)
    mixed = mixed_llm.generate(batch, [GREEDY, SCORED, GREEDY], adapters)
    for ours, theirs in zip(mixed, plain, strict=True):
        assert ours.output_token_ids == theirs.output_token_ids
        assert torch.equal(torch.stack(mixed_llm.executor.captured_logits[ours.request_id]),
                           torch.stack(plain_llm.executor.captured_logits[theirs.request_id]))
    assert [r.prompt_logprobs is None for r in mixed] == [True, False, True]


def test_zero_top_and_one_token_prompts(tiny_model):
    llm = make_llm(tiny_model, num_blocks=400)
    one, two = llm.generate([[5], [5, 6]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    assert one.prompt_logprobs == [None]
    assert two.prompt_logprobs[0] is None and two.prompt_logprobs[1].top_logprobs is None
    assert two.prompt_logprobs[1].rank >= 1
