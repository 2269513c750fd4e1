"""The scheduler seam, the mechanics every policy shares, and the FIFO scheduler.

There are no prefill or decode phases, only a per-step token budget: every request is given tokens
so that its computed tokens catch up with its known tokens (prompt chunks first, then one token per
decode). With `long_prefill_token_threshold` one request's prompt gets at most that many tokens of a
step, so a short prompt that arrives during a long one's prefill joins the next step instead of
waiting behind all of it. Running requests go first, oldest first; when KV blocks run out the newest running request
is preempted; its computed blocks stay in the prefix cache, so it resumes from there. `BatchScheduler` does all of that; a policy only decides which
waiting requests to admit (`_schedule_waiting`) and keeps its own waiting structure. FIFO admits in
arrival order while the budget, the batch size, memory and adapters allow; a request whose
adapter is not on the device yet is skipped for this step (its copy starts), keeping its place.
The other policies (`sjf`, `vtc`, `chameleon`) live one per module; `schedulers.py` names them.

Every step that leaves requests waiting is counted under what ended admission
(`SchedulerStats.admission_limits`): the step's token budget, the seats (`max_num_seqs`), KV pages
(a refused first chunk, or a preemption), an adapter that could not get memory yet, or the policy
itself (quotas, an order that holds requests back). Only the last two are a policy's to change.

Idle capacity is counted too (`SchedulerStats.idle`): a step that ends with a free seat and unused
token budget while a waiting request fits (its adapter is on the device and not being copied, the
KV pages of its first chunk are free, and no admission tried it this step) left capacity idle that
the policy could have used; the policy names why it held that request (`_held_reason`). A
work-conserving policy keeps these counters at zero.
"""

from __future__ import annotations

import enum
import math
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Protocol

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.device_memory import DeviceMemory
from loraplex.engine.memory.kv_cache import blocks_for
from loraplex.engine.messages import (
    NO_ADAPTER_SLOT,
    DecodeSpan,
    ExecutorResult,
    RequestOutput,
    ScheduledChunk,
    SchedulerOutput,
)
from loraplex.engine.options import options_for
from loraplex.engine.output.stopping import finish_reason
from loraplex.engine.request import FinishReason, Request, RequestStatus, SampledToken
from loraplex.engine.scheduling.stats import IdleCapacity, QueueStats, SchedulerStats
from loraplex.spec.adapter import AdapterId
from loraplex.util.clock import Clock

RankOf = Callable[[AdapterId], int]
ADMISSION_LIMITS = ("budget", "seats", "kv", "adapter", "policy")
# Limits that hold, unchanged, while the batch only decodes: its seats stay taken, and an adapter
# refused a slot stays refused (a budget spent on prefill chunks frees up, a refused first chunk may
# have evicted cache, and a policy's own order may change: those are not steady).
_STEADY_LIMITS = frozenset(("seats", "adapter"))


