"""What a real API server showed and the offline handlers missed: writes that grow with the pool,
statuses that flap, a pool's changes not reaching its adapters, state left behind by a deleted pool,
Redis trusted over Kubernetes, user volumes that collide with ours. Handlers are called as kopf calls
them (operator_world.World); only the Kubernetes API is recorded."""

from __future__ import annotations

import copy
import threading
from typing import Any

import kopf
import pytest
from loraplex_operator import handlers
from loraplex_operator.coalesce import Coalescer
from loraplex_operator.kube import KubeError
from operator_world import NS, World, bump

POOL_SPEC = {"baseModel": {"name": "tiny", "source": "file:///models/tiny"},
             "servers": {"minReplicas": 2, "maxReplicas": 2, "gpusPerServer": 0},
             "engine": {"maxLoraRank": 64}, "placement": {"intervalSeconds": 30, "autoscale": False}}


@pytest.fixture
def world() -> World:
    w = World("http://127.0.0.1:1")  # every adapter here declares its digest and rank: nothing is fetched
    w.create("AdapterPool", "tiny", POOL_SPEC, "pool-uid")
    w.call(handlers.pool_changed, "AdapterPool", "tiny")
    return w


def _adapter(world: World, name: str, rank: int = 16, tps: float = 0.0) -> None:
    spec = {"pool": "tiny", "adapter": {"source": f"file:///adapters/{name}", "sha256": "e" * 64, "rank": rank},
            "traffic": {"expectedTokensPerSecond": tps}}
    world.create("LoRADeployment", name, spec, f"{name}-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", name)


def _serve(world: World, holds_all: bool = True) -> None:
    """Both servers heartbeat with Ready pods, holding what the table assigns them."""
    table = world.deps.store("tiny").read_table()
    for sid in ("tiny-0", "tiny-1"):
        holds = tuple(table.assignments(sid)) if table and holds_all else ()
        world.heartbeat("tiny", sid, holds=holds)


def _phase(world: World, name: str) -> tuple[str, str]:
    status = world.status("LoRADeployment", name)
    return status["phase"], status["reason"]


def _update(world: World, kind: str, name: str, **spec_changes: Any) -> None:
    obj = world.kube.objects[(kind, NS, name)]
    for section, values in spec_changes.items():
        obj["spec"][section] = {**obj["spec"].get(section, {}), **values}
    obj["metadata"]["generation"] += 1
    bump(obj)


def _settle(world: World, n: int = 40) -> None:
    _serve(world, holds_all=False)
    for i in range(n):
        _adapter(world, f"a{i}")
    _serve(world)
    world.tick("tiny")
    assert {_phase(world, f"a{i}") for i in range(n)} == {("Ready", "Serving")}


def test_a_pool_at_rest_writes_nothing(world: World) -> None:
    _settle(world)
    world.kube.status_patches.clear()
    versions: list[int] = []
    world.stores["tiny"].watch_versions(versions.append)
    pool_writes = 0
    for _ in range(20):  # 100 s: three placements, nothing changed
        world.clock.advance(5)
        _serve(world)
        before = copy.deepcopy(world.status("AdapterPool", "tiny"))
        patch = dict(world.tick("tiny"))
        if "status" in patch:  # only the time of the placement moved
            pool_writes += 1
            after = world.status("AdapterPool", "tiny")
            assert {k for k in after if after[k] != before.get(k)} == {"lastPlacementTime"}
    assert pool_writes == 3 and world.kube.status_patches == [] and versions == []


def test_one_adapter_added_changed_or_deleted_costs_constant_writes(world: World) -> None:
    _settle(world)
    world.kube.status_patches.clear()
    _adapter(world, "new")  # its handler writes its status with kopf's patch
    _serve(world)
    world.tick("tiny")
    assert world.kube.status_patches == ["new"] and _phase(world, "new") == ("Ready", "Serving")

    world.kube.status_patches.clear()
    _update(world, "LoRADeployment", "a3", traffic={"expectedTokensPerSecond": 5.0})
    patch = world.call(handlers.adapter_changed, "LoRADeployment", "a3")
    world.tick("tiny")
    assert world.kube.status_patches == [] and dict(patch)["status"]["observedGeneration"] == 2

    body = kopf.Body(world.kube.objects[("LoRADeployment", NS, "a5")])
    handlers.adapter_deleted(spec=body.spec, meta=body.meta, name="a5", memo=world.memo)
    del world.kube.objects[("LoRADeployment", NS, "a5")]
    world.tick("tiny")
    assert world.kube.status_patches == [] and "a5" not in world.stores["tiny"].read_table().entries


