"""The twin's fast mode: a span of plain decode steps (one batch, unchanged between two events) runs
as one closed-form advance of the SimExecutor instead of one Python step per token. The scheduler
says which steps form a span (`BatchScheduler.decode_span`) and applies them; the exact mode runs
every step through `EngineCore.step` and is the reference the fast mode is tested against."""

from __future__ import annotations

from loraplex.engine.core import EngineCore
from loraplex.engine.messages import RequestOutput
from loraplex.sim.executor import DUMMY_TOKEN, SimExecutor


def step(core: EngineCore, executor: SimExecutor, until: float, strict: bool = False,
         exact: bool = False) -> list[RequestOutput] | None:
    """Run the next step of `core`, or with `exact` off, when it starts a span, the span's steps that
    start at or before `until` (before it, `strict`). Returns the step's outputs (after a span, those
    of the requests its last step finished), or None when a normal step ran nothing."""
    if not exact:
        span = core.scheduler.decode_span(DUMMY_TOKEN.token_id)
        if span is not None:
            starts = executor.run_span(span, until, strict)
            return core.advance_decodes(len(starts), DUMMY_TOKEN, starts)
    steps = core.num_steps
    outputs = core.step()
    return outputs if outputs or core.num_steps != steps else None
