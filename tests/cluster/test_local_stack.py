"""End to end through `loraplex up`: a real redis-server, 3 real agents on the tiny model, the placement
controller and the router, driven with the real openai client.

The tests share one stack and run in file order; the last one kills an agent."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai_load import OpenAILoad, client, complete, stream_chat
from waiting import wait_until

from loraplex.routing.table import RoutingTable, make_entry

ADAPTERS = [f"ad{i:02d}" for i in range(20)]


def test_twenty_adapters_over_three_agents(stack):
    c = client(stack)
    listed = {m.id for m in c.models.list()}
    assert set(ADAPTERS) <= listed and "tiny-llama" in listed
    with ThreadPoolExecutor(6) as pool:
        plain = list(pool.map(lambda a: complete(c, a), ADAPTERS))
        streamed = list(pool.map(lambda a: stream_chat(c, a), ADAPTERS))
    assert all(isinstance(t, str) and t for t in plain)
    assert all(t for t in streamed)
    table = stack.store.read_table()
    assert set(table.entries) >= set(ADAPTERS)
    assert len(table.servers()) == 3  # the placement spread the adapters over every agent
    assert len(table.routes("ad19")) == 3  # its LoRADeployment asks for replicas.min = 3
    assert stack.controller.policy.inner.hysteresis == 0.2  # the AdapterPool's placement.hysteresis
    assert complete(c, "tiny-llama")


def served_by(stack, requests: list[str]) -> dict[str, Counter[str]]:
    """{adapter: Counter(server)}: who served each request, from the router's x-loraplex-server."""
    def one(http: httpx.Client, adapter: str) -> tuple[str, str]:
        r = http.post("/v1/completions", json={"model": adapter, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text
        return adapter, r.headers["x-loraplex-server"]

    seen: dict[str, Counter[str]] = {}
    with httpx.Client(base_url=stack.router_url, timeout=60) as http, ThreadPoolExecutor(6) as pool:
        for adapter, server in pool.map(lambda a: one(http, a), requests):
            seen.setdefault(adapter, Counter())[server] += 1
    return seen


def test_routing_follows_phi_over_real_agents(stack):
    """A hand-published table with known φ: the router's choices over the three agents must match it
    (chi-square, p = 1e-4, so a correct router fails once in 10,000 runs) and never use a φ = 0 server."""
    s0, s1, s2 = sorted(stack.agents)
    phi = {"ad00": {s0: 0.2, s1: 0.3, s2: 0.5}, "ad01": {s1: 0.7, s2: 0.3}, "ad02": {s0: 1.0}}
    counts = {"ad00": 300, "ad01": 200, "ad02": 30}
    with stack.placement_paused():
        current = stack.store.read_table()
        entries = dict(current.entries)
        for adapter, weights in phi.items():
            entries[adapter] = make_entry(adapter, current.entries[adapter].digest, current.entries[adapter].rank,
                                          weights.items())
        # ad19's LoRADeployment asks for replicas.min = 3: pinned to one server, the table is one the
        # controller must replace once unpaused (hysteresis may otherwise keep the pinned φ as it is).
        entries["ad19"] = make_entry("ad19", current.entries["ad19"].digest, current.entries["ad19"].rank,
                                     [(s0, 1.0)])
        pinned = current.version + 1
        stack.store.publish_table(RoutingTable(pinned, time.time(), entries, policy="pinned-by-test"))
        wait_until(lambda: httpx.get(stack.router_url + "/health").json()["routing_version"] == pinned)
        seen = served_by(stack, [a for a, n in counts.items() for _ in range(n)])
    chi2 = 0.0
    for adapter, weights in phi.items():
        assert set(seen[adapter]) <= set(weights), (adapter, seen[adapter])  # φ = 0: never
        chi2 += sum((seen[adapter][s] - w * counts[adapter]) ** 2 / (w * counts[adapter]) for s, w in weights.items())
    assert chi2 < 21.1, (seen, chi2)  # 3 degrees of freedom (2 + 1 + 0), p = 1e-4
    # Unpaused, the controller finds a table that is not its own and places again.
    wait_until(lambda: stack.store.current_version() > pinned)
    assert len(stack.store.read_table().routes("ad19")) == 3


def test_a_new_deployment_file_becomes_routable(stack, write_deployment):
    c = client(stack)
    write_deployment("late-arrival")
    wait_until(lambda: "late-arrival" in {m.id for m in c.models.list()})
    assert complete(c, "late-arrival")
    assert stream_chat(c, "late-arrival")


def test_a_redis_restart_fails_no_request(stack):
    version = stack.store.current_version()
    with OpenAILoad(stack, ADAPTERS) as load:
        wait_until(lambda: load.ok >= 8)
        stack.redis.kill()
        done_before = load.ok
        wait_until(lambda: load.ok >= done_before + 8)  # served from the router's last snapshot
        stack.start_redis()  # empty: no table, no registry, no adapters
        wait_until(lambda: stack.store.current_version() not in (None, version), timeout_s=90)
        wait_until(lambda: len(stack.store.healthy_servers()) == 3)
        done_after = load.ok
        wait_until(lambda: load.ok >= done_after + 8)
    assert load.failures == []
    assert set(stack.store.read_table().entries) >= set(ADAPTERS)


def test_killing_an_agent_mid_load_loses_no_unstarted_request(stack):
    table = stack.store.read_table()
    victim = max(table.servers(), key=lambda s: len(table.assignments(s)))  # the busiest server
    with OpenAILoad(stack, ADAPTERS, clients=6) as load:
        wait_until(lambda: load.ok >= 12)
        stack.agents[victim].kill()
        killed_at = time.monotonic()
        gone_after = wait_until(lambda: victim not in {s.id for s in stack.store.healthy_servers()})
        wait_until(lambda: victim not in stack.store.read_table().servers())
        replaced_after = time.monotonic() - killed_at
        done = load.ok
        wait_until(lambda: load.ok >= done + 12)
    print(f"\ndead server left the registry {gone_after:.1f} s and the table {replaced_after:.1f} s after "
          f"the kill (heartbeat TTL {stack.config.heartbeat_ttl_s} s); {load.ok} requests served")
    unstarted = [f for f in load.failures if not f[1]]
    assert unstarted == [], unstarted
    assert set(stack.store.read_table().entries) >= set(ADAPTERS)
    metrics = httpx.get(stack.router_url + "/metrics").text
    assert f'loraplex_router_upstream_failures_total{{server="{victim}"}}' in metrics