def test_a_resumed_operator_rewrites_nothing(world: World) -> None:
    _settle(world, 5)
    puts = []
    store = world.stores["tiny"]
    original = store.put_adapter
    store.put_adapter = lambda record: (puts.append(record.name), original(record))  # type: ignore[method-assign]
    for i in range(5):  # kopf's on.resume after a restart: same generation, same registry
        patch = world.call(handlers.adapter_changed, "LoRADeployment", f"a{i}")
        assert dict(patch) == {}
    assert puts == []


def test_concurrent_syncs_are_coalesced() -> None:
    runs = []
    gate = threading.Event()

    def work() -> int:
        runs.append(1)
        gate.wait(5)
        return len(runs)

    sync = Coalescer(work)
    first = threading.Thread(target=sync)
    first.start()
    while not runs:
        pass
    results: list[int] = []
    others = [threading.Thread(target=lambda: results.append(sync())) for _ in range(20)]
    for t in others:
        t.start()
    gate.set()
    for t in [first, *others]:
        t.join(5)
    # The first run was under way when the others asked: one more run serves all twenty.
    assert len(runs) == 2 and results == [2] * 20


def test_a_heartbeat_without_a_ready_pod_does_not_serve(world: World) -> None:
    _adapter(world, "x")
    table = world.stores["tiny"].read_table()
    assert table is None or "x" not in table.entries
    world.heartbeat("tiny", "tiny-0", holds=("x",), pod_ready=False)  # a Pending pod with a stale registration
    world.tick("tiny")
    assert _phase(world, "x") == ("Pending", "NoServers")
    pool = world.status("AdapterPool", "tiny")
    assert pool["readyReplicas"] == 0 and pool["phase"] == "Pending"
    world.clock.advance(30)
    world.heartbeat("tiny", "tiny-0", holds=("x",))
    world.tick("tiny")
    assert _phase(world, "x") == ("Ready", "Serving")


def test_the_pool_max_rank_follows_its_adapters_both_ways(world: World) -> None:
    _serve(world)
    _adapter(world, "big", rank=32)
    assert _phase(world, "big") == ("Loading", "Fetching")
    _update(world, "AdapterPool", "tiny", engine={"maxLoraRank": 16})
    world.call(handlers.pool_changed, "AdapterPool", "tiny")
    world.tick("tiny")
    status = world.status("LoRADeployment", "big")
    assert (status["phase"], status["reason"], status["rank"]) == ("Failed", "RankTooLarge", 32)
    assert world.stores["tiny"].get_adapter("big") is None and "big" not in world.stores["tiny"].read_table().entries

    _update(world, "AdapterPool", "tiny", engine={"maxLoraRank": 64})
    world.call(handlers.pool_changed, "AdapterPool", "tiny")
    world.tick("tiny")
    assert _phase(world, "big") == ("Loading", "Fetching")
    assert world.events.reasons("big") == ["Fetching", "RankTooLarge", "Fetching"]


def test_a_failed_generation_leaves_the_registry(world: World) -> None:
    _serve(world)
    _adapter(world, "x")
    _update(world, "LoRADeployment", "x", adapter={"rank": 128})
    world.call(handlers.adapter_changed, "LoRADeployment", "x")
    status = world.status("LoRADeployment", "x")
    assert (status["phase"], status["reason"], status["rank"]) == ("Failed", "RankTooLarge", 128)
    assert world.stores["tiny"].get_adapter("x") is None and "x" not in world.stores["tiny"].read_table().entries


def test_a_deleted_pool_leaves_nothing_and_a_new_one_takes_its_adapters_back(world: World) -> None:
    _serve(world)
    _adapter(world, "x")
    pool = world.kube.objects.pop(("AdapterPool", NS, "tiny"))
    world.kube.objects[("AdapterPool", NS, "tiny")] = pool  # the finalizer runs while the object still exists
    world.call(handlers.pool_deleted, "AdapterPool", "tiny")
    del world.kube.objects[("AdapterPool", NS, "tiny")]
    assert _phase(world, "x") == ("Pending", "PoolNotFound")
    assert world.stores["tiny"].read_table() is None and world.stores["tiny"].adapters() == []

    world.create("AdapterPool", "tiny", POOL_SPEC, "pool-uid-2")
    world.call(handlers.pool_changed, "AdapterPool", "tiny")
    _serve(world)
    world.tick("tiny")
    assert _phase(world, "x") == ("Loading", "Fetching")


def test_an_unreachable_source_keeps_one_reason(world: World) -> None:
    spec = {"pool": "tiny", "adapter": {"source": "https://127.0.0.1:1/a"}}
    world.create("LoRADeployment", "far", spec, "far-uid")
    with pytest.raises(kopf.TemporaryError):
        world.call(handlers.adapter_changed, "LoRADeployment", "far")
    for _ in range(3):
        world.clock.advance(30)
        world.tick("tiny")
        assert _phase(world, "far") == ("Pending", "SourceUnreachable")
    assert world.events.reasons("far") == ["SourceUnreachable"]


