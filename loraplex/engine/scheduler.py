"""The scheduler seam and the FIFO scheduler.

There are no prefill or decode phases, only a per-step token budget: every request is given tokens
so that its computed tokens catch up with its known tokens (prompt chunks first, then one token per
decode). Running requests go first, oldest first; when KV blocks run out the newest running request
is preempted and recomputed later. Waiting requests are admitted in arrival order while the budget,
the batch size, memory and adapter slots allow; a request whose adapter cannot get a slot is skipped
for this step, keeping its place in the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from loraplex.engine.adapter_residency import AdapterResidency
from loraplex.engine.clock import Clock
from loraplex.engine.config import EngineConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.messages import (
    NO_ADAPTER_SLOT,
    AdapterLoad,
    ExecutorResult,
    RequestOutput,
    ScheduledChunk,
    SchedulerOutput,
)
from loraplex.engine.request import FinishReason, Request, RequestStatus
from loraplex.engine.stopping import finish_reason
from loraplex.spec.adapter import AdapterId

RankOf = Callable[[AdapterId], int]


class Scheduler(Protocol):
    """A step's policy. `schedule` says what one forward pass computes; `update` applies its result."""

    def add_request(self, request: Request) -> None: ...

    def abort_request(self, request_id: str) -> Request | None: ...

    def schedule(self) -> SchedulerOutput: ...

    def update(self, output: SchedulerOutput, result: ExecutorResult) -> list[RequestOutput]: ...

    def retire_adapter(self, adapter: AdapterId) -> None: ...

    def has_unfinished(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...


class FifoScheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, residency: AdapterResidency,
                 rank_of: RankOf, clock: Clock) -> None:
        self.config = config
        self.kv = kv
        self.residency = residency
        self.rank_of = rank_of
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._slots: dict[str, int] = {}  # request_id -> adapter slot, while it holds one
        self._retiring: set[AdapterId] = set()
        self._evictions: list[int] = []
        self._finished: list[str] = []

    # ---- public API -------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return request

    def retire_adapter(self, adapter: AdapterId) -> None:
        """Drop `adapter` from its slot as soon as no running request uses it."""
        self._retiring.add(adapter)
        self._try_retire(adapter)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(chunks=[], adapter_loads=[], adapter_evictions=self._evictions,
                              finished_request_ids=self._finished, preempted_request_ids=[])
        self._evictions, self._finished = [], []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if self.waiting and not out.preempted_request_ids:
            self._schedule_waiting(out, budget)
        return out

    def update(self, output: SchedulerOutput, result: ExecutorResult) -> list[RequestOutput]:
        # Runs once per sequence per step, hence the locals and the token bookkeeping written inline.
        outputs = []
        now = self.clock.now()
        requests, running, sampled = self.requests, RequestStatus.RUNNING, result.sampled
        max_model_len = self.config.max_model_len
        finished = False
        for chunk in output.chunks:
            request = requests.get(chunk.request_id)
            if request is None or request.status is not running:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(chunk.token_ids)
            if not chunk.sample:
                continue
            token = sampled[chunk.request_id]
            token_id, tokens = token.token_id, request.output_token_ids
            tokens.append(token_id)
            request.output_logprobs.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = finish_reason(request, max_model_len)
            if reason is not None:
                self._finish(request, reason)  # dropped from the running list below
                finished = True
            outputs.append(RequestOutput(chunk.request_id, [token_id], [token], len(request.prompt_token_ids),
                                         len(tokens), reason is not None, reason))
        if finished:  # one pass instead of a list.remove per finished request
            self.running = [r for r in self.running if r.status is running]
        return outputs

    # ---- scheduling -------------------------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Runs once per running request per step, hence the locals and the counts read once.
        chunks, allocate, chunk, running = out.chunks, self.kv.allocate, self._chunk, RequestStatus.RUNNING
        for request in list(self.running):  # a copy: preemption removes from self.running
            if budget == 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this loop
            start = request.num_computed_tokens
            num_prompt, num_output = len(request.prompt_token_ids), len(request.output_token_ids)
            num_tokens = num_prompt + num_output - start
            if num_tokens > budget:
                num_tokens = budget
            if allocate(request, num_tokens) or self._allocate_or_preempt(request, num_tokens, out):
                chunks.append(chunk(request, start, num_tokens, num_prompt, num_output))
                budget -= num_tokens
        return budget

    def _allocate_or_preempt(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running requests until `request` fits (a failed allocate takes nothing)."""
        while not self.kv.allocate(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if not self._acquire_slot(request, out):
                skipped.append(request)
                continue
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate(request, num_tokens):
                self._release_slot(request)
                self.waiting.appendleft(request)
                break
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock.now()
            self.running.append(request)
            out.chunks.append(self._chunk(request, request.num_computed_tokens, num_tokens,
                                          len(request.prompt_token_ids), len(request.output_token_ids)))
            budget -= num_tokens
        self.waiting.extendleft(reversed(skipped))

    def _chunk(self, request: Request, start: int, num_tokens: int, num_prompt: int,
               num_output: int) -> ScheduledChunk:
        """`num_tokens` tokens from position `start` (the request's computed tokens); the caller
        passes the counts it already read."""
        if start >= num_prompt:  # a decode: the common case, sliced here without a call
            tokens = request.output_token_ids[start - num_prompt:start - num_prompt + num_tokens]
        else:
            tokens = request.token_slice(start, num_tokens)
        return ScheduledChunk(
            request.request_id, tokens, start, request.block_ids,
            self._slots.get(request.request_id, NO_ADAPTER_SLOT),
            start + num_tokens == num_prompt + num_output, request.sampling, num_output)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._release_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)

    # ---- adapters -------------------------------------------------------------------------

    def _acquire_slot(self, request: Request, out: SchedulerOutput) -> bool:
        if request.adapter is None:
            return True
        grant = self.residency.acquire(request.adapter)
        if grant is None:
            return False
        if grant.loaded:
            out.adapter_loads.append(AdapterLoad(grant.slot, request.adapter, self.rank_of(request.adapter)))
        self._slots[request.request_id] = grant.slot
        return True

    def _release_slot(self, request: Request) -> None:
        if self._slots.pop(request.request_id, None) is None:
            return
        self.residency.release(request.adapter)
        self._try_retire(request.adapter)

    def _try_retire(self, adapter: AdapterId) -> None:
        if adapter not in self._retiring:
            return
        slot = self.residency.retire(adapter)
        if slot is not None:
            self._evictions.append(slot)
            self._retiring.discard(adapter)
        elif self.residency.slot_of(adapter) is None:
            self._retiring.discard(adapter)

    # ---- results ----------------------------------------------------------------------------

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.block_ids:
            self.kv.free(request)
        self._release_slot(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = self.clock.now()
        del self.requests[request.request_id]
        self._finished.append(request.request_id)


SCHEDULERS = {"fifo": FifoScheduler}


def make_scheduler(config: EngineConfig, kv: KVCacheManager, residency: AdapterResidency,
                   rank_of: RankOf, clock: Clock) -> Scheduler:
    try:
        cls = SCHEDULERS[config.scheduler]
    except KeyError:
        raise ValueError(f"unknown scheduler {config.scheduler!r}; choose from {sorted(SCHEDULERS)}") from None
    return cls(config, kv, residency, rank_of, clock)
