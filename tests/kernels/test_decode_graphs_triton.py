"""The static decode path CUDA graphs capture, with the Triton kernels (run by Triton's interpreter
on the CPU): padded rows, fixed-width tables, the padded LoRA segment table and page list, the
rank bound. Its logits must equal the torch reference engine's to 1e-4."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from loraplex_agent.runtime.decode_graphs import DecodeGraphs  # noqa: E402
from loraplex_agent.runtime.llm import LLM  # noqa: E402
from oracle_cases import prompts  # noqa: E402

from loraplex.engine.output.sampling import SamplingParams  # noqa: E402

ADAPTERS = ["lora00-r8", None, "lora03-r64"]
SAMPLING = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def run(tiny_model, static: bool) -> tuple[LLM, list]:
    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", max_model_len=64, num_blocks=300, max_num_seqs=4)
    for name in filter(None, ADAPTERS):
        llm.add_adapter(name, tiny_model.adapters[name])
    llm.executor.capture_logits = True
    if static:
        e = llm.executor
        e.graphs = DecodeGraphs(e.model, e.kv_caches, e.config, e.device, capture=False)
    return llm, llm.generate(prompts([6, 9, 5], seed=7), SAMPLING, ADAPTERS)


def test_static_triton_decode_equals_the_reference_engine(tiny_model, monkeypatch):
    expected, expected_requests = run(tiny_model, static=False)
    monkeypatch.setenv("LORAPLEX_ATTENTION_KERNEL", "triton")
    monkeypatch.setenv("LORAPLEX_LORA_KERNEL", "triton")
    got, got_requests = run(tiny_model, static=True)
    assert got.executor.graphs.replays == SAMPLING.max_tokens - 1
    for e, g in zip(expected_requests, got_requests, strict=True):
        assert g.output_token_ids == e.output_token_ids
        ours = torch.stack(got.executor.captured_logits[g.request_id])
        theirs = torch.stack(expected.executor.captured_logits[e.request_id])
        assert (ours - theirs).abs().max().item() <= 1e-4
