"""Device slots holding resident adapters' LoRA weights, laid out for `lora_linear_delta`.

A slot's weights are copied from the host adapter in the model dtype when the scheduler loads it:
A and B are transposed, B is multiplied by the adapter's scaling, and each layer's pairs go into
the `StackedLoraWeights` of their fused group (q/k/v, o, gate/up, down). Every slot has a location
(rank class, index) shared by all layers and groups: the class is the adapter's rank rounded up to
a power of two, the index the lowest free one of that class, which keeps the resident adapters of a
class at consecutive indices, so a decode step over many adapters runs few batched matmuls.
"""

from __future__ import annotations

import torch
from loraplex_agent.host_adapter import HostAdapter
from loraplex_agent.model_config import ModelConfig
from loraplex_kernels.lora import Location, LoraPair, StackedLoraWeights, rank_class

from loraplex.spec.adapter import AdapterId

# fused group -> the PEFT modules it holds, in output order
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}

LayerLoraWeights = dict[str, StackedLoraWeights]  # fused group -> its stacked weights


def slot_rank_units(max_lora_rank: int) -> int:
    """Rank units one slot reserves. A slot may hold an adapter of any rank class up to
    max_lora_rank's, and every class has its own stacked buffers with one index per slot, so one
    slot costs the sum of the classes 1 + 2 + 4 + ... + rank_class(max_lora_rank)."""
    return 2 * rank_class(max_lora_rank) - 1


def slot_bytes_per_rank(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one rank unit of one slot: a column of A [in, 1] and a row of B [1, out] for every
    LoRA target module of every layer."""
    per_layer = sum(sum(config.module_shape(m)) for modules in LORA_GROUPS.values() for m in modules)
    return per_layer * config.num_hidden_layers * dtype.itemsize


def lora_slots_bytes(config: ModelConfig, dtype: torch.dtype, num_slots: int, max_lora_rank: int) -> int:
    """Device memory `LoraSlots(config, num_slots, ..., max_lora_rank=max_lora_rank)` allocates."""
    return num_slots * slot_rank_units(max_lora_rank) * slot_bytes_per_rank(config, dtype)


class LoraSlots:
    """`max_lora_rank` given: every rank class up to it is allocated now, at its full size
    (`lora_slots_bytes`), so the slots never grow after the KV cache has taken the rest of the
    memory. Without it the classes grow on first use (tests and tools that size nothing)."""

    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device, dtype: torch.dtype,
                 max_lora_rank: int | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"adapter slots must be at least 1, got {num_slots}")
        self.config = config
        self.device = device
        self.dtype = dtype
        self.layers: list[LayerLoraWeights] = [
            {group: self._stack(modules) for group, modules in LORA_GROUPS.items()}
            for _ in range(config.num_hidden_layers)]
        self.adapters: list[AdapterId | None] = [None] * num_slots
        self.locations: list[Location | None] = [None] * num_slots
        if max_lora_rank is not None:
            self._allocate(rank_class(max_lora_rank))

    @property
    def num_slots(self) -> int:
        return len(self.adapters)

    def _stack(self, modules: tuple[str, ...]) -> StackedLoraWeights:
        in_features = self.config.module_shape(modules[0])[0]
        outs = [self.config.module_shape(m)[1] for m in modules]
        return StackedLoraWeights(in_features, outs, self.device, self.dtype)

    def _allocate(self, top_class: int) -> None:
        """Size every class's buffers for all slots: storing a rank-1 zero pair at the last index
        makes each stack grow straight to `num_slots` (loads use indices below it, so it never
        grows again), and clearing it leaves the buffers with nothing wrapped."""
        last = self.num_slots - 1
        for layer in self.layers:
            for group, stack in layer.items():
                zeros = [self._zero_pair(m) for m in LORA_GROUPS[group]]
                for cls in (1 << k for k in range(top_class.bit_length())):
                    stack.put((cls, last), zeros)
                    stack.clear((cls, last))

    def _zero_pair(self, module: str) -> LoraPair:
        in_features, out_features = self.config.module_shape(module)
        return (torch.zeros(in_features, 1, device=self.device, dtype=self.dtype),
                torch.zeros(1, out_features, device=self.device, dtype=self.dtype))

    def location(self, slot: int) -> Location:
        """The occupied slot's (rank class, index) in the stacked buffers."""
        location = self.locations[slot]
        if location is None:
            raise ValueError(f"adapter slot {slot} holds no adapter")
        return location

    def load(self, slot: int, adapter: HostAdapter) -> None:
        """Copy `adapter` into `slot`, replacing whatever the slot held."""
        self._check_slot(slot)
        if self.adapters[slot] is not None:
            self.evict(slot)
        location = self._free_location(_adapter_rank(adapter))
        for layer_index, layer in enumerate(self.layers):
            for group, modules in LORA_GROUPS.items():
                layer[group].put(location, [self._pair(adapter, layer_index, m) for m in modules])
        self.adapters[slot], self.locations[slot] = adapter.id, location

    def evict(self, slot: int) -> None:
        self._check_slot(slot)
        location = self.locations[slot]
        if location is not None:
            for layer in self.layers:
                for stack in layer.values():
                    stack.clear(location)
        self.adapters[slot], self.locations[slot] = None, None

    def _free_location(self, rank: int) -> Location:
        cls = rank_class(rank)
        taken = {loc[1] for loc in self.locations if loc is not None and loc[0] == cls}
        return cls, next(i for i in range(self.num_slots + 1) if i not in taken)

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


def _adapter_rank(adapter: HostAdapter) -> int:
    """The largest rank over the adapter's modules (rank_pattern may give modules other ranks)."""
    return max((a.shape[0] for a, _ in adapter.weights.values()), default=adapter.rank)
