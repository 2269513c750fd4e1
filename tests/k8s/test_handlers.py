"""The kopf handlers, called as kopf calls them (through operator_world.World): real kopf
Body/Patch/Memo objects, a real in-memory routing store, the real placement controller, and a real
HTTP server holding an adapter. Only the Kubernetes API is replaced (no cluster here)."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
from hub_files import hub_files
from loraplex_operator import handlers
from operator_world import NS, World, merge

from loraplex.routing import InMemoryRoutingStore


@pytest.fixture(scope="module")
def adapter_server() -> Iterator[str]:
    weights = b"\x00" * 4096
    with hub_files({
        "/sql/resolve/main/adapter_config.json": json.dumps({"r": 16, "target_modules": ["q_proj"]}).encode(),
        "/sql/resolve/main/adapter_model.safetensors": weights,
        "/big/resolve/main/adapter_config.json": json.dumps({"r": 128}).encode(),
        "/big/resolve/main/adapter_model.safetensors": weights,
        "/checker/resolve/main/adapter_config.json": json.dumps({"r": 8, "alora_invocation_tokens": [30, 94, 922]}).encode(),
        "/checker/resolve/main/adapter_model.safetensors": weights,
        # a config and no weights: a deployment that declares sha256 and rank never fetches them
        "/declared-checker/resolve/main/adapter_config.json": json.dumps(
            {"r": 8, "alora_invocation_tokens": [30, 94, 922]}).encode()}) as url:
        yield url


POOL_SPEC = {"baseModel": {"name": "tiny", "source": "file:///models/tiny"},
             "servers": {"minReplicas": 1, "maxReplicas": 3, "gpusPerServer": 0},
             "engine": {"maxLoraRank": 64}, "placement": {"intervalSeconds": 30, "scaleDownDelaySeconds": 60}}


@pytest.fixture
def world(adapter_server: str) -> World:
    w = World(adapter_server)
    w.create("AdapterPool", "tiny", POOL_SPEC, "pool-uid")
    return w


def test_pool_create_applies_owned_objects(world: World) -> None:
    patch = world.call(handlers.pool_changed, "AdapterPool", "tiny")
    kinds = [o["kind"] for o in world.kube.applied]
    assert kinds == ["ConfigMap", "Service", "PodDisruptionBudget", "StatefulSet"]
    assert world.kube.objects[("StatefulSet", NS, "tiny")]["spec"]["replicas"] == 1
    status = dict(patch)["status"]
    assert {k: status[k] for k in ("replicas", "selector")} == {
        "replicas": 1, "selector": "app.kubernetes.io/component=agent,loraplex.io/pool=tiny"}
    world.kube.applied.clear()  # a restart resumes the pool: the same objects are not applied again
    assert dict(world.call(handlers.pool_changed, "AdapterPool", "tiny")) == {} and world.kube.applied == []


def test_a_tick_that_read_the_pool_before_a_spec_change_leaves_its_applied_hash(world: World) -> None:
    """kopf runs the pool's timer beside its handlers: a tick that read the status before
    pool_changed applied a change must not write the older appliedHash back, or a later change back
    to those objects is taken as applied already (on a real node the pool was scaled 2 -> 3 -> 2 and
    its StatefulSet stayed at 3)."""
    key = ("AdapterPool", NS, "tiny")
    world.call(handlers.pool_changed, "AdapterPool", "tiny")
    read_by_the_tick = copy.deepcopy(world.kube.objects[key])
    world.kube.objects[key]["spec"]["servers"]["replicas"] = 2
    world.call(handlers.pool_changed, "AdapterPool", "tiny")
    assert world.kube.objects[("StatefulSet", NS, "tiny")]["spec"]["replicas"] == 2
    current, world.kube.objects[key] = world.kube.objects[key], read_by_the_tick
    tick = dict(world.tick("tiny"))
    world.kube.objects[key] = merge(current, tick)  # the API server merges the tick's patch last
    assert tick["status"]["phase"] and "appliedHash" not in tick["status"]
    world.kube.objects[key]["spec"]["servers"]["replicas"] = 1
    world.call(handlers.pool_changed, "AdapterPool", "tiny")
    assert world.kube.objects[("StatefulSet", NS, "tiny")]["spec"]["replicas"] == 1


def test_adapter_registered_inspected_and_routed_at_once(world: World) -> None:
    world.heartbeat("tiny", "tiny-0")
    world.create("LoRADeployment", "sql", {"pool": "tiny", "adapter": {"source": "hf://sql"}}, "sql-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "sql")
    record = world.stores["tiny"].get_adapter("sql")
    assert record.rank == 16 and record.digest == "sha256:" + hashlib.sha256(b"\x00" * 4096).hexdigest()
    assert record.size_bytes == 4096 and record.target_modules == ("q_proj",) and record.base_model == "tiny"
    table = world.stores["tiny"].read_table()
    assert [(r.server, r.weight) for r in table.routes("sql")] == [("tiny-0", 1.0)]
    status = world.status("LoRADeployment", "sql")
    assert (status["phase"], status["rank"], status["weights"]) == ("Loading", 16, "tiny-0=1.00")
    assert world.events.reasons("sql") == ["Fetching"]  # the weights are in its message


def test_adapters_created_together_are_registered_in_one_batch_and_one_table_version(world: World) -> None:
    world.heartbeat("tiny", "tiny-0")
    names = [f"a{i:03d}" for i in range(200)]  # far more than kopf's worker threads
    for name in names:
        world.create("LoRADeployment", name, {"pool": "tiny", "adapter": {"source": f"s3://b/{name}",
                                                                           "sha256": "e" * 64, "rank": 8}},
                     f"{name}-uid")
    world.call_together(handlers.adapter_changed, "LoRADeployment", names)
    table = world.stores["tiny"].read_table()
    assert table.version == 1 and set(table.entries) == set(names)
    assert {world.status("LoRADeployment", n)["phase"] for n in names} == {"Loading"}
    assert world.deps.registrations["tiny"].batches == 1


def test_a_restart_resumes_every_adapter_in_a_batch_writing_nothing(world: World) -> None:
    world.heartbeat("tiny", "tiny-0")
    names = [f"a{i:03d}" for i in range(100)]
    for name in names:
        world.create("LoRADeployment", name, {"pool": "tiny", "adapter": {"source": f"s3://b/{name}",
                                                                           "sha256": "e" * 64, "rank": 8}},
                     f"{name}-uid")
    world.call_together(handlers.adapter_changed, "LoRADeployment", names)
    before = {n: copy.deepcopy(world.kube.objects[("LoRADeployment", NS, n)]) for n in names}
    world.memo = kopf.Memo(deps=type(world.deps)(**{**world.deps.__dict__, "written": {}, "refreshed": {},
                                                    "registrations": {}, "_routes": {}}))  # a new process
    world.call_together(handlers.adapter_changed, "LoRADeployment", names)  # kopf resumes each object
    assert {n: world.kube.objects[("LoRADeployment", NS, n)] for n in names} == before  # no patch at all
    assert world.stores["tiny"].read_table().version == 1  # no table published
    assert world.memo.deps.registrations["tiny"].batches == 1


def test_rank_above_the_pool_limit_fails_with_a_reason(world: World) -> None:
    world.create("LoRADeployment", "big", {"pool": "tiny", "adapter": {"source": "hf://big"}}, "big-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "big")
    status = world.status("LoRADeployment", "big")
    assert (status["phase"], status["reason"]) == ("Failed", "RankTooLarge")
    assert world.deps.store("tiny").get_adapter("big") is None
    assert world.events.posted[-1][1].type == "Warning"


def test_an_activated_lora_is_registered_as_one_and_fails_on_a_vllm_pool(world: World) -> None:
    world.heartbeat("tiny", "tiny-0")
    world.create("LoRADeployment", "checker", {"pool": "tiny", "adapter": {"source": "hf://checker"}}, "c-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "checker")
    assert world.stores["tiny"].get_adapter("checker").invocation_tokens == (30, 94, 922)
    assert world.status("LoRADeployment", "checker")["phase"] != "Failed"
    _pool(world, engine={"backend": "vllm"})
    world.call(handlers.adapter_changed, "LoRADeployment", "checker")
    status = world.status("LoRADeployment", "checker")
    assert (status["phase"], status["reason"]) == ("Failed", "ActivatedLoRAUnsupported")
    assert "vllm" in status["message"] and world.stores["tiny"].get_adapter("checker") is None


def test_a_declared_activated_lora_is_still_known_as_one(world: World) -> None:
    """Declaring sha256 and rank spares the download of the weights, not the read of adapter_config.json:
    the record says aLoRA, so a vllm pool refuses the adapter whether or not its digest was declared."""
    world.heartbeat("tiny", "tiny-0")
    declared = {"source": "hf://declared-checker", "sha256": "e" * 64, "rank": 8}
    world.create("LoRADeployment", "checker", {"pool": "tiny", "adapter": declared}, "c-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "checker")
    record = world.stores["tiny"].get_adapter("checker")
    assert (record.invocation_tokens, record.digest, record.rank) == ((30, 94, 922), "sha256:" + "e" * 64, 8)
    _pool(world, engine={"backend": "vllm"})
    world.call(handlers.adapter_changed, "LoRADeployment", "checker")
    status = world.status("LoRADeployment", "checker")
    assert (status["phase"], status["reason"]) == ("Failed", "ActivatedLoRAUnsupported")
    wrong = {"pool": "tiny", "adapter": {**declared, "rank": 16}}
    world.create("LoRADeployment", "wrong", wrong, "w-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "wrong")
    assert world.status("LoRADeployment", "wrong")["reason"] == "RankMismatch"


def test_a_version_the_servers_refuse_to_load_fails_until_they_load_it(world: World) -> None:
    """What the operator cannot read (an s3:// aLoRA on a vllm pool): the agents fetch it, verify it
    and report their engine's refusal in their heartbeats; the tick fails the deployment with it."""
    _pool(world, engine={"backend": "vllm"})
    world.heartbeat("tiny", "tiny-0")
    _declared(world, "checker", 8)
    assert world.status("LoRADeployment", "checker")["phase"] == "Loading"
    why = "adapter 'checker' is an activated LoRA (alora_invocation_tokens); the vllm backend cannot serve it"
    world.heartbeat("tiny", "tiny-0", refused=(("checker", "sha256:" + "e" * 64, why),
                                               ("checker", "sha256:" + "0" * 64, "an older version")))
    world.tick("tiny")
    status = world.status("LoRADeployment", "checker")
    assert (status["phase"], status["reason"]) == ("Failed", "AdapterRefused")
    assert status["message"].endswith(f"tiny-0: {why}") and "older" not in status["message"]
    assert world.events.reasons("checker")[-1] == "AdapterRefused"
    world.heartbeat("tiny", "tiny-0", holds=("checker",))  # e.g. a fixed engine loaded it
    world.clock.advance(5)
    world.tick("tiny")
    assert world.status("LoRADeployment", "checker")["phase"] == "Ready", world.status("LoRADeployment", "checker")


def test_an_activated_lora_the_operator_cannot_read_gets_its_invocation_from_the_agents(world: World) -> None:
    """An s3:// (or gs://, or file:// in the pods) aLoRA is registered from its declared sha256 and rank;
    the agent that loads it reports the invocation for that version, and the tick writes it into the
    record, so the router keys its requests as the base model's conversation. A report for another
    version, or for a record that already has one, changes nothing."""
    world.heartbeat("tiny", "tiny-0")
    _declared(world, "checker", 8)
    assert world.stores["tiny"].get_adapter("checker").invocation_tokens == ()
    world.heartbeat("tiny", "tiny-0", holds=("checker",),
                    invocations=(("checker", "sha256:" + "0" * 64, (1, 2)),))  # an older version
    world.tick("tiny")
    assert world.stores["tiny"].get_adapter("checker").invocation_tokens == ()
    world.heartbeat("tiny", "tiny-0", holds=("checker",), invocations=(("checker", "sha256:" + "e" * 64, (30, 94)),))
    world.clock.advance(5)
    world.tick("tiny")
    record = world.stores["tiny"].get_adapter("checker")
    assert record.is_alora and record.invocation_tokens == (30, 94) and record.digest == "sha256:" + "e" * 64
    world.heartbeat("tiny", "tiny-0", holds=("checker",), invocations=(("checker", "sha256:" + "e" * 64, (7,)),))
    world.clock.advance(5)
    world.tick("tiny")
    assert world.stores["tiny"].get_adapter("checker").invocation_tokens == (30, 94)


def test_missing_pool_is_pending_and_retried(world: World) -> None:
    world.create("LoRADeployment", "orphan", {"pool": "nope", "adapter": {"source": "hf://sql"}}, "o-uid")
    with pytest.raises(kopf.TemporaryError):
        world.call(handlers.adapter_changed, "LoRADeployment", "orphan")
    assert world.status("LoRADeployment", "orphan")["reason"] == "PoolNotFound"


def test_missing_adapter_files_fail_with_the_http_status(world: World) -> None:
    world.create("LoRADeployment", "gone", {"pool": "tiny", "adapter": {"source": "hf://missing"}}, "g-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "gone")  # a 404 will not heal by itself
    status = world.status("LoRADeployment", "gone")
    assert (status["phase"], status["reason"]) == ("Failed", "SourceUnreadable") and "HTTP 404" in status["message"]


def test_declared_s3_adapter_needs_no_download(world: World) -> None:
    world.heartbeat("tiny", "tiny-0")
    spec = {"pool": "tiny", "adapter": {"source": "s3://b/a", "sha256": "e" * 64, "rank": 8}}
    world.create("LoRADeployment", "s3a", spec, "s-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "s3a")
    assert world.stores["tiny"].get_adapter("s3a").digest == "sha256:" + "e" * 64
    undeclared = {"pool": "tiny", "adapter": {"source": "s3://b/c"}}
    world.create("LoRADeployment", "s3b", undeclared, "s2-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "s3b")
    assert world.status("LoRADeployment", "s3b")["reason"] == "DeclareDigestAndRank"


def test_finalizer_removes_adapter_from_registry_and_table(world: World) -> None:
    world.heartbeat("tiny", "tiny-0")
    world.create("LoRADeployment", "sql", {"pool": "tiny", "adapter": {"source": "hf://sql"}}, "sql-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "sql")
    body = kopf.Body(world.kube.objects[("LoRADeployment", NS, "sql")])
    handlers.adapter_deleted(spec=body.spec, meta=body.meta, name="sql", memo=world.memo)
    assert world.stores["tiny"].get_adapter("sql") is None
    assert "sql" not in world.stores["tiny"].read_table().entries


def test_timer_places_reports_status_and_scales(world: World) -> None:
    world.call(handlers.pool_changed, "AdapterPool", "tiny")
    world.heartbeat("tiny", "tiny-0")
    for name in ("a", "b"):
        spec = {"pool": "tiny", "adapter": {"source": "hf://sql"}, "traffic": {"expectedTokensPerSecond": 500}}
        world.create("LoRADeployment", name, spec, f"{name}-uid")
        world.call(handlers.adapter_changed, "LoRADeployment", name)
    world.kube.objects[("StatefulSet", NS, "tiny")]["status"] = {"readyReplicas": 1}
    world.heartbeat("tiny", "tiny-0", holds=("a",))

    patch = world.tick("tiny")
    # 1000 tokens/s of rank-16 adapters over a CPU operating point of 380 tokens/s: 3 servers needed.
    pool = world.status("AdapterPool", "tiny")
    assert pool["requiredServers"] == 3 and pool["replicas"] == 3 and pool["readyReplicas"] == 1
    assert dict(patch)["spec"] == {"servers": {"replicas": 3}}
    assert world.kube.objects[("StatefulSet", NS, "tiny")]["spec"]["replicas"] == 3
    assert ("tiny", "ScaleUp") in [(n, e.reason) for n, e in world.events.posted]
    assert world.status("LoRADeployment", "a")["phase"] == "Ready"
    assert world.status("LoRADeployment", "b")["phase"] == "Loading"

    # The next tick before the interval does not place again; statuses of Ready adapters stay put.
    version = pool["routingVersion"]
    world.clock.advance(5)
    world.tick("tiny")
    assert world.status("AdapterPool", "tiny")["routingVersion"] == version


def test_timer_scales_down_only_after_the_delay(world: World) -> None:
    spec = copy.deepcopy(POOL_SPEC)
    spec["servers"]["replicas"] = 3
    world.create("AdapterPool", "tiny", spec, "pool-uid")
    world.call(handlers.pool_changed, "AdapterPool", "tiny")
    world.heartbeat("tiny", "tiny-0")
    world.create("LoRADeployment", "a", {"pool": "tiny", "adapter": {"source": "hf://sql"}}, "a-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "a")
    world.tick("tiny")
    assert world.status("AdapterPool", "tiny")["replicas"] == 3 and "belowSince" in world.status("AdapterPool", "tiny")
    for _ in range(2):
        world.clock.advance(35)
        world.heartbeat("tiny", "tiny-0")
        world.tick("tiny")
    pool = world.status("AdapterPool", "tiny")
    assert pool["replicas"] == 1 and "belowSince" not in pool
    assert world.kube.objects[("AdapterPool", NS, "tiny")]["spec"]["servers"]["replicas"] == 1


def test_timer_with_the_store_down_marks_the_pool_degraded(world: World) -> None:
    from loraplex.routing import StoreUnavailableError

    def down(pool: str) -> InMemoryRoutingStore:
        raise StoreUnavailableError("redis unavailable: connection refused")

    world.deps.store_factory = down
    world.call(handlers.pool_changed, "AdapterPool", "tiny")
    world.tick("tiny")
    status = world.status("AdapterPool", "tiny")
    assert status["phase"] == "Degraded"
    assert {c["type"]: c["status"] for c in status["conditions"]}["StoreAvailable"] == "False"


def test_generated_crds_match_what_handlers_watch() -> None:
    crds = {p.name for p in (Path(__file__).resolve().parents[2] / "crds").glob("*.yaml")}
    assert {f"{handlers.POOLS[2]}.yaml", f"{handlers.ADAPTERS[2]}.yaml", "kopf-peerings.yaml"} == crds


def _pool(world: World, **changes: Any) -> None:
    """Recreates the pool `tiny` with `changes` ({"engine": {...}} merges into the section) and applies it."""
    spec = copy.deepcopy(POOL_SPEC)
    for section, values in changes.items():
        spec[section] = {**spec.get(section, {}), **values}
    world.create("AdapterPool", "tiny", spec, "pool-uid")
    world.call(handlers.pool_changed, "AdapterPool", "tiny")


def _declared(world: World, name: str, rank: int, tps: float = 0.0, **replicas: int) -> None:
    """A LoRADeployment whose digest and rank are declared (no download), registered at once."""
    spec = {"pool": "tiny", "adapter": {"source": f"s3://b/{name}", "sha256": "e" * 64, "rank": rank},
            "traffic": {"expectedTokensPerSecond": tps}, "replicas": {"min": 1, **replicas}}
    world.create("LoRADeployment", name, spec, f"{name}-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", name)


def _servers(table: Any, name: str) -> set[str]:
    return {r.server for r in table.routes(name)}


def test_replica_bounds_are_in_the_one_table_each_placement_publishes(world: World) -> None:
    _pool(world, servers={"replicas": 3})
    for i in range(3):
        world.heartbeat("tiny", f"tiny-{i}")
    _declared(world, "pinned", 16, min=2)
    # 1000 tokens/s of rank 16 is 2.6 servers' worth: loraserve would spread it over all three.
    _declared(world, "capped", 16, tps=1000, max=1)
    store = world.stores["tiny"]
    assert len(store.read_table().routes("pinned")) == 2  # replicas.min holds from the first route on
    published: list[int] = []
    store.watch_versions(published.append)

    world.tick("tiny")
    table = store.read_table()
    assert published == [table.version]  # bounds and placement in a single version
    assert len(_servers(table, "pinned")) == 2 and len(_servers(table, "capped")) == 1
    assert world.status("LoRADeployment", "capped")["placement"][0]["weight"] == 1.0

    world.clock.advance(30)
    for i in range(3):
        world.heartbeat("tiny", f"tiny-{i}")
    world.tick("tiny")
    assert published == [table.version]  # the next placement finds the bounded routes unchanged


def test_adapter_no_server_can_hold_fails_then_recovers_when_placed(world: World) -> None:
    _pool(world, engine={"maxLoraRank": 128})
    world.heartbeat("tiny", "tiny-0", max_rank=64)  # e.g. servers still running an older engine setting
    _declared(world, "big", 128)
    status = world.status("LoRADeployment", "big")
    assert (status["phase"], status["reason"]) == ("Failed", "RankExceedsServers")
    assert status["message"].startswith("rank 128 exceeds every server's maxLoraRank (at most 64)")
    assert [(e.type, e.reason) for n, e in world.events.posted if n == "big"] == [("Warning", "RankExceedsServers")]

    world.tick("tiny")  # the placement reports it unplaceable: still Failed, no second event
    assert world.status("LoRADeployment", "big")["reason"] == "RankExceedsServers"
    world.clock.advance(5)
    world.tick("tiny")  # between placements the placement's verdict stands
    assert world.status("LoRADeployment", "big")["reason"] == "RankExceedsServers"
    assert world.events.reasons("big") == ["RankExceedsServers"]

    world.clock.advance(30)
    world.heartbeat("tiny", "tiny-0", max_rank=128)
    world.tick("tiny")
    status = world.status("LoRADeployment", "big")
    assert (status["phase"], status["weights"]) == ("Loading", "tiny-0=1.00")
    assert world.events.reasons("big") == ["RankExceedsServers", "Fetching"]


def _shortfall(world: World) -> tuple[str, str, str]:
    pool = world.status("AdapterPool", "tiny")
    c = {c["type"]: c for c in pool["conditions"]}["CapacityShortfall"]
    return c["status"], c["reason"], c["message"]


def _mixed_ranks(world: World, servers: dict[str, int], tps: float) -> None:
    """Servers of mixed max ranks; two rank-128 adapters at `tps` each and a light rank-8 one."""
    for sid, rank in servers.items():
        world.heartbeat("tiny", sid, max_rank=rank)
    for name, rank, rate in (("b1", 128, tps), ("b2", 128, tps), ("s", 8, 40)):
        if ("LoRADeployment", NS, name) not in world.kube.objects:
            _declared(world, name, rank, rate)


def test_overloaded_server_beyond_capacity_is_a_shortfall_and_scales_up(world: World) -> None:
    _pool(world, engine={"maxLoraRank": 128}, servers={"replicas": 3, "maxReplicas": 4})
    world.kube.objects[("StatefulSet", NS, "tiny")]["status"] = {"readyReplicas": 3}
    # 1.7 servers of load in all (3 would do), but 1.6 of it rank 128 that only tiny-0 can hold.
    _mixed_ranks(world, {"tiny-0": 128, "tiny-1": 8, "tiny-2": 8}, tps=200)

    patch = world.tick("tiny")
    status, reason, message = _shortfall(world)
    assert (status, reason) == ("True", "ServersOverloaded") and "servers tiny-0 are overloaded" in message
    pool = world.status("AdapterPool", "tiny")
    assert pool["overloadedServers"] == ["tiny-0"] and pool["maxServerLoad"] == pytest.approx(1.6)
    assert pool["requiredServers"] == 4 and dict(patch)["spec"] == {"servers": {"replicas": 4}}
    assert {"ScaleUp", "CapacityShortfall"} <= set(world.events.reasons("tiny"))

    # Between placements the shortfall is not counted again: no climb past what was asked.
    world.clock.advance(5)
    assert "spec" not in dict(world.tick("tiny"))
    assert world.status("AdapterPool", "tiny")["replicas"] == 4 and _shortfall(world)[0] == "True"

    # A fourth server able to hold rank 128 takes half of it: above the balanced share, within capacity.
    world.clock.advance(30)
    _mixed_ranks(world, {"tiny-0": 128, "tiny-1": 8, "tiny-2": 8, "tiny-3": 128}, tps=200)
    world.tick("tiny")
    assert _shortfall(world)[:2] == ("False", "Unbalanced")
    assert world.status("AdapterPool", "tiny")["requiredServers"] == 2
    assert world.events.reasons("tiny").count("CapacityShortfall") == 1


def test_overloaded_server_within_capacity_does_not_scale(world: World) -> None:
    _pool(world, engine={"maxLoraRank": 128}, servers={"replicas": 3, "maxReplicas": 4})
    _mixed_ranks(world, {"tiny-0": 128, "tiny-1": 8, "tiny-2": 8}, tps=100)  # 0.8 on tiny-0
    patch = world.tick("tiny")
    status, reason, message = _shortfall(world)
    assert (status, reason) == ("False", "Unbalanced") and "tiny-0" in message and "0.80" in message
    assert "spec" not in dict(patch) and world.status("AdapterPool", "tiny")["requiredServers"] == 1


def test_shortfall_at_max_replicas_says_so(world: World) -> None:
    _pool(world, engine={"maxLoraRank": 128}, servers={"replicas": 3, "maxReplicas": 3})
    _mixed_ranks(world, {"tiny-0": 128, "tiny-1": 8, "tiny-2": 8}, tps=200)
    patch = world.tick("tiny")
    status, reason, message = _shortfall(world)
    assert (status, reason) == ("True", "AtMaxReplicas") and "maxReplicas is 3" in message
    assert "spec" not in dict(patch)


def test_pool_hysteresis_reaches_the_policy(world: World) -> None:
    from loraplex.spec.crd import AdapterPoolSpec

    spec = AdapterPoolSpec.model_validate(POOL_SPEC)
    assert world.deps.controller("tiny", spec).policy.inner.hysteresis == pytest.approx(0.1)
    sticky_off = AdapterPoolSpec.model_validate({**POOL_SPEC, "placement": {"hysteresis": 0}})
    assert world.deps.controller("tiny", sticky_off).policy.inner.hysteresis == 0
