"""EMULATION of engines sharing a host's cores (loraplex.sim.shared_host): a step stretches by the
engines inside a step at its start, plus the background, over the cores; the twin's executor applies
it."""

from __future__ import annotations

import pytest

from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.latency.profile import load_profile
from loraplex.sim.server import make_sim_engine
from loraplex.sim.shared_host import SharedHost


def test_a_step_gets_its_share_of_the_cores_that_the_running_steps_leave() -> None:
    """A step runs at its fair share of the cores (the engines stepping, the background), at most what
    the steps already running and the serving work leave: the cores are never overcommitted."""
    host = SharedHost(cores=2)
    assert host.stretch(1, 0.0, 1.0) == 1.0  # alone
    assert host.stretch(2, 0.5, 1.0) == 1.0  # two engines, two cores
    # three on two cores: nothing left until engine 1's step ends at 1.0, then a core
    assert host.stretch(3, 0.6, 1.0) == pytest.approx(0.4 + 1.0)
    assert host.stretch(1, 2.6, 1.0) == 1.0  # the others' steps are over by then
    assert SharedHost(cores=2, background=2).stretch(1, 0.0, 1.0) == pytest.approx(1.5)
    assert host.steps_cpu_s == 4.0  # the steps' profiled seconds
    with pytest.raises(ValueError):
        SharedHost(cores=0)


def test_serving_work_in_flight_takes_its_share_of_the_cores() -> None:
    """A request's serving CPU, spread over its serving path, takes that share of a core while the path
    lasts: 0.2 s of CPU over 0.4 s is half a core."""
    host = SharedHost(cores=2)
    host.serve(0.0, 0.4, 0.2)
    host.serve(0.1, 0.4, 0.2)
    assert host.stretch(1, 0.0, 1.0) == 1.0  # one engine and half a core of serving on two cores
    # nothing left until the first path ends at 0.4, then half a core until the second ends, then a core
    assert host.stretch(2, 0.2, 1.0) == pytest.approx(0.2 + 0.1 + (1.0 - 0.05))
    assert host.stretch(3, 2.0, 1.0) == 1.0  # both paths over, engine 1's step too: two engines on two cores
    host.serve(0.0, 0.0, 0.0)  # no path, no CPU: nothing to spread
    for seconds, cpu in ((0.0, 0.1), (0.1, -1.0)):
        with pytest.raises(ValueError):
            host.serve(0.0, seconds, cpu)


def test_the_twin_executor_stretches_its_steps_on_a_shared_host() -> None:
    profile = load_profile("cpu-tiny")
    times = []
    for host in (None, SharedHost(cores=1, background=1)):
        core, clock = make_sim_engine(profile)
        core.executor.host = host
        core.add_request(Request("r", list(range(3, 300)), SamplingParams(max_tokens=4, ignore_eos=True)))
        while core.has_unfinished():
            core.step()
        times.append(clock.now())
    assert times[1] == pytest.approx(2 * times[0])
