"""LLM: the offline engine (model + executor + EngineCore + adapter registry + tokenizer) in one object.

    llm = LLM("out/base", max_loras=8)
    llm.add_adapter("sql", "out/adapters/lora00-r8")
    [request] = llm.generate(["SELECT"], SamplingParams(temperature=0, max_tokens=16), adapters=["sql"])
    request.output_token_ids

The server drives `llm.core` from its engine thread instead of calling `generate`.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.engine.scheduling.schedulers import parse_scheduler_options
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.spec.errors import InvalidRequestError, NotFoundError
from loraplex.util.clock import Clock
from loraplex_agent.adapters.host import HostAdapter
from loraplex_agent.adapters.peft import load_peft_adapter
from loraplex_agent.adapters.registry import AdapterRecord, AdapterRegistry
from loraplex_agent.runtime.device import cpu_threads, num_kv_blocks, resolve_device, resolve_dtype
from loraplex_agent.runtime.executor import TorchExecutor
from loraplex_agent.runtime.json_mode import TokenTexts
from loraplex_agent.runtime.model.config import ModelConfig
from loraplex_agent.runtime.pinned_adapters import DEFAULT_PINNED_ADAPTER_GIB

Prompt = str | list[int]


class LLM:
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LLM:
        """Build from the engine arguments of `loraplex_agent.cli.add_engine_args` plus `args.model`."""
        return cls(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                   block_size=args.block_size, num_blocks=args.num_blocks,
                   kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   long_prefill_token_threshold=args.long_prefill_token_threshold, max_loras=args.max_loras,
                   max_lora_rank=args.max_lora_rank, scheduler=args.scheduler,
                   scheduler_options=parse_scheduler_options(args.scheduler_option),
                   memory_policy=args.memory_policy, prefix_cache=not args.no_prefix_cache,
                   num_host_blocks=args.num_host_blocks, memory_options=parse_scheduler_options(args.memory_option),
                   emulate_h2d_gbps=args.emulate_h2d_gbps,
                   cpu_assist={"on": True, "off": False}.get(args.cpu_assist),
                   cuda_graphs=False if args.enforce_eager else None,
                   pinned_adapter_gib=args.pinned_adapter_memory,
                   served_model_name=getattr(args, "served_model_name", None),  # the agent's flag only
                   threads=args.threads)

    def __init__(self, model: str | Path, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, block_size: int = EngineConfig.block_size,
                 num_blocks: int | None = None, kv_cache_memory: float | None = None,
                 max_num_seqs: int = EngineConfig.max_num_seqs,
                 max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
                 long_prefill_token_threshold: int = EngineConfig.long_prefill_token_threshold,
                 max_loras: int = EngineConfig.max_loras, max_lora_rank: int = EngineConfig.max_lora_rank,
                 scheduler: str = EngineConfig.scheduler, scheduler_options: dict | None = None,
                 memory_policy: str = EngineConfig.memory_policy, prefix_cache: bool = True,
                 num_host_blocks: int | None = None,
                 memory_options: dict | None = None, emulate_h2d_gbps: float | None = None,
                 cpu_assist: bool | None = None, cpu_assist_workers: int | None = None,
                 cuda_graphs: bool | None = None,
                 pinned_adapter_gib: float = DEFAULT_PINNED_ADAPTER_GIB,
                 served_model_name: str | None = None,
                 seed: int | None = None, threads: int | None = None, clock: Clock | None = None) -> None:
        """`clock`: what the engine reads the time from (default the monotonic clock; a benchmark may
        run it on a virtual one)."""
        from transformers import AutoTokenizer

        self.model_dir = Path(model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.served_model_name = served_model_name or self.model_dir.name
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, self.model_config, torch_device)
        if torch_device.type == "cpu":
            torch.set_num_threads(cpu_threads(self.model_config, threads))
        max_len = resolve_max_model_len(self.model_config, max_model_len)
        blocks = num_kv_blocks(self.model_config, torch_device, torch_dtype, block_size=block_size,
                               max_model_len=max_len, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                               kv_cache_memory_gib=kv_cache_memory)
        self.engine_config = EngineConfig(
            max_model_len=max_len, block_size=block_size, num_blocks=blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, long_prefill_token_threshold=long_prefill_token_threshold,
            max_loras=max_loras, max_lora_rank=max_lora_rank, scheduler=scheduler, scheduler_options=dict(scheduler_options or {}),
            memory_policy=memory_policy, prefix_cache=prefix_cache,
            num_host_blocks=blocks if num_host_blocks is None else num_host_blocks,
            memory_options=dict(memory_options or {}),
            cpu_assist=resolve_cpu_assist(cpu_assist, torch_device, emulate_h2d_gbps))
        # the one map of the adapters: the core's table, and where the executor reads their weights
        self.adapters = AdapterRegistry()
        self.executor = TorchExecutor(self.model_config, self.engine_config, torch_device, torch_dtype,
                                      self.adapters.host, model_dir=self.model_dir, seed=seed,
                                      emulate_h2d_gbps=emulate_h2d_gbps, cpu_assist_workers=cpu_assist_workers,
                                      cuda_graphs=cuda_graphs, pinned_adapter_gib=pinned_adapter_gib)
        self.core = EngineCore(self.engine_config, self.executor, clock=clock, adapter_pages=self._adapter_pages,
                               adapters=self.adapters)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.eos_token_ids = _eos_ids(self.model_config.eos_token_ids, self.tokenizer.eos_token_id)
        self.executor.sampler.json.use_vocabulary(TokenTexts.of(self.tokenizer, self.model_config.vocab_size,
                                                                torch_device))
        self._request_ids = itertools.count()

    # ---- adapters ---------------------------------------------------------------------------

    def _adapter_pages(self, info: AdapterInfo) -> int:
        """Device pages of an adapter in host memory; an unknown one (the size of a fixed slot) is
        taken to wrap every target module."""
        if self.adapters.holds(info.id):
            return self.executor.adapter_pages(self.adapters.host(info.id))
        return self.executor.pages_for_rank(info.rank)

    def add_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        """Read and validate a PEFT folder into host memory and make it servable."""
        host = load_peft_adapter(name, path, self.model_config, self.engine_config.max_lora_rank,
                                 base_model_aliases=[self.served_model_name])
        self.register(host, path=str(path))
        return host.info

    def register(self, host: HostAdapter, pinned: bool = False, path: str | None = None) -> None:
        """Make an adapter already in host memory servable (the engine sizes its pages from it). A
        taken name is refused before anything changes; a refusal by the engine leaves no trace."""
        self.adapters.hold(AdapterRecord(host, path))
        try:
            self.executor.stage_adapter(host)  # in pinned memory on CUDA, before any load of it
            self.core.add_adapter(host.info, pinned=pinned)  # the core admits it into the registry
        except Exception:
            self._drop(host.id)
            raise

    def remove_adapter(self, name: str) -> AdapterInfo:
        """Stop serving `name` (servable or unloading) and drop its weights: call between `generate`
        calls, or, as the engine thread does, once no accepted request uses it."""
        info = self.core.remove_adapter(name)  # the core retires it in the registry
        self._drop(info.id)
        return info

    def _drop(self, adapter_id: AdapterId) -> None:
        self.adapters.release(adapter_id)
        self.executor.forget_adapter(adapter_id)

    # ---- generation -------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams],
                 adapters: Sequence[str | None] | None = None) -> list[Request]:
        """Run every prompt to completion (continuous batching inside); requests in prompt order,
        with their `prompt_logprobs` when their sampling parameters ask for them."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        names = list(adapters) if adapters is not None else [None] * len(prompts)
        if not len(params) == len(names) == len(prompts):
            raise InvalidRequestError("prompts, sampling and adapters must have the same length")
        requests = [self.make_request(p, s, a) for p, s, a in zip(prompts, params, names, strict=True)]
        by_id = {request.request_id: request for request in requests}
        for request in requests:
            self.core.add_request(request)
        while not all(r.is_finished for r in requests):
            for output in self.core.step():
                if output.prompt_logprobs is not None and output.request_id in by_id:
                    by_id[output.request_id].prompt_logprobs = output.prompt_logprobs
        return requests

    def make_request(self, prompt: Prompt, sampling: SamplingParams, adapter: str | None = None) -> Request:
        token_ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        adapter_id = None
        if adapter is not None:
            record = self.adapters.get(adapter)
            if record is None:
                raise NotFoundError(f"adapter {adapter!r} is not loaded", param="model")
            adapter_id = record.info.id
        return Request(request_id=f"llm-{next(self._request_ids)}", prompt_token_ids=token_ids,
                       sampling=sampling, adapter=adapter_id, eos_token_ids=self.eos_token_ids)


def resolve_cpu_assist(asked: bool | None, device: torch.device, emulate_h2d_gbps: float | None) -> bool:
    """None (auto): on where copies cost time, on CUDA or under the emulated copy bandwidth; on a
    plain CPU host a copy is a memcpy and assisting would only add work."""
    return asked if asked is not None else (device.type == "cuda" or emulate_h2d_gbps is not None)


def resolve_max_model_len(config: ModelConfig, requested: int | None) -> int:
    """The model's context limit unless a smaller one is asked for. Sliding-window attention is not
    implemented, so a Mistral-style window caps the context (the window then never binds)."""
    limit = config.max_position_embeddings
    if config.sliding_window:
        limit = min(limit, config.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise InvalidRequestError(f"max_model_len={requested} exceeds this model's limit of {limit} tokens")
    return requested


def _eos_ids(configured: tuple[int, ...], tokenizer_eos: int | None) -> tuple[int, ...]:
    if tokenizer_eos is None or tokenizer_eos in configured:
        return configured
    return (*configured, tokenizer_eos)
