"""Decode steps from CUDA graphs: one graph per batch-size bucket, replayed over static inputs.

A decode step of a large model is dozens of small kernels per layer; launching them one by one
from Python costs more than running them at small batch sizes. A pure decode step with at most
the largest bucket's rows is padded to its bucket and replayed from a graph captured at start-up:
the step's integers (token ids, positions, cache slots, context lengths, block tables, the LoRA
segment table and page list) are packed into one pinned host buffer, copied to the bucket's
static device buffer in one transfer, and the graph replays every kernel of the forward pass.

Padding rows have cache slot -1 (nothing written), context length 0 (attention output zero) and
an empty LoRA segment; the block tables have the fixed width of `max_model_len`; the LoRA kernels
are sized by `max_lora_rank`. Steps with prefill rows, more rows than the largest bucket, or
adapters still loading run eagerly.

`capture=False` runs the very same padded static forward eagerly (what the CPU tests check
against the dynamic path); capturing needs CUDA and the Triton kernels.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from loraplex_kernels.attention import AttentionBatch, decode_key_mask
from loraplex_kernels.lora import MODULE_COLUMNS, SEGMENT_COLUMNS, LoraBatch, LoraGroup
from loraplex_kernels.lora_pages import LORA_MODULES

from loraplex.engine.config import EngineConfig
from loraplex_agent.runtime.model.llama import ForwardBatch, LlamaModel

log = logging.getLogger(__name__)

SEGMENT_WIDTH = len(SEGMENT_COLUMNS) + len(LORA_MODULES) * len(MODULE_COLUMNS)
BUCKET_STEPS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Bucket sizes up to the largest batch the engine runs (which is always a bucket)."""
    return tuple(sorted({b for b in BUCKET_STEPS if b < max_num_seqs} | {max_num_seqs}))


@dataclass(frozen=True, eq=False)
class StaticLoraBatch(LoraBatch):
    """A LoRA batch whose kernel tables are a graph's static buffers: fixed shapes, padded
    segments, rank bound and one row per segment (decode)."""

    tables: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))
    rank_bound: int = 0

    @property
    def is_empty(self) -> bool:
        return False  # a captured graph must hold the LoRA kernels whatever the step at capture

    def device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables

    @property
    def max_rank(self) -> int:  # type: ignore[override]
        return self.rank_bound

    @property
    def max_segment_rows(self) -> int:  # type: ignore[override]
        return 1

    def check_fits(self, group: LoraGroup, in_features: int) -> None:
        """Checked on the step's own batch before its tables are copied in."""


