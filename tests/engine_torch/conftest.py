"""The HF transformers + peft oracle over the session's tiny model, and helpers to compare with it.

`hf_oracle` holds every tiny-model adapter in one PeftModel; a row picks its adapter through
`adapter_names` ("__base__" for the base model), as peft's mixed-batch inference does.
"""

from __future__ import annotations

import pytest
import torch

ORACLE_ADAPTERS = ("lora00-r8", "lora01-r16", "lora03-r64", "lora04-r8")
BASE = "__base__"


class HFOracle:
    def __init__(self, model) -> None:
        self.model = model

    @torch.inference_mode()
    def logits(self, token_ids: list[int], adapter: str | None) -> torch.Tensor:
        """Float32 logits [len(token_ids), vocab] of one sequence, by teacher forcing."""
        ids = torch.tensor([token_ids])
        return self.model(input_ids=ids, adapter_names=[adapter or BASE]).logits[0].float()


def load_hf_oracle(base_dir, adapters: dict) -> HFOracle:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return HFOracle(model.eval())


@pytest.fixture(scope="session")
def hf_oracle(tiny_model) -> HFOracle:
    return load_hf_oracle(tiny_model.base_dir, {n: tiny_model.adapters[n] for n in ORACLE_ADAPTERS})


@pytest.fixture(scope="session")
def assert_matches_oracle(hf_oracle: HFOracle):
    """assert_matches_oracle(llm, requests): every generated token is the oracle's argmax and every
    step's logits are within 1e-4 of the oracle's (the LLM must have `capture_logits` on)."""
    return lambda llm, requests: check_against_oracle(llm, requests, hf_oracle)


def check_against_oracle(llm, requests, oracle: HFOracle, atol: float = 1e-4) -> None:
    for request in requests:
        adapter = request.adapter.name if request.adapter else None
        tokens = request.prompt_token_ids + request.output_token_ids
        expected = oracle.logits(tokens, adapter)[request.num_prompt_tokens - 1:-1]
        ours = torch.stack(llm.executor.captured_logits[request.request_id])
        assert ours.shape == expected.shape, request.request_id
        diff = (ours - expected).abs().max().item()
        assert diff <= atol, f"{request.request_id} ({adapter}): max |logit diff| {diff}"
        assert expected.argmax(-1).tolist() == request.output_token_ids, request.request_id
