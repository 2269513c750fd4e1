"""A torch-free executor for scheduler tests: it keeps a per-request 'KV cache' of tokens by
position and block, checks that every chunk continues where the cache ends and fits its block
table, and 'samples' a token that depends on the whole sequence, so any scheduling mistake
(lost tokens, wrong positions, stale blocks) changes the output."""

from __future__ import annotations

from loraplex.engine.messages import NO_ADAPTER_SLOT, ExecutorResult, SchedulerOutput
from loraplex.engine.request import SampledToken


class ToyExecutor:
    def __init__(self, block_size: int, vocab: int = 1000, eos: int | None = None) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.eos = eos
        self.cache: dict[str, list[int]] = {}
        self.block_owner: dict[int, str] = {}
        self.slots: dict[int, str] = {}
        self.steps: list[SchedulerOutput] = []

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        self.steps.append(output)
        for slot in output.adapter_evictions:
            self.slots.pop(slot, None)
        for load in output.adapter_loads:
            self.slots[load.slot] = load.adapter.name
        # blocks of finished and preempted requests may be reused by this very step
        for request_id in output.finished_request_ids + output.preempted_request_ids:
            for block in [b for b, owner in self.block_owner.items() if owner == request_id]:
                del self.block_owner[block]
        for request_id in output.finished_request_ids:
            self.cache.pop(request_id, None)
        sampled = {}
        for chunk in output.chunks:
            seq = self.cache.setdefault(chunk.request_id, [])
            del seq[chunk.start_position:]  # recompute after preemption rewrites the tail
            assert len(seq) == chunk.start_position, "chunk does not continue the cached sequence"
            seq.extend(chunk.token_ids)
            assert len(chunk.block_ids) * self.block_size >= len(seq), "block table too small"
            for block in chunk.block_ids:
                owner = self.block_owner.setdefault(block, chunk.request_id)
                assert owner == chunk.request_id, f"block {block} shared by {owner} and {chunk.request_id}"
            if chunk.adapter_slot != NO_ADAPTER_SLOT:
                assert chunk.adapter_slot in self.slots, "adapter slot used before it was loaded"
            if chunk.sample:
                salt = 0 if chunk.adapter_slot == NO_ADAPTER_SLOT else hash(self.slots[chunk.adapter_slot])
                sampled[chunk.request_id] = SampledToken((sum(seq) * 31 + len(seq) + salt) % self.vocab)
        return ExecutorResult(sampled=sampled)
