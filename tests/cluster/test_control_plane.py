"""One pool control plane, two drivers: each shared piece (loraplex.pool) run through the operator
(its reconcile functions and Deps, as its kopf handlers call them) and through `loraplex up`'s
LocalStack (its -f folder), with the same spec in both: the same refusal, the same registry record,
the same controller with the same replica bounds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hub_files import hub_files
from loraplex_local.manifests import ManifestError
from loraplex_local.stack import LocalStack, StackConfig
from loraplex_operator import handlers
from loraplex_operator.kube import ObjectRef
from loraplex_operator.pool_reconcile import InvalidPool, apply_pool
from operator_world import NS, World, bump

from loraplex.pool import PoolPolicy, replica_bounds
from loraplex.routing import InMemoryRoutingStore, ServerRecord
from loraplex.routing.choice import RoutingChoice
from loraplex.spec.crd import API_VERSION, AdapterPoolSpec, LoRADeploymentSpec
from loraplex.util.clock import ManualClock

POOL = "tiny"
SPEC: dict[str, Any] = {"baseModel": {"name": "tiny-llama", "source": "file:///unused"},
                        "servers": {"gpusPerServer": 0}, "engine": {"maxLoraRank": 64},
                        "placement": {"policy": "loraserve", "intervalSeconds": 30, "hysteresis": 0.35}}


def with_spec(**changes: Any) -> dict[str, Any]:
    spec = json.loads(json.dumps(SPEC))
    for key, value in changes.items():
        spec[key] = {**spec.get(key, {}), **value}
    return spec


def write(folder: Path, kind: str, name: str, spec: dict[str, Any]) -> None:
    doc = {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name}, "spec": spec}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(doc))


@pytest.fixture
def hub(tiny_model) -> Iterator[tuple[str, Path]]:
    """(the Hub endpoint serving adapter `sql` as hf://sql, the same adapter's folder)."""
    folder = next(iter(tiny_model.adapters.values()))
    with hub_files({f"/sql/resolve/main/{f}": (folder / f).read_bytes()
                    for f in ("adapter_config.json", "adapter_model.safetensors")}) as url:
        yield url, folder


@pytest.mark.parametrize(("changes", "reason"), [
    ({"servers": {"volumeMounts": [{"name": "data", "mountPath": "/var/lib/loraplex"}]}}, "VolumeConflict"),
    ({"engine": {"memoryPolicy": "no-such-policy"}}, "InvalidEngine"),
    ({"routing": {"profile": "rank-aware", "options": {"slo_tpot_s": "fast"}}}, "InvalidRouting"),
])
def test_a_spec_is_refused_alike_by_both_drivers(tmp_path: Path, changes: dict[str, Any], reason: str) -> None:
    spec = with_spec(**changes)
    with pytest.raises(InvalidPool) as refused:
        apply_pool(ObjectRef("loraplex.io/v1alpha1", "AdapterPool", NS, POOL, "uid"),
                   AdapterPoolSpec.model_validate(spec), World("http://127.0.0.1:9").deps)
    assert refused.value.reason == reason
    write(tmp_path, "AdapterPool", POOL, spec)
    with pytest.raises(ManifestError) as local:
        LocalStack(StackConfig(manifests=tmp_path, workdir=tmp_path / "work"))
    assert refused.value.message in str(local.value) and str(tmp_path / f"{POOL}.yaml") in str(local.value)


def test_an_adapter_record_is_written_alike_by_both_drivers(tmp_path: Path, hub: tuple[str, Path]) -> None:
    """target_modules read from the adapter's config and the pool's base model, in both records."""
    endpoint, folder = hub
    world = World(endpoint)
    world.create("AdapterPool", POOL, SPEC, "pool-uid")
    world.create("LoRADeployment", "sql", {"pool": POOL, "adapter": {"source": "hf://sql"}}, "sql-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "sql")
    in_cluster = world.deps.store(POOL).get_adapter("sql")
    write(tmp_path, "AdapterPool", POOL, SPEC)
    write(tmp_path, "LoRADeployment", "sql", {"pool": POOL, "adapter": {"source": f"file://{folder}"}})
    local = LocalStack(StackConfig(manifests=tmp_path, workdir=tmp_path / "work")).desired_records()["sql"]
    assert in_cluster.target_modules and in_cluster.base_model == "tiny-llama"
    assert {**vars(local), "source": ""} == {**vars(in_cluster), "source": ""}


def test_the_controller_and_its_replica_bounds_are_built_alike_by_both_drivers(tmp_path: Path, tiny_model) -> None:
    deployments = {"pair": {"min": 2, "max": 2}, "capped": {"max": 1}, "free": {}}
    world = World("http://127.0.0.1:9")
    spec = AdapterPoolSpec.model_validate(SPEC)
    routes = world.deps.routes(POOL)
    routes.bounds = replica_bounds((name, LoRADeploymentSpec.model_validate(
        {"pool": POOL, "adapter": {"source": "hf://x"}, "replicas": r}).replicas) for name, r in deployments.items())
    in_cluster = world.deps.controller(POOL, spec)
    write(tmp_path, "AdapterPool", POOL, SPEC)
    source = next(iter(tiny_model.adapters.values()))
    for name, replicas in deployments.items():
        write(tmp_path, "LoRADeployment", name, {"pool": POOL, "adapter": {"source": f"file://{source}"},
                                                   "replicas": replicas})
    stack = LocalStack(StackConfig(manifests=tmp_path, workdir=tmp_path / "work"))
    stack.store = InMemoryRoutingStore(POOL, ManualClock())
    stack.apply_manifests()
    local = stack.build_controller()
    for controller in (in_cluster, local):
        assert isinstance(controller.policy, PoolPolicy) and controller.policy.inner.name == "loraserve"
        assert controller.policy.inner.hysteresis == pytest.approx(0.35) and controller.interval_s == 30
        assert controller.server_filter is not None
    assert local.operating_points == in_cluster.operating_points  # gpusPerServer 0: CPU points in both
    assert (local.min_replicas(), local.policy.maximum()) == (in_cluster.min_replicas(), in_cluster.policy.maximum())
    assert local.min_replicas() == {"pair": 2} and local.policy.maximum() == {"pair": 2, "capped": 1}


def test_up_copies_nothing_of_the_control_plane() -> None:
    """The local driver's package defines none of the shared pieces (they are imported from loraplex.pool)."""
    source = "\n".join(p.read_text() for p in (Path(__file__).parents[2] / "local" / "loraplex_local").glob("*.py"))
    for name in ("def spec_failure", "def adapter_record", "def replica_bounds", "class PoolPolicy",
                 "make_policy(", "default_operating_points(", "PlacementController("):
        assert name not in source, name


def _edit_pool(world: World, folder: Path, spec: dict[str, Any]) -> None:
    """The same AdapterPool edit in both drivers: the object in the API server, the file in -f."""
    obj = world.kube.objects[("AdapterPool", NS, POOL)]
    obj["spec"] = spec
    obj["metadata"]["generation"] += 1
    bump(obj)
    write(folder, "AdapterPool", POOL, spec)


def test_the_routing_choice_reaches_the_table_one_way_in_both_drivers(tmp_path: Path) -> None:
    """The pool's controller carries spec.routing into the tables it publishes, in both drivers; an
    edited choice is placed at once (not at the 30 s interval), keeping the routes. (An s3:// adapter
    with its digest and rank declared: neither driver reads it.)"""
    deployment = {"pool": POOL, "adapter": {"source": "s3://adapters/a", "sha256": "e" * 64, "rank": 8}}
    chosen = {"profile": "rank-aware", "options": {"slo_tpot_s": "0.05"}}
    world = World("http://127.0.0.1:9")
    world.create("AdapterPool", POOL, with_spec(routing=chosen), "pool-uid")
    world.call(handlers.pool_changed, "AdapterPool", POOL)
    world.create("LoRADeployment", "a", deployment, "a-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "a")
    write(tmp_path, "AdapterPool", POOL, with_spec(routing=chosen))
    write(tmp_path, "LoRADeployment", "a", deployment)
    stack = LocalStack(StackConfig(manifests=tmp_path, workdir=tmp_path / "work"))
    stack.store = InMemoryRoutingStore(POOL, ManualClock())
    for sid in ("s0", "s1"):
        world.heartbeat(POOL, sid)
        stack.store.register_server(ServerRecord(sid, f"http://{sid}:8000", 64), ttl_s=600)
    stack.controller = stack.build_controller()
    stores = (world.stores[POOL], stack.store)
    for routing, expected in ((chosen, RoutingChoice("rank-aware", {"slo_tpot_s": "0.05"})),
                              ({"profile": "least-loaded"}, RoutingChoice("least-loaded")), (None, None)):
        before = [store.read_table() for store in stores]
        if routing is not chosen:
            _edit_pool(world, tmp_path, with_spec(routing=routing) if routing else SPEC)
        world.clock.advance(5)  # a tick, not the placement interval
        world.tick(POOL)
        stack.tick()
        assert world.deps.controller(POOL, AdapterPoolSpec.model_validate(
            world.kube.objects[("AdapterPool", NS, POOL)]["spec"])).routing() == expected
        assert stack.controller.routing() == expected
        for store, previous in zip(stores, before, strict=True):
            table = store.read_table()
            assert table.routing == expected and "a" in table.entries
            if previous is not None:
                assert table.version == previous.version + 1 and table.same_routes(previous)


def test_an_invocation_the_agents_report_reaches_the_record_in_both_drivers(tmp_path: Path) -> None:
    """An s3:// activated LoRA with its digest and rank declared: neither driver reads its config. An
    agent that loaded it reports the invocation; both drivers write it into the record, and keep it
    there on their next ticks (the local driver rebuilds its records from the files every tick)."""
    deployment = {"pool": POOL, "adapter": {"source": "s3://adapters/checker", "sha256": "e" * 64, "rank": 8}}
    report = (("checker", "sha256:" + "e" * 64, (30, 94, 922)),)
    world = World("http://127.0.0.1:9")
    world.create("AdapterPool", POOL, SPEC, "pool-uid")
    world.create("LoRADeployment", "checker", deployment, "c-uid")
    world.call(handlers.adapter_changed, "LoRADeployment", "checker")
    write(tmp_path, "AdapterPool", POOL, SPEC)
    write(tmp_path, "LoRADeployment", "checker", deployment)
    stack = LocalStack(StackConfig(manifests=tmp_path, workdir=tmp_path / "work"))
    stack.store = InMemoryRoutingStore(POOL, ManualClock())
    stack.controller = stack.build_controller()
    stack.tick()
    stores = (world.stores[POOL], stack.store)
    assert [store.get_adapter("checker").invocation_tokens for store in stores] == [(), ()]
    world.heartbeat(POOL, "s0", holds=("checker",), invocations=report)
    stack.store.register_server(ServerRecord("s0", "http://s0:8000", 64, host_adapters=("checker",),
                                             invocations=report), ttl_s=600)
    for _ in range(2):
        world.clock.advance(5)
        world.tick(POOL)
        stack.tick()
        assert [store.get_adapter("checker").invocation_tokens for store in stores] == [(30, 94, 922)] * 2
