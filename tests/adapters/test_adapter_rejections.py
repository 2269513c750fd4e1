"""Every adapter the engine would not compute like PEFT is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from loraplex_agent.adapters.peft import load_peft_adapter

from loraplex.spec.errors import AdapterError

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def refused(folder, model_config, match: str, max_rank: int = 64, **kwargs) -> None:
    with pytest.raises(AdapterError, match=match):
        load_peft_adapter("a", folder, model_config, max_rank, **kwargs)


def test_missing_folder_and_config(tmp_path, model_config) -> None:
    refused(tmp_path / "nowhere", model_config, "does not exist")
    refused(tmp_path, model_config, "adapter_config.json is missing")
    (tmp_path / "adapter_config.json").write_text("{not json")
    refused(tmp_path, model_config, "not valid JSON")


def test_invalid_name(tiny_model, model_config) -> None:
    with pytest.raises(AdapterError, match="invalid adapter name"):
        load_peft_adapter("../etc", tiny_model.adapters["lora00-r8"], model_config, 64)


@pytest.mark.parametrize(("changes", "match"), [
    ({"peft_type": "IA3"}, "only LORA"),
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"layers_to_transform": [0, 1]}, "layers_to_transform"),
    ({"layers_pattern": "layers"}, "layers_pattern"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
    ({"lora_bias": True}, "lora_bias"),
    ({"use_future_variant": True}, "use_future_variant is not supported"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target modules \['lm_head'\]"),
    ({"r": 0}, "rank r must be an integer >= 1"),
    ({"lora_alpha": "big"}, "lora_alpha must be a positive number"),
    ({"rank_pattern": {"q_proj": -1}}, r"rank_pattern\['q_proj'\]"),
])
def test_unsupported_config(copy_adapter, model_config, config_editor, changes, match) -> None:
    folder = copy_adapter("lora00-r8")
    config_editor(folder, **changes)
    refused(folder, model_config, match)


def test_rank_above_max(tiny_model, model_config) -> None:
    refused(tiny_model.adapters["lora03-r64"], model_config, "rank 64 is larger than the maximum LoRA rank 32",
            max_rank=32)


def test_config_rank_differs_from_weights(copy_adapter, model_config, config_editor) -> None:
    folder = copy_adapter("lora01-r16")
    config_editor(folder, r=8)
    refused(folder, model_config, "the weights have rank 16, but adapter_config.json gives rank 8")


def test_pickle_weights_refused(copy_adapter, model_config) -> None:
    folder = copy_adapter("lora00-r8")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    refused(folder, model_config, "pickle weights are not loaded; convert them to safetensors")
    (folder / "adapter_model.bin").unlink()
    refused(folder, model_config, "adapter_model.safetensors is missing")


def test_corrupt_and_truncated_weights(copy_adapter, model_config) -> None:
    folder = copy_adapter("lora00-r8")
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    refused(folder, model_config, "not a valid safetensors file")
    weights.write_bytes(b"\x00" * 64)
    refused(folder, model_config, "not a valid safetensors file")


def _set(key: str, value: torch.Tensor):
    def change(tensors: dict) -> dict:
        tensors[key] = value
        return tensors
    return change


@pytest.mark.parametrize(("change", "match"), [
    (_set(Q_A, torch.zeros(8, 128)), r"layer 0 q_proj: lora_A \(8, 128\)"),
    (_set(Q_B, torch.zeros(256, 8, 1)), "must be matrices"),
    (_set(Q_A.replace("layers.0", "layers.9"), torch.zeros(8, 256)), "layer 9, but the base model has 4 layers"),
    (_set(Q_A.replace("q_proj", "fc1"), torch.zeros(8, 256)), "not supported"),
    (_set(Q_A.replace("self_attn.q_proj", "mlp.q_proj"), torch.zeros(8, 256)), "mlp.q_proj"),
    (_set("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(8, 8000)), "unsupported weight"),
    (_set(Q_A, torch.full((8, 256), float("nan"))), "NaN or infinite"),
    (_set(Q_B, torch.full((256, 8), float("inf"))), "NaN or infinite"),
    (_set(Q_A, torch.zeros(8, 256, dtype=torch.int8)), "must be floating point"),
    (lambda t: {k: v for k, v in t.items() if k != Q_B}, "layer 0 q_proj has no lora_B"),
    (lambda t: {"unrelated": torch.zeros(1)} | {}, "unsupported weight 'unrelated'"),
])
def test_bad_weights(copy_adapter, model_config, weights_editor, change, match) -> None:
    folder = copy_adapter("lora00-r8")
    weights_editor(folder, change)
    refused(folder, model_config, match)


def test_empty_weights(copy_adapter, model_config) -> None:
    from safetensors.torch import save_file

    folder = copy_adapter("lora00-r8")
    save_file({}, folder / "adapter_model.safetensors")
    refused(folder, model_config, "holds no LoRA weights")


def test_base_model_name(copy_adapter, model_config, config_editor) -> None:
    folder = copy_adapter("lora00-r8")
    config_editor(folder, base_model_name_or_path="meta-llama/Llama-3.1-8B")
    refused(folder, model_config, "trained on base model 'meta-llama/Llama-3.1-8B'")
    assert load_peft_adapter("a", folder, model_config, 64, base_model_aliases=["llama-3.1-8b"]).rank == 8
    config_editor(folder, base_model_name_or_path="/elsewhere/BASE/")
    assert load_peft_adapter("a", folder, model_config, 64).rank == 8
    config_editor(folder, base_model_name_or_path=None)
    assert load_peft_adapter("a", folder, model_config, 64).info.base_model is None
