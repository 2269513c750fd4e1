"""The padded static decode path that CUDA graphs replay, run eagerly on the CPU: steps padded to
their batch bucket (slot -1, context 0, empty LoRA segments), fixed-width block tables, one packed
copy of the step's integers. It must give HF+peft's logits to 1e-4 and leave the cache alone
outside the real rows. (Capture and replay themselves need CUDA and are not run here.)"""

from __future__ import annotations

import pytest
from loraplex_agent.runtime.decode_graphs import DecodeGraphs, batch_buckets
from loraplex_agent.runtime.llm import LLM
from oracle_cases import GREEDY, MIX, prompts


def static_llm(tiny_model, **engine) -> LLM:
    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", max_model_len=128, num_blocks=400, **engine)
    for name in sorted({m for m in MIX if m}):
        llm.add_adapter(name, tiny_model.adapters[name])
    llm.executor.capture_logits = True
    executor = llm.executor
    executor.graphs = DecodeGraphs(executor.model, executor.kv_caches, executor.config, executor.device,
                                   capture=False)
    return llm


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert batch_buckets(5) == (1, 2, 4, 5)
    assert batch_buckets(1) == (1,)


def test_static_decode_steps_match_hf_peft(tiny_model, assert_matches_oracle):
    llm = static_llm(tiny_model)
    requests = llm.generate(prompts([7, 23, 16, 30, 5, 11]), GREEDY, MIX)  # 6 rows: padded to bucket 8
    assert llm.executor.graphs.replays >= GREEDY.max_tokens - 1
    assert_matches_oracle(llm, requests)


@pytest.mark.parametrize("count", [1, 3])
def test_odd_batches_are_padded_without_writing_the_cache(tiny_model, assert_matches_oracle, count):
    llm = static_llm(tiny_model, max_num_seqs=4)
    requests = llm.generate(prompts([9, 4, 13][:count], seed=2), GREEDY, MIX[:count])
    assert llm.executor.graphs.replays > 0
    assert_matches_oracle(llm, requests)  # a padded row writing slot 0 would corrupt page 0's KV or adapter


def test_a_step_beyond_the_largest_bucket_runs_eagerly(tiny_model):
    llm = static_llm(tiny_model)
    graphs = llm.executor.graphs
    assert graphs.bucket_for(graphs.largest + 1) is None
    assert graphs.bucket_for(3).rows == 4
