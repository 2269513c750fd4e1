"""A server that stops answering costs seconds, not its share of the traffic: a real agent process on
the tiny model, stopped with SIGSTOP, behind the router next to an echo server.

The test writes both servers' heartbeats itself (the in-process store), so it decides what the
router sees: a heartbeat that stays fresh while the process is stopped is what a stuck GPU behind a
live event loop looks like (only the deadline and ejection can help); heartbeats that stop are a
frozen process (its late heartbeat gives it away, and the router drops it from the registry); a
record that goes is a server that left."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from loraplex_bench.echo_server import EchoServer
from loraplex_router.app import RouterSettings, create_app
from loraplex_router.auth import KeyRing
from processes import terminate, wait_healthy
from threaded_server import ThreadedServer

from loraplex.routing.memory_store import InMemoryRoutingStore
from loraplex.routing.outliers import OutlierConfig
from loraplex.routing.pipeline import make_profile
from loraplex.routing.records import ServerRecord
from loraplex.util.clock import MonotonicClock

LORAPLEX = str(Path(sys.executable).parent / "loraplex")
BASE = "tiny-base"
DEADLINE_S = 2.0
HEARTBEAT_S = 0.2


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


class Agent:
    """A real agent process on the tiny model's base (served as tiny-base), on a fixed port."""

    def __init__(self, model: Path, port: int, log: Path) -> None:
        self.argv = [LORAPLEX, "agent", "--model", str(model), "--port", str(port), "--device", "cpu",
                     "--served-model-name", BASE, "--num-blocks", "128", "--max-model-len", "256"]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.process: subprocess.Popen | None = None

    def ensure_serving(self) -> None:
        """Starts it, or starts it again if an earlier test left it unable to serve."""
        if self.process is not None:
            self.send_signal(signal.SIGCONT)
            try:
                if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            self.stop()
        with self.log.open("a") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        wait_healthy(self.url, self.process, self.log)

    def send_signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        terminate(self.process)


@pytest.fixture(scope="module")
def agent(tiny_model, tmp_path_factory, free_port):
    agent = Agent(tiny_model.base_dir, free_port(), tmp_path_factory.mktemp("agent") / "agent.log")
    yield agent
    if agent.process is not None:
        agent.stop()


@dataclass
class Env:
    """The router over {agent, echo}, both serving the base model (each request picks one at random).
    The test beats their hearts."""

    agent: Agent
    store: InMemoryRoutingStore
    router: ThreadedServer
    echo: ThreadedServer
    app: object
    beating: set[str] = field(default_factory=lambda: {"agent", "echo"})
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Env:
        self._beat()
        self._thread = threading.Thread(target=self._beat_loop, daemon=True)
        self._thread.start()
        wait_for(lambda: self.snapshot().taken_at > 0 and len(self.snapshot().servers) == 2)
        # The router judges a heartbeat late against the server's interval, learned from two heartbeats.
        wait_for(lambda: all(self.snapshot().late_after_s(s) is not None for s in ("agent", "echo")))
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.router.stop()
        self.echo.stop()

    def snapshot(self):
        return self.app.state.cache.snapshot

    def _beat(self) -> None:
        for sid, url in (("agent", self.agent.url), ("echo", self.echo.url)):
            if sid in self.beating:
                record = ServerRecord(sid, url, max_rank=64, base_model=BASE, heartbeat_at=time.time())
                self.store.register_server(record, ttl_s=600)

    def _beat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._beat()

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.router.url + "/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(f"{name}{{{want}}} " if want else f"{name} "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture
def make_env(agent, free_port):
    agent.ensure_serving()
    envs: list[Env] = []

    def make(ttfb_deadline_s: float = DEADLINE_S, **outliers) -> Env:
        store = InMemoryRoutingStore("test", MonotonicClock(), window_s=1.0)
        settings = RouterSettings(profile=make_profile("loraserve", rng=random.Random(0)), keys=KeyRing(),
                                  base_model=BASE, poll_interval_s=0.05, ttfb_deadline_s=ttfb_deadline_s,
                                  outliers=OutlierConfig(**outliers))
        app = create_app(store, settings)
        echo = ThreadedServer(EchoServer("echo"), free_port()).start()
        router = ThreadedServer(app, free_port()).start()
        envs.append(Env(agent, store, router, echo, app).start())
        return envs[-1]

    yield make
    agent.send_signal(signal.SIGCONT)
    for env in envs:
        env.stop()


@dataclass
class Outcome:
    status: int
    server: str
    seconds: float


def request(env: Env, stream: bool, timeout_s: float = 60.0) -> Outcome:
    body = {"model": BASE, "prompt": "def add(a, b):", "max_tokens": 3, "stream": stream}
    start = time.monotonic()
    with httpx.stream("POST", env.router.url + "/v1/completions", json=body, timeout=timeout_s) as r:
        r.read()
        return Outcome(r.status_code, r.headers.get("x-loraplex-server", ""), time.monotonic() - start)


