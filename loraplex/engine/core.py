"""EngineCore: the `schedule -> execute -> update` loop over a scheduler and an executor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.engine.adapter_table import AdapterInfos, AdapterTable
from loraplex.engine.config import EngineConfig
from loraplex.engine.executor import Executor
from loraplex.engine.memory.paged_memory import AdapterPages, no_adapter_pages
from loraplex.engine.memory.policies import make_memory
from loraplex.engine.memory.stats import MemoryStats
from loraplex.engine.messages import RequestOutput
from loraplex.engine.output.prompt_logprobs import PromptLogprobsCollector
from loraplex.engine.request import Request, SampledToken
from loraplex.engine.scheduling.schedulers import make_scheduler
from loraplex.engine.scheduling.stats import SchedulerStats
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.spec.alora import adapter_start
from loraplex.spec.errors import AdapterError, ConflictError, InvalidRequestError, NotFoundError
from loraplex.util.clock import Clock, MonotonicClock


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    resident_adapters: list[AdapterId]
    prompt_tokens_total: int
    generation_tokens_total: int
    adapter_loads_total: int
    steps_total: int

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, clock: Clock | None = None,
                 adapter_pages: AdapterPages = no_adapter_pages, adapters: AdapterTable | None = None) -> None:
        """`adapter_pages` gives the device pages an adapter's weights take (the executor knows the
        layout); the default models adapters that cost no memory. `adapters`: the table of the
        adapters it serves, when its owner keeps one (the agent's registry); else a plain one."""
        self.config = config
        self.executor = executor
        self.clock = clock or MonotonicClock()
        self.memory = make_memory(config, adapter_pages, self.clock)
        self.adapters: AdapterTable = AdapterInfos() if adapters is None else adapters
        # ranks outlive unloading: queued requests of an unloaded adapter still need a slot
        self._ranks: dict[AdapterId, int] = {}
        self.scheduler = make_scheduler(config, self.memory, self._rank_of, self.clock)
        self._prompt_logprobs = PromptLogprobsCollector()
        self._copy_bytes = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._adapter_loads = 0
        self._steps = 0

    # ---- adapters ---------------------------------------------------------------------------

    def add_adapter(self, info: AdapterInfo, pinned: bool = False) -> None:
        """Make `info` servable; a pinned adapter is loaded to the device now and never evicted."""
        if self.adapters.serving(info.id.name) is not None:
            raise ConflictError(f"adapter {info.id.name!r} is already loaded; unload it first",
                                param="lora_name")
        if not 1 <= info.rank <= self.config.max_lora_rank:
            raise AdapterError(f"adapter {info.id.name!r} has rank {info.rank}, above this engine's "
                               f"max_lora_rank={self.config.max_lora_rank}")
        pages = self.memory.adapter_pages_of(info) if self.memory.shares_pool else 0
        if pages >= self.memory.num_pages:
            raise AdapterError(f"adapter {info.id.name!r} needs {pages} pages of device memory and this engine has "
                               f"{self.memory.num_pages}; give the engine more memory")
        self.memory.add_adapter(info, pinned=pinned)
        self.adapters.admit(info)
        self._ranks[info.id] = info.rank

    def remove_adapter(self, name: str) -> AdapterInfo:
        """New requests for `name` are refused at once; running ones finish with the weights they have."""
        info = self.adapters.retire(name)
        if info is None:
            raise NotFoundError(f"adapter {name!r} is not loaded", param="lora_name")
        self.scheduler.retire_adapter(info.id)
        return info

    def _rank_of(self, adapter: AdapterId) -> int:
        return self._ranks[adapter]

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        limit = self.config.max_model_len
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if request.num_prompt_tokens >= limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{request.num_prompt_tokens} tokens", param="prompt", code="context_length_exceeded")
        if request.adapter is not None:
            info = self.adapters.serving(request.adapter.name)
            if info is None or info.id != request.adapter:
                raise NotFoundError(f"adapter {request.adapter.name!r} is not loaded", param="model")
            request.adapter_from = adapter_start(request.prompt_token_ids, info.invocation_tokens)
        request.arrival_time = request.arrival_time or self.clock.now()
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        scheduler = self.scheduler
        output = scheduler.schedule()
        if output.is_empty and not output.finished_request_ids and not self.memory.copies_in_flight:
            return []
        result = self.executor.execute(output)
        outputs = scheduler.update(output, result)
        if result.prompt_logprobs or self._prompt_logprobs:
            self._prompt_logprobs.update(result.prompt_logprobs, outputs, output.finished_request_ids)
        self._copy_bytes += result.copy_bytes
        self._steps += 1
        self._adapter_loads += len(output.adapter_loads)
        self._generation_tokens += len(outputs)
        for o in outputs:  # a loop, not sum(generator): this runs every step
            if o.num_output_tokens == 1:
                self._prompt_tokens += o.num_prompt_tokens
        return outputs

    def advance_decodes(self, steps: int, token: SampledToken, starts: Sequence[float]) -> list[RequestOutput]:
        """Count `steps` plain decode steps of the scheduler's `decode_span` that an executor ran at
        once (the twin's), starting at `starts`, each decode sampling `token`; returns the outputs
        of the requests its last step finished."""
        self._generation_tokens += steps * self.scheduler.num_running
        self._steps += steps
        return self.scheduler.advance_decodes(steps, token, starts)

    @property
    def num_steps(self) -> int:
        """Steps run so far (a step may produce no token: one that only finished a copy)."""
        return self._steps

    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler's queues, quotas, bypasses, predictor error and per-adapter service."""
        return self.scheduler.stats()

    def memory_stats(self) -> MemoryStats:
        """Pages by kind, prefix and adapter hit rates, copies and evictions of the memory policy."""
        stats = self.memory.stats()
        stats.h2d_bytes = self._copy_bytes
        return stats

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_free_blocks=self.memory.num_free_pages, num_blocks=self.memory.num_pages,
            num_preemptions=getattr(self.scheduler, "num_preemptions", 0),
            resident_adapters=self.memory.resident(), prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens, adapter_loads_total=self._adapter_loads,
            steps_total=self._steps)
