"""`loraplex_bench.interleave`: engines stepped in turn, the one whose clock is behind first, each clock
moved only by its own steps and its jumps to the next arrival."""

from __future__ import annotations

import pytest
from loraplex_bench.interleave import Baton, Lane, StepClock, interleave

from loraplex.engine.messages import RequestOutput
from loraplex.engine.request import Request


class Engine:
    """A stand-in for an engine: `steps` steps, each of which moves its own clock by `cost` (a jump, as
    if the step had measured that long) and logs every clock at its start."""

    def __init__(self, name: str, steps: int, cost: float, log: list[tuple[str, list[float]]],
                 clocks: list[StepClock], fail_at: int | None = None) -> None:
        self.name, self.left, self.cost, self.log, self.clocks, self.fail_at = name, steps, cost, log, clocks, fail_at
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        raise AssertionError("no requests here")

    def has_unfinished(self) -> bool:
        return self.left > 0

    def step(self) -> list[RequestOutput]:
        if self.num_steps == self.fail_at:
            raise ValueError(f"{self.name} failed")
        self.log.append((self.name, [c.now() for c in self.clocks]))
        clock = self.clocks[0 if self.name == "a" else 1]
        clock.advance(self.cost)
        self.left -= 1
        self.num_steps += 1
        return []


def lanes(costs: tuple[float, float], steps: tuple[int, int], fail_at: int | None = None
          ) -> tuple[Baton, list[Lane], list[tuple[str, list[float]]]]:
    clocks = [StepClock(), StepClock()]
    baton, log = Baton(clocks), []
    engines = [Engine("a", steps[0], costs[0], log, clocks), Engine("b", steps[1], costs[1], log, clocks, fail_at)]
    return baton, [Lane(e, baton, i, clocks[i]) for i, e in enumerate(engines)], log


def drain(lane: Lane) -> int:
    while lane.has_unfinished():
        lane.step()
    return lane.num_steps


def test_the_engine_behind_steps_next_and_ties_go_to_the_first() -> None:
    baton, (a, b), log = lanes(costs=(1.0, 3.5), steps=(9, 3))
    assert interleave(baton, [lambda: drain(a), lambda: drain(b)]) == [9, 3]
    names = [name for name, _ in log]
    assert names == ["a", "b", "a", "a", "a", "b", "a", "a", "a", "b", "a", "a"]
    last_b = len(names) - 1 - names[::-1].index("b")
    for name, (ta, tb) in log[:last_b + 1]:  # while both ran, every step was on the clock behind
        assert (ta <= tb) if name == "a" else (tb <= ta)
    assert a.clock.now() >= 9.0 and b.clock.now() >= 10.5  # its jumps plus the wall time its steps measured


def test_an_idle_engine_jumps_to_its_next_arrival_and_waits_for_the_other() -> None:
    baton, (a, b), log = lanes(costs=(1.0, 1.0), steps=(4, 4))

    def idle_then_drain() -> int:
        baton.jump(0, 2.5)  # a has nothing to do before 2.5: b steps until its clock passes that
        return drain(a)

    interleave(baton, [idle_then_drain, lambda: drain(b)])
    first_a = next(i for i, (name, _) in enumerate(log) if name == "a")
    assert [name for name, _ in log[:first_a]] == ["b", "b", "b"] and log[first_a][1][0] == 2.5


def test_a_failing_engine_stops_the_other_and_its_error_is_raised() -> None:
    baton, (a, b), _ = lanes(costs=(1.0, 1.0), steps=(1000, 1000), fail_at=2)
    with pytest.raises(ValueError, match="b failed"):
        interleave(baton, [lambda: drain(a), lambda: drain(b)])
    assert a.num_steps < 1000
