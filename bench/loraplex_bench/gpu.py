"""`loraplex bench gpu`: the engine's decode speed and kernels on the device (issue 12's measurements).

One run measures, on a Llama-2-7B-shaped model with random weights (`--shape llama2-7b`, bf16 on
CUDA) and random adapters of ranks 8-128 wrapping all seven target modules:

1. decode tokens/s at batch 1, 16 and 64 with 0, 1 and 32 distinct adapters, and the fraction of
   the memory-bandwidth bound: bytes read per step (weights + the batch's KV + the distinct
   adapters' rows) over the device's measured copy bandwidth, divided by the measured step time;
2. mixed ranks: the LoRA cost of a batch of rank-8 and rank-128 requests against the sum of the
   LoRA costs of its two homogeneous halves (LoRA cost = step time minus a base-only step's);
3. our paged attention against torch SDPA over dense K/V of the same shapes (decode and prefill);
4. decode with CUDA graphs on and off;
5. greedy tokens of the same requests on this device and on the CPU, both in float32.

On a CPU (`--shape tiny`, what the tests run) every part runs except CUDA graphs (reported as
not applicable); the numbers then say nothing about a GPU. Weights and adapters are generated in
memory from a seed; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from loraplex_agent.adapters.host import HostAdapter
from loraplex_agent.adapters.registry import AdapterRecord, AdapterRegistry
from loraplex_agent.runtime.device import adapter_bytes_per_rank, kv_token_bytes, resolve_device, weight_bytes
from loraplex_agent.runtime.executor import TorchExecutor
from loraplex_agent.runtime.model.config import LORA_MODULES, ModelConfig

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.spec.errors import CommandError
from loraplex_bench.output import write_bench_json
from loraplex_bench.report import Series, group_points, plot_series

SHAPES: dict[str, dict] = {
    "llama2-7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
}
RANKS = (8, 16, 32, 64, 128)
BATCHES = (1, 16, 64)
ADAPTER_COUNTS = (0, 1, 32)
OFFSETS = 4096  # distinct starting points of AdapterWeights' views
GREEDY_ADAPTERS = 8


@dataclass
class DecodeResult:
    batch: int
    adapters: int
    cuda_graphs: bool
    step_s: float
    tokens_per_s: float
    bytes_per_step: int
    bandwidth_fraction: float  # (bytes_per_step / measured bandwidth) / step_s


@dataclass
class MixedRanks:
    batch: int
    base_step_s: float
    rank8_step_s: float
    rank128_step_s: float
    mixed_step_s: float
    lora_cost_ratio: float  # mixed LoRA cost / (rank-8 LoRA cost + rank-128 LoRA cost); goal <= 1.10


@dataclass
class AttentionTiming:
    phase: str  # decode or prefill
    batch: int
    context: int
    ours_s: float
    sdpa_s: float


class Bench:
    """One engine (executor + core) over a random model, with random adapters registered by rank.
    `engine` overrides EngineConfig fields (memory policy, scheduler, max_num_seqs...)."""

    def __init__(self, config: ModelConfig, model_dir: Path, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, num_blocks: int, cuda_graphs: bool, seed: int = 0,
                 adapter_weights: AdapterWeights | None = None, **engine: Any) -> None:
        self.model_config = config
        self.model_dir = model_dir
        self.engine_config = EngineConfig(**{
            "max_model_len": max_model_len, "block_size": 16, "num_blocks": num_blocks,
            "max_num_seqs": max(BATCHES), "max_num_batched_tokens": max(2048, max_model_len),
            "max_lora_rank": max(RANKS), "num_host_blocks": 0, **engine})
        self.store = AdapterRegistry()  # as `LLM`'s: the core's table and the executor's weights
        self.executor = TorchExecutor(config, self.engine_config, device, dtype, self.store.host,
                                      model_dir=model_dir, seed=seed, cuda_graphs=cuda_graphs)
        self.core = EngineCore(self.engine_config, self.executor, adapter_pages=self._adapter_pages,
                               adapters=self.store)
        self.adapters: list[AdapterId] = []
        self._generator = torch.Generator().manual_seed(seed)
        self._weights = adapter_weights
        self._requests = 0

    def _adapter_pages(self, info: AdapterInfo) -> int:
        """As `LLM`'s: an adapter not in host memory (lru-static's slot size) wraps every module."""
        if self.store.holds(info.id):
            return self.executor.adapter_pages(self.store.host(info.id))
        return self.executor.pages_for_rank(info.rank)

    def add_adapters(self, ranks: Sequence[int], names: Sequence[str] | None = None) -> list[AdapterId]:
        """Random adapters of `ranks` (named `names`, else by index and rank): drawn from the seed, or
        views of the shared `adapter_weights` when the bench was given them (large shapes)."""
        ids = []
        for i, rank in enumerate(ranks):
            name = names[i] if names else f"a{len(self.adapters)}-r{rank}"
            host = (self._weights.adapter(self.model_config, name, rank, len(self.adapters)) if self._weights
                    else random_adapter(self.model_config, name, rank, self._generator))
            self.store.hold(AdapterRecord(host))
            self.executor.stage_adapter(host)  # as `LLM.register`: pinned on CUDA while it fits
            self.core.add_adapter(host.info)
            self.adapters.append(host.id)
            ids.append(host.id)
        return ids

    def make_request(self, prompt: list[int], sampling: SamplingParams, adapter: str | None = None) -> Request:
        """A request of `adapter` by name (what `LLM.make_request` is for a bench without a tokenizer)."""
        self._requests += 1
        adapter_id = next(a for a in self.adapters if a.name == adapter) if adapter else None
        return Request(f"m{self._requests}", list(prompt), sampling, adapter=adapter_id)

    def step_time(self, adapters: Sequence[AdapterId | None], prompt_len: int, steps: int) -> float:
        """Mean seconds of a decode step of len(adapters) requests (one per entry), once every
        request has finished its prefill and every adapter is on the device."""
        prefill_steps = -(-len(adapters) * prompt_len // self.engine_config.max_num_batched_tokens)
        requests = [self._request(adapter, prompt_len, steps + prefill_steps + 8) for adapter in adapters]
        for request in requests:
            self.core.add_request(request)
        while any(not r.output_token_ids for r in requests):  # each has prefilled: its adapter is on the device
            self.core.step()
        begin = time.perf_counter()
        for _ in range(steps):
            self.core.step()
        elapsed = (time.perf_counter() - begin) / steps
        while self.core.has_unfinished():
            self.core.step()
        return elapsed

    def greedy(self, adapters: Sequence[AdapterId | None], prompts: Sequence[list[int]], tokens: int) -> list[list[int]]:
        requests = [Request(f"g{i}", list(p), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
                            adapter=a) for i, (a, p) in enumerate(zip(adapters, prompts, strict=True))]
        for request in requests:
            self.core.add_request(request)
        while self.core.has_unfinished():
            self.core.step()
        return [r.output_token_ids for r in requests]

    def _request(self, adapter: AdapterId | None, prompt_len: int, max_tokens: int) -> Request:
        self._requests += 1
        prompt = torch.randint(1, self.model_config.vocab_size, (prompt_len,), generator=self._generator).tolist()
        return Request(f"r{self._requests}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       adapter=adapter)

    def close(self) -> None:
        """Stop the copy and assist threads and drop the engine, so that its device memory (the model,
        the pool, the graphs) is freed at the next collection even while this bench is referenced."""
        self.executor.close()
        del self.core, self.executor


def model_config(shape: str, **overrides: int) -> ModelConfig:
    raw = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 4096, "torch_dtype": "bfloat16", **SHAPES[shape], **overrides}
    return ModelConfig.from_dict(raw, name=f"random-{shape}")


def write_random_model(config: ModelConfig, raw_shape: dict, folder: Path, seed: int,
                       device: torch.device | None = None) -> Path:
    """A Hugging Face folder (config.json + model.safetensors) with random bf16 weights, drawn on
    `device` (the CPU by default; a GPU draws the 7B shape's 6.7 billion numbers in a second)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "max_position_embeddings": config.max_position_embeddings,
        "torch_dtype": "bfloat16", **raw_shape}))
    device = device or torch.device("cpu")
    generator = torch.Generator(device).manual_seed(seed)
    save_file(random_state(config, generator, device), str(folder / "model.safetensors"))
    return folder


