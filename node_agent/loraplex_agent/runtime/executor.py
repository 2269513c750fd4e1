"""TorchExecutor: runs a SchedulerOutput through the model on CPU or CUDA and samples.

Adapters live in the KV page pool (`loraplex_kernels.lora_pages`). Per step it (1) copies swapped-out
KV blocks to the host tier, forgets evicted adapters and starts adapter loads and KV swap-ins (in
the background through the `CopyEngine`, or now when synchronous), (2) orders the chunks as decode
rows first, then prefill chunks, each part grouped by adapter, so every adapter's tokens form one
contiguous LoRA segment (an activated LoRA's rows before its invocation belong to none), (3) turns chunks into positions, cache slots and block tables, (4) runs the
model, (5) samples the rows that end a chunk with `sample=True` and (6) reports finished copies.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from loraplex_kernels.attention import AttentionBatch, build_attention_batch
from loraplex_kernels.attention import uses_triton as attention_uses_triton
from loraplex_kernels.lora import LoraBatch, prepare_lora_backend
from loraplex_kernels.lora import uses_triton as lora_uses_triton
from loraplex_kernels.lora_pages import AdapterPages

from loraplex.engine.config import EngineConfig
from loraplex.engine.messages import (
    NO_ADAPTER_SLOT,
    ExecutorResult,
    PromptLogprobs,
    ScheduledChunk,
    SchedulerOutput,
)
from loraplex.spec.adapter import AdapterId
from loraplex_agent.adapters.host import HostAdapter
from loraplex_agent.runtime.copy_engine import CopyEngine, CopyJobError
from loraplex_agent.runtime.cpu_assist import (
    AssistedAdapter,
    CpuAssist,
    LayerProgress,
    StepAssist,
    default_assist_workers,
)
from loraplex_agent.runtime.decode_graphs import DecodeGraphs
from loraplex_agent.runtime.host_kv import HostKVPool
from loraplex_agent.runtime.model.config import ModelConfig
from loraplex_agent.runtime.model.llama import ForwardBatch, LlamaModel
from loraplex_agent.runtime.model.lora_pages import PagedAdapters, Staged, lora_groups
from loraplex_agent.runtime.model.weights import load_state_dict
from loraplex_agent.runtime.pinned_adapters import DEFAULT_PINNED_ADAPTER_GIB, PinnedAdapters, pins_adapters
from loraplex_agent.runtime.prompt_logits import PromptRows, prompt_logprobs
from loraplex_agent.runtime.sampler import Sampler

GetAdapter = Callable[[AdapterId], HostAdapter]


class TorchExecutor:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, get_adapter: GetAdapter, model_dir: str | Path | None = None,
                 seed: int | None = None, emulate_h2d_gbps: float | None = None,
                 cpu_assist_workers: int | None = None, cuda_graphs: bool | None = None,
                 pinned_adapter_gib: float = DEFAULT_PINNED_ADAPTER_GIB) -> None:
        self.model_config = model_config
        self.config = engine_config
        self.device = device
        self.dtype = dtype
        self.get_adapter = get_adapter
        prepare_lora_backend(device, dtype)
        state = load_state_dict(model_dir or model_config.name, device, dtype)
        self.model = LlamaModel(model_config, state, lora_groups(model_config), engine_config.max_model_len,
                                device, dtype)
        self.kv_caches = [self._cache_tensors() for _ in range(model_config.num_hidden_layers)]
        self.adapters = PagedAdapters(model_config, self.kv_caches)
        # adapters' rows staged in pinned memory, so that loads are asynchronous DMA (CUDA only)
        self.pinned = PinnedAdapters(self.adapters, int(pinned_adapter_gib * 2**30)) if pins_adapters(device) else None
        self.host_kv = HostKVPool.like(self.kv_caches, engine_config.num_host_blocks) if engine_config.num_host_blocks else None
        self.copies = CopyEngine(device, emulate_h2d_gbps=emulate_h2d_gbps)
        self._loading: dict[int, tuple[int, AdapterPages]] = {}  # job -> (handle, adapter) of a background load
        # CPU-assisted LoRA for requests whose adapter is still being copied in (EngineConfig.cpu_assist)
        self.assist = CpuAssist(cpu_assist_workers or default_assist_workers()) if engine_config.cpu_assist else None
        self._assisted: dict[int, AssistedAdapter] = {}  # handle -> an adapter loading layer by layer
        self._load_seconds: deque[float] = deque(maxlen=10_000)  # drained by /metrics from another thread
        self.graphs = self._decode_graphs(cuda_graphs)
        self.sampler = Sampler(device, seed)
        self.capture_logits = False  # tests: keep every sampled row's raw logits per request
        self.captured_logits: dict[str, list[torch.Tensor]] = defaultdict(list)

    def _cache_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.config.num_blocks, self.config.block_size, self.model_config.num_key_value_heads,
                 self.model_config.head_dim)
        # zeros, not empty: padded key positions are masked, but NaN garbage would still poison 0 * v
        return (torch.zeros(shape, device=self.device, dtype=self.dtype),
                torch.zeros(shape, device=self.device, dtype=self.dtype))

    def _decode_graphs(self, asked: bool | None) -> DecodeGraphs | None:
        """Decode CUDA graphs: on by default on CUDA when the Triton kernels serve the step (the
        torch references synchronise with the host and cannot be captured)."""
        cuda = self.device.type == "cuda"
        wanted = asked if asked is not None else (
            cuda and attention_uses_triton(self.device, self.dtype) and lora_uses_triton(self.device, self.dtype))
        if not wanted:
            return None
        if not cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        graphs = DecodeGraphs(self.model, self.kv_caches, self.config, self.device, capture=True)
        graphs.capture_all()
        return graphs

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the pool (one KV block of every layer)."""
        return self.adapters.page_bytes

    def adapter_pages(self, adapter: HostAdapter) -> int:
        """Pages of the pool `adapter`'s weights take."""
        return self.adapters.pages_needed(adapter)

    def pages_for_rank(self, rank: int) -> int:
        """Pages of an adapter of `rank` that wraps every target module (a fixed slot's size)."""
        return self.adapters.pages_for_rank(rank)

    def stage_adapter(self, adapter: HostAdapter) -> None:
        """A newly registered adapter: stage it in pinned memory while that fits (CUDA)."""
        if self.pinned is not None:
            self.pinned.add(adapter)

    def forget_adapter(self, adapter_id: AdapterId) -> None:
        """An unregistered adapter: drop its staged rows."""
        if self.pinned is not None:
            self.pinned.discard(adapter_id)

    def close(self) -> None:
        self.copies.close()
        if self.assist is not None:
            self.assist.close()

    def drain_load_seconds(self) -> list[float]:
        """Seconds each adapter load took since the last call, from the step that started it to its
        weights on the device (queueing behind other copies included); safe from any thread."""
        drained = []
        while self._load_seconds:
            drained.append(self._load_seconds.popleft())
        return drained

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        start = time.perf_counter()
        result = ExecutorResult()
        self._copy(output, result)
        if output.chunks:
            chunks = sorted(output.chunks, key=self._row_order)
            logits, result.prompt_logprobs = self._logits(chunks)
            result.sampled = self._sample(logits, [c for c in chunks if c.sample])
        elif self._loading or output.kv_swap_in:
            self.copies.wait_all(timeout=0.005)  # nothing to compute: wait a little for a copy
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._finish_copies(result)
        result.elapsed_s = time.perf_counter() - start
        return result

    def _copy(self, output: SchedulerOutput, result: ExecutorResult) -> None:
        """Swap-outs first (the engine reuses those pages in this step), then evictions, then loads."""
        if output.kv_swap_out:
            result.copy_bytes += self.copies.run_sync(partial(self.host_kv.swap_out, self.kv_caches,
                                                              output.kv_swap_out))
        for handle in output.adapter_evictions:
            self.adapters.resident.pop(handle, None)
            self._assisted.pop(handle, None)
        for load in output.adapter_loads:
            host = self.get_adapter(load.adapter)
            if load.asynchronous and self.assist is not None:
                record, write = self._layered_copy(load.slot, host, load.pages)
            else:
                record, write = self.adapters.copy_job(host, load.pages, staged=self._staged())
            if load.asynchronous:
                self._loading[load.job] = (load.slot, record)
                self.copies.submit(load.job, write)
            else:
                began = time.perf_counter()
                result.copy_bytes += self.copies.run_sync(write)
                self._load_seconds.append(time.perf_counter() - began)
                self.adapters.resident[load.slot] = record
        for swap in output.kv_swap_in:
            self.copies.submit(swap.job, partial(self.host_kv.swap_in, self.kv_caches, swap.copies))

    def _finish_copies(self, result: ExecutorResult) -> None:
        for done in self.copies.poll_results():
            if not done.ok:
                raise CopyJobError(done.job_id) from done.error
            loaded = self._loading.pop(done.job_id, None)
            if loaded is not None:
                self.adapters.resident[loaded[0]] = loaded[1]
                self._assisted.pop(loaded[0], None)
                self._load_seconds.append(done.queued_s + done.seconds)
            result.copies_done.append(done.job_id)
            result.copy_bytes += done.nbytes

    def _layered_copy(self, handle: int, host: HostAdapter, pages: list[int]) -> tuple[AdapterPages, Callable[[], int]]:
        """An adapter copy that says when each layer is on the device, so requests can run while it
        loads: their LoRA terms come from the CPU for the layers not there yet."""
        progress = LayerProgress(self.model_config.num_hidden_layers)
        began = [0.0]

        def arrived(layer: int, nbytes: int) -> None:
            self.copies.settle(nbytes, began[0])
            progress.mark(layer)

        record, write = self.adapters.copy_job(host, pages, on_layer=arrived, staged=self._staged())
        self._assisted[handle] = AssistedAdapter.of(host, record, progress)

        def job() -> int:
            began[0] = time.perf_counter()
            try:
                return write()
            except BaseException:
                progress.fail()  # wakes an assisted layer waiting for the copy
                raise

        return record, job

    def _staged(self) -> Staged | None:
        return self.pinned.rows if self.pinned is not None else None

    def _row_order(self, chunk: ScheduledChunk) -> tuple[bool, int, int]:
        """Decode rows first, then prefill chunks; each part grouped by adapter handle (a decode row
        of an activated LoRA whose prompt lacks the invocation runs with the base rows)."""
        return chunk.num_tokens > 1, chunk.adapter_slot_at(chunk.start_position), 0

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> dict:
        if self.capture_logits:
            for row, chunk in enumerate(chunks):
                self.captured_logits[chunk.request_id].append(logits[row].cpu().clone())
        tokens = self.sampler(logits, [c.sampling for c in chunks], [c.num_output_tokens for c in chunks])
        return {c.request_id: t for c, t in zip(chunks, tokens, strict=True)}

    def _logits(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, dict[str, PromptLogprobs]]:
        """Runs the model over chunks ordered decode rows first: a pure decode step from its CUDA
        graph when one fits, else eagerly. Also the prompt logprobs of the chunks that want them."""
        rows = StepRows.of(chunks, self.config.block_size)
        lora, assist = self._lora_batch(rows.row_slots)
        if (self.graphs is not None and not rows.prefills and not rows.prompt_rows and assist is None
                and len(rows.sample_rows) == len(chunks)):
            logits = self.graphs.run(rows.ids, rows.positions, rows.slots, [c.block_ids for c in chunks], lora)
            if logits is not None:
                return logits, {}
        ids, positions, sample_rows = self._tensors(rows.ids, rows.positions, rows.sample_rows)
        batch = ForwardBatch(input_ids=ids, positions=positions,
                             attention=self._attention_batch(rows.slots, rows.decodes, rows.prefills), lora=lora,
                             sample_rows=sample_rows, assist=assist)
        if not rows.prompt_rows:
            return self.model.forward(batch, self.kv_caches), {}
        hidden = self.model.hidden_states(batch, self.kv_caches)
        return self.model.logits(hidden, sample_rows), prompt_logprobs(self.model, hidden, rows.prompt_rows)

    def _lora_batch(self, row_slots: list[int]) -> tuple[LoraBatch, StepAssist | None]:
        """The step's LoRA segments; adapters still loading layer by layer get CPU assistance."""
        if not self._assisted:
            return LoraBatch.from_row_adapters(row_slots, self.adapters.resident, no_adapter=NO_ADAPTER_SLOT), None
        adapters = {**self.adapters.resident, **{h: a.record for h, a in self._assisted.items()}}
        lora = LoraBatch.from_row_adapters(row_slots, adapters, no_adapter=NO_ADAPTER_SLOT)
        assist = StepAssist(lora, self._assisted, self.assist)
        return lora, (assist if assist.assisted else None)

    def _attention_batch(self, slots: list[int], decodes: list[ScheduledChunk],
                         prefills: list[tuple[int, ScheduledChunk]]) -> AttentionBatch:
        """Chunk rows follow the decode rows in order, as `build_attention_batch` lays them out."""
        return build_attention_batch(
            slots, [c.block_ids for c in decodes], [c.start_position + 1 for c in decodes],
            [(c.num_tokens, c.start_position, c.block_ids) for _, c in prefills], self.config.block_size,
            self.device)

    def _tensors(self, *values: list[int]) -> list[torch.Tensor]:
        """Int lists as int64 device tensors, in one host-to-device copy."""
        flat = torch.tensor([v for part in values for v in part], dtype=torch.long)
        return list(flat.to(self.device, non_blocking=True).split([len(part) for part in values]))


