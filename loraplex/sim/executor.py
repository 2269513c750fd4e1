"""SimExecutor: the only simulated part of the engine. It runs no model: it advances a virtual
clock by the profile's step latency and samples one fixed token per sequence; the request's
SamplingParams (max_tokens = output_len, ignore_eos) decide when it stops.

Host <-> device copies. With a profile that knows the copy bandwidth (`Memory.h2d_gbps`) a copy of
B bytes lasts B / bandwidth, and that replaces the profile's per-load terms (`loads`,
`load_rank_sum`: the fitted stand-in for the same copy):
- a synchronous adapter load and every KV swap-out are done before the step computes, so their
  time is added to the step;
- an asynchronous load or a KV swap-in goes onto one modelled copy link (one job at a time, in
  submission order, like the engine's copy worker) and its job is reported in
  `ExecutorResult.copies_done` by the first step that ends at or after the job's completion.
  Synchronous copies do not queue on that link (a simplification: on a GPU both would share PCIe).
A step with no chunks runs no model: it costs its synchronous copies only and, while background
copies are in flight, lasts until the next one completes (so an engine whose waiting requests all
wait on copies moves on). Without a bandwidth (older profiles) every load costs the per-load
terms in the step that issues it, background ones included, and completes with that step.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from loraplex.engine.messages import DecodeSpan, ExecutorResult, SchedulerOutput
from loraplex.engine.request import SampledToken
from loraplex.latency.features import FEATURES, SlotRanks
from loraplex.latency.profile import Profile
from loraplex.sim.shared_host import SharedHost
from loraplex.util.clock import ManualClock

DUMMY_TOKEN = SampledToken(token_id=0)
_LOAD_TERMS = (FEATURES.index("loads"), FEATURES.index("load_rank_sum"))
_CONTEXT_TERMS = (FEATURES.index("context_tokens"), FEATURES.index("padded_context"))
# A job due at t is reported by a step ending at t; the clock adds floats, so an idle step that
# runs exactly to t may stop an ulp short of it.
_TIME_EPS = 1e-9


class CopyLink:
    """One modelled host <-> device link: background copies run one at a time, first in first out."""

    def __init__(self) -> None:
        self.free_at = 0.0  # when the last queued job completes
        self.busy_s = 0.0
        self.pending: deque[tuple[float, int]] = deque()  # (completion time, job), in completion order

    def submit(self, job: int, now: float, seconds: float) -> None:
        start = self.free_at if self.free_at > now else now
        self.free_at = start + seconds
        self.busy_s += seconds
        self.pending.append((self.free_at, job))

    def next_done(self) -> float:
        return self.pending[0][0]

    def finished_by(self, t: float) -> list[int]:
        done = []
        pending = self.pending
        while pending and pending[0][0] <= t + _TIME_EPS:
            done.append(pending.popleft()[1])
        return done


class SimExecutor:
    def __init__(self, profile: Profile, clock: ManualClock, block_size: int | None = None) -> None:
        """`block_size`: the engine's KV block (page) size, default the profile's."""
        self.clock = clock
        self.slots = SlotRanks()
        self.profile = profile
        self.timed_copies = profile.memory.h2d_gbps is not None
        weights = profile.weights()
        self._w_loads = tuple(weights[i] for i in _LOAD_TERMS)
        if self.timed_copies:  # the bandwidth model times loads; the fitted load terms would count them twice
            for i in _LOAD_TERMS:
                weights[i] = 0.0
            self._w_loads = (0.0, 0.0)
        self._w = tuple(weights)  # in features.FEATURES order
        self._growing = min(weights[i] for i in _CONTEXT_TERMS) >= 0.0  # a decode span's steps never shorten
        self.page_bytes = profile.page_bytes(block_size or int(profile.engine.get("block_size", 16)))
        self.link = CopyLink()
        self.host: SharedHost | None = None  # EMULATION: the cores this engine shares with others (`shared_host`)
        self.busy_s = 0.0  # modelled time spent in steps
        self.sync_copy_s = 0.0  # of which synchronous copies

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        if output.adapter_loads or output.adapter_evictions:
            self.slots.apply(output)
        sampled: dict[str, SampledToken] = {}
        if output.chunks:
            elapsed = self.step_seconds(output, sampled)
            if not elapsed > 0.0:  # max(0.0, elapsed), without the call
                elapsed = 0.0
        else:
            elapsed = self._load_terms(output)
        result = ExecutorResult(sampled)
        if output.adapter_loads or output.kv_swap_out or output.kv_swap_in or self.link.pending:
            elapsed = self._copies(output, elapsed, result)
        if self.host is not None:
            elapsed = self.host.stretch(id(self), self.clock.now(), elapsed)
        self.clock.advance(elapsed)
        self.busy_s += elapsed
        result.elapsed_s = elapsed
        return result

    def run_span(self, span: DecodeSpan, until: float, strict: bool = False) -> list[float]:
        """Run the steps of `span` that start at or before `until` (before it, `strict`) and before
        `span.until`, at least the first; returns their start times. The batch is fixed, so only the
        context terms move (every decode is one position further on): the steps' latencies are one
        vector of the step formula and the clock their running sum, bit for bit what running the steps
        one by one gives, with no per-step Python."""
        if self.host is not None:
            raise RuntimeError("decode spans run at once are not timed on a shared host: step the engine instead")
        terms = self._terms(SchedulerOutput(chunks=span.chunks), {})
        first = max(0.0, self._seconds(*terms))
        now, steps = self.clock.now(), span.steps
        horizon = min(until, span.until) - now
        if first > 0.0 and self._growing and horizon < steps * first:  # later steps last no less: build fewer
            steps = max(1, int(horizon / first) + 2)
        batch, adapters, rank_sum, max_rank, prefill, prefill_rank, context, decodes, max_ctx, loads, load_rank, prefill_ctx = terms
        j = np.arange(steps)
        seconds = np.maximum(0.0, self._seconds(batch, adapters, rank_sum, max_rank, prefill, prefill_rank,
                                                context + batch * j, decodes, max_ctx + j, loads, load_rank,
                                                prefill_ctx))
        clock = np.cumsum(np.concatenate(([now], seconds)))  # sequential sums, as the clock adds them
        limit = int(np.searchsorted(clock[:-1], until, side="left" if strict else "right"))
        taken = max(1, min(limit, int(np.searchsorted(clock[:-1], span.until, side="left"))))
        self.clock.advance_to(float(clock[taken]))
        for elapsed in seconds[:taken].tolist():
            self.busy_s += elapsed
        return clock[:taken].tolist()

    def _load_terms(self, output: SchedulerOutput) -> float:
        """The per-load terms alone: what a step without chunks costs under an older profile."""
        loads = output.adapter_loads
        if not loads:
            return 0.0
        w_loads, w_load_rank_sum = self._w_loads
        return max(0.0, w_loads * len(loads) + w_load_rank_sum * sum(load.rank for load in loads))

    def _copies(self, output: SchedulerOutput, elapsed: float, result: ExecutorResult) -> float:
        """Start this step's copies, fill `result.copy_bytes` and `copies_done`; the step's new length."""
        profile, link = self.profile, self.link
        start = self.clock.now()
        sync_bytes = len(output.kv_swap_out) * self.page_bytes
        moved = sync_bytes
        for load in output.adapter_loads:
            nbytes = profile.adapter_bytes(load.rank)
            moved += nbytes
            if load.asynchronous:
                link.submit(load.job, start, profile.copy_seconds(nbytes))
            else:
                sync_bytes += nbytes
        for swap in output.kv_swap_in:
            nbytes = len(swap.copies) * self.page_bytes
            moved += nbytes
            link.submit(swap.job, start, profile.copy_seconds(nbytes))
        sync_s = profile.copy_seconds(sync_bytes)
        self.sync_copy_s += sync_s
        elapsed += sync_s
        if not output.chunks and link.pending and link.next_done() > start + elapsed:
            elapsed = link.next_done() - start  # nothing to compute: wait for the next copy
        result.copy_bytes = moved
        result.copies_done = link.finished_by(start + elapsed)
        return elapsed

    def step_seconds(self, output: SchedulerOutput, sampled: dict[str, SampledToken] | None = None) -> float:
        """Profile.step_seconds(SlotRanks.features(output)) in one pass with no objects built: this
        runs once per simulated step (tests check the two agree; keep the sum's order, so results stay
        bit-identical). The same pass fills `sampled` with the token of every chunk that samples.
        With a copy bandwidth in the profile the load terms are zero (`_copies` times the loads)."""
        return self._seconds(*self._terms(output, {} if sampled is None else sampled))

    def _terms(self, output: SchedulerOutput, sampled: dict[str, SampledToken]) -> tuple[int, ...]:
        """The step's features in `_seconds`' argument order; fills `sampled`."""
        rank_of = self.slots.rank_of
        rank_sum = max_rank = prefill = prefill_rank = context = decodes = max_ctx = prefill_ctx = 0
        slots = set()
        for chunk in output.chunks:
            if chunk.sample:
                sampled[chunk.request_id] = DUMMY_TOKEN
            slot = chunk.adapter_slot
            rank = rank_of(slot, 0)
            n = len(chunk.token_ids)
            start = chunk.start_position
            context += start
            if rank:
                slots.add(slot)
                rank_sum += rank
                if rank > max_rank:
                    max_rank = rank
            if n > 1 or chunk.num_output_tokens == 0:
                prefill += n
                prefill_rank += n * rank
                prefill_ctx += n * start
            else:
                decodes += 1
                if start > max_ctx:
                    max_ctx = start
        load_rank_sum = 0
        for load in output.adapter_loads:
            load_rank_sum += load.rank
        return (len(output.chunks), len(slots), rank_sum, max_rank, prefill, prefill_rank, context, decodes, max_ctx,
                len(output.adapter_loads), load_rank_sum, prefill_ctx)

    def _seconds(self, batch, adapters, rank_sum, max_rank, prefill, prefill_rank, context, decodes, max_ctx,
                 loads, load_rank_sum, prefill_ctx):  # noqa: ANN001, ANN202 - ints, or numpy arrays for context and max_ctx
        """The profile's step formula; `context` and `max_ctx` may be arrays (a span's steps)."""
        (w_intercept, w_batch, w_adapters, w_batch_x_adapters, w_rank_sum, w_batch_x_max_rank, w_prefill,
         w_prefill_rank, w_context, w_padded_context, w_loads, w_load_rank_sum, w_prefill_context) = self._w
        return (w_intercept + batch * (w_batch + w_batch_x_adapters * adapters + w_batch_x_max_rank * max_rank)
                + w_adapters * adapters + w_rank_sum * rank_sum + w_prefill * prefill
                + w_prefill_rank * prefill_rank + w_context * context
                + w_padded_context * decodes * max_ctx + w_loads * loads
                + w_load_rank_sum * load_rank_sum + w_prefill_context * prefill_ctx)
