"""How big each part of the GPU run is, per shape: the Llama-2-7B shape on the device, and the tiny
shape of the CPU rehearsal (CI-sized: the whole run in about a minute on two busy cores)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    # part 1
    greedy_adapters: int = 8
    # part 2: (batch, context) of decode attention, the prefill context, LoRA rows, timing repeats
    attention_decode: tuple[tuple[int, int], ...] = ((1, 2048), (16, 2048), (64, 2048))
    attention_prefill: int = 2048
    lora_decode_rows: int = 64
    lora_prefill_segments: tuple[int, int] = (8, 256)  # segments x rows each
    kernel_repeats: int = 20
    # parts 3 and 4
    batches: tuple[int, ...] = (1, 16, 64)
    adapter_counts: tuple[int, ...] = (0, 1, 32)
    prompt_len: int = 512
    steps: int = 32
    decode_blocks: int = 4096  # pages: 64 requests of 768 tokens, plus 32 adapters of ranks 8-128
    mixed_half: int = 16
    # part 5
    assist_adapters: int = 8
    assist_prompt_len: int = 256
    assist_background: int = 4
    assist_blocks: int = 4096
    h2d_bytes: int = 1 << 30
    # part 6: the pool holds `pool_share` of the adapters' weights, so they cannot all be resident
    policy_adapters: int = 120
    pool_share: float = 0.6
    max_loras: int = 8  # lru-static slots of rank 128
    host_share: float = 0.5  # host KV tier (pinned on CUDA) in pages, as a share of the device pool
    sessions: int = 40
    session_rate: float = 2.0
    turns: float = 4.0
    think_s: float = 2.0
    session_horizon_s: float = 40.0  # a policy's session run stops here (what finished is summarised)
    length_scale: float = 0.5  # of the session and Azure conversation lengths (both sides of part 6)
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    sched_requests: int = 150
    sched_unloaded: int = 10
    sched_load: float = 0.9


SIZES: dict[str, Sizes] = {
    "llama2-7b": Sizes(),
    "tiny": Sizes(attention_decode=((1, 64), (4, 64)), attention_prefill=64, lora_decode_rows=4,
                  lora_prefill_segments=(2, 16), kernel_repeats=1, batches=(1, 4), adapter_counts=(0, 1, 4),
                  prompt_len=24, steps=4, decode_blocks=1024, mixed_half=2, assist_adapters=3,
                  assist_prompt_len=32, assist_background=1, assist_blocks=1024, h2d_bytes=1 << 24,
                  policy_adapters=12, sessions=6, session_rate=6.0, turns=2.0, think_s=0.1, session_horizon_s=20.0,
                  length_scale=0.02,
                  max_model_len=1024, max_num_seqs=8, max_batched_tokens=256, sched_requests=12, sched_unloaded=3),
}