@dataclass
class StepRows:
    """A step's rows as host lists: decode rows first, then prefill chunks."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    row_slots: list[int] = field(default_factory=list)  # adapter handle per row
    sample_rows: list[int] = field(default_factory=list)
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[tuple[int, ScheduledChunk]] = field(default_factory=list)  # (first row, chunk)
    prompt_rows: list[PromptRows] = field(default_factory=list)  # rows whose prompt logprobs are wanted

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], block_size: int) -> StepRows:
        rows = cls()
        for chunk in chunks:
            row = len(rows.ids)
            span = range(chunk.start_position, chunk.start_position + chunk.num_tokens)
            rows.ids.extend(chunk.token_ids)
            rows.positions.extend(span)
            rows.slots.extend(chunk.block_ids[p // block_size] * block_size + p % block_size for p in span)
            if chunk.adapter_from <= chunk.start_position:
                rows.row_slots.extend([chunk.adapter_slot] * chunk.num_tokens)
            else:  # an activated LoRA: the rows before its invocation run on the base model
                rows.row_slots.extend(chunk.adapter_slot_at(p) for p in span)
            if chunk.sample:
                rows.sample_rows.append(len(rows.ids) - 1)
            if chunk.sampling.prompt_logprobs is not None and (wanted := PromptRows.of(chunk, row)):
                rows.prompt_rows.append(wanted)
            if chunk.num_tokens > 1:
                rows.prefills.append((row, chunk))
            else:
                rows.decodes.append(chunk)
        return rows