def random_state(config: ModelConfig, generator: torch.Generator,
                 device: torch.device | None = None) -> dict[str, torch.Tensor]:
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()

    state = {"model.embed_tokens.weight": normal(config.vocab_size, h), "model.norm.weight": torch.ones(h),
             "lm_head.weight": normal(config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                  "mlp.down_proj": (h, inter)}
        state.update({f"{p}{name}.weight": normal(*shape) for name, shape in shapes.items()})
        state[p + "input_layernorm.weight"] = torch.ones(h)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return {name: t.to(torch.bfloat16).contiguous() for name, t in state.items()}


def random_adapter(config: ModelConfig, name: str, rank: int, generator: torch.Generator) -> HostAdapter:
    """All seven target modules of every layer, bf16 on the host (the pool converts on copy)."""
    weights = {}
    for layer in range(config.num_hidden_layers):
        for module in LORA_MODULES:
            in_features, out_features = config.module_shape(module)
            a = (torch.randn(rank, in_features, generator=generator) * in_features ** -0.5).to(torch.bfloat16)
            b = (torch.randn(out_features, rank, generator=generator) * 0.01).to(torch.bfloat16)
            weights[(layer, module)] = (a, b)
    size = sum(a.numel() + b.numel() for a, b in weights.values()) * 2
    info = AdapterInfo(AdapterId(name, f"random-{name}"), rank, size, tuple(LORA_MODULES))
    return HostAdapter(info, scaling=1.0, weights=weights)


class AdapterWeights:
    """Adapter weights as views of one shared random buffer, for shapes where drawing every adapter's
    own numbers would take minutes (a rank-128 adapter of the Llama-2-7B shape has 320M of them): each
    adapter reads the buffer from its own offset, so adapters differ, and costs no host memory of its own.
    Copies move as many bytes as separate tensors would (the executor lays every adapter out anew)."""

    def __init__(self, config: ModelConfig, device: torch.device, seed: int) -> None:
        self.per_rank = sum(sum(config.module_shape(m)) for m in LORA_MODULES) * config.num_hidden_layers
        generator = torch.Generator(device).manual_seed(seed)
        buffer = torch.randn(self.per_rank * max(RANKS) + OFFSETS, generator=generator, device=device) * 0.02
        self.buffer = buffer.to(torch.bfloat16).cpu()

    def adapter(self, config: ModelConfig, name: str, rank: int, index: int) -> HostAdapter:
        offset = (index * 7919) % OFFSETS
        weights = {}
        for layer in range(config.num_hidden_layers):
            for module in LORA_MODULES:
                in_features, out_features = config.module_shape(module)
                a = self.buffer[offset:offset + rank * in_features].view(rank, in_features)
                b = self.buffer[offset + rank * in_features:offset + rank * (in_features + out_features)]
                offset += rank * (in_features + out_features)
                weights[(layer, module)] = (a, b.view(out_features, rank))
        info = AdapterInfo(AdapterId(name, f"random-{name}"), rank, rank * self.per_rank * 2, tuple(LORA_MODULES))
        return HostAdapter(info, scaling=1.0, weights=weights)


def device_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    begin = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * 5 / (time.perf_counter() - begin)


def bytes_per_decode_step(config: ModelConfig, dtype: torch.dtype, batch: int, context: int,
                          ranks: Sequence[int]) -> int:
    """Weights, the batch's KV, and every distinct adapter's rows, each read once per step."""
    return (weight_bytes(config, dtype) + batch * context * kv_token_bytes(config, dtype)
            + sum(ranks) * adapter_bytes_per_rank(config, dtype))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - begin) / repeats


