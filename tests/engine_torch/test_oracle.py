"""Our engine vs HF transformers + peft on the tiny model (fp32, CPU): a batch mixing adapters of
ranks 8, 16 and 64 with a base-model request, in one step, through chunked prefill and through a
forced preemption. Greedy tokens must equal the oracle's and every step's logits agree to 1e-4."""

from __future__ import annotations

import pytest
from loraplex_agent.runtime.llm import LLM
from oracle_cases import GREEDY, MIX, prompts

from loraplex.engine.output.sampling import SamplingParams


def make_llm(tiny_model, **engine) -> LLM:
    engine = {"max_model_len": 128, "max_loras": 4, **engine}
    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", **engine)
    for name in sorted({m for m in MIX if m}):
        llm.add_adapter(name, tiny_model.adapters[name])
    llm.executor.capture_logits = True
    return llm


# adapters take pages of the pool: ranks 8/16/32/64 of the tiny model are 11/22/44/88 pages of 16 tokens
ENGINES = {
    "one-batch": dict(num_blocks=400),
    "chunked-prefill": dict(num_blocks=400, max_num_batched_tokens=12),
    # 4 fixed slots of rank 64 take 1408 pages of 4 tokens, leaving 24 for KV
    "preemption": dict(max_model_len=64, block_size=4, num_blocks=1432, memory_policy="lru-static", max_lora_rank=64),
    "slot-reuse": dict(num_blocks=300, max_loras=2, max_num_seqs=3, memory_policy="lru-static"),
    "unified-eviction": dict(num_blocks=200, max_num_seqs=3),  # idle adapters and cached KV give way
}


@pytest.mark.parametrize("engine", ENGINES, ids=list(ENGINES))
def test_mixed_adapters_match_hf_peft(tiny_model, assert_matches_oracle, engine):
    llm = make_llm(tiny_model, **ENGINES[engine])
    requests = llm.generate(prompts([7, 23, 16, 30, 5, 11]), GREEDY, MIX)
    assert [len(r.output_token_ids) for r in requests] == [GREEDY.max_tokens] * len(MIX)
    if engine == "preemption":
        assert llm.core.stats().num_preemptions > 0
    if engine in ("slot-reuse", "unified-eviction"):
        assert llm.core.stats().adapter_loads_total > 2
    assert_matches_oracle(llm, requests)


def test_request_alone_equals_request_in_mixed_batch(tiny_model):
    llm = make_llm(tiny_model, num_blocks=400)
    batch = llm.generate(prompts([9, 14, 21, 6, 12, 17], seed=1), GREEDY, MIX)
    for i, name in enumerate(MIX):
        [alone] = llm.generate([batch[i].prompt_token_ids], GREEDY, [name])
        assert alone.output_token_ids == batch[i].output_token_ids, name


def test_seeded_sampling_alone_equals_in_batch_and_after_preemption(tiny_model):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt = prompts([13], seed=2)[0]
    alone = make_llm(tiny_model, num_blocks=400).generate([prompt], seeded, ["lora01-r16"])[0]
    crowded = make_llm(tiny_model, max_model_len=64, block_size=4, num_blocks=1428, memory_policy="lru-static",
                       max_lora_rank=64)
    batch = crowded.generate([prompt] + prompts([20, 25, 18], seed=3), [seeded] + [others] * 3,
                             ["lora01-r16", "lora00-r8", None, "lora03-r64"])
    assert crowded.core.stats().num_preemptions > 0
    assert batch[0].output_token_ids == alone.output_token_ids
