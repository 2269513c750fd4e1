"""Device slots holding resident adapters' LoRA weights, laid out for `lora_linear_delta`.

A slot's weights are copied from the host adapter in the model dtype when the scheduler loads it:
A and B are transposed, B is multiplied by the adapter's scaling, and the pairs of projections that
share their input are fused (q/k/v, gate/up), so a segment costs one shrink and one expand per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from loraplex_agent.host_adapter import HostAdapter
from loraplex_agent.model_config import ModelConfig
from loraplex_kernels.lora import LoraPair, fuse_lora_weights

from loraplex.spec.adapter import AdapterId

# fused group -> the PEFT modules it holds, in output order
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass
class LayerLoraWeights:
    """One layer's LoRA pairs per fused group, indexed by slot (None: empty slot or module not wrapped)."""

    qkv: list[LoraPair | None] = field(default_factory=list)
    o: list[LoraPair | None] = field(default_factory=list)
    gate_up: list[LoraPair | None] = field(default_factory=list)
    down: list[LoraPair | None] = field(default_factory=list)

    @classmethod
    def empty(cls, num_slots: int) -> LayerLoraWeights:
        return cls(*([None] * num_slots for _ in LORA_GROUPS))


class LoraSlots:
    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.layers = [LayerLoraWeights.empty(num_slots) for _ in range(config.num_hidden_layers)]
        self.adapters: list[AdapterId | None] = [None] * num_slots

    @property
    def num_slots(self) -> int:
        return len(self.adapters)

    def load(self, slot: int, adapter: HostAdapter) -> None:
        """Copy `adapter` into `slot`, replacing whatever the slot held."""
        self._check_slot(slot)
        for layer_index, layer in enumerate(self.layers):
            for group, modules in LORA_GROUPS.items():
                parts = [self._pair(adapter, layer_index, m) for m in modules]
                outs = [self.config.module_shape(m)[1] for m in modules]
                getattr(layer, group)[slot] = fuse_lora_weights(parts, outs)
        self.adapters[slot] = adapter.id

    def evict(self, slot: int) -> None:
        self._check_slot(slot)
        for layer in self.layers:
            for group in LORA_GROUPS:
                getattr(layer, group)[slot] = None
        self.adapters[slot] = None

    def _pair(self, adapter: HostAdapter, layer: int, module: str) -> LoraPair | None:
        pair = adapter.weights.get((layer, module))
        if pair is None:
            return None
        a, b = pair  # PEFT layout: A [r, in], B [out, r]
        a_t = a.t().to(device=self.device, dtype=self.dtype)
        b_t = (b.float() * adapter.scaling).t().to(device=self.device, dtype=self.dtype)
        return a_t, b_t

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"adapter slot {slot} is out of range 0..{self.num_slots - 1}")
