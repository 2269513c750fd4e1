"""A what-if GPU profile built from published constants, not from a Loraplex measurement.

The digital-twin paper's public code ships fitted constants for Llama-3.1-8B-Instruct on a 64 GB
H100 under vLLM 0.8.5 (Agullo et al., "Data-Driven Optimization of GPU efficiency for Distributed
LLM-Adapter Serving"). They map onto our step-latency terms as follows:

- decode: (c1*B + c2) * (d1*A_B + d2) / 100 ms expands exactly into intercept (c2*d2), batch (c1*d2),
  adapters (c2*d1) and batch_x_adapters (c1*d1);
- prefill: p1 ms per prompt token (their prefill intercept, ~3.5 s, is a bad fit and is dropped);
- adapter load from CPU: their Lat_load table shows no growth with rank (6.4-8.1 ms), so the least
  squares line, clipped to a non-negative rank slope, is a flat cost per load;
- memory: their Mem_max table (KV tokens vLLM reported per A_max x S_max) fitted as
  kv_tokens_base - kv_tokens_per_slot_rank * A_max * S_max;
- copies (not from the paper): bytes per KV token and per adapter rank from Llama-3.1-8B's shapes
  in bf16, and 25 GB/s host <-> device, what PCIe 4.0 x16 sustains.

Their scheduler-overhead model has no term here. Use the result to ask what-if questions about a
GPU deployment; it says nothing about how Loraplex's own engine performs on that GPU.
"""

from __future__ import annotations

import numpy as np

from loraplex.latency.profile import Memory, Profile

NAME = "whatif-h100-llama8b"
# Llama-3.1-8B in bf16: the byte terms of the unified pool and of its copies
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, MLP, DTYPE_BYTES = 32, 8, 128, 4096, 14336, 2
LORA_MODULE_DIMS = {  # (in, out) of every module a LoRA of all seven target modules wraps
    "q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "o_proj": (HIDDEN, HIDDEN), "gate_proj": (HIDDEN, MLP), "up_proj": (HIDDEN, MLP), "down_proj": (MLP, HIDDEN),
}
H2D_GBPS = 25.0  # PCIe 4.0 x16, sustained
SOURCE = ("what-if from published constants, not measured by Loraplex: Llama-3.1-8B-Instruct on a 64 GB H100, "
          "vLLM 0.8.5, constants from the public code of Agullo et al., 'Data-Driven Optimization of GPU "
          "efficiency for Distributed LLM-Adapter Serving'; the copy terms (bytes of Llama-3.1-8B bf16, "
          f"{H2D_GBPS:g} GB/s host-device as PCIe 4.0 x16) are what-if too")

DECODE_MS = (0.0437994, 10.54174836)  # c1 per decoding sequence, c2 per step
ADAPTER_PERCENT = (1.93011757, 200.01448221)  # d1 per distinct adapter in the batch, d2
PREFILL_MS_PER_TOKEN = 1.31633234e-2  # p1
LOAD_MS = {(8, 8): 6.61, (16, 8): 7.77, (16, 16): 6.38, (32, 8): 8.08, (32, 16): 7.87, (32, 32): 6.37}  # (S_max, rank)
# KV-cache tokens by A_max for S_max = 8, 16, 32 (None: the server did not start)
MEM_MAX = {
    8: (305104, 302000, 296352), 16: (301520, 296000, 284944), 32: (295232, 284176, 258176),
    64: (282640, 256640, 215104), 96: (268384, 235584, 168064), 128: (253568, 212032, None),
    160: (243536, 187840, None), 192: (230976, 163456, None), 224: (217488, 138272, None),
    256: (205888, None, None), 288: (191936, None, None), 320: (180160, None, None),
    352: (166016, None, None), 384: (154240, None, None),
}
MEM_MAX_RANKS = (8, 16, 32)

ENGINE = {"max_model_len": 4096, "block_size": 16, "max_num_seqs": 256, "max_num_batched_tokens": 2048,
          "scheduler": "fifo", "residency": "lru"}


def decode_terms() -> dict[str, float]:
    """The product (c1*B + c2)(d1*A_B + d2)/100 ms as four seconds-per-unit coefficients."""
    (c1, c2), (d1, d2) = DECODE_MS, ADAPTER_PERCENT
    ms_to_s = 1e-3 / 100
    return {"intercept": c2 * d2 * ms_to_s, "batch": c1 * d2 * ms_to_s,
            "adapters": c2 * d1 * ms_to_s, "batch_x_adapters": c1 * d1 * ms_to_s}


def load_terms() -> dict[str, float]:
    """Seconds per load and per rank of a load: least squares over the published table, with
    the rank slope clipped at zero (a negative one would make big adapters load faster)."""
    ranks = np.asarray([rank for _, rank in LOAD_MS], dtype=float)
    seconds = np.asarray(list(LOAD_MS.values())) * 1e-3
    slope, intercept = np.polyfit(ranks, seconds, 1)
    if slope < 0:
        slope, intercept = 0.0, float(seconds.mean())
    return {"loads": float(intercept), "load_rank_sum": float(slope)}


def memory_fit() -> Memory:
    """T_max = kv_tokens_base - kv_tokens_per_slot_rank * A_max * S_max, least squares over the table."""
    xs, ys = [], []
    for a_max, row in MEM_MAX.items():
        for s_max, tokens in zip(MEM_MAX_RANKS, row, strict=True):
            if tokens is not None:
                xs.append(a_max * s_max)
                ys.append(tokens)
    slope, intercept = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return Memory(kv_tokens_base=round(intercept), kv_tokens_per_slot_rank=round(-slope, 3))


def copy_terms() -> dict[str, float]:
    """Bytes of one KV token (K and V, every layer), of one adapter rank (A row and B column of
    every wrapped module, every layer) and the copy bandwidth."""
    kv_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES
    per_rank = LAYERS * DTYPE_BYTES * sum(i + o for i, o in LORA_MODULE_DIMS.values())
    return {"kv_token_bytes": kv_token, "adapter_bytes_per_rank": per_rank, "h2d_gbps": H2D_GBPS}


def whatif_profile(max_loras: int = 32, max_lora_rank: int = 32) -> Profile:
    """The what-if Llama-3.1-8B / H100 profile with the paper's engine settings."""
    if max_loras < 1 or max_lora_rank < 1:
        raise ValueError("max_loras and max_lora_rank must be at least 1")
    memory = memory_fit().model_copy(update=copy_terms())
    if memory.kv_tokens(max_loras, max_lora_rank) < ENGINE["max_model_len"]:
        raise ValueError(f"{max_loras} slots of rank {max_lora_rank} leave less KV cache than one "
                         f"{ENGINE['max_model_len']}-token request needs")
    coefficients = decode_terms() | {"prefill_tokens": PREFILL_MS_PER_TOKEN * 1e-3} | load_terms()
    return Profile(name=NAME, model="Llama-3.1-8B-Instruct (what-if, published constants)", hardware=SOURCE,
                   engine=ENGINE | {"max_loras": max_loras, "max_lora_rank": max_lora_rank},
                   memory=memory, coefficients=coefficients)
