"""An engine thread stuck in one step (a hung device) makes the agent unhealthy until the step ends:
/health answers 503 with the reason, so the pool member leaves the registry and the router's probe of
a waiting non-streamed request sends it elsewhere. A command that blocks the engine thread stands
in for the hung device."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture
def stall(agent):
    """stall(): block the engine thread until the returned event is set (the teardown sets it)."""
    released = threading.Event()
    saved = agent.engine.stall_timeout_s
    agent.engine.stall_timeout_s = 0.3

    def block() -> threading.Event:
        agent.engine._submit(lambda: released.wait(60))
        return released

    yield block
    released.set()
    agent.wait_for(lambda: agent.engine.stalled_for() == 0.0, "the engine thread to go on")
    agent.engine.stall_timeout_s = saved


def test_a_stalled_engine_answers_503_on_health_and_recovers(agent, stall):
    with agent.http() as http:
        assert http.get("/health").status_code == 200
        released = stall()
        response = agent.wait_for(lambda: (r := http.get("/health")).status_code == 503 and r, "a 503")
        assert "in one step for" in response.json()["error"]["message"]
        assert not agent.engine.healthy
        released.set()
        agent.wait_for(lambda: http.get("/health").status_code == 200, "a 200 again")


def test_requests_accepted_during_a_stall_are_served_after_it(agent, stall):
    released = stall()
    done = []
    worker = threading.Thread(target=lambda: done.append(agent.client().completions.create(
        model=agent.base, prompt="hello", max_tokens=2)))
    worker.start()
    agent.wait_for(lambda: agent.engine.stalled, "the stall")
    assert not done
    released.set()
    worker.join(60)
    assert done and done[0].choices[0].finish_reason in ("length", "stop")


def test_stall_timeout_zero_never_reports_a_stall(agent, stall):
    released = stall()
    agent.engine.stall_timeout_s = 0.0
    agent.wait_for(lambda: agent.engine.stalled_for() > 0.5, "a long step")
    assert agent.engine.healthy
    released.set()