class Scheduler(Protocol):
    """A step's policy. `schedule` says what one forward pass computes; `update` applies its result."""

    def add_request(self, request: Request) -> None: ...

    def abort_request(self, request_id: str) -> Request | None: ...

    def schedule(self) -> SchedulerOutput: ...

    def update(self, output: SchedulerOutput, result: ExecutorResult) -> list[RequestOutput]: ...

    def retire_adapter(self, adapter: AdapterId) -> None: ...

    def has_unfinished(self) -> bool: ...

    def decode_span(self, token_id: int) -> DecodeSpan | None:
        """The next steps that only decode an unchanged batch, for an executor that runs them at once."""

    def advance_decodes(self, steps: int, token: SampledToken, starts: Sequence[float]) -> list[RequestOutput]: ...

    def stats(self) -> SchedulerStats:
        """A snapshot for metrics; cheap enough to take every second, not every step."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...


class Admit(enum.Enum):
    """What happened when the scheduler tried to start one waiting request."""

    OK = "ok"  # running now; its first chunk is the last one in the step's output
    NO_SLOT = "no_slot"  # its adapter (or cached prefix) is not on the device yet
    NO_KV = "no_kv"  # too few KV blocks for its first chunk


def adapter_key(adapter: AdapterId | None) -> str:
    """The name metrics use for an adapter; '' is the base model."""
    return adapter.name if adapter is not None else ""


class BatchScheduler:
    """Running requests, preemption, device memory and finishing: what every policy shares. A subclass owns the waiting requests: `_enqueue`, `_requeue`, `_remove_waiting`,
    `num_waiting` and `_schedule_waiting`, which admits through `_admit`."""

    policy = "base"

    def __init__(self, config: EngineConfig, memory: DeviceMemory, rank_of: RankOf, clock: Clock) -> None:
        self.config = config
        self.chunk_tokens = config.prefill_chunk_tokens  # of one request's prompt per step
        self.memory = memory
        self.rank_of = rank_of
        self.clock = clock
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._slots: dict[str, int] = {}  # request_id -> adapter handle, while it holds one
        self._finished: list[str] = []
        self._waiting_adapters: Counter[AdapterId] = Counter()  # adapters of waiting requests
        memory.queued = self._is_queued  # the memory policy keeps these adapters longest
        self.adapter_service: defaultdict[str, int] = defaultdict(int)  # adapter -> tokens of finished requests
        self.admission_limits: Counter[str] = Counter()  # steps that left requests waiting, by what ended admission
        self._refused: Admit | None = None  # the last refusal of this step's admissions
        self._tried: set[str] = set()  # waiting requests an admission was tried on this step
        self.idle = IdleCapacity()
        self._stalled: str | None = None  # the limit of the last step when it admitted none and nothing moved
        self._idle_step: tuple[int, int, str] | None = None  # what the last step left idle, if anything
        self._span_finishes = 0  # the steps of the last decode span when its last step may finish requests

    # ---- the waiting requests: a policy's own structure ----------------------------------------

    @property
    def num_waiting(self) -> int:
        raise NotImplementedError

    def _enqueue(self, request: Request) -> None:
        """A new request arrived."""
        raise NotImplementedError

    def _requeue(self, request: Request) -> None:
        """A running request was preempted; it waits again (recomputed from scratch)."""
        raise NotImplementedError

    def _remove_waiting(self, request: Request) -> None:
        raise NotImplementedError

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        raise NotImplementedError

    def _on_finished(self, request: Request) -> None:
        """A request left for good (finished or aborted): policies learn from it here."""

    # ---- public API -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self._stalled = None  # not tried yet
        self.requests[request.request_id] = request
        self._waiting_adapters[request.adapter] += 1
        self._enqueue(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._stalled = None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self._remove_waiting(request)
            self._waiting_adapters[request.adapter] -= 1
        self._finish(request, FinishReason.ABORT)
        return request

    def retire_adapter(self, adapter: AdapterId) -> None:
        """Drop `adapter`'s weights and cached KV as soon as no running request uses it."""
        self.memory.retire_adapter(adapter)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(chunks=[], adapter_loads=[], adapter_evictions=[],
                              finished_request_ids=self._finished, preempted_request_ids=[])
        self._finished = []
        self._stalled = None
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if out.preempted_request_ids:
            if self.num_waiting:
                self.admission_limits["kv"] += 1
        elif self.num_waiting:
            self._refused = None
            self._tried.clear()
            num_running = len(out.chunks)
            self._schedule_waiting(out, budget)
            if self.num_waiting:
                limit = self._admission_limit(out)
                self.admission_limits[limit] += 1
                self._count_idle(out)
                if len(out.chunks) == num_running and limit in _STEADY_LIMITS:
                    self._stalled = limit
        self.memory.drain(out, len(self.running))
        if self._stalled is not None and (out.adapter_loads or out.adapter_evictions or out.kv_swap_out
                                          or out.kv_swap_in):
            self._stalled = None
        return out

    # ---- the twin's shortcut: a span of plain decode steps at once ------------------------------

    def quiet_until(self) -> float:
        """Until when the policy takes no decision of its own while the batch only decodes; a policy
        that acts on the clock says when it next does."""
        return math.inf

    def decode_span(self, token_id: int) -> DecodeSpan | None:
        """The steps from now on that change nothing but positions, when every decode samples
        `token_id`: each running request decodes one token and none finishes before the last of them
        (nor in the last while requests wait),
        no request is admitted (none waits, or the last step's admissions stopped at a steady limit),
        preempted or waits on a copy, and the new KV blocks fit in the free pages. None when the next
        step is not one of them. The real engine never asks; the twin times a span at once and applies
        it with `advance_decodes`."""
        running = self.running
        if not running or (self.num_waiting and self._stalled is None):
            return None
        if len(running) > self.config.max_num_batched_tokens:
            return None
        until = min(self.quiet_until(), self.memory.quiet_until())
        if until <= self.clock.now():
            return None
        # A finish frees a seat and a slot, which ends a stall; with nothing waiting nothing follows
        # from it until an arrival, so the span may run through the step that finishes the first.
        steps, last = self.config.max_model_len, 1 if self.num_waiting else 0
        for request in running:
            num_prompt, num_output = len(request.prompt_token_ids), len(request.output_token_ids)
            if (not num_output or request.num_computed_tokens != num_prompt + num_output - 1
                    or not _repeats(request, token_id)):
                return None
            steps = min(steps, request.sampling.max_tokens - num_output - last,
                        self.config.max_model_len - num_prompt - num_output - last)
        steps = self._steps_that_fit(steps)
        if steps < 1:
            return None
        self._span_finishes = 0 if last else steps  # its last step may finish requests
        chunks = [self._chunk(r, r.num_computed_tokens, 1, len(r.prompt_token_ids), len(r.output_token_ids))
                  for r in running]
        return DecodeSpan(chunks, steps, until)

    def advance_decodes(self, steps: int, token: SampledToken, starts: Sequence[float]) -> list[RequestOutput]:
        """Apply `steps` steps of the span `decode_span` gave (at most its `steps`): what as many
        `schedule` / `update` rounds would do, each decode sampling `token`; `starts` are the clock
        readings the steps start at, and the clock reads the end of the last. Returns the outputs
        of the requests the last step finished."""
        allocate, token_ids, tokens = self.memory.allocate, [token.token_id] * steps, [token] * steps
        max_model_len, finishing, last = self.config.max_model_len, [], steps == self._span_finishes
        for request in self.running:
            if not allocate(request, steps):
                raise RuntimeError(f"request {request.request_id!r} lost its KV room inside a decode span")
            request.num_computed_tokens += steps
            request.output_token_ids.extend(token_ids)
            request.output_logprobs.extend(tokens)
            self._on_decoded(request, steps)
            if last and (reason := finish_reason(request, max_model_len)) is not None:
                finishing.append((request, reason))
        if self._stalled is not None:
            self.admission_limits[self._stalled] += steps
            if self._idle_step is not None:  # each step of the span leaves what the last one left idle
                self.idle.add(*self._idle_step, steps=steps)
        self.memory.note_decode_steps(starts, len(self.running))
        outputs = []
        for request, reason in finishing:  # in batch order, as `update` finishes them
            self._finish(request, reason)
            outputs.append(RequestOutput(request.request_id, [token.token_id], [token], len(request.prompt_token_ids),
                                         len(request.output_token_ids), True, reason,
                                         num_cached_tokens=request.num_cached_tokens))
        if finishing:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
            self._stalled = None
        return outputs

    def _on_decoded(self, request: Request, steps: int) -> None:
        """`request` decoded `steps` tokens in a span: policies that count tokens count them here."""

    def _steps_that_fit(self, steps: int) -> int:
        """The most of `steps` decode steps whose new KV blocks fit in the free pages (a binary search:
        the pages needed grow with the steps)."""
        free, size, running = self.memory.num_free_pages, self.config.block_size, self.running

        def needed(k: int) -> int:
            return sum(max(0, blocks_for(r.num_computed_tokens + k, size) - len(r.block_ids)) for r in running)

        if needed(steps) <= free:
            return steps
        low, high = 0, steps  # needed(low) fits, needed(high) does not
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if needed(mid) <= free else (low, mid)
        return low

    def _admission_limit(self, out: SchedulerOutput) -> str:
        """What ended this step's admissions while requests still wait (one of ADMISSION_LIMITS)."""
        if sum(c.num_tokens for c in out.chunks) >= self.config.max_num_batched_tokens:
            return "budget"
        if len(self.running) >= self.config.max_num_seqs:
            return "seats"
        if self._refused is Admit.NO_KV:
            return "kv"
        return "adapter" if self._refused is Admit.NO_SLOT else "policy"

    def _count_idle(self, out: SchedulerOutput) -> None:
        """Count this step in `idle` if it ends with a free seat and unused budget while a waiting
        request fits (see the module's docstring)."""
        self._idle_step = None
        seats = self.config.max_num_seqs - len(self.running)
        tokens = self.config.max_num_batched_tokens - sum(c.num_tokens for c in out.chunks)
        if seats <= 0 or tokens <= 0:
            return
        fitting = next((r for r in self._waiting_requests() if self._fits(r, tokens)), None)
        if fitting is not None:
            self._idle_step = (seats, tokens, self._held_reason(fitting))
            self.idle.add(*self._idle_step)

    def _fits(self, request: Request, budget: int) -> bool:
        """The engine would start `request` now: untried this step, its adapter ready, the pages of its
        first chunk free (cached pages that could be evicted are not counted: an underestimate)."""
        if request.request_id in self._tried:
            return False
        adapter = request.adapter
        if adapter is not None and (not self.memory.holds(adapter) or self.memory.loading(adapter)):
            return False
        return blocks_for(self.first_chunk(request, budget), self.config.block_size) <= self.memory.num_free_pages

    def _held_reason(self, request: Request) -> str:
        """Why the policy left a fitting `request` waiting (`IdleCapacity.reasons`)."""
        return "order"  # behind a request that could not start, which ended the policy's admissions

    def stats(self) -> SchedulerStats:
        return SchedulerStats(policy=self.policy, queues=[self._queue_stats(0, None, self._waiting_requests())],
                              num_preemptions=self.num_preemptions, adapter_service=dict(self.adapter_service),
                              admission_limits=dict(self.admission_limits), idle=self.idle.snapshot())

    def update(self, output: SchedulerOutput, result: ExecutorResult) -> list[RequestOutput]:
        # Runs once per sequence per step, hence the locals and the token bookkeeping written inline.
        if result.copies_done:
            self.memory.on_result(result)
            self._stalled = None
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
                                         len(tokens), reason is not None, reason,
                                         num_cached_tokens=request.num_cached_tokens))
        if finished:  # one pass instead of a list.remove per finished request
            self.running = [r for r in self.running if r.status is running]
            self._stalled = None  # seats and slots came free
        return outputs

    # ---- scheduling -------------------------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Runs once per running request per step, hence the locals and the counts read once.
        chunks, allocate, chunk, running = out.chunks, self.memory.allocate, self._chunk, RequestStatus.RUNNING
        cap = self.chunk_tokens
        for request in list(self.running):  # a copy: preemption removes from self.running
            if budget == 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this loop
            start = request.num_computed_tokens
            num_prompt, num_output = len(request.prompt_token_ids), len(request.output_token_ids)
            num_tokens = num_prompt + num_output - start
            if num_tokens > cap:  # a long prefill leaves room for the requests that arrive meanwhile
                num_tokens = cap
            if num_tokens > budget:
                num_tokens = budget
            if allocate(request, num_tokens) or self._allocate_or_preempt(request, num_tokens, out):
                chunks.append(chunk(request, start, num_tokens, num_prompt, num_output))
                budget -= num_tokens
        return budget

    def _allocate_or_preempt(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running requests until `request` fits (a failed allocate takes nothing)."""
        while not self.memory.allocate(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, out: SchedulerOutput, budget: int) -> Admit:
        """Start `request` with a first chunk of at most `budget` tokens, or take nothing."""
        self._tried.add(request.request_id)
        if not self._acquire_slot(request):
            return self._refuse(Admit.NO_SLOT)
        if request.num_computed_tokens == 0 and not self.memory.begin(request):
            self._release_slot(request)
            return self._refuse(Admit.NO_SLOT)
        num_tokens = self.first_chunk(request, budget)
        if not self.memory.allocate(request, num_tokens):
            self.memory.release(request)
            request.num_computed_tokens = 0
            self._release_slot(request)
            return self._refuse(Admit.NO_KV)
        request.status = RequestStatus.RUNNING
        self._waiting_adapters[request.adapter] -= 1
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock.now()
        self.running.append(request)
        out.chunks.append(self._chunk(request, request.num_computed_tokens, num_tokens,
                                      len(request.prompt_token_ids), len(request.output_token_ids)))
        return Admit.OK

    def first_chunk(self, request: Request, budget: int) -> int:
        """The tokens `request` would compute if admitted now, with `budget` tokens left in the step."""
        return min(request.num_tokens - request.num_computed_tokens, budget, self.chunk_tokens)

    def _refuse(self, admit: Admit) -> Admit:
        if self._refused is not Admit.NO_KV:  # KV ends a step's admissions; a missing adapter only skips one
            self._refused = admit
        return admit

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
            start + num_tokens == num_prompt + num_output, request.sampling, num_output, request.adapter_from)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        self._stop_running(request, out)

    def _stop_running(self, request: Request, out: SchedulerOutput) -> None:
        """Take a running request off the batch and let it wait again; its computed blocks go to the
        prefix cache (where the policy keeps one), the rest is recomputed."""
        self.running.remove(request)
        self.memory.release(request)
        self._release_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._waiting_adapters[request.adapter] += 1
        self._requeue(request)
        out.preempted_request_ids.append(request.request_id)

    # ---- adapters -------------------------------------------------------------------------

    def _is_queued(self, adapter: AdapterId | None) -> bool:
        return self._waiting_adapters[adapter] > 0

    def _acquire_slot(self, request: Request) -> bool:
        if request.adapter is None:
            return True
        handle = self.memory.acquire_adapter(request.adapter)
        if handle is None:
            return False
        self._slots[request.request_id] = handle
        return True

    def _release_slot(self, request: Request) -> None:
        if self._slots.pop(request.request_id, None) is not None:
            self.memory.release_adapter(request.adapter)

    # ---- results ----------------------------------------------------------------------------

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.block_ids:
            self.memory.release(request)
        self._release_slot(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = self.clock.now()
        del self.requests[request.request_id]
        self._finished.append(request.request_id)
        if request.first_scheduled_time is not None:
            self.adapter_service[adapter_key(request.adapter)] += request.num_tokens
        self._on_finished(request)

    # ---- stats ------------------------------------------------------------------------------

    def _waiting_requests(self) -> list[Request]:
        return [r for r in self.requests.values() if r.status is not RequestStatus.RUNNING]

    def _queue_stats(self, index: int, upper: float | None, waiting: list[Request], **extra) -> QueueStats:
        now = self.clock.now()
        oldest = min((r.arrival_time for r in waiting), default=now)
        return QueueStats(index=index, upper_boundary=upper, length=len(waiting),
                          head_wait_s=max(0.0, now - oldest), **extra)


def _repeats(request: Request, token_id: int) -> bool:
    """Whether sampling `token_id` again and again leaves `request` running until its length limit."""
    sampling = request.sampling
    return (not sampling.json_object and token_id not in sampling.stop_token_ids
            and (sampling.ignore_eos or token_id not in request.eos_token_ids))


class FifoScheduler(BatchScheduler):
    policy = "fifo"

    def __init__(self, config: EngineConfig, memory: DeviceMemory, rank_of: RankOf, clock: Clock) -> None:
        super().__init__(config, memory, rank_of, clock)
        options_for(config.scheduler_options)  # takes none
        self.waiting: deque[Request] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def _requeue(self, request: Request) -> None:
        self.waiting.appendleft(request)

    def _remove_waiting(self, request: Request) -> None:
        self.waiting.remove(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            admit = self._admit(request, out, budget)
            if admit is Admit.OK:
                budget -= out.chunks[-1].num_tokens
            elif admit is Admit.NO_SLOT:
                skipped.append(request)
            else:
                self.waiting.appendleft(request)
                break
        self.waiting.extendleft(reversed(skipped))
