"""Shortest job first by predicted output length (the µServe baseline Chameleon compares with).

Waiting requests are ordered by the output length the online predictor gave them on arrival,
ties by arrival. With `order_by: prompt` they are ordered by prompt length instead: known exactly
at arrival, and what a request's first token costs where the step's token budget is the limit (the
shortest-prefill-first order, the lowest mean TTFT an admission order gets there). Preempted requests go before all others (their work is lost already). As in FIFO,
a request whose adapter cannot get a slot is skipped for the step and keeps its place. Long
requests can wait forever under a steady stream of short ones: that is the baseline's flaw.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass
from itertools import count

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.device_memory import DeviceMemory
from loraplex.engine.messages import SchedulerOutput
from loraplex.engine.request import FinishReason, Request
from loraplex.engine.scheduling.output_predictor import OutputLengthPredictor, PredictorOptions
from loraplex.engine.scheduling.scheduler import Admit, BatchScheduler, RankOf, options_for
from loraplex.engine.scheduling.stats import SchedulerStats
from loraplex.util.clock import Clock

_RESUMED, _NEW = 0, 1


def predict_output(predictor: OutputLengthPredictor, request: Request, max_model_len: int) -> int:
    """The predictor's answer for a request, bounded by its max_tokens and the context left."""
    max_out = min(request.sampling.max_tokens, max_model_len - request.num_prompt_tokens)
    return predictor.predict(request.adapter, request.num_prompt_tokens, max_out, request.sampling.min_tokens)


def learn_output(predictor: OutputLengthPredictor, request: Request, predicted: int | None) -> None:
    if request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        predictor.observe(request.adapter, request.num_prompt_tokens, len(request.output_token_ids), predicted)


@dataclass(frozen=True)
class SjfOptions:
    order_by: str = "output"  # "output" (predicted, µServe's) or "prompt" (its exact length)

    def __post_init__(self) -> None:
        if self.order_by not in ("output", "prompt"):
            raise ValueError(f"sjf option order_by {self.order_by!r} is not 'output' or 'prompt'")


class SjfScheduler(BatchScheduler):
    policy = "sjf"

    def __init__(self, config: EngineConfig, memory: DeviceMemory,
                 rank_of: RankOf, clock: Clock, predictor: OutputLengthPredictor | None = None) -> None:
        super().__init__(config, memory, rank_of, clock)
        self.options, predictor_options = options_for(config.scheduler_options, SjfOptions, PredictorOptions)
        self.predictor = predictor or OutputLengthPredictor(predictor_options)
        self._waiting: list[tuple[int, int, int, Request]] = []  # (resumed first, predicted, arrival, request)
        self._predicted: dict[str, int] = {}
        self._order: dict[str, int] = {}
        self._arrivals = count()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def _enqueue(self, request: Request) -> None:
        predicted = predict_output(self.predictor, request, self.config.max_model_len)
        self._predicted[request.request_id] = predicted
        self._order[request.request_id] = next(self._arrivals)
        insort(self._waiting, (_NEW, self._key(request), self._order[request.request_id], request))

    def _key(self, request: Request) -> int:
        if self.options.order_by == "prompt":
            return request.num_prompt_tokens
        return self._predicted[request.request_id]

    def _requeue(self, request: Request) -> None:
        rid = request.request_id
        insort(self._waiting, (_RESUMED, self._key(request), self._order[rid], request))

    def _remove_waiting(self, request: Request) -> None:
        self._waiting = [e for e in self._waiting if e[3] is not request]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        admitted = []
        for i, entry in enumerate(self._waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            admit = self._admit(entry[3], out, budget)
            if admit is Admit.OK:
                budget -= out.chunks[-1].num_tokens
                admitted.append(i)
            elif admit is Admit.NO_KV:
                break
        for i in reversed(admitted):
            del self._waiting[i]

    def _on_finished(self, request: Request) -> None:
        self._order.pop(request.request_id, None)
        learn_output(self.predictor, request, self._predicted.pop(request.request_id, None))

    def stats(self) -> SchedulerStats:
        stats = super().stats()
        stats.predictor = self.predictor.stats()
        return stats
