"""Loraplex's shortest-job-first order inside an unmodified vLLM server, through vLLM's own hook:

    python -m vllm.entrypoints.openai.api_server ... --scheduler-cls loraplex_vllm_scheduler.SJFScheduler

(`SJFAsyncScheduler` with `--async-scheduling`.) This file runs inside vLLM's interpreter and imports
vLLM's V1 scheduler (checked with vLLM 0.32: `vllm.v1.core.sched`; the interface is not public and
may change, which vLLM says in its log). The agent and the operator put it on vLLM's PYTHONPATH next
to loraplex_vllm.py.

vLLM's scheduler is kept whole (token budget, chunked prefill, KV allocation, preemption, LoRA slots);
only the order of its waiting queue changes: requests that have not started are taken smallest job
first, the job being prompt tokens plus `max_tokens` (vLLM knows no predicted output length, which our
engine's SJF and Chameleon use), ties by arrival. Requests vLLM puts back at the front (preempted, or
skipped in a step) stay at the front, as in its FCFS queue, so its invariants hold.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request


def job_size(request: Request) -> int:
    return int(request.num_prompt_tokens) + int(request.max_tokens or 0)


class SJFRequestQueue(RequestQueue):
    """Requests put back at the front first (in their order), then the rest smallest job first."""

    def __init__(self) -> None:
        self._front: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (job_size(request), request.arrival_time, next(self._order), request))

    def pop_request(self) -> Request:
        if self._front:
            return self._front.popleft()
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        if self._front:
            return self._front[0]
        if not self._heap:
            raise IndexError("peek into an empty queue")
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self._front.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._front.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._front = deque(r for r in self._front if id(r) not in gone)
        self._heap = [item for item in self._heap if id(item[-1]) not in gone]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._front) or bool(self._heap)

    def __len__(self) -> int:
        return len(self._front) + len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        yield from list(self._front)
        yield from (item[-1] for item in sorted(self._heap))


class SJFScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.waiting = SJFRequestQueue()


class SJFAsyncScheduler(AsyncScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.waiting = SJFRequestQueue()