def bursts_until(env: Env, done, streams: int, plain: int = 0, most: int = 8) -> list[Outcome]:
    """Concurrent bursts (each request picks a server at random) until `done()`; every outcome."""
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(streams + plain) as pool:
        for _ in range(most):
            outcomes += pool.map(lambda s: request(env, s), [True] * streams + [False] * plain)
            if done():
                return outcomes
    raise AssertionError(f"not done after {most} bursts: {outcomes}")


def stuck_on_agent(env: Env, pool: ThreadPoolExecutor, stream: bool) -> Future:
    """One request after the other until one waits on the (stopped) agent; that one's future."""
    while True:
        future = pool.submit(request, env, stream)
        wait_for(lambda f=future: f.done() or env.app.state.proxy.in_flight.get("agent", 0) > 0)
        if not future.done():
            return future
        assert future.result().server == "echo"


@pytest.fixture
def stopped(agent):
    """stopped(env): SIGSTOP the agent once it has served through the router; SIGCONT is the test's
    (or the teardown's)."""
    def stop(env: Env) -> None:
        wait_for(lambda: request(env, stream=True).server == "agent")
        agent.send_signal(signal.SIGSTOP)
    return stop


def back_in_rotation(env: Env) -> None:
    try:
        wait_for(lambda: request(env, stream=True).server == "agent", timeout_s=60)
    except AssertionError:
        health = httpx.get(env.agent.url + "/health", timeout=10)
        raise AssertionError(f"the agent is not picked again; its /health: {health.status_code} {health.text}") from None


def test_a_stopped_server_that_still_heartbeats_is_left_after_the_deadline_then_ejected(make_env, stopped, agent):
    env = make_env(consecutive=2, base_ejection_s=3.0)
    stopped(env)
    with ThreadPoolExecutor(1) as pool:
        plain = stuck_on_agent(env, pool, stream=False)  # its server's /health is probed past the deadline
        ejected = lambda: env.metric("loraplex_router_ejections_total", server="agent", reason="deadline") >= 1  # noqa: E731
        outcomes = bursts_until(env, ejected, streams=6) + [plain.result()]
    # Nothing lost, all served elsewhere. Without the deadline the streams sent to the agent would
    # wait for the client's 60 s timeout; with it they took about one deadline (2 s) and a retry.
    assert {o.status for o in outcomes} == {200}
    assert {o.server for o in outcomes} == {"echo"}
    assert max(o.seconds for o in outcomes) < 20.0, outcomes
    assert env.metric("loraplex_router_attempts_abandoned_total", server="agent", reason="deadline") >= 2
    # The non-streamed request waiting there was released by the ejection or by its failed probe.
    released = sum(env.metric("loraplex_router_attempts_abandoned_total", server="agent", reason=reason)
                   for reason in ("ejected", "unresponsive"))
    assert released >= 1
    agent.send_signal(signal.SIGCONT)
    back_in_rotation(env)  # once its ejection time is up


def test_a_non_streamed_request_on_a_stopped_server_is_sent_elsewhere_when_health_does_not_answer(
        make_env, stopped, agent):
    # Ejection only after many misses: the probe alone releases the request.
    env = make_env(consecutive=10)
    stopped(env)
    with ThreadPoolExecutor(1) as pool:
        plain = stuck_on_agent(env, pool, stream=False)
        outcome = plain.result()
    assert (outcome.status, outcome.server) == (200, "echo")
    # One deadline (2 s), one probe (2 s at most) and the answer from the echo server.
    assert outcome.seconds < DEADLINE_S + 2.0 + 3.0, outcome
    assert env.metric("loraplex_router_attempts_abandoned_total", server="agent", reason="unresponsive") == 1
    assert env.metric("loraplex_router_ejections_total", server="agent", reason="unresponsive") == 0


