"""Shared builders for the paged LoRA kernel tests: random adapters written into a small KV pool,
and the dense per-row LoRA term they must produce."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from loraplex_kernels.lora import LoraBatch, LoraGroup
from loraplex_kernels.lora_pages import (
    AdapterPages,
    LoraWeights,
    RowLayout,
    page_elems,
    pages_for,
    write_adapter,
)

NO_ADAPTER = -1
# a GQA-like model: q and o 48 wide, k and v 16, an MLP of 72; none lines up with the pages
SHAPES = {"q_proj": (48, 48), "k_proj": (48, 16), "v_proj": (48, 16), "o_proj": (48, 48),
          "gate_proj": (48, 72), "up_proj": (48, 72), "down_proj": (72, 48)}
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


def group(name: str) -> LoraGroup:
    modules = GROUPS[name]
    return LoraGroup(modules, tuple(SHAPES[m][1] for m in modules))


@dataclass
class Pool:
    """A one-layer KV pool holding adapters, and their dense weights for the expected values."""

    k: torch.Tensor
    v: torch.Tensor
    adapters: dict[int, AdapterPages]
    weights: dict[int, LoraWeights]
    scaling: dict[int, float]

    def batch(self, row_adapters: list[int]) -> LoraBatch:
        return LoraBatch.from_row_adapters(row_adapters, self.adapters, no_adapter=NO_ADAPTER)

    def dense_delta(self, x: torch.Tensor, row_adapters: list[int], name: str) -> torch.Tensor:
        """The LoRA term of every row, computed per row in float64 from the dense weights."""
        out = torch.zeros(len(row_adapters), sum(group(name).out_features), dtype=torch.float64)
        for row, handle in enumerate(row_adapters):
            if handle == NO_ADAPTER:
                continue
            parts = []
            for module in GROUPS[name]:
                pair = self.weights[handle].get((0, module))
                if pair is None:
                    parts.append(torch.zeros(SHAPES[module][1], dtype=torch.float64))
                    continue
                a, b = (t.double() for t in pair)
                parts.append(b @ (a @ x[row].double()) * self.scaling[handle])
            out[row] = torch.cat(parts)
        return out


def random_weights(rng: random.Random, gen: torch.Generator, rank: int, modules: list[str],
                   dtype: torch.dtype) -> LoraWeights:
    """PEFT pairs for one layer; some modules get a smaller rank (rank_pattern) when rank > 1."""
    weights = {}
    for module in modules:
        in_f, out_f = SHAPES[module]
        r = rank if rng.random() < 0.7 else rng.randint(1, rank)
        a = torch.randn(r, in_f, generator=gen) / in_f ** 0.5
        b = torch.randn(out_f, r, generator=gen) / r ** 0.5
        weights[(0, module)] = (a.to(dtype), b.to(dtype))
    return weights


def make_pool(ranks: list[int], *, seed: int = 0, dtype: torch.dtype = torch.float32, block: tuple = (4, 2, 5),
              all_modules: bool = False, spare_pages: int = 3) -> Pool:
    """A pool of (block_size, kv_heads, head_dim) pages, adapters on scattered pages in random
    order; each adapter wraps a random subset of the modules (all of them with `all_modules`)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    weights = {}
    for handle, rank in enumerate(ranks):
        modules = list(SHAPES) if all_modules else [m for m in SHAPES if rng.random() < 0.6] or ["q_proj"]
        weights[handle] = random_weights(rng, gen, rank, modules, dtype)
    layouts = {h: RowLayout.of_weights(w) for h, w in weights.items()}
    elements = 2 * block[0] * block[1] * block[2]
    needed = {h: pages_for(ranks[h], layouts[h].row_len, elements) for h in weights}
    free = list(range(sum(needed.values()) + spare_pages))
    rng.shuffle(free)
    k = torch.randn(len(free), *block, generator=gen).to(dtype)  # garbage where no adapter lives
    v = torch.randn(len(free), *block, generator=gen).to(dtype)
    assert page_elems(k) == elements
    adapters, scaling = {}, {}
    for handle, w in weights.items():
        pages, free = free[:needed[handle]], free[needed[handle]:]
        scaling[handle] = rng.choice([0.5, 1.0, 2.0])
        write_adapter([(k, v)], pages, w, scaling[handle], layouts[handle], ranks[handle])
        adapters[handle] = AdapterPages.create(pages, ranks[handle], layouts[handle], k.device)
    return Pool(k, v, adapters, weights, scaling)


def executor_rows(rng: random.Random, num_adapters: int) -> list[int]:
    """Decode rows (one per request) grouped by adapter, then prefill chunks of random lengths,
    with base-model rows in both parts: the executor's order. An activated LoRA's chunk starts with
    base rows (those before its invocation), so one adapter may own several segments."""
    decode = sorted(rng.choice([NO_ADAPTER, *range(num_adapters)]) for _ in range(rng.randint(0, 40)))
    rows = list(decode)
    for _ in range(rng.randint(0, 4)):
        handle = rng.choice([NO_ADAPTER, *range(num_adapters)])
        before_invocation = rng.randint(1, 20) if handle != NO_ADAPTER and rng.random() < 0.3 else 0
        rows += [NO_ADAPTER] * before_invocation + [handle] * rng.randint(2, 70)
    return rows
