"""Adapter weights inside the KV page pool, paged along the rank dimension (S-LoRA / FastLibra).

KV blocks and adapters share one physical pool: the per-layer KV cache tensors `K`, `V`, each
`[num_pages, block_size, num_kv_heads, head_dim]`. Page `p` of one layer is `2H` elements, its K
block `K[p]` (H elements, flat) followed by its V block `V[p]`.

An adapter stores, per layer, `rank` rows of `row_len` elements each. Row k is, for every module
the adapter wraps, in the canonical order of `LORA_MODULES`: `A_m[k, :]` (PEFT's lora_A row,
in_m elements) then `B_m[:, k] * scaling` (a row of B^T, pre-scaled, out_m elements). A module of
smaller rank (rank_pattern) has zero rows beyond its rank. The rows are consecutive: flat element
`e` of the adapter's `rank * row_len` lives in page `pages[e // 2H]` at offset `e % 2H` (the K half
below H, else the V half). Every layer uses the same page ids. A row may straddle pages and K/V
halves; only the tail of the last page is padding.

Pure torch: the engine side (host adapters, handles) lives in `loraplex_agent.runtime.model.lora_pages`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

LoraWeights = Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A [r, in], B [out, r])
KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (K, V)


@dataclass(frozen=True)
class ModuleSpan:
    """Where one wrapped module sits inside a row: A's row at `a_offset`, B^T's row at `b_offset`."""

    module: str
    in_features: int
    out_features: int
    rank: int  # rows of this module that may be non-zero (<= the adapter's rank)
    a_offset: int

    @property
    def b_offset(self) -> int:
        return self.a_offset + self.in_features

    @property
    def end(self) -> int:
        return self.b_offset + self.out_features


@dataclass(frozen=True)
class RowLayout:
    """An adapter's row layout: the spans of the modules it wraps, in canonical order."""

    spans: tuple[ModuleSpan, ...]

    @property
    def row_len(self) -> int:
        return self.spans[-1].end if self.spans else 0

    @cached_property
    def by_module(self) -> dict[str, ModuleSpan]:
        return {span.module: span for span in self.spans}

    def span(self, module: str) -> ModuleSpan | None:
        return self.by_module.get(module)

    @cached_property
    def kernel_columns(self) -> tuple[int, ...]:
        """Per module of LORA_MODULES: (a_offset, b_offset, rank, in_features, out_features), zeros
        where not wrapped (the layout part of a row of the C++ kernel's segment table)."""
        columns: list[int] = []
        for module in LORA_MODULES:
            span = self.span(module)
            columns += ((0, 0, 0, 0, 0) if span is None else
                        (span.a_offset, span.b_offset, span.rank, span.in_features, span.out_features))
        return tuple(columns)

    @classmethod
    def build(cls, modules: Mapping[str, tuple[int, int, int]]) -> RowLayout:
        """From module -> (in_features, out_features, rank); canonical order whatever the mapping's."""
        unknown = set(modules) - set(LORA_MODULES)
        if unknown:
            raise ValueError(f"unknown LoRA modules {sorted(unknown)}; expected some of {LORA_MODULES}")
        spans, offset = [], 0
        for name in (m for m in LORA_MODULES if m in modules):
            in_features, out_features, rank = modules[name]
            spans.append(ModuleSpan(name, in_features, out_features, rank, offset))
            offset = spans[-1].end
        return cls(tuple(spans))

    @classmethod
    def of_weights(cls, weights: LoraWeights) -> RowLayout:
        """The layout of an adapter's PEFT pairs: a module's rank is its largest over the layers."""
        modules: dict[str, tuple[int, int, int]] = {}
        for (_, name), (a, b) in weights.items():
            rank = max(a.shape[0], modules[name][2]) if name in modules else a.shape[0]
            modules[name] = (a.shape[1], b.shape[0], rank)
        return cls.build(modules)


def weights_rank(weights: LoraWeights, default: int = 0) -> int:
    """The adapter's rank: the largest over its modules (rank_pattern may give modules others)."""
    return max((a.shape[0] for a, _ in weights.values()), default=default)


def page_elems(k_cache: torch.Tensor) -> int:
    """Elements of one page of one layer: its K block and its V block (2H)."""
    return 2 * k_cache[0].numel()