def decode_sweep(bench: Bench, dtype: torch.dtype, bandwidth: float, prompt_len: int, steps: int,
                 batches: Sequence[int], counts: Sequence[int], cuda_graphs: bool,
                 results: list[DecodeResult] | None = None, deadline: float | None = None) -> list[DecodeResult]:
    """Every (adapter count, batch) point, appended to `results` as it is measured (a caller keeps what
    ran when a later point fails); points left when `deadline` (perf_counter) has passed are skipped."""
    results = [] if results is None else results
    pool = bench.add_adapters([RANKS[i % len(RANKS)] for i in range(max(counts))])
    for count in counts:
        for batch in batches:
            if deadline is not None and time.perf_counter() > deadline:
                print(f"decode: over the time budget, batch {batch} with {count} adapters skipped")
                continue
            used = [pool[i % count] if count else None for i in range(batch)]
            step_s = bench.step_time(used, prompt_len, steps)
            ranks = [bench.store.host(a).rank for a in set(used) if a is not None]
            nbytes = bytes_per_decode_step(bench.model_config, dtype, batch, prompt_len + steps, ranks)
            results.append(DecodeResult(batch, len(ranks), cuda_graphs, step_s, batch / step_s, nbytes,
                                        nbytes / bandwidth / step_s))
            print(f"decode batch {batch:>3} adapters {len(ranks):>2} graphs {cuda_graphs!s:>5}: "
                  f"{step_s * 1e3:8.2f} ms/step {batch / step_s:9.1f} tok/s "
                  f"{100 * results[-1].bandwidth_fraction:5.1f}% of the bandwidth bound", flush=True)
    return results


