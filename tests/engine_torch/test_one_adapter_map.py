"""The engine's adapters are one map: the core's table, the weights the executor copies and the
registry the agent serves from are the same object, so no step of loading, unloading, reloading with
new weights, evicting or refusing can leave them disagreeing. Every generation below is checked
against HF + peft with the weights the adapter's name should mean at that moment."""

from __future__ import annotations

import pytest
import torch
from loraplex_agent.adapters.peft import load_peft_adapter
from loraplex_agent.runtime.llm import LLM

from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.spec.errors import AdapterError, ConflictError, NotFoundError

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPT = [5, 17, 230, 41, 9, 88, 120, 7]


def _llm(tiny_model, **engine) -> LLM:
    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", max_model_len=128, **{"num_blocks": 64, **engine})
    llm.executor.capture_logits = True
    return llm


def _run(llm: LLM, adapter: str) -> Request:
    [request] = llm.generate([PROMPT], GREEDY, [adapter])
    return request


def _check(llm: LLM, request: Request, oracle_adapter: str, hf_oracle) -> None:
    """`request`'s tokens and logits are HF + peft's with `oracle_adapter`'s weights."""
    tokens = request.prompt_token_ids + request.output_token_ids
    expected = hf_oracle.logits(tokens, oracle_adapter)[request.num_prompt_tokens - 1:-1]
    ours = torch.stack(llm.executor.captured_logits[request.request_id])
    assert (ours - expected).abs().max().item() <= 1e-4
    assert expected.argmax(-1).tolist() == request.output_token_ids


def test_the_core_and_the_executor_read_the_registry(tiny_model):
    llm = _llm(tiny_model)
    assert llm.core.adapters is llm.adapters
    info = llm.add_adapter("a", tiny_model.adapters["lora00-r8"])
    assert llm.core.adapters.serving("a") == info and llm.adapters["a"].info == info
    assert llm.executor.get_adapter(info.id) is llm.adapters["a"].host
    assert llm.adapters["a"].path == str(tiny_model.adapters["lora00-r8"])


def test_load_unload_and_load_again(tiny_model, hf_oracle):
    llm = _llm(tiny_model)
    info = llm.add_adapter("a", tiny_model.adapters["lora00-r8"])
    _check(llm, _run(llm, "a"), "lora00-r8", hf_oracle)
    assert llm.remove_adapter("a") == info
    assert "a" not in llm.adapters and llm.core.adapters.serving("a") is None
    assert not llm.adapters.holds(info.id)
    with pytest.raises(NotFoundError):
        llm.generate([PROMPT], GREEDY, ["a"])
    with pytest.raises(NotFoundError):  # the core too refuses the old identity
        llm.core.add_request(Request("old", list(PROMPT), GREEDY, adapter=info.id))
    llm.add_adapter("a", tiny_model.adapters["lora00-r8"])
    _check(llm, _run(llm, "a"), "lora00-r8", hf_oracle)


def test_a_name_reloaded_with_new_weights_serves_the_new_ones(tiny_model, hf_oracle):
    llm = _llm(tiny_model)
    old = llm.add_adapter("a", tiny_model.adapters["lora00-r8"])
    _check(llm, _run(llm, "a"), "lora00-r8", hf_oracle)  # on the device now
    llm.remove_adapter("a")
    new = llm.add_adapter("a", tiny_model.adapters["lora01-r16"])
    assert new.id.digest != old.id.digest and llm.core.adapters.serving("a") == new
    _check(llm, _run(llm, "a"), "lora01-r16", hf_oracle)


def test_an_evicted_adapter_comes_back_from_the_registry(tiny_model, hf_oracle):
    """One device slot: each adapter evicts the other, and is read back from the same weights."""
    llm = _llm(tiny_model, max_loras=1, max_lora_rank=16, memory_policy="lru-static")
    llm.add_adapter("a", tiny_model.adapters["lora00-r8"])
    llm.add_adapter("b", tiny_model.adapters["lora01-r16"])
    loads = llm.core.stats().adapter_loads_total
    for name, weights in (("a", "lora00-r8"), ("b", "lora01-r16"), ("a", "lora00-r8")):
        _check(llm, _run(llm, name), weights, hf_oracle)
    assert llm.core.stats().adapter_loads_total - loads == 3


def test_a_taken_name_is_refused_and_the_loaded_adapter_keeps_its_weights(tiny_model, hf_oracle):
    """The refusal happens before anything changes: the loaded adapter's weights are not dropped
    with the refused copy's, even when both are the same folder (the same identity)."""
    llm = _llm(tiny_model)
    info = llm.add_adapter("a", tiny_model.adapters["lora00-r8"])
    with pytest.raises(ConflictError, match="already loaded"):
        llm.add_adapter("a", tiny_model.adapters["lora00-r8"])
    with pytest.raises(ConflictError, match="already loaded"):
        llm.add_adapter("a", tiny_model.adapters["lora01-r16"])
    assert llm.adapters.host(info.id) is llm.adapters["a"].host
    _check(llm, _run(llm, "a"), "lora00-r8", hf_oracle)  # its first load to the device comes after


def test_an_adapter_the_engine_refuses_leaves_no_trace(tiny_model):
    llm = _llm(tiny_model, max_lora_rank=8)
    host = load_peft_adapter("big", tiny_model.adapters["lora03-r64"], llm.model_config, 64)
    with pytest.raises(AdapterError, match="max_lora_rank=8"):
        llm.register(host)
    assert "big" not in llm.adapters and not llm.adapters.holds(host.id)
    assert llm.core.adapters.serving("big") is None
    llm.add_adapter("big", tiny_model.adapters["lora00-r8"])  # the name is free
    assert llm.adapters["big"].info.rank == 8