def test_a_long_non_streamed_generation_on_a_live_server_is_not_cut(make_env, agent):
    # The deadline is far below the generation's length; the agent answers its probes, so it keeps it.
    env = make_env(ttfb_deadline_s=0.2, consecutive=1)
    env.beating.discard("echo")
    env.store.deregister_server("echo")
    wait_for(lambda: set(env.snapshot().servers) == {"agent"})
    env.beating.add("echo")  # back in the registry while the request waits: the probe decides
    body = {"model": BASE, "prompt": "def add(a, b):", "max_tokens": 200, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        waiting = pool.submit(httpx.post, env.router.url + "/v1/completions", json=body, timeout=60)
        wait_for(lambda: len(env.snapshot().servers) == 2)
        response = waiting.result()
        seconds = time.monotonic() - start
    assert response.status_code == 200 and response.headers["x-loraplex-server"] == "agent"
    assert response.json()["usage"]["completion_tokens"] == 200
    assert seconds > 2 * 0.2, f"the generation ({seconds:.2f} s) did not outlast the deadline: nothing was probed"
    assert env.metric("loraplex_router_attempts_abandoned_total", server="agent", reason="unresponsive") == 0


def test_a_stopped_server_whose_heartbeat_stops_is_left_before_the_deadline_and_back_at_its_next_heartbeat(
        make_env, stopped, agent):
    # No deadline at all, and an ejection far longer than the test: only the late heartbeat can act.
    env = make_env(ttfb_deadline_s=0.0, consecutive=3, base_ejection_s=600.0)
    stopped(env)
    env.beating.discard("agent")  # the agent's record stays (TTL 600 s); its heartbeat no longer moves
    ejected = lambda: env.metric("loraplex_router_ejections_total", server="agent", reason="silent") >= 1  # noqa: E731
    outcomes = bursts_until(env, ejected, streams=4, plain=4)
    assert {o.status for o in outcomes} == {200}
    assert {o.server for o in outcomes} == {"echo"}
    # Late after 2 heartbeat intervals and a poll (about 0.5 s here): far below 20 s.
    assert max(o.seconds for o in outcomes) < 20.0, outcomes
    # Dropped from the registry at once, not when its 600 s TTL runs out.
    assert "agent" not in {s.id for s in env.store.healthy_servers()}
    assert env.metric("loraplex_router_servers_dropped_total", server="agent") == 1
    agent.send_signal(signal.SIGCONT)
    env.beating.add("agent")  # its next heartbeat registers it again
    back_in_rotation(env)  # and ends its ejection, long before its 600 s are up
    assert env.metric("loraplex_router_ejections_total", server="agent", reason="silent") == 1


def test_when_every_heartbeat_is_late_no_server_is_singled_out(make_env, stopped, agent):
    """Late heartbeats everywhere have a shared cause (Redis, the network, the machine): the router
    neither ejects nor drops anyone for them, and a request waiting on the stopped agent stays."""
    env = make_env(ttfb_deadline_s=0.0, consecutive=3, base_ejection_s=600.0)
    stopped(env)
    with ThreadPoolExecutor(1) as pool:
        waiting = stuck_on_agent(env, pool, stream=True)
        env.beating.clear()  # no heartbeat moves any more; both records stay (TTL 600 s)
        time.sleep(2.0)  # four times as long as a heartbeat may be late here
        assert not waiting.done()
        agent.send_signal(signal.SIGCONT)
        outcome = waiting.result()
    assert (outcome.status, outcome.server) == (200, "agent")
    assert env.metric("loraplex_router_ejections_total", server="agent", reason="silent") == 0
    assert {s.id for s in env.store.healthy_servers()} == {"agent", "echo"}


def test_requests_waiting_on_a_server_that_leaves_the_registry_go_elsewhere(make_env, stopped, agent):
    env = make_env(ttfb_deadline_s=0.0, consecutive=0)  # no deadline, no ejection
    stopped(env)
    with ThreadPoolExecutor(1) as pool:
        stuck = stuck_on_agent(env, pool, stream=True)
        env.beating.discard("agent")
        env.store.deregister_server("agent")
        outcome = stuck.result()
    assert (outcome.status, outcome.server) == (200, "echo")
    assert env.metric("loraplex_router_attempts_abandoned_total", server="agent", reason="gone") == 1


def test_with_nowhere_else_to_go_a_request_waits(make_env, stopped, agent):
    """The deadline never fails a request that no other server could take: it waits for the answer."""
    env = make_env(ttfb_deadline_s=0.5, consecutive=1)
    stopped(env)
    env.beating.discard("echo")
    env.store.deregister_server("echo")
    wait_for(lambda: set(env.snapshot().servers) == {"agent"})
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(request, env, True)
        time.sleep(1.5)  # three deadlines: nothing may give it up, there is no other server
        assert not waiting.done()
        agent.send_signal(signal.SIGCONT)
        outcome = waiting.result()
    assert (outcome.status, outcome.server) == (200, "agent")
    assert env.metric("loraplex_router_attempts_abandoned_total", server="agent", reason="deadline") == 0


def test_bad_outlier_flags_are_one_line_errors(free_port):
    for flag, value in (("--ttfb-deadline", "-1"), ("--eject-after", "-2"), ("--ejection-time", "0"),
                        ("--max-ejected-fraction", "1.5")):
        result = subprocess.run([LORAPLEX, "router", "--port", str(free_port()), f"{flag}={value}"],
                                capture_output=True, text=True, timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode != 0 and len(lines) == 1, result.stderr
        assert lines[0].startswith("error: ") and flag in lines[0], lines[0]
