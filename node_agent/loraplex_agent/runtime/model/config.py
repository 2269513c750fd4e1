"""The base model's shape, read from a Hugging Face `config.json` (Llama, Mistral, Qwen2)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loraplex.spec.errors import InvalidRequestError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise InvalidRequestError(f"{path} does not exist: not a Hugging Face model folder") from None
        return cls.from_dict(raw, name=str(model_dir))

    @classmethod
    def from_dict(cls, raw: dict, name: str) -> ModelConfig:
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise InvalidRequestError(f"unsupported architecture {arch}; supported: {SUPPORTED_ARCHITECTURES}")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            name=name, architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
            bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a LoRA target module."""
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden_size, q_out), "k_proj": (self.hidden_size, kv_out),
            "v_proj": (self.hidden_size, kv_out), "o_proj": (q_out, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        return shapes[module]


def _rope_theta(raw: dict) -> float:
    """transformers < 5 writes `rope_theta`; 5.x nests it in `rope_parameters`."""
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict) -> dict | None:
    """The rope scaling dict (with `rope_type`), or None for plain rope; either config generation."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" else {**scaling, "rope_type": kind}