def pages_for(rank: int, row_len: int, page_elements: int) -> int:
    """Pages an adapter of `rank` rows of `row_len` elements takes: ceil(rank * row_len / 2H)."""
    return -(-rank * row_len // page_elements)


@dataclass(frozen=True)
class AdapterPages:
    """A resident adapter: its pages (in order), rank and row layout; `index` is `pages` as an
    int64 tensor on the pool's device, built once at load for the torch reference."""

    pages: tuple[int, ...]
    rank: int
    layout: RowLayout
    index: torch.Tensor

    @classmethod
    def create(cls, pages: Sequence[int], rank: int, layout: RowLayout, device: torch.device) -> AdapterPages:
        return cls(tuple(pages), rank, layout, torch.tensor(list(pages), dtype=torch.int64, device=device))

    @property
    def num_elements(self) -> int:
        return self.rank * self.layout.row_len


def adapter_rows(weights: LoraWeights, layer: int, layout: RowLayout, rank: int, scaling: float) -> torch.Tensor:
    """One layer's rows [rank, row_len] in float32 on the host; zeros where a module is absent in
    this layer or beyond its rank."""
    rows = torch.zeros(rank, layout.row_len, dtype=torch.float32)
    for span in layout.spans:
        pair = weights.get((layer, span.module))
        if pair is None:
            continue
        a, b = pair
        r = a.shape[0]
        rows[:r, span.a_offset:span.b_offset] = a
        rows[:r, span.b_offset:span.end] = b.t().float() * scaling  # scaled in float32, as PEFT does
    return rows


def host_pages(weights: LoraWeights, layer: int, layout: RowLayout, rank: int, scaling: float,
               num_elements: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """One layer of an adapter as its pages hold it, on the host: its rows, then zeros up to
    `num_elements` (whole pages), in `dtype`. Written into `out` when given (a staged buffer)."""
    flat = torch.zeros(num_elements, dtype=dtype) if out is None else out
    used = rank * layout.row_len
    flat[:used] = adapter_rows(weights, layer, layout, rank, scaling).view(-1)
    if out is not None:
        flat[used:] = 0
    return flat


def stage_adapter(weights: LoraWeights, scaling: float, layout: RowLayout, rank: int, num_layers: int,
                  num_elements: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """Every layer's `host_pages` in one host tensor [num_layers, num_elements], page-locked with
    `pin_memory` (CUDA only), so `write_adapter(staged=...)` is one asynchronous copy per layer."""
    staged = torch.empty(num_layers, num_elements, dtype=dtype, pin_memory=pin_memory)
    for layer in range(num_layers):
        host_pages(weights, layer, layout, rank, scaling, num_elements, dtype, out=staged[layer])
    return staged


def write_adapter(kv_caches: Sequence[KVCache], pages: Sequence[int], weights: LoraWeights, scaling: float,
                  layout: RowLayout, rank: int, on_layer: Callable[[int, int], None] | None = None,
                  staged: torch.Tensor | None = None) -> int:
    """Write one adapter into `pages` of every layer: the host->device copy; returns the bytes
    moved. Safe to call from another thread (it touches only the adapter's own pages). Per layer
    the rows are laid out on the host (`host_pages`, or taken from `staged`, `stage_adapter`'s
    tensor), copied in one transfer, then scattered into the K and V halves of the pages by two
    index copies; `on_layer(layer, bytes so far)` runs after each layer's copy is queued
    (layer-by-layer loading waits there). From a staged tensor the copy is non-blocking: on CUDA,
    with the tensor pinned, it returns once queued on the current stream."""
    if not kv_caches:
        return 0
    k0 = kv_caches[0][0]
    elements = page_elems(k0)
    needed = pages_for(rank, layout.row_len, elements)
    if len(pages) < needed:
        raise ValueError(f"an adapter of rank {rank} and row length {layout.row_len} needs {needed} pages, "
                         f"got {len(pages)}")
    if staged is not None and (tuple(staged.shape), staged.dtype) != ((len(kv_caches), needed * elements), k0.dtype):
        raise ValueError(f"the staged adapter is {tuple(staged.shape)} {staged.dtype}, the pages take "
                         f"{(len(kv_caches), needed * elements)} {k0.dtype}")
    index = torch.tensor(list(pages[:needed]), dtype=torch.int64, device=k0.device)
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        if staged is None:
            flat = host_pages(weights, layer, layout, rank, scaling, needed * elements, k_cache.dtype)
        else:
            flat = staged[layer]
        halves = flat.to(k_cache.device, non_blocking=staged is not None).view(needed, 2, elements // 2)
        k_cache.view(k_cache.shape[0], -1).index_copy_(0, index, halves[:, 0])
        v_cache.view(v_cache.shape[0], -1).index_copy_(0, index, halves[:, 1])
        if on_layer is not None:
            on_layer(layer, (layer + 1) * needed * elements * k0.element_size())
    return needed * elements * k0.element_size() * len(kv_caches)


def read_adapter(k_cache: torch.Tensor, v_cache: torch.Tensor, adapter: AdapterPages) -> torch.Tensor:
    """One layer's rows [rank, row_len] of a resident adapter, gathered from its pages (a copy)."""
    count = pages_for(adapter.rank, adapter.layout.row_len, page_elems(k_cache))
    index = adapter.index[:count]
    k = k_cache.view(k_cache.shape[0], -1).index_select(0, index)
    v = v_cache.view(v_cache.shape[0], -1).index_select(0, index)
    flat = torch.stack((k, v), dim=1).view(-1)  # page by page: its K half, then its V half
    return flat[:adapter.num_elements].view(adapter.rank, adapter.layout.row_len)


def group_modules(names: Iterable[str]) -> tuple[int, ...]:
    """Canonical indices of the named modules (what the C++ kernel's tables use)."""
    return tuple(LORA_MODULES.index(name) for name in names)
