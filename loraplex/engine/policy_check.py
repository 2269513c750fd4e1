"""Check a scheduler and memory policy by name, with their options, without starting an engine:
what an AdapterPool's `engine` settings are validated with before any pod is made (operator) or any
agent is started (`loraplex up`)."""

from __future__ import annotations

from collections.abc import Mapping

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.paged_memory import no_adapter_pages
from loraplex.engine.memory.policies import make_memory
from loraplex.engine.scheduling.schedulers import make_scheduler
from loraplex.spec.crd import EngineSpec
from loraplex.util.clock import ManualClock


def check_policies(scheduler: str, scheduler_options: Mapping[str, str], memory_policy: str,
                   memory_options: Mapping[str, str]) -> None:
    """Raise ValueError (one line) for an unknown policy or a bad option of either."""
    config = EngineConfig(scheduler=scheduler, scheduler_options=dict(scheduler_options),
                          memory_policy=memory_policy, memory_options=dict(memory_options))
    clock = ManualClock()
    memory = make_memory(config, no_adapter_pages, clock)
    make_scheduler(config, memory, lambda adapter: 1, clock)


def engine_error(engine: EngineSpec) -> str:
    """Why the agents would refuse an AdapterPool's engine policies or their options; '' when they would not."""
    try:
        check_policies(engine.scheduler, engine.scheduler_options, engine.memory_policy, engine.memory_options)
    except ValueError as exc:
        return str(exc)
    return ""
