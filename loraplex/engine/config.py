"""Engine settings, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.spec.engine_settings import ENGINE_SETTINGS as _SETTINGS


@dataclass(frozen=True)
class EngineConfig:
    # The defaults of the settings an AdapterPool sets too are declared once, in loraplex.spec.engine_settings.
    max_model_len: int = 2048  # the pool's default is the model's own limit, which the agent reads
    block_size: int = _SETTINGS["block_size"].default
    num_blocks: int = 1024  # KV pages on the device; the torch executor sizes this from memory
    max_num_seqs: int = _SETTINGS["max_num_seqs"].default  # requests in the running batch
    max_num_batched_tokens: int = _SETTINGS["max_num_batched_tokens"].default  # per-step token budget
    # tokens of one prompt per step; 0: the whole budget (`prefill_chunk_tokens`)
    long_prefill_token_threshold: int = _SETTINGS["long_prefill_token_threshold"].default
    max_loras: int = _SETTINGS["max_loras"].default  # slots under memory_policy="lru-static"; the page pool needs none
    max_lora_rank: int = _SETTINGS["max_lora_rank"].default
    scheduler: str = _SETTINGS["scheduler"].default  # by name (loraplex.engine.scheduling.schedulers)
    scheduler_options: dict[str, Any] = field(default_factory=dict)  # the scheduler's knobs by name
    residency: str = "lru"  # read by nothing now: kept so that profiles written with it still load
    memory_policy: str = _SETTINGS["memory_policy"].default  # by name (loraplex.engine.memory.policies)
    prefix_cache: bool = True  # reuse KV of earlier requests of the same adapter (unified only)
    num_host_blocks: int = 0  # host-tier KV blocks for swapped-out prefixes; 0 drops evicted KV
    memory_options: dict[str, Any] = field(default_factory=dict)  # the memory policy's knobs by name
    # admit a request whose adapter is still being copied in: the executor computes its LoRA terms
    # on the CPU for the layers not on the device yet (Toppings); only with background loads
    cpu_assist: bool = False

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "num_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be at least 0")
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({self.num_blocks} blocks of {self.block_size} tokens) cannot hold one "
                f"request of max_model_len={self.max_model_len}; lower max_model_len or add memory")

    @property
    def prefill_chunk_tokens(self) -> int:
        """The most tokens of one request's prompt that a step computes: a long prompt leaves the rest of
        the step's budget to the requests that arrive during its prefill."""
        threshold = self.long_prefill_token_threshold
        return threshold if 0 < threshold < self.max_num_batched_tokens else self.max_num_batched_tokens
