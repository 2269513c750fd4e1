"""Resident adapters paged in the KV pool: handle -> pages, rank and row layout.

The engine decides which pages an adapter gets (`AdapterLoad.pages`); this registry writes the
host adapter's weights into those pages of every layer (`loraplex_kernels.lora_pages` has the
layout) and remembers where they are (`resident`), so each step's `LoraBatch` can find them.
Evicting only forgets the handle: freed pages are reused as they are, and KV writes overwrite them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from loraplex_kernels.lora import LoraGroup
from loraplex_kernels.lora_pages import (
    AdapterPages,
    KVCache,
    RowLayout,
    page_elems,
    pages_for,
    stage_adapter,
    weights_rank,
    write_adapter,
)

from loraplex_agent.adapters.host import HostAdapter
from loraplex_agent.runtime.model.config import LORA_MODULES, ModelConfig

# fused group -> the PEFT modules it holds, in output order
LORA_GROUP_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def lora_groups(config: ModelConfig) -> dict[str, LoraGroup]:
    """The model's fused groups with their output widths (built once per model)."""
    return {name: LoraGroup(modules, tuple(config.module_shape(m)[1] for m in modules))
            for name, modules in LORA_GROUP_MODULES.items()}


def adapter_rank(adapter: HostAdapter) -> int:
    """The largest rank over the adapter's modules (rank_pattern may give modules other ranks)."""
    return weights_rank(adapter.weights, default=adapter.rank)


def adapter_layout(adapter: HostAdapter) -> RowLayout:
    return RowLayout.of_weights(adapter.weights)


def full_row_len(config: ModelConfig) -> int:
    """Row length of an adapter that wraps all seven target modules."""
    return sum(sum(config.module_shape(m)) for m in LORA_MODULES)


Staged = Callable[[HostAdapter], torch.Tensor | None]
"""An adapter's rows as `stage_adapter` lays them out (pinned on CUDA), or None to lay them out now."""


def write_host_adapter(kv_caches: Sequence[KVCache], adapter: HostAdapter, pages: Sequence[int],
                       on_layer: Callable[[int, int], None] | None = None, staged: Staged | None = None) -> int:
    """Copy `adapter` into `pages` of every layer (the host -> device copy; callable from a copy
    thread); returns the bytes moved. `on_layer` as in `write_adapter`; `staged` is asked for the
    adapter's staged rows when the copy runs."""
    return write_adapter(kv_caches, pages, adapter.weights, adapter.scaling, adapter_layout(adapter),
                         adapter_rank(adapter), on_layer, staged(adapter) if staged is not None else None)


class PagedAdapters:
    """The resident adapters of one executor, by handle (`AdapterLoad.slot`)."""

    def __init__(self, config: ModelConfig, kv_caches: Sequence[KVCache]) -> None:
        self.config = config
        self.kv_caches = kv_caches
        self.resident: dict[int, AdapterPages] = {}

    @property
    def page_elements(self) -> int:
        """Elements of one page of one layer (its K block and V block)."""
        return page_elems(self.kv_caches[0][0])

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers."""
        k = self.kv_caches[0][0]
        return self.page_elements * k.element_size() * len(self.kv_caches)

    @property
    def num_pages(self) -> int:
        return self.kv_caches[0][0].shape[0]

    def pages_needed(self, adapter: HostAdapter) -> int:
        return pages_for(adapter_rank(adapter), adapter_layout(adapter).row_len, self.page_elements)

    def pages_for_rank(self, rank: int) -> int:
        """Pages of an adapter of `rank` that wraps every target module."""
        return pages_for(rank, full_row_len(self.config), self.page_elements)

    def stage(self, adapter: HostAdapter, pin_memory: bool = False) -> torch.Tensor:
        """`adapter`'s rows as its pages hold them, every layer, in host memory (`stage_adapter`)."""
        return stage_adapter(adapter.weights, adapter.scaling, adapter_layout(adapter), adapter_rank(adapter),
                             len(self.kv_caches), self.pages_needed(adapter) * self.page_elements,
                             self.kv_caches[0][0].dtype, pin_memory)

    def copy_job(self, adapter: HostAdapter, pages: Sequence[int],
                 on_layer: Callable[[int, int], None] | None = None,
                 staged: Staged | None = None) -> tuple[AdapterPages, Callable[[], int]]:
        """The record to serve `adapter` from `pages` once written, and the write itself (returns
        the bytes moved; may run on another thread; `on_layer` and `staged` as in
        `write_host_adapter`). Raises ValueError for too few pages."""
        needed = self.pages_needed(adapter)
        if len(pages) < needed:
            raise ValueError(f"adapter {adapter.id.name!r} (rank {adapter_rank(adapter)}) needs {needed} pages, "
                             f"the load gives {len(pages)}")
        if any(not 0 <= p < self.num_pages for p in pages):
            raise ValueError(f"adapter {adapter.id.name!r}: pages outside the pool of {self.num_pages}")
        pages = list(pages[:needed])
        record = AdapterPages.create(pages, adapter_rank(adapter), adapter_layout(adapter),
                                     self.kv_caches[0][0].device)
        return record, partial(write_host_adapter, self.kv_caches, adapter, pages, on_layer=on_layer, staged=staged)

    def load(self, handle: int, adapter: HostAdapter, pages: Sequence[int]) -> int:
        """Write `adapter` into `pages` now and serve it under `handle`; returns the bytes moved."""
        record, write = self.copy_job(adapter, pages)
        self.resident.pop(handle, None)
        moved = write()
        self.resident[handle] = record
        return moved

    def evict(self, handle: int) -> None:
        """Forget `handle`; its pages keep their bytes until KV or another adapter overwrites them."""
        self.resident.pop(handle, None)
