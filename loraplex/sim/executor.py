"""SimExecutor: the only simulated part of the engine. It runs no model: it advances a virtual
clock by the profile's step latency and samples one fixed token per sequence; the request's
SamplingParams (max_tokens = output_len, ignore_eos) decide when it stops."""

from __future__ import annotations

from loraplex.engine.clock import ManualClock
from loraplex.engine.messages import ExecutorResult, SchedulerOutput
from loraplex.engine.request import SampledToken
from loraplex.sim.features import SlotRanks
from loraplex.sim.profile import Profile

DUMMY_TOKEN = SampledToken(token_id=0)


class SimExecutor:
    def __init__(self, profile: Profile, clock: ManualClock) -> None:
        self.clock = clock
        self.slots = SlotRanks()
        self._w = tuple(profile.weights())  # in features.FEATURES order
        self.busy_s = 0.0  # modelled time spent in steps

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        if output.adapter_loads or output.adapter_evictions:
            self.slots.apply(output)
        sampled: dict[str, SampledToken] = {}
        elapsed = self.step_seconds(output, sampled)
        if not elapsed > 0.0:  # max(0.0, elapsed), without the call
            elapsed = 0.0
        self.clock.advance(elapsed)
        self.busy_s += elapsed
        return ExecutorResult(sampled, elapsed)

    def step_seconds(self, output: SchedulerOutput, sampled: dict[str, SampledToken] | None = None) -> float:
        """Profile.step_seconds(SlotRanks.features(output)) in one pass with no objects built: this
        runs once per simulated step (tests check the two agree; keep the sum's order, so results stay
        bit-identical). The same pass fills `sampled` with the token of every chunk that samples."""
        (w_intercept, w_batch, w_adapters, w_batch_x_adapters, w_rank_sum, w_batch_x_max_rank, w_prefill,
         w_prefill_rank, w_context, w_padded_context, w_loads, w_load_rank_sum) = self._w
        rank_of = self.slots.rank_of
        if sampled is None:
            sampled = {}
        rank_sum = max_rank = prefill = prefill_rank = context = decodes = max_ctx = 0
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
            else:
                decodes += 1
                if start > max_ctx:
                    max_ctx = start
        batch, adapters = len(output.chunks), len(slots)
        loads = output.adapter_loads
        load_rank_sum = 0
        for load in loads:
            load_rank_sum += load.rank
        return (w_intercept + batch * (w_batch + w_batch_x_adapters * adapters + w_batch_x_max_rank * max_rank)
                + w_adapters * adapters + w_rank_sum * rank_sum + w_prefill * prefill
                + w_prefill_rank * prefill_rank + w_context * context
                + w_padded_context * decodes * max_ctx + w_loads * len(loads)
                + w_load_rank_sum * load_rank_sum)
