"""SimExecutor: the only simulated part of the engine. It runs no model: it advances a virtual
clock by the profile's step latency and samples one fixed token per sequence; the request's
SamplingParams (max_tokens = output_len, ignore_eos) decide when it stops."""

from __future__ import annotations

from loraplex.engine.clock import ManualClock
from loraplex.engine.messages import ExecutorResult, SchedulerOutput
from loraplex.engine.request import SampledToken
from loraplex.sim.features import FEATURES, SlotRanks
from loraplex.sim.profile import Profile

DUMMY_TOKEN = SampledToken(token_id=0)


class SimExecutor:
    def __init__(self, profile: Profile, clock: ManualClock) -> None:
        self.clock = clock
        self.slots = SlotRanks()
        self._w = dict(zip(FEATURES, profile.weights(), strict=True))
        self.busy_s = 0.0  # modelled time spent in steps

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        self.slots.apply(output)
        elapsed = max(0.0, self.step_seconds(output))
        self.clock.advance(elapsed)
        self.busy_s += elapsed
        sampled = {chunk.request_id: DUMMY_TOKEN for chunk in output.chunks if chunk.sample}
        return ExecutorResult(sampled=sampled, elapsed_s=elapsed)

    def step_seconds(self, output: SchedulerOutput) -> float:
        """Profile.step_seconds(SlotRanks.features(output)) in one pass with no objects built: this
        runs once per simulated step (tests check the two agree)."""
        w = self._w
        rank_of = self.slots.rank_of
        rank_sum = max_rank = prefill = prefill_rank = context = decodes = max_ctx = 0
        slots = set()
        for chunk in output.chunks:
            rank = rank_of(chunk.adapter_slot, 0)
            n = len(chunk.token_ids)
            start = chunk.start_position
            context += start
            if rank:
                slots.add(chunk.adapter_slot)
                rank_sum += rank
                max_rank = max(max_rank, rank)
            if n > 1 or chunk.num_output_tokens == 0:
                prefill += n
                prefill_rank += n * rank
            else:
                decodes += 1
                max_ctx = max(max_ctx, start)
        batch, adapters = len(output.chunks), len(slots)
        loads = output.adapter_loads
        return (w["intercept"] + batch * (w["batch"] + w["batch_x_adapters"] * adapters + w["batch_x_max_rank"] * max_rank)
                + w["adapters"] * adapters + w["rank_sum"] * rank_sum + w["prefill_tokens"] * prefill
                + w["prefill_rank_tokens"] * prefill_rank + w["context_tokens"] * context
                + w["padded_context"] * decodes * max_ctx + w["loads"] * len(loads)
                + w["load_rank_sum"] * sum(load.rank for load in loads))
