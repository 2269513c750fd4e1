"""Schedulers by name: what `EngineConfig.scheduler`, `--scheduler` and an AdapterPool's
`engine.scheduler` choose from."""

from __future__ import annotations

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.device_memory import DeviceMemory
from loraplex.engine.scheduling.chameleon import ChameleonScheduler
from loraplex.engine.scheduling.scheduler import FifoScheduler, RankOf, Scheduler
from loraplex.engine.scheduling.sjf import SjfScheduler
from loraplex.engine.scheduling.vtc import VtcScheduler
from loraplex.util.clock import Clock

SCHEDULERS: dict[str, type] = {"fifo": FifoScheduler, "sjf": SjfScheduler, "vtc": VtcScheduler,
                               "chameleon": ChameleonScheduler}


def make_scheduler(config: EngineConfig, memory: DeviceMemory, rank_of: RankOf, clock: Clock) -> Scheduler:
    try:
        cls = SCHEDULERS[config.scheduler]
    except KeyError:
        raise ValueError(f"unknown scheduler {config.scheduler!r}; choose from {sorted(SCHEDULERS)}") from None
    return cls(config, memory, rank_of, clock)


def parse_scheduler_options(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` strings (a command line's `--scheduler-option`); the scheduler converts and checks them."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"scheduler option {pair!r} is not KEY=VALUE")
        options[key.strip()] = value.strip()
    return options
