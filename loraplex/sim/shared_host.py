"""EMULATION: twin engines that share one host's CPU cores, as `loraplex up`'s agents do on a machine
with fewer cores than agents (plus its router and clients).

The latency profile times a step of one engine computing alone on its core(s): its CPU. On a shared
host a step runs at `min(1, cores / (stepping + serving + background))` of a core (processor
sharing), where `stepping` counts the engines inside a step (itself included), `serving` the cores
that the serving work of requests in flight keeps busy (`serve`: a request's client, router and HTTP
work, its CPU spread evenly over its serving path) and `background` the other processes that keep a
core busy; and at most at what the steps already running and the serving work leave of the cores, so
the host never runs more CPU than it has. A step's pieces are fixed when it starts (the twin's engine
clocks move on): a step that starts later takes what is left, and an earlier one does not slow down
for it. Only the twin's step-by-step mode uses it; it is an emulation parameter of the run, not of
the profile, and every figure computed with it says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SharedHost:
    cores: float  # host cores the engines share
    background: float = 0.0  # other processes that keep a core busy meanwhile
    steps_cpu_s: float = 0.0  # the steps' profiled seconds so far: the CPU they take
    # engine -> its last step as (start, end, cores it used) pieces; serving work as (start, end, cores)
    _steps: dict[int, list[tuple[float, float, float]]] = field(default_factory=dict)
    _serving: list[tuple[float, float, float]] = field(default_factory=list)

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
        self.steps_cpu_s += seconds
        steps = [(other, piece) for other, pieces in self._steps.items() if other != engine
                 for piece in pieces if piece[1] > start]
        serving = [work for work in self._serving if work[1] > start]
        bounds = sorted({t for piece in [*(p for _, p in steps), *serving] for t in piece[:2] if t > start})
        pieces, at, work = [], start, seconds
        for until in [*bounds, float("inf")]:
            running = [(other, cores) for other, (s, end, cores) in steps if s <= at < end]
            serving_cores = sum(cores for s, end, cores in serving if s <= at < end)
            share = self.cores / (1 + len({other for other, _ in running}) + serving_cores + self.background)
            rate = min(1.0, share, self.cores - serving_cores - sum(cores for _, cores in running))
            if rate > 0:
                if rate * (until - at) >= work:
                    pieces.append((at, at + work / rate, rate))
                    break
                pieces.append((at, until, rate))
                work -= rate * (until - at)
            at = until
        self._steps[engine] = pieces
        return pieces[-1][1] - start
