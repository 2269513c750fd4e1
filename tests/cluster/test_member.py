"""An agent's pool membership over a real engine (the tiny model) and the in-process store: heartbeat
record, prefetch of assigned adapters, eviction of unassigned ones, and never deleting a last copy."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import httpx
import pytest
from loraplex_agent.cli import DEFAULT_STALL_TIMEOUT_S
from loraplex_agent.cluster.fetcher import AdapterFetcher
from loraplex_agent.cluster.files import adapter_digest
from loraplex_agent.cluster.member import ClusterMember
from loraplex_agent.cluster.settings import ClusterSettings
from loraplex_agent.cluster.sources import SourcePolicy
from loraplex_agent.runtime.async_engine import AsyncEngine
from loraplex_agent.runtime.llm import LLM
from loraplex_agent.vllm_backend.server import Sidecar, build_app
from waiting import wait_until

from loraplex.routing.memory_store import InMemoryRoutingStore
from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.table import RoutingTable, make_entry
from loraplex.spec.errors import AdapterError, OverloadedError
from loraplex.util.clock import MonotonicClock

ME, OTHER = "me", "other"


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model.base_dir, device="cpu", num_blocks=300, max_model_len=128, max_loras=2)


@pytest.fixture
async def member(llm, tiny_model, tmp_path):
    store = InMemoryRoutingStore("test", MonotonicClock())
    for name, path in list(tiny_model.adapters.items())[:3]:
        store.put_adapter(AdapterRecord(name, adapter_digest(path), 8, 1, f"file://{path}"))
    engine = AsyncEngine(llm, DEFAULT_STALL_TIMEOUT_S)
    engine.start()
    settings = ClusterSettings("redis://unused", "test", ME, "http://127.0.0.1:1", tmp_path / "store")
    m = ClusterMember(settings, store, engine, AdapterFetcher(settings.adapter_store, SourcePolicy()),
                      max_rank=64, base_model="tiny")
    m.names = list(tiny_model.adapters)[:3]
    yield m
    for name in list(engine.adapters):
        await engine.remove_adapter(name)
    engine.shutdown()


def publish(store, version: int, assignment: dict[str, str]) -> None:
    entries = {}
    for name, server in assignment.items():
        digest = store.get_adapter(name).digest
        entries[name] = make_entry(name, digest, 8, [(server, 1.0)])
    store.publish_table(RoutingTable(version, time.time(), entries))


async def test_prefetches_its_assignment_and_reports_it(member):
    a, b, c = member.names
    publish(member.store, 1, {a: ME, b: ME, c: OTHER})
    await member.reconcile()
    assert set(member.engine.adapters) == {a, b}
    assert member.store.get_adapter(a).locations == {ME}
    record = member.record()
    assert record.host_adapters == tuple(sorted((a, b))) and record.max_rank == 64 and record.base_model == "tiny"
    assert record.block_size == member.engine.core.config.block_size > 0  # for prefix-aware routing


async def test_drops_unassigned_adapters_but_never_the_last_copy(member):
    a, b, c = member.names
    publish(member.store, 1, {a: ME, b: ME, c: OTHER})
    await member.reconcile()
    member.store.add_location(a, OTHER)  # `other` has copied a; nobody else holds b
    publish(member.store, 2, {a: OTHER, b: OTHER, c: OTHER})
    await member.reconcile()
    assert set(member.engine.adapters) == {a, b}  # unassigned once: kept for one more pass
    await member.reconcile()
    assert set(member.engine.adapters) == {b}
    assert member.store.get_adapter(a).locations == {OTHER}
    assert member.store.get_adapter(b).locations == {ME}  # the last copy stays


async def moved_away(member) -> str:
    """Adapter a, loaded here, then assigned to `other`, which holds a copy too: evicted here on the
    second pass from now, unless a request pins it."""
    a, _, c = member.names
    publish(member.store, 1, {a: ME, c: OTHER})
    await member.reconcile()
    member.store.add_location(a, OTHER)
    publish(member.store, 2, {a: OTHER, c: OTHER})
    return a


async def test_an_adapter_with_a_request_in_flight_is_not_evicted(member):
    a = await moved_away(member)
    with member.pinned(a):  # what the agent's middleware holds from before the load to the response's end
        for _ in range(3):
            await member.reconcile()
        assert a in member.engine.adapters and ME in member.store.get_adapter(a).locations
    await member.reconcile()
    assert a not in member.engine.adapters  # unpinned: evicted on the next pass


async def test_a_request_that_comes_while_its_adapter_is_unloaded_loads_it_again(member):
    """Not a 503: the request may have no other server to go to (the last one left in its pool)."""
    a = await moved_away(member)
    await member.reconcile()  # unassigned once
    gate, remove = asyncio.Event(), member.engine.remove_adapter

    async def slow_remove(name: str):
        await gate.wait()
        return await remove(name)

    member.engine.remove_adapter = slow_remove
    evicting = asyncio.create_task(member.reconcile())
    try:
        while a not in member._unloading:
            await asyncio.sleep(0.01)
        with member.pinned(a):  # what the request holds from before the load
            request = asyncio.create_task(member.ensure(a))
            await asyncio.sleep(0.1)
            assert not request.done()  # it waits for the unload
            gate.set()
            await asyncio.gather(evicting, request)
    finally:
        gate.set()
        member.engine.remove_adapter = remove
    assert a in member.engine.adapters and member.fetcher.path_of(member.store.get_adapter(a)).is_dir()
    assert ME in member.store.get_adapter(a).locations


async def test_the_vllm_middleware_pins_its_adapter_from_ensure_to_release(member):
    """/internal/ensure (the vLLM middleware's call before vLLM sees a request) pins the adapter until
    /internal/release: vLLM reloads an evicted LoRA from its folder, and dies if the folder is gone."""
    a = await moved_away(member)
    app = build_app(Sidecar(member.engine, member, member.store, None), None)  # no lifespan: the routes only
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent") as agent:
        for _ in range(2):  # two requests in flight
            assert (await agent.post("/internal/ensure", json={"adapter": a})).status_code == 200
        refused = await agent.post("/internal/ensure", json={"adapter": "not-registered"})
        assert refused.status_code == 503 and not member._pins["not-registered"]
        for _ in range(2):  # the two requests end, one after the other
            await member.reconcile()
            await member.reconcile()  # two passes unassigned: evicted unless pinned
            assert a in member.engine.adapters  # a request is still in vLLM
            assert (await agent.post("/internal/release", json={"adapter": a})).status_code == 200
    await member.reconcile()
    assert a not in member.engine.adapters


async def test_a_request_for_an_unassigned_adapter_loads_it_lazily(member):
    a, _, c = member.names
    publish(member.store, 1, {a: ME, c: OTHER})
    await member.ensure(c)
    assert c in member.engine.adapters and ME in member.store.get_adapter(c).locations
    with pytest.raises(OverloadedError):
        await member.ensure("not-registered")


async def test_a_stalled_engine_leaves_the_registry_until_its_step_ends(member):
    """A hung device (here: a command blocking the engine thread) takes the agent out of the registry,
    so the router sends its waiting requests elsewhere; it registers again once the step ends."""
    engine = member.engine
    engine.stall_timeout_s = 0.1
    released = threading.Event()
    engine._submit(lambda: released.wait(60))
    await member._heartbeat()
    wait_until(lambda: engine.stalled)  # blocks the loop: nothing on it has to run meanwhile
    await member._heartbeat()
    assert ME not in {s.id for s in member.store.healthy_servers()}
    released.set()
    wait_until(lambda: engine.stalled_for() == 0)
    await member._heartbeat()
    assert ME in {s.id for s in member.store.healthy_servers()}


async def test_a_version_its_engine_refuses_is_in_the_heartbeat_until_unassigned(member, tmp_path):
    """Fetched and verified, then refused by the engine (here a DoRA config): the heartbeat reports
    (adapter, digest, why) for the operator, the prefetch does not retry it, a request still does."""
    a = member.names[0]
    dora = tmp_path / "dora"
    shutil.copytree(member.store.get_adapter(a).source.removeprefix("file://"), dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    digest = adapter_digest(dora)
    member.store.put_adapter(AdapterRecord("dora", digest, 8, 1, f"file://{dora}"))
    publish(member.store, 1, {a: ME, "dora": ME})
    await member.reconcile()
    assert set(member.engine.adapters) == {a}
    [(name, refused_digest, why)] = member.record().refused
    assert (name, refused_digest) == ("dora", digest) and "use_dora" in why
    assert member.store.get_adapter("dora").locations == set()
    assert not member._needs(member.store.get_adapter("dora"))
    with pytest.raises(AdapterError):
        await member.ensure("dora")
    publish(member.store, 2, {a: ME})
    await member.reconcile()
    assert member.record().refused == ()


async def test_an_activated_lora_whose_record_lacks_the_invocation_reports_it(member, tiny_alora_model):
    """A file:// (or s3://, gs://) aLoRA is registered from declared facts: no invocation in its record.
    Once loaded here, the heartbeat carries (adapter, digest, invocation) for the pool's driver to write
    into the record; once the record has it, the heartbeat stops carrying it."""
    a = member.names[0]
    path = tiny_alora_model.adapters["alora00-r8"]
    invocation = tuple(json.loads((path / "adapter_config.json").read_text())["alora_invocation_tokens"])
    digest = adapter_digest(path)
    member.store.put_adapter(AdapterRecord("checker", digest, 8, 1, f"file://{path}"))
    publish(member.store, 1, {a: ME, "checker": ME})
    await member.reconcile()
    assert member.record().invocations == (("checker", digest, invocation),)
    assert ServerRecord.from_json(member.record().to_json()).invocations == (("checker", digest, invocation),)
    member.store.put_adapter(AdapterRecord("checker", digest, 8, 1, f"file://{path}", invocation_tokens=invocation))
    await member.reconcile()
    assert member.record().invocations == ()
