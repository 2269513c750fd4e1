"""The Llama-family decoder (Llama 2/3.x, Mistral, Qwen2) over a paged KV cache, with multi-LoRA.

Weights of projections that read the same input are fused at load time (q/k/v -> qkv, gate/up ->
gate_up), so a layer runs four matmuls. Each fused projection adds its segmented LoRA delta
(`loraplex_kernels.lora`) before the output is split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from loraplex_kernels.attention import AttentionBatch, paged_attention, write_kv
from loraplex_kernels.lora import LoraBatch, LoraGroup, lora_linear_delta

from loraplex.spec.errors import InvalidRequestError
from loraplex_agent.runtime.model.config import ModelConfig
from loraplex_agent.runtime.model.rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from loraplex_agent.runtime.cpu_assist import StepAssist


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides the weights, built once per step by the executor."""

    input_ids: torch.Tensor  # [rows] long
    positions: torch.Tensor  # [rows] long
    attention: AttentionBatch
    lora: LoraBatch
    sample_rows: torch.Tensor  # [num_sampled] long: rows whose next-token logits are wanted
    assist: StepAssist | None = None  # adapters still being copied in, helped by the CPU


class LayerLora:
    """One layer's projections with their LoRA terms: the device kernel for adapters whose weights
    of this layer are on the device and, for an adapter still being copied in, CPU-computed terms
    (`loraplex_agent.runtime.cpu_assist`) started before the base matmul so the two overlap."""

    def __init__(self, batch: ForwardBatch, layer: int, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.layer = layer
        self.kv_cache = kv_cache
        self.assist = batch.assist
        self.waiting = self.assist.waiting(layer) if self.assist is not None else []
        self.device_lora = self.assist.device_lora(self.waiting) if self.waiting else batch.lora

    def project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: LoraGroup) -> torch.Tensor:
        pending = self.assist.start(x, self.layer, group, self.waiting) if self.waiting else None
        y = F.linear(x, weight, bias)
        lora_linear_delta(y, x, self.device_lora, group, *self.kv_cache)
        if pending:
            self.assist.finish(pending, y, x, self.layer, group, self.kv_cache)
        return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled in the input dtype (as HF Llama does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class _Weights:
    """Pops named tensors from a checkpoint's state dict with a clear error when one is missing."""

    def __init__(self, state: dict[str, torch.Tensor], model_dir: str) -> None:
        self.state = state
        self.model_dir = model_dir

    def take(self, name: str) -> torch.Tensor:
        try:
            return self.state.pop(name)
        except KeyError:
            raise InvalidRequestError(f"{self.model_dir}: the checkpoint has no tensor {name!r}") from None

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.state.pop(name, None)


class DecoderLayer:
    def __init__(self, config: ModelConfig, weights: _Weights, index: int, lora: dict[str, LoraGroup]) -> None:
        p = f"model.layers.{index}."
        attn, mlp = p + "self_attn.", p + "mlp."
        self.index = index
        self.eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_split = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.input_norm = weights.take(p + "input_layernorm.weight")
        self.post_norm = weights.take(p + "post_attention_layernorm.weight")
        self.qkv = torch.cat([weights.take(f"{attn}{m}.weight") for m in ("q_proj", "k_proj", "v_proj")])
        self.qkv_bias = None
        if config.attention_bias:
            self.qkv_bias = torch.cat([weights.take(f"{attn}{m}.bias") for m in ("q_proj", "k_proj", "v_proj")])
        self.o = weights.take(attn + "o_proj.weight")
        self.gate_up = torch.cat([weights.take(mlp + "gate_proj.weight"), weights.take(mlp + "up_proj.weight")])
        self.down = weights.take(mlp + "down_proj.weight")
        self.lora = lora

    def forward(self, h: torch.Tensor, batch: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        lora = LayerLora(batch, self.index, kv_cache)
        h = h + self._attention(rms_norm(h, self.input_norm, self.eps), batch, rope, kv_cache, lora)
        return h + self._mlp(rms_norm(h, self.post_norm, self.eps), lora)

    def _attention(self, x: torch.Tensor, batch: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor],
                   kv_cache: tuple[torch.Tensor, torch.Tensor], lora: LayerLora) -> torch.Tensor:
        qkv = lora.project(x, self.qkv, self.qkv_bias, self.lora["qkv"])
        q, k, v = qkv.split(self.qkv_split, dim=-1)
        cos, sin = rope
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        write_kv(kv_cache[0], kv_cache[1], k, v, batch.attention.slot_mapping)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], batch.attention, self.scale)
        out = out.view(-1, self.num_heads * self.head_dim)
        return lora.project(out, self.o, None, self.lora["o"])

    def _mlp(self, x: torch.Tensor, lora: LayerLora) -> torch.Tensor:
        gate_up = lora.project(x, self.gate_up, None, self.lora["gate_up"])
        gate, up = gate_up.chunk(2, dim=-1)
        return lora.project(F.silu(gate) * up, self.down, None, self.lora["down"])


class LlamaModel:
    """Weights plus forward; the KV cache tensors (which also hold the adapters) are owned by the executor."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], lora: dict[str, LoraGroup],
                 max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        weights = _Weights(state, config.name)
        self.config = config
        self.embed = weights.take("model.embed_tokens.weight")
        self.layers = [DecoderLayer(config, weights, i, lora) for i in range(config.num_hidden_layers)]
        self.norm = weights.take("model.norm.weight")
        lm_head = weights.maybe("lm_head.weight")
        self.lm_head = self.embed if config.tie_word_embeddings or lm_head is None else lm_head
        self.rope = RotaryEmbedding(config, max_positions, device, dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run the step's rows through the decoder; float32 logits [num_sampled, vocab]."""
        return self.logits(self.hidden_states(batch, kv_caches), batch.sample_rows)

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The last decoder layer's output for every row of the step [rows, hidden] (KV written)."""
        h = F.embedding(batch.input_ids, self.embed)
        rope = self.rope.tables(batch.positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer.forward(h, batch, rope, kv_cache)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Float32 next-token logits [len(rows), vocab] of the given rows of `hidden_states`. The
        norm and the head work row by row, so other rows asked for separately (prompt logprobs)
        leave the sampled rows' logits bit for bit as they are."""
        h = rms_norm(hidden[rows], self.norm, self.config.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
