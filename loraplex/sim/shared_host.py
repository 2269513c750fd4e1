"""EMULATION: twin engines that share one host's CPU cores, as `loraplex up`'s agents do on a machine
with fewer cores than agents (plus its router and clients).

The latency profile times a step of one engine computing alone on its core(s). On a shared host a
step that starts while other engines are inside theirs gets a share of the cores: it lasts
`max(1, (busy + serving + background) / cores)` times its profiled length, where `busy` counts the
engines inside a step at its start (itself included), `serving` the cores that the serving work of
requests then in flight keeps busy (`serve`: the client, router and HTTP work of a request, its CPU
spread evenly over its serving path), and `background` the other processes that keep a core busy
(processor sharing, judged once at the step's start: a step does not stretch again when another
starts during it). Only the twin's step-by-step mode uses it; it is an emulation parameter of the run,
not of the profile, and every figure computed with it says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SharedHost:
    cores: float  # host cores the engines share
    background: float = 0.0  # other processes that keep a core busy meanwhile
    steps_cpu_s: float = 0.0  # the steps' profiled seconds so far: the CPU they take
    _steps: dict[int, tuple[float, float]] = field(default_factory=dict)  # engine -> its last step (start, end)
    _serving: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, cores) of serving work

    def __post_init__(self) -> None:
        if not self.cores > 0 or self.background < 0:
            raise ValueError(f"a shared host needs cores > 0 and background >= 0, not {self.cores}, {self.background}")

    def serve(self, start: float, seconds: float, cpu_s: float) -> None:
        """A request's serving work: `cpu_s` of CPU spread evenly over the `seconds` from `start`, so
        `cpu_s / seconds` of a core meanwhile (kept for the run: a twin run serves a few hundred requests)."""
        if cpu_s < 0 or seconds < 0 or (cpu_s > 0 and seconds == 0):
            raise ValueError(f"serving work needs cpu_s >= 0 and seconds > 0 (0 without CPU), not {cpu_s}, {seconds}")
        if cpu_s > 0:
            self._serving.append((start, start + seconds, cpu_s / seconds))

    def stretch(self, engine: int, start: float, seconds: float) -> float:
        """How long engine `engine`'s step of `seconds` (profiled alone) lasts when it starts at `start`."""
        busy = 1 + sum(1 for other, (s, e) in self._steps.items() if other != engine and s <= start < e)
        serving = sum(cores for s, e, cores in self._serving if s <= start < e)
        self.steps_cpu_s += seconds
        seconds *= max(1.0, (busy + serving + self.background) / self.cores)
        self._steps[engine] = (start, start + seconds)
        return seconds
