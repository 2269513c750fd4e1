"""Virtual token counter (VTC, from S-LoRA's fairness work): each adapter is a client, and the
client that has received the least service goes next.

Every adapter ('' for the base model) has a counter of the service its requests received:
`input_weight` per prompt token when a request is first admitted, `output_weight` per generated
token. Admission repeatedly takes the oldest waiting request of the backlogged adapter with the
smallest counter (ties: the older head). An adapter that becomes backlogged has its counter lifted
to the smallest counter among backlogged adapters (or, with none, to that of the adapter served
last), so idle time banks no credit. An adapter that cannot get a slot is passed over for the step,
keeping its requests in order; a preempted request goes back to the head of its adapter's queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from itertools import count

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.device_memory import DeviceMemory
from loraplex.engine.messages import ExecutorResult, RequestOutput, SchedulerOutput
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.scheduling.scheduler import Admit, BatchScheduler, RankOf, adapter_key, options_for
from loraplex.engine.scheduling.stats import SchedulerStats
from loraplex.spec.adapter import AdapterId
from loraplex.util.clock import Clock


@dataclass(frozen=True)
class VtcOptions:
    input_weight: float = 1.0
    output_weight: float = 2.0

    def __post_init__(self) -> None:
        if self.input_weight < 0 or self.output_weight < 0:
            raise ValueError("vtc weights must be non-negative")


class VtcScheduler(BatchScheduler):
    policy = "vtc"

    def __init__(self, config: EngineConfig, memory: DeviceMemory,
                 rank_of: RankOf, clock: Clock) -> None:
        super().__init__(config, memory, rank_of, clock)
        (self.options,) = options_for(config.scheduler_options, VtcOptions)
        self.counters: dict[AdapterId | None, float] = {}
        self._queues: dict[AdapterId | None, deque[Request]] = {}  # backlogged adapters only
        self._num_waiting = 0
        self._order: dict[str, int] = {}
        self._arrivals = count()
        self._charged: set[str] = set()  # requests whose prompt was counted
        self._last_served: AdapterId | None = None  # the adapter admitted last

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def _enqueue(self, request: Request) -> None:
        self._order[request.request_id] = next(self._arrivals)
        self._push(request, front=False)

    def _requeue(self, request: Request) -> None:
        self._push(request, front=True)

    def _push(self, request: Request, front: bool) -> None:
        key = request.adapter
        queue = self._queues.get(key)
        if queue is None:  # becomes backlogged: lift its counter
            floor = min((self.counters[a] for a in self._queues),
                        default=self.counters.get(self._last_served, 0.0))
            self.counters[key] = max(self.counters.get(key, 0.0), floor)
            queue = self._queues[key] = deque()
        if front:
            queue.appendleft(request)
        else:
            queue.append(request)
        self._num_waiting += 1

    def _remove_waiting(self, request: Request) -> None:
        queue = self._queues[request.adapter]
        queue.remove(request)
        self._num_waiting -= 1
        if not queue:
            del self._queues[request.adapter]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        counters, order = self.counters, self._order
        heap = [(counters[a], order[q[0].request_id], i, a) for i, (a, q) in enumerate(self._queues.items())]
        heapq.heapify(heap)
        while heap and budget > 0 and len(self.running) < self.config.max_num_seqs:
            _, _, i, adapter = heapq.heappop(heap)
            queue = self._queues[adapter]
            request = queue[0]
            admit = self._admit(request, out, budget)
            if admit is Admit.NO_SLOT:
                continue  # passed over for this step
            if admit is Admit.NO_KV:
                break
            budget -= out.chunks[-1].num_tokens
            queue.popleft()
            self._num_waiting -= 1
            if request.request_id not in self._charged:
                self._charged.add(request.request_id)
                counters[adapter] += self.options.input_weight * request.num_prompt_tokens
            self._last_served = adapter
            if queue:
                heapq.heappush(heap, (counters[adapter], order[queue[0].request_id], i, adapter))
            else:
                del self._queues[adapter]

    def update(self, output: SchedulerOutput, result: ExecutorResult) -> list[RequestOutput]:
        weight, requests, counters = self.options.output_weight, self.requests, self.counters
        for chunk in output.chunks:
            if chunk.sample:
                request = requests.get(chunk.request_id)
                if request is not None and request.status is RequestStatus.RUNNING:
                    counters[request.adapter] += weight
        return super().update(output, result)

    def _on_decoded(self, request: Request, steps: int) -> None:
        self.counters[request.adapter] += self.options.output_weight * steps

    def _on_finished(self, request: Request) -> None:
        self._order.pop(request.request_id, None)
        self._charged.discard(request.request_id)

    def stats(self) -> SchedulerStats:
        stats = super().stats()
        stats.adapter_counters = {adapter_key(a): c for a, c in self.counters.items()}
        return stats