class _Bucket:
    """One bucket's static buffers (host and device), views into them, and its graph."""

    def __init__(self, rows: int, width: int, num_pages: int, device: torch.device) -> None:
        self.rows = rows
        self.sizes = (rows, rows, rows, rows, rows * width, rows * SEGMENT_WIDTH, num_pages)
        total = sum(self.sizes)
        self.device_buffer = torch.zeros(total, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self.host_buffer = torch.zeros(total, dtype=torch.int64, pin_memory=pin)
        ids, positions, slots, context_lens, tables, segments, pages = self.device_buffer.split(self.sizes)
        self.input_ids, self.positions, self.slots, self.context_lens = ids, positions, slots, context_lens
        self.block_tables = tables.view(rows, width)
        self.segments = segments.view(rows, SEGMENT_WIDTH)
        self.pages = pages
        slots.fill_(-1)  # a run before the first step (warm-up) must write no cache page
        self.sample_rows = torch.arange(rows, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def load(self, values: array) -> None:
        """Copy the packed step (host) into the static device buffer in one transfer."""
        host = torch.frombuffer(values, dtype=torch.int64)
        self.host_buffer[:len(host)].copy_(host)
        self.device_buffer[:len(host)].copy_(self.host_buffer[:len(host)], non_blocking=True)


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 config: EngineConfig, device: torch.device, capture: bool) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv_caches = list(kv_caches)
        self.block_size = config.block_size
        self.width = -(-config.max_model_len // config.block_size)
        self.rank_bound = config.max_lora_rank
        self.num_pages = config.num_blocks
        self.device = device
        self.capture = capture
        self.buckets = {rows: _Bucket(rows, self.width, self.num_pages, device)
                        for rows in batch_buckets(config.max_num_seqs)}
        self.replays = 0  # decode steps served from graphs (or the static path)

    @cached_property
    def largest(self) -> int:
        return max(self.buckets)

    def bucket_for(self, rows: int) -> _Bucket | None:
        return next((self.buckets[b] for b in sorted(self.buckets) if b >= rows), None)

    def capture_all(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (start-up, before serving)."""
        pool = torch.cuda.graph_pool_handle()
        for rows in sorted(self.buckets, reverse=True):
            bucket = self.buckets[rows]
            self._forward(bucket)  # compiles the Triton kernels and warms the allocator
            torch.cuda.synchronize(self.device)
            bucket.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.graph, pool=pool):
                bucket.logits = self._forward(bucket)
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", sorted(self.buckets))

    def run(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            block_ids: Sequence[Sequence[int]], lora: LoraBatch) -> torch.Tensor | None:
        """Logits [rows, vocab] of a pure decode step, or None when it must run eagerly."""
        rows = len(ids)
        bucket = self.bucket_for(rows)
        if bucket is None or any(len(b) > self.width for b in block_ids) or lora.max_rank > self.rank_bound:
            return None
        segments, pages = lora.kernel_tables
        if len(pages) > self.num_pages:
            return None
        for group, width in self._groups_and_widths():
            lora.check_fits(group, width)
        bucket.load(self._pack(bucket, ids, positions, slots, block_ids, segments, pages))
        self.replays += 1
        if bucket.graph is not None:
            bucket.graph.replay()
            return bucket.logits[:rows]
        return self._forward(bucket, lora)[:rows]

    def _groups_and_widths(self) -> list[tuple[LoraGroup, int]]:
        layer = self.model.layers[0]
        hidden = self.model.config.hidden_size
        return [(layer.lora["qkv"], hidden), (layer.lora["o"], layer.num_heads * layer.head_dim),
                (layer.lora["gate_up"], hidden), (layer.lora["down"], self.model.config.intermediate_size)]

    def _pack(self, bucket: _Bucket, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
              block_ids: Sequence[Sequence[int]], segments: torch.Tensor, pages: torch.Tensor) -> array:
        """The step's integers in the bucket's buffer order (padding rows as described above);
        the page list is copied only as far as it is used."""
        pad = bucket.rows - len(ids)
        values = array("q", ids)
        values.extend([0] * pad)
        values.extend(positions)
        values.extend([0] * pad)
        values.extend(slots)
        values.extend([-1] * pad)
        values.extend(p + 1 for p in positions)  # a decode row's context: every position up to its own
        values.extend([0] * pad)
        for table in block_ids:
            values.extend(table)
            values.extend([0] * (self.width - len(table)))
        values.extend([0] * (pad * self.width))
        values.frombytes(segments.numpy().tobytes())
        values.extend([0] * ((bucket.rows - segments.shape[0]) * SEGMENT_WIDTH))
        values.frombytes(pages.numpy().tobytes())
        return values

    def _forward(self, bucket: _Bucket, lora: LoraBatch | None = None) -> torch.Tensor:
        segments = lora.segments if lora is not None else ()
        adapters = lora.adapters if lora is not None else {}
        static = StaticLoraBatch(segments, adapters, bucket.rows, tables=(bucket.segments, bucket.pages),
                                 rank_bound=self.rank_bound)
        attention = AttentionBatch(bucket.slots, bucket.rows, bucket.block_tables,
                                   decode_key_mask(bucket.context_lens, self.width * self.block_size), [],
                                   decode_context_lens=bucket.context_lens)
        batch = ForwardBatch(bucket.input_ids, bucket.positions, attention, static, bucket.sample_rows)
        return self.model.forward(batch, self.kv_caches)
