"""Chameleon's multi-queue, non-preemptive scheduler (MICRO '25; our notes in papers/chameleon.md).

On arrival a request gets a predicted output length (`output_predictor`), a weighted size
(`wrs.SizeModel.wrs`) and a token need (input + predicted output + adapter size in KV-token
equivalents), and joins the size queue its WRS falls in. Every step, after the running requests:

0. Queue heads that wait only for adapter memory, and now fit, go first (the holder, see below,
   then oldest first). If one cannot get memory but releasing the younger requests that bypassed
   it would give it some, those are squashed (stopped, their KV dropped, re-queued in arrival
   order) and the head starts. Then every request that has waited past the aging limit, whatever
   its queue, in arrival order (beyond the paper, `_serve_aged`); one refused KV pages ends the
   step's admissions, the fill below included, as FIFO's head does: the pages that free are its.
1. Phase 1, smallest queue first: each queue admits in arrival order while its quota has room,
   stopping at the first request that does not fit. A queue left empty lends what it did not use.
2. Phase 2, smallest queue first: the lent spare admits more, again stopping at a misfit.
3. Fill (beyond the paper; `work_conserving`, on by default): whatever seats and budget the quotas
   left goes to any waiting request that fits, queues in the step's order, each in arrival order,
   past misfits and blocked heads; such a request borrows no quota. With the quotas alone a
   queue at its quota waits while seats and budget sit idle whenever another queue is not empty.

A request borrows min(need, its queue's quota) tokens and one seat at admission and returns them
when it finishes (or is preempted). Quotas come from the M/M/1 floor (`quotas`); seats, the
engine's `max_num_seqs`, are split the same way with S = 1, so no queue can take every seat.
Every K-means refresh (`queue_plan`: each `refresh_s` on the injected clock, once `min_samples`
requests have arrived, and when the arrival rate or mean WRS of the last `shift_window_s` moves
by `shift_factor` from the last refresh) recomputes K, the boundaries and the quotas, moves waiting
requests to their new queues in arrival order and re-charges running ones to the queue their WRS
now falls in.

Opportunistic bypass: when a head fits its quota but its adapter cannot get memory
(`memory.gate`), a younger request of the same queue may pass it when the head's charge still
fits the quota left after it and either it takes no memory the head waits for (with slots: its
adapter is already resident) or, as in the paper, its predicted steps (prefill chunks + output)
are fewer than the steps until memory frees; at most `max_bypasses` per head. Squash: when the
memory held by the head's running bypassers alone would let it start, they are stopped and
re-queued in arrival order, and the head starts; only bypassers less than half done (by their
prediction) are stopped, which bounds the work thrown away.

Beyond the paper: once a head has been blocked for `reserve_after_s`, the oldest such head becomes
the holder (one at a time): it reserves the resident adapter whose running requests are predicted
to end first, new requests of that adapter wait, and no one else may take memory for an adapter
that has none until the holder starts, so memory does free for it. Queues that a global limit (the
step's token budget, seats, KV blocks) kept from being served go first on the next step. Together
these keep a steady stream of small or hot-adapter requests from starving anyone through limits
the quotas do not cover. The engine's memory preemption (recompute of the newest running request)
stays as the safety net when predictions run short. Nothing here is random (K-means seeds are
deterministic).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from itertools import count, takewhile

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.device_memory import DeviceMemory
from loraplex.engine.memory.gate import MemoryGate, PageGate
from loraplex.engine.messages import SchedulerOutput
from loraplex.engine.request import FinishReason, Request, RequestStatus
from loraplex.engine.scheduling.output_predictor import OutputLengthPredictor, PredictorOptions
from loraplex.engine.scheduling.queue_plan import classify, plan_boundaries
from loraplex.engine.scheduling.quotas import QueueLoad, plan_quotas
from loraplex.engine.scheduling.scheduler import Admit, BatchScheduler, RankOf, options_for
from loraplex.engine.scheduling.sjf import learn_output, predict_output
from loraplex.engine.scheduling.stats import SchedulerStats
from loraplex.engine.scheduling.wrs import SizeModel
from loraplex.spec.adapter import AdapterId
from loraplex.util.clock import Clock

SPARE = -1  # `_Entry.charged_to` of a request admitted on the spare of emptied queues (or by an aged head)
UNCHARGED = -2  # waiting: holds nothing
IDLE = -3  # admitted on capacity the quotas left idle this step (work-conserving fill): holds no quota


@dataclass(frozen=True)
class ChameleonOptions:
    refresh_s: float = 300.0  # T_refresh: K-means, boundaries and quotas
    max_queues: int = 4  # K_max
    elbow_gain: float = 0.1  # one more queue must remove this share of WCSS(1)
    min_samples: int = 32  # arrivals before the first K-means (one queue until then)
    window_max: int = 4096  # most recent arrivals kept for K-means and the quota inputs
    shift_window_s: float = 30.0  # recent window compared with the last refresh
    shift_factor: float = 2.0  # a rate or mean WRS this many times higher or lower is a load shift
    slo_s: float = 5.0  # SLO of the M/M/1 floor (time in system)
    default_service_s: float = 1.0  # D before any request of a queue has finished
    quota_split: str = "min"  # the pool beyond the floors: "min" (in proportion to them) or "equal"
    input_weight: float = 0.4  # WRS weights
    output_weight: float = 0.6
    base_rank: int = 8  # the rank a base-model request counts as in WRS
    adapter_tokens_per_rank: float = 4.0  # KV-token equivalents of one rank (Llama-7B: 4)
    max_bypasses: int = 64  # younger requests that may pass one blocked head
    reserve_after_s: float = 1.0  # a head blocked this long gets memory reserved (one at a time)
    bypass_scan: int = 64  # younger requests looked at per blocked head and step
    # a queue head waiting longer goes before the smaller queues and may borrow what nobody holds
    # (None: aging_factor x the recent mean wait, at most half of slo_s; 0: off, the paper's order alone)
    max_wait_s: float | None = None
    aging_factor: float = 1.0
    # after the quotas, any waiting request that fits takes what the step left idle (False: the paper's
    # quotas alone, which leave seats and budget idle while a quota-bound queue waits)
    work_conserving: bool = True

    def __post_init__(self) -> None:
        for name in ("refresh_s", "shift_window_s", "slo_s", "default_service_s", "elbow_gain"):
            if not getattr(self, name) > 0:
                raise ValueError(f"chameleon option {name} must be positive")
        if not 1 <= self.max_queues <= 16 or self.min_samples < 2 or self.window_max < self.min_samples:
            raise ValueError("chameleon needs 1 <= max_queues <= 16 and 2 <= min_samples <= window_max")
        if self.shift_factor <= 1 or self.max_bypasses < 0 or self.bypass_scan < 1 or self.reserve_after_s < 0:
            raise ValueError("chameleon needs shift_factor > 1, max_bypasses >= 0, bypass_scan >= 1, "
                             "reserve_after_s >= 0")
        if self.max_wait_s is not None and self.max_wait_s < 0:
            raise ValueError("chameleon option max_wait_s must be >= 0 (0: off)")
        if not self.aging_factor > 0:
            raise ValueError("chameleon option aging_factor must be positive")
        if self.quota_split not in ("min", "equal"):
            raise ValueError(f"quota_split {self.quota_split!r} is not 'min' or 'equal'")


@dataclass(slots=True, eq=False)
class _Entry:
    request: Request
    seq: int  # arrival order
    predicted: int
    wrs: float
    need: int  # tokens
    adapter_tokens: int  # of `need`: its adapter's weights
    charged_to: int = UNCHARGED
    charge: int = 0
    admitted_at: float = 0.0


@dataclass(eq=False)
class _Blocked:
    """A queue head that fits its quota but whose adapter cannot get memory."""

    entry: _Entry
    since: float  # when it was first found blocked
    reserved: AdapterId | None = None  # the holder's: the adapter whose memory it waits for
    steps_until_free: float = math.inf
    bypassers: list[_Entry] = field(default_factory=list)
    num_bypasses: int = 0


@dataclass
class _Step:
    budget: int
    stopped: bool = False  # a global limit (budget, seats, KV) ended admission for this step
    kv_refused: float = math.inf  # the smallest first chunk (tokens) refused for KV pages this step
    aged_kv: bool = False  # an aged request was refused KV pages: no one younger takes the pages that free


class ChameleonScheduler(BatchScheduler):
    policy = "chameleon"

    def __init__(self, config: EngineConfig, memory: DeviceMemory,
                 rank_of: RankOf, clock: Clock, predictor: OutputLengthPredictor | None = None,
                 gate: MemoryGate | None = None) -> None:
        super().__init__(config, memory, rank_of, clock)
        options, predictor_options = options_for(config.scheduler_options, ChameleonOptions, PredictorOptions)
        self.options: ChameleonOptions = options
        self._recent_wait: float | None = None  # mean arrival-to-admission wait, recent (all queues)
        self.predictor = predictor or OutputLengthPredictor(predictor_options)
        self.gate: MemoryGate = gate or PageGate(memory)
        self.size = SizeModel(max_in=config.max_model_len, max_out=config.max_model_len,
                              max_rank=config.max_lora_rank, block_size=config.block_size,
                              input_weight=options.input_weight, output_weight=options.output_weight,
                              base_rank=min(options.base_rank, config.max_lora_rank),
                              adapter_tokens_per_rank=options.adapter_tokens_per_rank)
        self.token_pool = config.num_blocks * config.block_size
        self._entries: dict[str, _Entry] = {}
        self._arrivals = count()
        # recent arrivals (time, wrs, need) and finished services (time, wrs, seconds admitted)
        self._samples: deque[tuple[float, float, int]] = deque(maxlen=options.window_max)
        self._services: deque[tuple[float, float, float]] = deque(maxlen=options.window_max)
        self._blocked: dict[int, _Blocked] = {}
        self._holder: _Blocked | None = None  # the blocked head that memory is reserved for
        self._starved: set[int] = set()
        self._aged_kv = False  # the last step's admissions ended on an aged request refused KV pages
        self._spare_tokens = self._spare_seats = self._held_total = 0
        self.num_squashes = self.num_bypasses = self.num_refreshes = self.num_idle_admissions = 0
        self.overloaded = False
        # timers start at the first step, on whatever clock the scheduler has then (a profiler swaps it)
        self._next_refresh: float | None = None
        self._last_refresh = self._next_shift_check = 0.0
        self._ref_rate: float | None = None
        self._ref_mean = 0.0
        self._config_samples = 0
        self._configure([], [self.token_pool], [config.max_num_seqs], [0], [None])

    def _configure(self, bounds: list[float], tokens: list[int], seats: list[int], minimums: list[int],
                   rates: list[float | None]) -> None:
        k = len(bounds) + 1
        self.bounds = bounds
        self.quota_tokens, self.quota_seats, self.min_tokens, self._rates = tokens, seats, minimums, rates
        self.queues: list[deque[_Entry]] = [deque() for _ in range(k)]
        self.held_tokens = [0] * k
        self.held_seats = [0] * k
        self._mean_wait: list[float | None] = [None] * k

    # ---- waiting requests ---------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.queues)

    def _enqueue(self, request: Request) -> None:
        predicted = predict_output(self.predictor, request, self.config.max_model_len)
        rank = self.rank_of(request.adapter) if request.adapter is not None else 0
        num_input = request.num_prompt_tokens
        entry = _Entry(request, next(self._arrivals), predicted, self.size.wrs(num_input, predicted, rank),
                       self.size.need_tokens(num_input, predicted, rank), self.size.adapter_tokens(rank))
        self._entries[request.request_id] = entry
        self._samples.append((self.clock.now(), entry.wrs, entry.need))
        self.queues[classify(entry.wrs, self.bounds)].append(entry)

    def _requeue(self, request: Request) -> None:
        entry = self._entries[request.request_id]
        self._give_back(entry)
        self._insert(entry)

    def _insert(self, entry: _Entry) -> None:
        """Into its queue at its arrival position."""
        queue = self.queues[classify(entry.wrs, self.bounds)]
        for i, other in enumerate(queue):
            if other.seq > entry.seq:
                queue.insert(i, entry)
                return
        queue.append(entry)

    def _remove_waiting(self, request: Request) -> None:
        entry = self._entries[request.request_id]
        self.queues[classify(entry.wrs, self.bounds)].remove(entry)

    def _on_finished(self, request: Request) -> None:
        entry = self._entries.pop(request.request_id)
        self._give_back(entry)
        if request.finish_reason is not FinishReason.ABORT and request.first_scheduled_time is not None:
            now = self.clock.now()
            self._services.append((now, entry.wrs, now - entry.admitted_at))
        learn_output(self.predictor, request, entry.predicted)

    # ---- quota accounting -------------------------------------------------------------------

    def _borrow(self, entry: _Entry, where: int, charge: int) -> None:
        entry.charged_to, entry.charge = where, charge
        if where == IDLE:
            return
        if where == SPARE:
            self._spare_tokens += charge
            self._spare_seats += 1
        else:
            self.held_tokens[where] += charge
            self.held_seats[where] += 1
        self._held_total += charge

    def _give_back(self, entry: _Entry) -> None:
        where = entry.charged_to
        if where in (UNCHARGED, IDLE):
            entry.charged_to, entry.charge = UNCHARGED, 0
            return
        if where == SPARE:
            self._spare_tokens -= entry.charge
            self._spare_seats -= 1
        else:
            self.held_tokens[where] -= entry.charge
            self.held_seats[where] -= 1
        self._held_total -= entry.charge
        entry.charged_to, entry.charge = UNCHARGED, 0

    def _charge(self, entry: _Entry, q: int) -> int:
        """What `entry` borrows from queue `q`: its need, less its adapter's weights when they are on
        the device already (held once for all its requests, paid by the request that brought them in),
        at most the queue's quota."""
        need = entry.need
        adapter = entry.request.adapter
        if adapter is not None and entry.adapter_tokens and self.gate.holds(adapter):
            need -= entry.adapter_tokens
        return min(need, self.quota_tokens[q])

    # ---- admission ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._maybe_refresh(self.clock.now())
        return super().schedule()

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        step = _Step(budget)
        self._serve_blocked_heads(out, step)
        aged = self._aged_queues()
        self._serve_aged(out, step)
        starved, self._starved = self._starved, set()
        k = len(self.queues)
        first = aged + [q for q in sorted(starved) if q not in aged]
        order = first + [q for q in range(k) if q not in first]
        served: set[int] = set()
        spare_tokens = spare_seats = 0
        for q in order:  # phase 1: each queue within its own quota
            if step.stopped:
                break
            avail_tokens = self.quota_tokens[q] - self.held_tokens[q]
            avail_seats = self.quota_seats[q] - self.held_seats[q]
            used_tokens, used_seats = self._put(q, avail_tokens, avail_seats, q, out, step)
            if used_seats or not step.stopped:
                served.add(q)
            if step.stopped:
                break
            queue = self.queues[q]
            if not queue:
                spare_tokens += max(0, avail_tokens - used_tokens)
                spare_seats += max(0, avail_seats - used_seats)
            elif q in self._blocked and self._blocked[q].entry is queue[0]:
                # its head waits for adapter memory, not quota: lend what its charge leaves
                spare_tokens += max(0, avail_tokens - used_tokens - self._charge(queue[0], q))
                spare_seats += max(0, avail_seats - used_seats - 1)
        spare_tokens -= self._spare_tokens
        spare_seats -= self._spare_seats
        for q in range(k):  # phase 2: the spare of emptied queues, smallest queue first
            if step.stopped or spare_tokens <= 0 or spare_seats <= 0:
                break
            used_tokens, used_seats = self._put(q, spare_tokens, spare_seats, SPARE, out, step)
            spare_tokens -= used_tokens
            spare_seats -= used_seats
        if step.stopped:
            self._starved = {q for q in range(k) if q not in served and self.queues[q]}
        self._aged_kv = step.aged_kv
        if self.options.work_conserving and not step.aged_kv:
            self._fill(order, out, step)

    def _fill(self, order: list[int], out: SchedulerOutput, step: _Step) -> None:
        """Work conservation: what the quotas left of the step's seats and budget goes to any waiting
        request that fits, queues in this step's order, each in arrival order, past blocked heads
        (the holder's reservation still stands). A request refused for KV pages does not end the
        pass: only first chunks at least as large are skipped after it. These requests borrow no
        quota (`IDLE`): the quotas keep ordering the steps to come."""
        max_seqs = self.config.max_num_seqs
        for q in order:
            queue, i = self.queues[q], 0
            while i < len(queue):
                if step.budget <= 0 or len(self.running) >= max_seqs:
                    return
                entry = queue[i]
                request = entry.request
                if self.first_chunk(request, step.budget) >= step.kv_refused:
                    i += 1
                    continue
                if self._admit_entry(entry, q, out, step) is Admit.OK:
                    del queue[i]
                    self._borrow(entry, IDLE, 0)
                    self.num_idle_admissions += 1
                    if q in self._blocked and self._blocked[q].entry is entry:
                        self._unblock(q)
                    continue
                i += 1

    def max_wait_s(self) -> float:
        """How long a queue head may wait before it goes first: `max_wait_s` when set, else
        `aging_factor` x the recent mean wait (so a size class is never held back much longer than
        the load makes everyone wait), at most half of `slo_s`."""
        options = self.options
        if options.max_wait_s is not None:
            return options.max_wait_s
        cap = options.slo_s / 2
        return cap if self._recent_wait is None else min(cap, options.aging_factor * self._recent_wait)

    def _aged_queues(self) -> list[int]:
        """Queues whose head has waited longer than `max_wait_s`, oldest head first: they go first in
        phase 1 (after the aged requests themselves, `_serve_aged`)."""
        limit = self.max_wait_s()
        if limit <= 0:
            return []
        now = self.clock.now()
        heads = [(queue[0].request.arrival_time, q) for q, queue in enumerate(self.queues)
                 if queue and now - queue[0].request.arrival_time > limit]
        return [q for _, q in sorted(heads)]

    def _serve_aged(self, out: SchedulerOutput, step: _Step) -> None:
        """Every request that has waited longer than `max_wait_s`, whatever its queue, in arrival
        order, before the size classes: within its queue's quota, else on what nobody holds (charged
        to the spare, so the pool is never over-lent), else, work-conserving, on no quota. So past
        the aging limit the order is FIFO's, whose waiting-time tail no size order beats: a steady
        stream of small requests cannot hold a large one back for longer than that. A request whose
        adapter is not ready is passed over for the step, as FIFO does; one refused KV pages ends
        the step's admissions, the fill included (`_Step.aged_kv`): filling past it let younger
        requests that need fewer pages take every page that freed, and near capacity the oldest
        waited on; a queue head that cannot get adapter memory is blocked, as in `_put`."""
        limit = self.max_wait_s()
        if limit <= 0:
            return
        since = self.clock.now() - limit
        aged = sorted(((e, q) for q, queue in enumerate(self.queues)
                       for e in takewhile(lambda e: e.request.arrival_time < since, queue)), key=lambda eq: eq[0].seq)
        for entry, q in aged:
            if step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                step.stopped = True
                return
            charge = self._charge(entry, q)
            if self._held_total + charge > self.token_pool:
                where = IDLE if self.options.work_conserving else None
            elif self.held_tokens[q] + charge > self.quota_tokens[q] or self.held_seats[q] + 1 > self.quota_seats[q]:
                where = SPARE
            else:
                where = q
            if where is None or (not self._start(entry, q, where, charge, out, step) and step.stopped):
                step.aged_kv = step.stopped
                return

    def _start(self, entry: _Entry, q: int, where: int, charge: int, out: SchedulerOutput, step: _Step) -> bool:
        """Admit `entry` of queue `q`, charging `where`. When it cannot start: a refusal for KV pages
        ends the step's admissions, and a queue head without adapter memory is blocked (it may come
        to hold a reservation)."""
        admit = self._admit_entry(entry, q, out, step)
        if admit is Admit.OK:
            self.queues[q].remove(entry)
            self._borrow(entry, where, 0 if where == IDLE else charge)
            self.num_idle_admissions += where == IDLE
            if q in self._blocked and self._blocked[q].entry is entry:
                self._unblock(q)
            return True
        if admit is Admit.NO_KV:
            step.stopped = True
        elif self.queues[q][0] is entry and not self.gate.loading(entry.request.adapter):
            self._block(q, entry)
        return False

    def _put(self, q: int, avail_tokens: int, avail_seats: int, where: int, out: SchedulerOutput,
             step: _Step) -> tuple[int, int]:
        """Admit from queue `q` in arrival order within `avail_*`, charging `where`; stop at the first
        request that does not fit. A head blocked on adapter memory may be bypassed; one whose
        adapter is being copied in (it has its memory) is passed over for the step, as FIFO does."""
        queue, max_seqs = self.queues[q], self.config.max_num_seqs
        used_tokens = used_seats = 0
        blocked: _Blocked | None = None
        i = scanned = 0
        while i < len(queue):
            if step.budget <= 0 or len(self.running) >= max_seqs:
                step.stopped = True
                break
            entry = queue[i]
            charge = self._charge(entry, q)
            if (used_tokens + charge > avail_tokens or used_seats + 1 > avail_seats
                    or self._held_total + charge > self.token_pool):
                break
            if blocked is not None and not self._may_bypass(blocked, entry, avail_tokens - used_tokens - charge,
                                                            avail_seats - used_seats - 1, q):
                i, scanned = i + 1, scanned + 1
                if scanned >= self.options.bypass_scan:
                    break
                continue
            admit = self._admit_entry(entry, q, out, step)
            if admit is Admit.OK:
                del queue[i]
                self._borrow(entry, where, charge)
                used_tokens += charge
                used_seats += 1
                if blocked is not None:
                    if entry not in blocked.bypassers:  # a squashed or preempted one may pass again
                        blocked.bypassers.append(entry)
                    blocked.num_bypasses += 1
                    self.num_bypasses += 1
                elif q in self._blocked and self._blocked[q].entry is entry:
                    self._unblock(q)
                continue
            if admit is Admit.NO_KV:
                step.stopped = True
                break
            if i == 0 and not self.gate.loading(entry.request.adapter):  # the head cannot get adapter memory
                blocked = self._block(q, entry)
                if blocked is None:
                    break
            i, scanned = i + 1, scanned + 1
            if scanned >= self.options.bypass_scan:
                break
        return used_tokens, used_seats

    def _admit_entry(self, entry: _Entry, q: int, out: SchedulerOutput, step: _Step) -> Admit:
        request, adapter = entry.request, entry.request.adapter
        holder = self._holder
        if adapter is not None and holder is not None and entry is not holder.entry:
            if adapter == holder.reserved:
                return Admit.NO_SLOT  # its adapter's memory is promised to the holder
            if not self.gate.holds(adapter):
                return Admit.NO_SLOT  # memory that frees goes to the holder first
        first = request.first_scheduled_time is None
        admit = self._admit(request, out, step.budget)
        if admit is Admit.NO_KV:
            step.kv_refused = min(step.kv_refused, self.first_chunk(request, step.budget))
        if admit is Admit.OK:
            step.budget -= out.chunks[-1].num_tokens
            now = self.clock.now()
            entry.admitted_at = now
            if first:
                wait, mean, recent = now - request.arrival_time, self._mean_wait[q], self._recent_wait
                self._mean_wait[q] = wait if mean is None else mean + 0.1 * (wait - mean)
                self._recent_wait = wait if recent is None else recent + 0.05 * (wait - recent)
        return admit

    def _held_reason(self, request: Request) -> str:
        """Why a waiting request that fits was left waiting: an aged request waits for KV pages (FIFO's
        stop), its adapter is reserved for the holder,
        its queue's token or seat quota, the pool all charges share, a blocked head it may not pass,
        or its place behind a request that could not start."""
        if self._aged_kv:
            return "aged"
        entry = self._entries[request.request_id]
        q = classify(entry.wrs, self.bounds)
        holder = self._holder
        if holder is not None and entry is not holder.entry and request.adapter == holder.reserved:
            return "reservation"
        blocked = self._blocked.get(q)
        if blocked is not None and blocked.entry is not entry:
            return "bypass"
        charge = self._charge(entry, q)
        if (self.held_tokens[q] + charge > self.quota_tokens[q]
                or self.held_seats[q] + 1 > self.quota_seats[q]):
            return "quota"
        if self._held_total + charge > self.token_pool:
            return "pool"
        return "order"

    # ---- bypass, reservation and squash -------------------------------------------------------

    def _block(self, q: int, entry: _Entry) -> _Blocked | None:
        """`entry`, the head of queue `q`, could not get adapter memory. None when its adapter is
        the one reserved for the holder: then the queue just waits."""
        if self._holder is not None and entry.request.adapter == self._holder.reserved:
            return None
        blocked = self._blocked.get(q)
        if blocked is None or blocked.entry is not entry:
            if blocked is not None:
                self._unblock(q)
            blocked = self._blocked[q] = _Blocked(entry, since=self.clock.now())
        self._update_wait(blocked)
        return blocked

    def _update_wait(self, blocked: _Blocked) -> None:
        """The holder re-reserves once its adapter has no running request left (and it still cannot
        get memory); every blocked head learns how many steps until memory it could use frees."""
        ends = self._adapter_ends()
        if blocked is self._holder:
            stale = blocked.reserved is None or blocked.reserved not in ends
            if stale and not self.gate.can_admit(blocked.entry.request.adapter):
                blocked.reserved = min(ends, key=ends.__getitem__) if ends else None
            blocked.steps_until_free = ends.get(blocked.reserved, math.inf) if blocked.reserved else math.inf
        else:
            blocked.steps_until_free = min(ends.values(), default=math.inf)

    def _adapter_ends(self) -> dict[AdapterId, float]:
        """Per adapter with running requests: predicted steps until the last of them ends."""
        ends: dict[AdapterId, float] = {}
        for request in self.running:
            adapter = request.adapter
            if adapter is not None:
                ends[adapter] = max(ends.get(adapter, 0.0), self._remaining_steps(request))
        return ends

    def _unblock(self, q: int) -> None:
        blocked = self._blocked.pop(q)
        if blocked is self._holder:
            self._holder = None

    def _remaining_steps(self, request: Request) -> float:
        entry = self._entries[request.request_id]
        prefill = max(0, request.num_prompt_tokens - request.num_computed_tokens)
        # past its prediction, a request is taken to need a quarter of it again
        left = max(entry.predicted - len(request.output_token_ids), -(-entry.predicted // 4), 1)
        return math.ceil(prefill / self.config.max_num_batched_tokens) + left

    def _may_bypass(self, blocked: _Blocked | None, entry: _Entry, tokens_left: int, seats_left: int,
                    q: int) -> bool:
        """A younger request may pass the blocked head if the head's own charge still fits what is
        left after it, and if it either takes no memory the head waits for or is predicted to end
        before that memory frees."""
        if blocked is None or blocked.num_bypasses >= self.options.max_bypasses:
            return False
        if tokens_left < self._charge(blocked.entry, q) or seats_left < 1:
            return False
        if not self.gate.competes(entry.request.adapter):
            return True
        steps = math.ceil(entry.request.num_prompt_tokens / self.config.max_num_batched_tokens) + entry.predicted
        return steps < blocked.steps_until_free

    def _serve_blocked_heads(self, out: SchedulerOutput, step: _Step) -> None:
        """The holder first, then the other blocked heads oldest first: a head that now fits and
        can get memory (or would, once the younger requests that bypassed it stop) starts. The
        oldest head blocked for `reserve_after_s` becomes the holder when there is none."""
        now = self.clock.now()
        order = sorted(self._blocked, key=lambda q: (self._blocked[q] is not self._holder, self._blocked[q].entry.seq))
        for q in order:
            blocked = self._blocked[q]
            entry, queue = blocked.entry, self.queues[q]
            if not queue or queue[0] is not entry:
                self._unblock(q)
                continue
            if self._holder is None and now - blocked.since >= self.options.reserve_after_s:
                self._holder = blocked
            if step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            self._update_wait(blocked)
            charge = self._charge(entry, q)
            if (self.held_tokens[q] + charge > self.quota_tokens[q] or self.held_seats[q] + 1 > self.quota_seats[q]
                    or self._held_total + charge > self.token_pool):
                continue
            if not self.gate.can_admit(entry.request.adapter):
                blocked.bypassers = [e for e in blocked.bypassers if e.request.status is RequestStatus.RUNNING]
                # only bypassers less than half done (by prediction) are worth stopping
                young = [e.request for e in blocked.bypassers if 2 * len(e.request.output_token_ids) < e.predicted]
                victims = self.gate.release_set(entry.request.adapter, young)
                if victims is None:
                    continue
                self._squash(victims, out, step)
            if not self._start(entry, q, q, charge, out, step) and step.stopped:
                return

    def _squash(self, victims: list[Request], out: SchedulerOutput, step: _Step) -> None:
        """Stop running bypassers so the head they passed can start; their chunks leave this step."""
        victims = [r for r in {r.request_id: r for r in victims}.values() if r.status is RequestStatus.RUNNING]
        ids = {r.request_id for r in victims}
        step.budget += sum(c.num_tokens for c in out.chunks if c.request_id in ids)
        out.chunks = [c for c in out.chunks if c.request_id not in ids]
        for request in victims:
            self._stop_running(request, out)
            self.num_squashes += 1

    # ---- queue configuration ------------------------------------------------------------------

    def quiet_until(self) -> float:
        """Aged queues and refreshes act on the clock: no span while requests wait, none past the
        next refresh or load-shift check."""
        if self.num_waiting or self._next_refresh is None or self._config_samples < self.options.min_samples <= len(
                self._samples):
            return -math.inf
        return min(self._next_refresh, self._next_shift_check)

    def _maybe_refresh(self, now: float) -> None:
        options = self.options
        if self._next_refresh is None:
            self._next_refresh, self._last_refresh, self._next_shift_check = now + options.refresh_s, now, now
        if now >= self._next_refresh:
            self.refresh(now)
        elif self._config_samples < options.min_samples <= len(self._samples):
            self.refresh(now)  # the first configuration with enough data
        elif now >= self._next_shift_check:
            self._next_shift_check = now + options.shift_window_s / 4
            if self._load_shifted(now):
                self.refresh(now)

    def _load_shifted(self, now: float) -> bool:
        options = self.options
        if self._ref_rate is None or now - self._last_refresh < options.shift_window_s:
            return False
        since = now - options.shift_window_s
        recent = []
        for t, wrs, _ in reversed(self._samples):
            if t < since:
                break
            recent.append(wrs)
        expected = self._ref_rate * options.shift_window_s
        evidence = options.min_samples / 2
        if max(expected, len(recent)) < evidence:
            return False
        f = options.shift_factor
        if not expected / f <= len(recent) <= expected * f:
            return True
        if len(recent) >= evidence and self._ref_mean > 0:
            return not self._ref_mean / f <= sum(recent) / len(recent) <= self._ref_mean * f
        return False

    def refresh(self, now: float) -> None:
        """Recompute K, the boundaries and the quotas from the recent window; re-bucket the queues."""
        options = self.options
        horizon = now - options.refresh_s
        for window in (self._samples, self._services):
            while window and window[0][0] < horizon:
                window.popleft()
        samples = list(self._samples)
        values = [wrs for _, wrs, _ in samples]
        max_queues = min(options.max_queues, self.config.max_num_seqs)
        bounds = plan_boundaries(values, max_queues, options.elbow_gain) if len(values) >= options.min_samples else []
        k = len(bounds) + 1
        # arrival rates over the window, at least a second long (a burst at one instant is not infinite)
        window_s = max(1.0, min(options.refresh_s, now - samples[0][0])) if samples else options.refresh_s
        counts, sizes = [0] * k, [0] * k
        for _, wrs, need in samples:
            q = classify(wrs, bounds)
            counts[q] += 1
            sizes[q] = max(sizes[q], need)
        service = self._service_times(bounds)
        rates = [c / window_s for c in counts]
        loads = [QueueLoad(sizes[q], service[q], rates[q]) for q in range(k)]
        tokens = plan_quotas(loads, self.token_pool, options.slo_s, options.quota_split)
        seats = plan_quotas([QueueLoad(1.0 if sizes[q] else 0.0, service[q], rates[q]) for q in range(k)],
                            self.config.max_num_seqs, options.slo_s, options.quota_split)
        self._apply(bounds, tokens.quotas, seats.quotas, tokens.minimums, list(rates))
        self.overloaded = tokens.overloaded
        self._ref_rate = len(samples) / window_s
        self._ref_mean = sum(values) / len(values) if values else 0.0
        self._config_samples = len(values)
        self._last_refresh = now
        self._next_refresh = now + options.refresh_s
        self._next_shift_check = now + options.shift_window_s
        self.num_refreshes += 1

    def configure(self, bounds: list[float], quota_tokens: list[int], quota_seats: list[int] | None = None) -> None:
        """Fixed queues (the paper's Static variant, and tests): until the next refresh, which
        `refresh_s` and the load-shift check still trigger."""
        k = len(bounds) + 1
        if len(quota_tokens) != k or (quota_seats is not None and len(quota_seats) != k):
            raise ValueError(f"{len(bounds)} boundaries make {k} queues: give {k} quotas")
        if list(bounds) != sorted(bounds):
            raise ValueError("queue boundaries must ascend")
        seats = quota_seats or plan_quotas([QueueLoad(1, 1, 0)] * k, self.config.max_num_seqs, 1.0, "equal").quotas
        self._apply(list(bounds), list(quota_tokens), list(seats), [0] * k, [None] * k)
        self.overloaded = False
        self._config_samples = max(self._config_samples, self.options.min_samples)

    def _apply(self, bounds: list[float], tokens: list[int], seats: list[int], minimums: list[int],
               rates: list[float | None]) -> None:
        """New queues: waiting requests move to theirs in arrival order; running requests are
        re-charged to the queue their size now falls in (spare loans stay spare)."""
        waiting = sorted((e for queue in self.queues for e in queue), key=lambda e: e.seq)
        running = [self._entries[r.request_id] for r in self.running]
        for q in list(self._blocked):
            self._unblock(q)
        self._starved = set()
        self._configure(bounds, tokens, seats, minimums, rates)
        for entry in waiting:
            self.queues[classify(entry.wrs, bounds)].append(entry)
        for entry in running:
            if entry.charged_to >= 0:
                q = classify(entry.wrs, bounds)
                entry.charged_to = q
                self.held_tokens[q] += entry.charge
                self.held_seats[q] += 1

    def _service_times(self, bounds: list[float]) -> list[float]:
        """D per queue: mean admission-to-finish seconds of its recent requests, else of all recent
        requests, else `default_service_s`."""
        k = len(bounds) + 1
        sums, counts = [0.0] * k, [0] * k
        for _, wrs, seconds in self._services:
            q = classify(wrs, bounds)
            sums[q] += seconds
            counts[q] += 1
        overall = sum(sums) / sum(counts) if sum(counts) else self.options.default_service_s
        return [sums[q] / counts[q] if counts[q] else overall for q in range(k)]

    # ---- stats --------------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        queues = []
        for q, queue in enumerate(self.queues):
            queues.append(self._queue_stats(
                q, self.bounds[q] if q < len(self.bounds) else None, [e.request for e in queue],
                mean_wait_s=self._mean_wait[q], quota_tokens=self.quota_tokens[q],
                held_tokens=self.held_tokens[q], min_quota_tokens=self.min_tokens[q],
                quota_seats=self.quota_seats[q], held_seats=self.held_seats[q], arrival_rate=self._rates[q]))
        return SchedulerStats(
            policy=self.policy, queues=queues, num_preemptions=self.num_preemptions,
            num_squashes=self.num_squashes, num_bypasses=self.num_bypasses, num_refreshes=self.num_refreshes,
            num_idle_admissions=self.num_idle_admissions,
            overloaded=self.overloaded, token_pool=self.token_pool, spare_held_tokens=self._spare_tokens,
            predictor=self.predictor.stats(), adapter_service=dict(self.adapter_service),
            admission_limits=dict(self.admission_limits), idle=self.idle.snapshot())