def mixed_ranks(bench: Bench, prompt_len: int, steps: int, half: int) -> MixedRanks:
    """`half` rank-8 requests next to `half` rank-128 ones (4 adapters of each rank)."""
    low, high = bench.add_adapters([8] * 4), bench.add_adapters([128] * 4)
    lows = [low[i % 4] for i in range(half)]
    highs = [high[i % 4] for i in range(half)]
    base_half = bench.step_time([None] * half, prompt_len, steps)
    base_full = bench.step_time([None] * 2 * half, prompt_len, steps)
    rank8 = bench.step_time(lows, prompt_len, steps)
    rank128 = bench.step_time(highs, prompt_len, steps)
    mixed = bench.step_time(lows + highs, prompt_len, steps)
    ratio = (mixed - base_full) / max((rank8 - base_half) + (rank128 - base_half), 1e-12)
    print(f"mixed ranks, {half}+{half} requests: LoRA cost of the mixed batch / sum of the homogeneous "
          f"halves' = {ratio:.3f} (goal <= 1.10)")
    return MixedRanks(2 * half, base_full, rank8, rank128, mixed, ratio)


def attention_timings(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                      cases: Sequence[tuple[str, int, int]], repeats: int) -> list[AttentionTiming]:
    """Our paged attention (the backend the engine uses on this device) against torch SDPA over
    dense K/V of the same shapes: (phase, batch, context) per case."""
    results = []
    for phase, batch, context in cases:
        ours, sdpa = _time_attention(config, device, dtype, phase, batch, context, repeats)
        results.append(AttentionTiming(phase, batch, context, ours, sdpa))
        print(f"attention {phase:<7} batch {batch:>3} context {context:>5}: ours {ours * 1e6:9.1f} us, "
              f"SDPA {sdpa * 1e6:9.1f} us ({ours / sdpa:.2f}x)")
    return results


