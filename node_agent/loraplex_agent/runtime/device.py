"""Device, dtype and CPU thread resolution, and how many KV blocks fit."""

from __future__ import annotations

import os

import torch

from loraplex_agent.runtime.model.config import ModelConfig
from loraplex_agent.runtime.model.lora_pages import LORA_GROUP_MODULES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_GIB = 1.0
GPU_KV_FRACTION = 0.9  # of the free memory left once the weights are loaded
GPU_ACTIVATION_RESERVE = 1 << 30  # bytes kept free for activations and the allocator's slack
# below this hidden size a decode step's ops last tens of microseconds: splitting them over threads
# costs more in synchronisation than it saves (measured 3x slower on a busy 2-core machine)
SINGLE_THREAD_MAX_HIDDEN = 1024


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use cpu, cuda, cuda:N or auto")
    return device


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto` is the checkpoint's dtype on CUDA and float32 on the CPU (where half precision is slow)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        name = config.torch_dtype if config.torch_dtype in DTYPES else "bfloat16"
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose from auto, {', '.join(DTYPES)}") from None


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (keys and values)."""
    return kv_token_bytes(config, dtype) * block_size


def kv_token_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one token's keys and values across all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize


def adapter_bytes_per_rank(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one rank of an adapter that wraps every target module takes in the page pool."""
    per_layer = sum(sum(config.module_shape(m)) for modules in LORA_GROUP_MODULES.values() for m in modules)
    return per_layer * config.num_hidden_layers * dtype.itemsize


def kv_tokens_per_slot_rank(config: ModelConfig, dtype: torch.dtype, max_lora_rank: int) -> float:
    """KV tokens one rank of an adapter slot costs: the profile's `Memory.kv_tokens_per_slot_rank`,
    so that kv_tokens_base - this * max_loras * max_lora_rank is the KV cache left once
    `lru-static` has carved out its slots (pages are whole, so this is exact up to one page a slot)."""
    return adapter_bytes_per_rank(config, dtype) / kv_token_bytes(config, dtype)


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """The decoder's parameter memory, estimated from its shape."""
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return (per_layer * config.num_hidden_layers + embeddings + h) * dtype.itemsize


def num_kv_blocks(config: ModelConfig, device: torch.device, dtype: torch.dtype, *, block_size: int,
                  max_model_len: int, max_num_seqs: int, num_blocks: int | None = None,
                  kv_cache_memory_gib: float | None = None) -> int:
    """Pages of the pool (KV blocks and adapter weights share them): `num_blocks` if given, else
    sized from `kv_cache_memory_gib`, else from free memory (90% of what the GPU has left after the
    weights; 1 GiB on the CPU). Memory-derived sizes are capped at what max_num_seqs requests of
    max_model_len tokens can use."""
    if num_blocks is not None:
        return num_blocks
    if kv_cache_memory_gib is not None:
        budget = int(kv_cache_memory_gib * (1 << 30))
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(GPU_KV_FRACTION * (free - weight_bytes(config, dtype) - GPU_ACTIVATION_RESERVE))
    else:
        budget = int(CPU_DEFAULT_KV_GIB * (1 << 30))
    if budget <= 0:
        raise ValueError("no device memory is left for the page pool; give it more memory (--kv-cache-memory)")
    blocks_per_seq = -(-max_model_len // block_size)
    cap = blocks_per_seq * max_num_seqs + 1
    return min(budget // kv_block_bytes(config, block_size, dtype), cap)


def cpu_threads(config: ModelConfig, requested: int | None = None) -> int:
    """Torch threads for the CPU engine: `requested`, else OMP_NUM_THREADS when set, else 1 for
    small models and every CPU this process may run on for larger ones."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be at least 1, not {requested}")
        return requested
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    if config.hidden_size < SINGLE_THREAD_MAX_HIDDEN:
        return 1
    return len(os.sched_getaffinity(0))
