"""bf16 end to end (the CUDA default) runs on the CPU through the reference kernels: the page pool,
paged adapters and sampler in bf16 give the fp32 engine's logits to bf16 precision."""

from __future__ import annotations

import torch
from loraplex_agent.runtime.llm import LLM
from oracle_cases import GREEDY, MIX, prompts


def run(tiny_model, dtype: str) -> tuple[LLM, list]:
    llm = LLM(tiny_model.base_dir, dtype=dtype, device="cpu", max_model_len=128, num_blocks=400)
    for name in sorted({m for m in MIX if m}):
        llm.add_adapter(name, tiny_model.adapters[name])
    llm.executor.capture_logits = True
    return llm, llm.generate(prompts([7, 23, 16, 30, 5, 11]), GREEDY, MIX)


def test_bf16_logits_follow_fp32_to_bf16_precision(tiny_model):
    full, expected = run(tiny_model, "float32")
    half, got = run(tiny_model, "bfloat16")
    assert half.executor.kv_caches[0][0].dtype == torch.bfloat16
    for e, g in zip(expected, got, strict=True):
        # the first sampled step: both runs have seen the same prompt (later ones may follow other tokens)
        ours = half.executor.captured_logits[g.request_id][0]
        theirs = full.executor.captured_logits[e.request_id][0]
        assert (ours - theirs).abs().max().item() <= 0.05 * theirs.abs().max().item()
