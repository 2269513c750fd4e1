"""TorchExecutor: runs a SchedulerOutput through the model on CPU or CUDA and samples.

Per step it (1) applies adapter evictions and loads to the device slots, (2) orders the chunks as
decode rows first, then prefill chunks, each part grouped by adapter slot, so every adapter's
tokens form one contiguous LoRA segment, (3) turns chunks into positions, cache slots and block
tables, (4) runs the model and (5) samples the rows that end a chunk with `sample=True`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from loraplex_kernels.attention import AttentionBatch, PrefillChunk, decode_key_mask
from loraplex_kernels.lora import LoraBatch, prepare_lora_backend

from loraplex.engine.config import EngineConfig
from loraplex.engine.messages import NO_ADAPTER_SLOT, ExecutorResult, ScheduledChunk, SchedulerOutput
from loraplex.spec.adapter import AdapterId
from loraplex_agent.host_adapter import HostAdapter
from loraplex_agent.model.llama import ForwardBatch, LlamaModel
from loraplex_agent.model.lora_slots import LoraSlots
from loraplex_agent.model.weights import load_state_dict
from loraplex_agent.model_config import ModelConfig
from loraplex_agent.sampler import Sampler

GetAdapter = Callable[[AdapterId], HostAdapter]


class TorchExecutor:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, get_adapter: GetAdapter, model_dir: str | Path | None = None,
                 seed: int | None = None) -> None:
        self.model_config = model_config
        self.config = engine_config
        self.device = device
        self.dtype = dtype
        self.get_adapter = get_adapter
        self.lora = LoraSlots(model_config, engine_config.max_loras, device, dtype, engine_config.max_lora_rank)
        prepare_lora_backend(device, dtype)
        state = load_state_dict(model_dir or model_config.name, device, dtype)
        self.model = LlamaModel(model_config, state, self.lora.layers, engine_config.max_model_len, device, dtype)
        self.kv_caches = [self._cache_tensors() for _ in range(model_config.num_hidden_layers)]
        self.sampler = Sampler(device, seed)
        self.capture_logits = False  # tests: keep every sampled row's raw logits per request
        self.captured_logits: dict[str, list[torch.Tensor]] = defaultdict(list)

    def _cache_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.config.num_blocks, self.config.block_size, self.model_config.num_key_value_heads,
                 self.model_config.head_dim)
        # zeros, not empty: padded key positions are masked, but NaN garbage would still poison 0 * v
        return (torch.zeros(shape, device=self.device, dtype=self.dtype),
                torch.zeros(shape, device=self.device, dtype=self.dtype))

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        start = time.perf_counter()
        for slot in output.adapter_evictions:
            self.lora.evict(slot)
        for load in output.adapter_loads:
            self.lora.load(load.slot, self.get_adapter(load.adapter))
        result = ExecutorResult()
        if output.chunks:
            chunks = sorted(output.chunks, key=self._row_order)
            logits = self.model.forward(self._forward_batch(chunks), self.kv_caches)
            result.sampled = self._sample(logits, [c for c in chunks if c.sample])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.elapsed_s = time.perf_counter() - start
        return result

    def _row_order(self, chunk: ScheduledChunk) -> tuple[bool, int, int]:
        """Decode rows first; each part grouped by adapter, adapters in (rank class, index) order so
        that a decode step's adapters of one class form one batched LoRA run."""
        if chunk.adapter_slot == NO_ADAPTER_SLOT:
            return chunk.num_tokens > 1, -1, -1
        return (chunk.num_tokens > 1, *self.lora.location(chunk.adapter_slot))

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> dict:
        if self.capture_logits:
            for row, chunk in enumerate(chunks):
                self.captured_logits[chunk.request_id].append(logits[row].cpu().clone())
        tokens = self.sampler(logits, [c.sampling for c in chunks], [c.num_output_tokens for c in chunks])
        return {c.request_id: t for c, t in zip(chunks, tokens, strict=True)}

    def _forward_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        """Chunks are ordered decode rows first; builds the step's index tensors on the device."""
        bs = self.config.block_size
        ids, positions, slots, row_slots, sample_rows = [], [], [], [], []
        prefills: list[tuple[int, ScheduledChunk]] = []
        for chunk in chunks:
            row = len(ids)
            span = range(chunk.start_position, chunk.start_position + chunk.num_tokens)
            ids.extend(chunk.token_ids)
            positions.extend(span)
            slots.extend(chunk.block_ids[p // bs] * bs + p % bs for p in span)
            row_slots.extend([chunk.adapter_slot] * chunk.num_tokens)
            if chunk.sample:
                sample_rows.append(len(ids) - 1)
            if chunk.num_tokens > 1:
                prefills.append((row, chunk))
        decodes = [c for c in chunks if c.num_tokens == 1]
        return ForwardBatch(
            input_ids=self._tensor(ids), positions=self._tensor(positions),
            attention=self._attention_batch(slots, decodes, prefills),
            lora=LoraBatch.from_row_slots(row_slots, self.lora.location, no_adapter=NO_ADAPTER_SLOT),
            sample_rows=self._tensor(sample_rows))

    def _attention_batch(self, slots: list[int], decodes: list[ScheduledChunk],
                         prefills: list[tuple[int, ScheduledChunk]]) -> AttentionBatch:
        tables = masks = None
        if decodes:
            width = max(len(c.block_ids) for c in decodes)
            tables = self._tensor([c.block_ids + [0] * (width - len(c.block_ids)) for c in decodes])
            context_lens = self._tensor([c.start_position + 1 for c in decodes])
            masks = decode_key_mask(context_lens, width * self.config.block_size)
        chunks = [PrefillChunk(row, row + c.num_tokens, c.start_position, self._tensor(c.block_ids))
                  for row, c in prefills]
        return AttentionBatch(self._tensor(slots), len(decodes), tables, masks, chunks)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
