"""CPU-assisted LoRA while adapters load (Toppings): with the copy slowed by the emulated bandwidth,
requests of cold adapters run before their weights are on the device, their LoRA terms computed
on the CPU for the layers not copied yet. The logits must equal HF+peft (and the non-assisted
engine) within 1e-4, next to warm adapters in the same batch; a failing CPU worker must fall
back to waiting for the copy, never to a wrong or lost request."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from loraplex_agent.runtime import cpu_assist
from loraplex_agent.runtime.llm import LLM
from oracle_cases import GREEDY, MIX, prompts
from safetensors.torch import load_file, save_file

from loraplex.engine.output.sampling import SamplingParams

SLOW_COPY_GBPS = 0.05  # a rank-64 adapter of the tiny model then takes ~0.1 s to copy: many steps
ENGINE = dict(max_model_len=128, num_blocks=400)


def make_llm(tiny_model, adapters: dict, **engine) -> LLM:
    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", **{**ENGINE, **engine})
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    llm.executor.capture_logits = True
    return llm


def oracle_adapters(tiny_model) -> dict:
    return {name: tiny_model.adapters[name] for name in sorted({m for m in MIX if m})}


def assisted(tiny_model, adapters: dict | None = None) -> LLM:
    return make_llm(tiny_model, adapters or oracle_adapters(tiny_model), cpu_assist=True, cpu_assist_workers=2,
                    emulate_h2d_gbps=SLOW_COPY_GBPS)


def warm(llm: LLM, name: str) -> None:
    """Run one request of `name` so its adapter is on the device."""
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=1), [name])


def test_cold_adapters_next_to_a_warm_one_match_hf_peft(tiny_model, assert_matches_oracle):
    llm = assisted(tiny_model)
    warm(llm, "lora00-r8")
    requests = llm.generate(prompts([7, 23, 16, 30, 5, 11]), GREEDY, MIX)
    assert llm.executor.assist.assisted_layers > 0  # the cold adapters really ran before their copy
    assert llm.executor.assist.failures == 0
    assert_matches_oracle(llm, requests)


def test_assisted_logits_equal_the_non_assisted_engine(tiny_model):
    plain = make_llm(tiny_model, oracle_adapters(tiny_model), cpu_assist=False)
    helped = assisted(tiny_model)
    batch = prompts([9, 14, 21, 6, 12, 17], seed=3)
    expected = plain.generate(batch, GREEDY, MIX)
    got = helped.generate(batch, GREEDY, MIX)
    assert helped.executor.assist.assisted_layers > 0
    for e, g in zip(expected, got, strict=True):
        assert g.output_token_ids == e.output_token_ids
        ours = torch.stack(helped.executor.captured_logits[g.request_id])
        theirs = torch.stack(plain.executor.captured_logits[e.request_id])
        assert (ours - theirs).abs().max().item() <= 1e-4


def test_adapters_wrapping_some_modules_are_assisted_exactly(tiny_model, tmp_path):
    subset = only_modules(tiny_model.adapters["lora03-r64"], tmp_path / "qv-r64", ("q_proj", "v_proj"))
    mlp = only_modules(tiny_model.adapters["lora01-r16"], tmp_path / "mlp-r16", ("gate_proj", "down_proj"))
    adapters = {"qv": subset, "mlp": mlp, "lora00-r8": tiny_model.adapters["lora00-r8"]}
    plain = make_llm(tiny_model, adapters, cpu_assist=False)
    helped = assisted(tiny_model, adapters)
    names = ["qv", "mlp", "lora00-r8", None, "qv"]
    batch = prompts([12, 20, 8, 10, 15], seed=4)
    expected = plain.generate(batch, GREEDY, names)
    got = helped.generate(batch, GREEDY, names)
    assert helped.executor.assist.assisted_layers > 0
    for e, g in zip(expected, got, strict=True):
        assert g.output_token_ids == e.output_token_ids
        diff = torch.stack(helped.executor.captured_logits[g.request_id]) - torch.stack(
            plain.executor.captured_logits[e.request_id])
        assert diff.abs().max().item() <= 1e-4


def test_a_failing_worker_falls_back_to_the_copy(tiny_model, assert_matches_oracle, monkeypatch):
    def broken(*args):
        raise RuntimeError("worker crashed")

    monkeypatch.setattr(cpu_assist, "_lora_term", broken)
    llm = assisted(tiny_model)
    requests = llm.generate(prompts([7, 23, 16, 30, 5, 11]), GREEDY, MIX)
    assert llm.executor.assist.failures > 0 and llm.executor.assist.assisted_layers == 0
    assert [len(r.output_token_ids) for r in requests] == [GREEDY.max_tokens] * len(MIX)
    assert_matches_oracle(llm, requests)


def test_rows_are_split_by_worker_speed():
    workers = cpu_assist.CpuAssist(2)
    try:
        workers.speeds = [3.0, 1.0]
        assert workers.split(8) == [6, 2]
        assert sum(workers.split(7)) == 7 and workers.split(1) in ([1, 0], [0, 1])
    finally:
        workers.close()


def test_layer_progress_wakes_on_arrival_and_on_failure():
    progress = cpu_assist.LayerProgress(num_layers=2)
    assert not progress.arrived(0)
    progress.mark(0)
    assert progress.arrived(0) and not progress.arrived(1)
    assert progress.wait_until(lambda: False, 0, timeout=0.01)
    progress.fail()
    with pytest.raises(cpu_assist.AdapterCopyFailed):
        progress.wait_until(lambda: False, 1, timeout=0.01)


def only_modules(source, target, modules: tuple[str, ...]):
    """A copy of a PEFT adapter folder keeping the weights of `modules` only."""
    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config["target_modules"] = list(modules)
    (target / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(str(target / "adapter_model.safetensors"))
    kept = {k: v for k, v in weights.items() if any(f".{m}." in k for m in modules)}
    save_file(kept, str(target / "adapter_model.safetensors"))
    return target
