"""A hung agent costs seconds, through `loraplex up`: a real redis-server, 3 real agents on the tiny
model, the placement controller and the router, under load; one agent is stopped with SIGSTOP for
longer than the router's time-to-first-byte deadline, then continued.

The heartbeat TTL (30 s) is longer than the stop, so without the router the registry and the table
would keep the stopped agent throughout. The router leaves the agent when an attempt has waited as
long as the agent's heartbeat is late (about 1.5 s here), gives up the requests waiting there, sends
them elsewhere and drops the agent from the registry (placement re-places without it, the other
agents stop asking it for adapter copies). Its first heartbeat after SIGCONT registers it again.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import httpx
import pytest
from loraplex_bench.closed_loop import ClosedLoop
from loraplex_local.stack import StackConfig, running_stack
from stack_manifests import deployment_yaml, pool_yaml
from waiting import wait_until

from loraplex.ports import free_port_block

POOL = "hung"
ADAPTERS = [f"hung{i}" for i in range(4)]
STOP_S = 12.0
DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, free_port):
    folder = tmp_path_factory.mktemp("manifests")
    (folder / "pool.yaml").write_text(pool_yaml(POOL, tiny_model.base_dir))
    sources = list(tiny_model.adapters.values())
    for i, name in enumerate(ADAPTERS):  # on every agent: no request waits for a copy from the stopped one
        (folder / f"{name}.yaml").write_text(deployment_yaml(name, sources[i], POOL, replicas="{min: 3}"))
    config = StackConfig(agents=3, manifests=folder, router_port=free_port(), agent_base_port=free_port_block(3),
                         redis_port=free_port(), heartbeat_interval_s=0.5, heartbeat_ttl_s=30.0,
                         workdir=tmp_path_factory.mktemp("stack"), agent_args=["--num-blocks", "256"],
                         router_args=["--ttfb-deadline", str(DEADLINE_S)])
    with running_stack(config) as stack:  # continues the agent if the test left it stopped
        yield stack


@dataclass
class Done:
    at: float        # when the request was sent (monotonic)
    seconds: float
    server: str
    stream: bool


class Load(ClosedLoop):
    """Clients sending requests through the router until stopped: streamed and not, adapters and base."""

    def __init__(self, url: str, clients: int = 4) -> None:
        super().__init__(clients)
        self.url = url
        self.done: list[Done] = []
        self.failures: list[str] = []

    def served_by(self, server: str, since: float) -> bool:
        with self.lock:
            return any(d.server == server and d.at >= since for d in self.done)

    def session(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def send(self, http: httpx.Client, i: int) -> None:
        models = [*ADAPTERS, "tiny-llama"]
        body = {"model": models[i % len(models)], "prompt": "def add(a, b):", "max_tokens": 3, "stream": i % 2 == 0}
        start = time.monotonic()
        try:
            with http.stream("POST", "/v1/completions", json=body) as r:
                r.read()
                ok = r.status_code == 200 and (not body["stream"] or b"[DONE]" in r.content)
                outcome = None if ok else f"{r.status_code} {r.content[:200]!r}"
        except httpx.HTTPError as exc:
            outcome = repr(exc)
        with self.lock:
            if outcome is None:
                self.done.append(Done(start, time.monotonic() - start, r.headers["x-loraplex-server"], body["stream"]))
            else:
                self.failures.append(outcome)


def metric(stack, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(stack.router_url + "/metrics").text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.split()[-1])
    return 0.0


def test_a_stopped_agent_costs_seconds_and_is_back_after_sigcont(stack):
    victim = sorted(stack.agents)[0]
    process = stack.agents[victim].process
    with Load(stack.router_url) as load:
        wait_until(lambda: load.served_by(victim, 0.0) and len(load.done) >= 20)
        process.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(STOP_S)
        registered = victim in {s.id for s in stack.store.healthy_servers()}
        process.send_signal(signal.SIGCONT)
        continued_at = time.monotonic()
        try:
            wait_until(lambda: load.served_by(victim, continued_at))
        except AssertionError:
            health = httpx.get(stack.agent_url(victim) + "/health", timeout=10)
            raise AssertionError(f"{victim} does not serve again; its /health: {health.status_code} "
                                 f"{health.text}\n{stack.router.tail(20)}") from None
    during = [d for d in load.done if stopped_at <= d.at < continued_at]
    print(f"\n{len(load.done)} requests; {len(during)} sent during the {STOP_S:.0f} s stop, the slowest of them "
          f"{max(d.seconds for d in during):.2f} s; slowest overall {max(d.seconds for d in load.done):.2f} s")
    router_log = stack.router.tail(20)
    assert load.failures == [], router_log
    assert not registered, router_log  # dropped by the router long before its 30 s TTL
    assert metric(stack, "loraplex_router_servers_dropped_total", server=victim) == 1, router_log
    # A request that waited for the stopped agent would have taken the whole stop (12 s); every one sent
    # during the stop took less than the deadline: the late heartbeat gave the agent away first.
    assert max(d.seconds for d in during) < DEADLINE_S, (during, router_log)
    # Only a stream already under way there when it stopped may wait for it: its first bytes had
    # reached the client, so it is committed to that agent.
    slow = [d for d in load.done if d.seconds >= DEADLINE_S]
    assert all(d.stream and d.at < stopped_at and d.server == victim for d in slow), slow
    assert len(during) >= 8, router_log  # the clients kept being served during the stop
    # Once the router left it (about 2 s after the stop; 5 s is a generous bound), no request went there.
    assert not [d for d in during if d.at >= stopped_at + 5.0 and d.server == victim], router_log
    assert metric(stack, "loraplex_router_ejections_total", server=victim, reason="silent") >= 1, router_log