def test_user_volumes_never_collide_with_ours(world: World) -> None:
    spec = copy.deepcopy(POOL_SPEC)
    spec["servers"]["volumes"] = [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}]
    spec["servers"]["volumeMounts"] = [{"name": "models", "mountPath": "/models"}]
    world.create("AdapterPool", "ok", spec, "ok-uid")
    world.call(handlers.pool_changed, "AdapterPool", "ok")
    pod = world.kube.objects[("StatefulSet", NS, "ok")]["spec"]["template"]["spec"]
    names = [v["name"] for v in pod["volumes"]]
    assert len(names) == len(set(names)) and "models" in names

    spec["servers"]["volumeMounts"] = [{"name": "models", "mountPath": "/var/lib/loraplex"}]
    spec["servers"]["volumes"].append({"name": "loraplex-dshm", "emptyDir": {}})
    world.create("AdapterPool", "clash", spec, "clash-uid")
    world.call(handlers.pool_changed, "AdapterPool", "clash")
    assert ("StatefulSet", NS, "clash") not in world.kube.objects
    world.tick("clash")
    status = world.status("AdapterPool", "clash")
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert status["phase"] == "Failed" and ready["reason"] == "VolumeConflict"
    assert "'loraplex-dshm'" in ready["message"] and "'/var/lib/loraplex'" in ready["message"]
    world.clock.advance(5)
    world.tick("clash")
    assert world.events.reasons("clash") == ["VolumeConflict"]  # once, not at every tick


def test_an_object_the_api_server_refuses_fails_the_pool_without_a_traceback(world: World) -> None:
    world.kube.refuse["StatefulSet"] = KubeError(422, "StatefulSet.apps \"bad\" is invalid: something")
    world.create("AdapterPool", "bad", POOL_SPEC, "bad-uid")
    with pytest.raises(kopf.TemporaryError, match="is invalid"):
        world.call(handlers.pool_changed, "AdapterPool", "bad")
    world.tick("bad")
    status = world.status("AdapterPool", "bad")
    assert status["phase"] == "Failed" and {c["type"]: c for c in status["conditions"]}["Ready"]["reason"] == "ApplyFailed"
    del world.kube.refuse["StatefulSet"]
    world.call(handlers.pool_changed, "AdapterPool", "bad")
    world.tick("bad")
    assert world.status("AdapterPool", "bad")["phase"] == "Pending"


def test_only_adapters_the_routers_counted_get_a_demand_written(world: World) -> None:
    _settle(world, 10)
    assert all("observedDemand" not in world.status("LoRADeployment", f"a{i}") for i in range(10))
    world.kube.status_patches.clear()
    store = world.stores["tiny"]
    for _ in range(7):  # the routers count a3 for more than the windows the placement reads
        store.add_demand({"a3": 1000}, world.clock.now())
        world.clock.advance(10)
    _serve(world)
    world.tick("tiny")
    assert world.kube.status_patches == ["a3"]
    assert world.status("LoRADeployment", "a3")["observedDemand"]["tokensPerSecond"] == 100.0
    world.kube.status_patches.clear()
    world.clock.advance(700)  # no traffic for longer than every window
    _serve(world)
    world.tick("tiny")
    assert world.kube.status_patches == ["a3"]
    assert world.status("LoRADeployment", "a3")["observedDemand"]["tokensPerSecond"] == 0.0


def test_a_statefulset_deleted_by_hand_is_made_again(world: World) -> None:
    world.tick("tiny")
    world.kube.applied.clear()
    world.tick("tiny")
    assert world.kube.applied == []  # the pool's objects are not re-applied at every tick
    del world.kube.objects[("StatefulSet", NS, "tiny")]
    world.clock.advance(5)
    world.tick("tiny")
    assert [o["kind"] for o in world.kube.applied] == ["ConfigMap", "Service", "PodDisruptionBudget", "StatefulSet"]


def test_a_refused_status_write_is_retried_at_the_next_tick(world: World) -> None:
    _serve(world, holds_all=False)
    _adapter(world, "x")
    original, refused = world.kube.patch_status, []

    def refuse_once(ref: Any, status: dict[str, Any]) -> None:
        if not refused:
            refused.append(ref.name)
            raise KubeError(500, "etcdserver: request timed out")
        original(ref, status)

    world.kube.patch_status = refuse_once  # type: ignore[method-assign]
    _serve(world)
    world.tick("tiny")  # the tick goes on; the status is not written
    assert refused == ["x"] and _phase(world, "x") == ("Loading", "Fetching")
    world.clock.advance(5)
    _serve(world)
    world.tick("tiny")
    assert _phase(world, "x") == ("Ready", "Serving")