def _time_attention(config: ModelConfig, device: torch.device, dtype: torch.dtype, phase: str, batch: int,
                    context: int, repeats: int) -> tuple[float, float]:
    from loraplex_kernels.attention import build_attention_batch, paged_attention

    heads, kv_heads, dim, block = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 16
    blocks_per_seq = -(-context // block)
    k_cache = torch.randn(batch * blocks_per_seq + 1, block, kv_heads, dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = [list(range(1 + b * blocks_per_seq, 1 + (b + 1) * blocks_per_seq)) for b in range(batch)]
    if phase == "decode":
        queries = 1
        slots = [t[(context - 1) // block] * block + (context - 1) % block for t in tables]
        meta = build_attention_batch(slots, tables, [context] * batch, [], block, device)
    else:
        queries = context
        slots = [t[p // block] * block + p % block for t in tables for p in range(context)]
        meta = build_attention_batch(slots, [], [], [(context, 0, t) for t in tables], block, device)
    q = torch.randn(batch * queries, heads, dim, device=device, dtype=dtype)
    new_kv = torch.randn(batch * queries, kv_heads, dim, device=device, dtype=dtype)
    q_dense = torch.randn(batch, heads, queries, dim, device=device, dtype=dtype)
    k_dense = torch.randn(batch, kv_heads, context, dim, device=device, dtype=dtype)
    v_dense = torch.randn_like(k_dense)
    ours = timed(lambda: paged_attention(q, new_kv, new_kv, k_cache, v_cache, meta, dim ** -0.5), device, repeats)
    sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
        q_dense, k_dense, v_dense, is_causal=phase == "prefill", enable_gqa=True), device, repeats)
    return ours, sdpa


def greedy_tokens_match(device: torch.device, seed: int, workdir: Path, adapters: int = GREEDY_ADAPTERS) -> dict:
    """The same greedy requests (tiny model, float32, `adapters` adapters of mixed ranks and one base
    request) on `device` and on the CPU: the tokens must be identical, and the largest difference of
    their logits (up to each request's first differing token) says how far from a tie they are."""
    config = model_config("tiny")
    model_dir = write_random_model(config, SHAPES["tiny"], workdir / "greedy", seed)
    generator = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(1, config.vocab_size, (12 + 5 * i,), generator=generator).tolist()
               for i in range(adapters + 1)]
    ranks = [RANKS[i % len(RANKS)] for i in range(adapters)]
    outputs, logits = {}, {}
    for where in (device, torch.device("cpu")):
        bench = Bench(config, model_dir, where, torch.float32, max_model_len=256, num_blocks=512,
                      cuda_graphs=where.type == "cuda", seed=seed)
        bench.executor.capture_logits = True
        used: list[AdapterId | None] = [None, *bench.add_adapters(ranks)]
        outputs[where.type] = bench.greedy(used, prompts, tokens=24)
        logits[where.type] = {rid: torch.stack(rows) for rid, rows in bench.executor.captured_logits.items()}
        bench.close()
    pairs = list(zip(outputs[device.type], outputs["cpu"], strict=True))
    differing = [i for i, (a, b) in enumerate(pairs) if a != b]
    diff = 0.0
    for i, (a, b) in enumerate(pairs):  # rows past the first differing token see different contexts
        rows = next((t for t, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) + 1
        ours, cpu = logits[device.type][f"g{i}"][:rows], logits["cpu"][f"g{i}"][:rows]
        diff = max(diff, float((ours - cpu).abs().max()))
    same = not differing
    print(f"greedy tokens, float32, {device.type} vs cpu: {'identical' if same else 'DIFFERENT'} "
          f"({len(prompts)} requests, adapter ranks {ranks} and one base request); largest logit "
          f"difference {diff:.1e}")
    return {"device": device.type, "identical": same, "requests": len(prompts), "adapter_ranks": ranks,
            "differing_requests": differing, "tokens_per_request": 24, "max_abs_logit_diff": diff}


def gpu_series(decode: list[DecodeResult], attention: list[AttentionTiming]) -> list[Series]:
    """Decode speed and its share of the bandwidth bound against the batch, a line per adapter count (and
    CUDA graphs on or off); decode attention's time against the batch, ours and SDPA's."""
    def line(d: DecodeResult) -> str:
        return f"{d.adapters} adapters" + (", CUDA graphs" if d.cuda_graphs else "")

    decoding = [t for t in attention if t.phase == "decode"]
    return [Series("gpu-decode-tokens-per-s-vs-batch", "decode throughput", "batch (requests)", "tokens/s",
                   group_points(decode, line, "batch", "tokens_per_s")),
            Series("gpu-decode-bandwidth-fraction-vs-batch", "decode against the bandwidth bound", "batch (requests)",
                   "share of the bandwidth bound (fraction)", group_points(decode, line, "batch", "bandwidth_fraction")),
            Series("gpu-decode-attention-time-vs-batch", "decode attention", "batch (requests)", "time per call (s)",
                   {"ours (paged)": [(t.batch, t.ours_s) for t in decoding],
                    "torch SDPA (dense)": [(t.batch, t.sdpa_s) for t in decoding]})]


def run(args: argparse.Namespace) -> int:
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    cuda = device.type == "cuda"
    shape = args.shape or ("llama2-7b" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = model_config(shape)
    prompt_len, steps = (512, 32) if shape != "tiny" else (24, 4)
    batches = BATCHES if not args.quick else (1, 4)
    counts = ADAPTER_COUNTS if not args.quick else (0, 1, 4)
    num_blocks = args.num_blocks or (4096 if shape != "tiny" else 1024)
    results: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "shape": shape,
                     "dtype": str(dtype), "prompt_len": prompt_len, "timed_steps": steps}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model(config, SHAPES[shape], Path(tmp) / "model", args.seed)
        bandwidth = device_bandwidth(device, (1 << 30) if cuda else (1 << 26))
        results["bandwidth_gbps"] = bandwidth / 1e9
        print(f"{results['device']}: measured copy bandwidth {bandwidth / 1e9:.0f} GB/s")
        decode: list[DecodeResult] = []
        for graphs in ((True, False) if cuda else (False,)):
            bench = Bench(config, model_dir, device, dtype, prompt_len + 256, num_blocks, graphs, args.seed)
            decode += decode_sweep(bench, dtype, bandwidth, prompt_len, steps, batches, counts, graphs)
            if graphs or not cuda:
                results["mixed_ranks"] = asdict(mixed_ranks(bench, prompt_len, steps, half=max(batches) // 4))
            bench.close()
            del bench
            if cuda:
                torch.cuda.empty_cache()
        results["decode"] = [asdict(d) for d in decode]
        cases = [("decode", b, 4 * prompt_len) for b in batches] + [("prefill", 1, 4 * prompt_len)]
        results["attention"] = [asdict(t) for t in attention_timings(config, device, dtype, cases,
                                                                     repeats=20 if cuda else 2)]
        results["greedy"] = greedy_tokens_match(device, args.seed, Path(tmp))
    if args.out:
        write_bench_json(Path(args.out), "bench gpu", args, results)
    if args.plots:
        plot_series(gpu_series(decode, [AttentionTiming(**t) for t in results["attention"]]), Path(args.plots))
    return 0 if results["greedy"]["identical"] else 1
