"""What one engine step does, in the numbers the latency model is linear in.

The terms follow the digital-twin paper's Eq. 1, Lat_model = (K4*B + K5) * (K6*A_B + K7), expanded
into its four products, plus the rank terms of Toppings' Eq. 2 (sum of ranks over the batch, and
BGMV's batch x max rank), a prefill-token term with its rank-weighted twin, the attention context (a prompt chunk's over the
KV cached before it too) and the adapter loads of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.messages import SchedulerOutput

FEATURES = (
    "intercept",  # K5*K7: a step's fixed cost
    "batch",  # K4*K7: per sequence in the batch (B)
    "adapters",  # K5*K6: per distinct adapter in the batch (A_B)
    "batch_x_adapters",  # K4*K6: B * A_B
    "rank_sum",  # Toppings MBGMV: sum of ranks over the batch's sequences
    "batch_x_max_rank",  # Toppings BGMV: B * max rank
    "prefill_tokens",  # tokens of prompt chunks
    "prefill_rank_tokens",  # sum over prompt chunks of tokens * rank (LoRA FLOPs of a prefill)
    "context_tokens",  # KV positions read by attention: sum of start positions
    "padded_context",  # decode rows x the longest decode context (a padded decode-attention kernel)
    "loads",  # adapters copied into device slots before the step
    "load_rank_sum",  # their ranks: load time follows adapter size
    "prefill_context",  # sum over prompt chunks of tokens * start position: their attention over cached KV
)


@dataclass
class StepFeatures:
    batch: int = 0
    adapters: int = 0
    rank_sum: int = 0
    max_rank: int = 0
    prefill_tokens: int = 0
    prefill_rank_tokens: int = 0
    context_tokens: int = 0
    decodes: int = 0
    max_decode_context: int = 0
    loads: int = 0
    load_rank_sum: int = 0
    prefill_context: int = 0

    def vector(self) -> list[float]:
        return [1.0, self.batch, self.adapters, self.batch * self.adapters, self.rank_sum,
                self.batch * self.max_rank, self.prefill_tokens, self.prefill_rank_tokens,
                self.context_tokens, self.decodes * self.max_decode_context, self.loads, self.load_rank_sum,
                self.prefill_context]


class SlotRanks:
    """The rank held in each adapter slot, tracked from the loads and evictions a step carries
    (exactly what a real executor knows)."""

    def __init__(self) -> None:
        self._rank: dict[int, int] = {}
        self.rank_of = self._rank.get  # slot -> rank (or a default)

    def apply(self, output: SchedulerOutput) -> None:
        for slot in output.adapter_evictions:
            self._rank.pop(slot, None)
        for load in output.adapter_loads:
            self._rank[load.slot] = load.rank

    def features(self, output: SchedulerOutput) -> StepFeatures:
        """Call after `apply`."""
        f = StepFeatures(batch=len(output.chunks), loads=len(output.adapter_loads),
                         load_rank_sum=sum(load.rank for load in output.adapter_loads))
        slots = set()
        rank_of = self.rank_of
        for chunk in output.chunks:
            rank = rank_of(chunk.adapter_slot, 0)
            n = len(chunk.token_ids)
            f.context_tokens += chunk.start_position
            if rank:
                slots.add(chunk.adapter_slot)
                f.rank_sum += rank
                if rank > f.max_rank:
                    f.max_rank = rank
            if n > 1 or chunk.num_output_tokens == 0:
                f.prefill_tokens += n
                f.prefill_rank_tokens += n * rank
                f.prefill_context += n * chunk.start_position
            else:
                f.decodes += 1
                if chunk.start_position > f.max_decode_context:
                    f.max_decode_context = chunk.start_position
        f.adapters = len(slots)
        return f
