"""The memory seam between a scheduler and the engine's memory policy (`policies.py`).

A policy owns the device page pool (KV blocks and, except under `lru-static`, adapter weights),
the prefix cache and adapter residency. The scheduler asks it for an adapter and KV pages when it
admits or grows a request, hands a request back when it leaves the batch, and lets it add its
copies and evictions to every step's output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from loraplex.engine.memory.stats import MemoryStats
from loraplex.engine.messages import ExecutorResult, SchedulerOutput
from loraplex.engine.request import Request
from loraplex.spec.adapter import AdapterId


class DeviceMemory(Protocol):
    policy: str
    shares_pool: bool  # adapters take KV pages: every admission competes for the same memory
    queued: Callable[[AdapterId], bool]  # set by the scheduler: adapters of waiting requests leave last

    @property
    def num_pages(self) -> int: ...

    @property
    def num_free_pages(self) -> int: ...

    # ---- adapters ------------------------------------------------------------------------------

    def acquire_adapter(self, adapter: AdapterId) -> int | None:
        """Pin `adapter` for one request that runs this step: its handle (`ScheduledChunk.adapter_slot`)
        once its weights are on the device or will be before this step computes. None while they are
        not; the policy starts a background copy when memory allows, so asking again later succeeds."""

    def release_adapter(self, adapter: AdapterId) -> None:
        """One request of `adapter` left the batch."""

    def holds(self, adapter: AdapterId) -> bool:
        """`adapter`'s weights are on the device, ready to use."""

    def can_acquire(self, adapter: AdapterId) -> bool:
        """`adapter` is ready, or memory could be found to bring it in now; changes nothing."""

    def loading(self, adapter: AdapterId) -> bool:
        """`adapter`'s weights have their memory and are being copied in: a request of it waits for
        the copy, not for memory."""

    def pins(self, adapter: AdapterId) -> int:
        """Requests in the batch that use `adapter`."""

    def adapter_pages(self, adapter: AdapterId) -> int:
        """Device pages `adapter`'s weights take (0 where adapters live outside the pool)."""

    def retire_adapter(self, adapter: AdapterId) -> None:
        """`adapter` was unloaded: free its weights and cached KV once no request uses it."""

    def resident(self) -> list[AdapterId]:
        """Adapters whose weights are on the device."""

    # ---- KV ------------------------------------------------------------------------------------

    def begin(self, request: Request) -> bool:
        """Look `request` up in the prefix cache as it is admitted with nothing computed: its block
        table starts with the cached blocks and `num_computed_tokens` skips them. False while a
        cached prefix it would use is being copied back to the device (try again later)."""

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table for `num_new_tokens` more tokens, evicting cached data if
        needed; False (nothing taken) if memory is short."""

    def release(self, request: Request) -> None:
        """`request` left the batch (finished, aborted or preempted) or its admission was undone: its
        computed full blocks join the prefix cache, its other pages are freed, its block table is
        emptied and `num_computed_tokens` is left to the caller."""

    # ---- per step ------------------------------------------------------------------------------

    def drain(self, out: SchedulerOutput, num_running: int) -> None:
        """Add this step's adapter loads, evictions and KV copies to `out`; run background upkeep."""

    def on_result(self, result: ExecutorResult) -> None:
        """Background copies that finished become usable."""

    def quiet_until(self) -> float:
        """Until when steps that only decode leave the policy nothing to do (the twin's decode spans)."""

    def note_decode_steps(self, starts: Sequence[float], num_running: int) -> None:
        """Plain decode steps ran at once, starting at `starts`: record what each step's upkeep would."""

    @property
    def copies_in_flight(self) -> bool: ...

    def stats(self) -> MemoryStats: ...
