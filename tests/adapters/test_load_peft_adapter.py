"""Good adapters load with the right identity, shapes and scaling."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from loraplex_agent.adapters.peft import load_peft_adapter
from loraplex_agent.runtime.model.config import LORA_MODULES
from safetensors.torch import load_file


def test_loads_tiny_adapter(tiny_model, model_config) -> None:
    path = tiny_model.adapters["lora02-r32"]
    adapter = load_peft_adapter("lora02-r32", path, model_config, max_rank=64)
    weights_file = path / "adapter_model.safetensors"
    assert adapter.id.name == "lora02-r32"
    assert adapter.id.digest == "sha256:" + hashlib.sha256(weights_file.read_bytes()).hexdigest()
    assert adapter.rank == 32
    assert adapter.scaling == pytest.approx(2.0)  # lora_alpha = 2 r
    assert adapter.info.target_modules == LORA_MODULES
    assert adapter.info.base_model == "base"
    assert adapter.info.size_bytes == weights_file.stat().st_size
    assert adapter.info.source == str(path)
    assert len(adapter.weights) == model_config.num_hidden_layers * len(LORA_MODULES)
    for (_, module), (lora_a, lora_b) in adapter.weights.items():
        in_features, out_features = model_config.module_shape(module)
        assert lora_a.shape == (32, in_features) and lora_b.shape == (out_features, 32)
        assert lora_a.dtype == torch.float32 and lora_b.dtype == torch.float32
    raw = load_file(weights_file)
    key = "base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"
    assert torch.equal(adapter.weights[(2, "down_proj")][1], raw[key])


def test_digest_follows_weights_not_name(copy_adapter, model_config, weights_editor) -> None:
    folder = copy_adapter("lora01-r16")
    first = load_peft_adapter("a", folder, model_config, 64)
    assert load_peft_adapter("b", folder, model_config, 64).id.digest == first.id.digest

    def bump(tensors: dict) -> dict:
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][0, 0] += 1.0
        return tensors

    weights_editor(folder, bump)
    second = load_peft_adapter("a", folder, model_config, 64)
    assert second.id.name == first.id.name and second.id.digest != first.id.digest
    assert second.id != first.id


def test_rslora_scaling(copy_adapter, model_config, config_editor) -> None:
    folder = copy_adapter("lora01-r16")
    config_editor(folder, use_rslora=True, lora_alpha=8)
    assert load_peft_adapter("a", folder, model_config, 64).scaling == pytest.approx(8 / math.sqrt(16))


def test_named_adapter_keys_and_pattern_targets(copy_adapter, model_config, config_editor, weights_editor) -> None:
    folder = copy_adapter("lora00-r8")
    reference = load_peft_adapter("a", folder, model_config, 64)
    weights_editor(folder, lambda t: {k.replace(".weight", ".default.weight"): v for k, v in t.items()})
    for target in ("all-linear", r".*\.(q|k|v|o|gate|up|down)_proj"):
        config_editor(folder, target_modules=target)
        adapter = load_peft_adapter("a", folder, model_config, 64)
        assert adapter.info.target_modules == LORA_MODULES
        assert all(torch.equal(adapter.weights[k][1], reference.weights[k][1]) for k in reference.weights)


def test_subset_of_modules(copy_adapter, model_config, config_editor, weights_editor) -> None:
    folder = copy_adapter("lora00-r8")
    config_editor(folder, target_modules=["q_proj", "v_proj"])
    weights_editor(folder, lambda t: {k: v for k, v in t.items() if ".q_proj." in k or ".v_proj." in k})
    adapter = load_peft_adapter("a", folder, model_config, 64)
    assert adapter.info.target_modules == ("q_proj", "v_proj")
    assert {module for _, module in adapter.weights} == {"q_proj", "v_proj"}


def test_rank_and_alpha_patterns_match_peft(tiny_model, model_config, tmp_path) -> None:
    """Per-module ranks and alphas give the same delta weights as PEFT computes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model.base_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_MODULES), init_lora_weights=False,
                        rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 12},
                        alpha_pattern={"v_proj": 3, "gate_proj": 40}, use_rslora=True)
    torch.manual_seed(0)  # init_lora_weights=False draws random A and B
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(tmp_path / "patterned", save_embedding_layers=False)

    adapter = load_peft_adapter("patterned", tmp_path / "patterned", model_config, max_rank=16)
    assert adapter.rank == 12
    assert adapter.weights[(0, "q_proj")][0].shape[0] == 4
    assert adapter.weights[(1, "down_proj")][0].shape[0] == 12
    assert adapter.weights[(0, "down_proj")][0].shape[0] == 8
    for (layer, module), (lora_a, lora_b) in adapter.weights.items():
        parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        peft_layer = peft_model.get_submodule(f"base_model.model.model.layers.{layer}.{parent}.{module}")
        expected = peft_layer.get_delta_weight("default")
        torch.testing.assert_close(adapter.scaling * lora_b @ lora_a, expected, rtol=1e-5, atol=1e-6)


def test_loads_activated_lora(tiny_alora_model, model_config) -> None:
    from loraplex_agent.tools.tiny_model import invocation_tokens

    adapter = load_peft_adapter("alora00-r8", tiny_alora_model.adapters["alora00-r8"], model_config, 64)
    standard = load_peft_adapter("lora00-r8", tiny_alora_model.adapters["lora00-r8"], model_config, 64)
    assert adapter.info.is_alora and not standard.info.is_alora
    assert list(adapter.info.invocation_tokens) == invocation_tokens(tiny_alora_model.base_dir)
    assert adapter.id.digest == standard.id.digest  # aloraNN has loraNN's weights


@pytest.mark.parametrize("tokens", [[], [1, "x"], [-1], [10**9], [True], "<|check|>"])
def test_bad_invocation_refused(copy_adapter, model_config, config_editor, tokens) -> None:
    from loraplex.spec.errors import AdapterError

    folder = copy_adapter("lora00-r8")
    config_editor(folder, alora_invocation_tokens=tokens)
    with pytest.raises(AdapterError, match="alora_invocation_tokens must be"):
        load_peft_adapter("bad", folder, model_config, 64)
