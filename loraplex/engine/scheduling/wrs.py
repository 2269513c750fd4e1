"""Chameleon's weighted request size and the tokens a request borrows from its queue's quota.

    WRS = (0.4 * In/MaxIn + 0.6 * Out/MaxOut) * Rank/MaxRank

In is the prompt length, Out the predicted output length (both normalised by the engine's
max_model_len), Rank the adapter's rank over the engine's max_lora_rank. The rank multiplies, so
a rank-8 request is at most 1/16 of the same request at rank 128 and queues split mostly by rank.
A base-model request (no adapter) counts as `base_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.memory.kv_cache import blocks_for


@dataclass(frozen=True)
class SizeModel:
    max_in: int  # MaxIn and MaxOut: the engine's max_model_len
    max_out: int
    max_rank: int
    block_size: int
    input_weight: float = 0.4
    output_weight: float = 0.6
    base_rank: int = 8  # the rank a base-model request counts as
    adapter_tokens_per_rank: float = 4.0  # KV-token equivalents of one rank of adapter weights

    def wrs(self, num_input: int, num_output: int, rank: int) -> float:
        size = self.input_weight * num_input / self.max_in + self.output_weight * num_output / self.max_out
        return size * (rank or self.base_rank) / self.max_rank

    def need_tokens(self, num_input: int, num_output: int, rank: int) -> int:
        """Input + predicted output (whole KV blocks, as the cache hands them out) + the adapter's size
        in KV-token equivalents; a base-model request has no adapter to pay for."""
        kv = blocks_for(num_input + num_output, self.block_size) * self.block_size
        return kv + self.adapter_tokens(rank)

    def adapter_tokens(self, rank: int) -> int:
        """An adapter's weights in KV-token equivalents."""
        return round(rank * self.adapter_tokens_per_rank)
