"""The operator's InferencePool per AdapterPool (Gateway API Inference Extension v1): built by a pure
function, checked against a CRD written from GIE's published v1 fields (tests/k8s/fixtures), applied by
the pool handler when the chart asks for it.

The CRD checks run twice: with the mirrored API-server rules (tests/support/api_server.py), and, when
KUBECONFIG names a cluster, on its real API server, which gets the CRD installed (unless GIE's own is
there) and every object sent as a server-side dry-run create (nothing is stored):

    KUBECONFIG=~/.kube/config pytest tests/k8s/test_inference_pool.py
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from api_server import decode
from gie import ensure_inference_pool_crd
from kube import kubectl
from loraplex_operator import handlers
from loraplex_operator.config import OperatorConfig
from loraplex_operator.kube import KubeError
from loraplex_operator.pool_objects import PoolRef, build_inference_pool, build_statefulset, pool_objects
from operator_world import NS, World

from loraplex.spec.crd import AdapterPoolSpec

CRD = Path(__file__).parent / "fixtures" / "inferencepools.inference.networking.k8s.io.yaml"
GATEWAY = OperatorConfig(redis_url="redis://redis:6379/0", inference_pool=True)
SPEC = {"baseModel": {"name": "tiny", "source": "file:///models/tiny"},
        "servers": {"minReplicas": 1, "maxReplicas": 3, "gpusPerServer": 0}, "engine": {"maxLoraRank": 64}}


def _schema() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _spec(**engine: Any) -> AdapterPoolSpec:
    return AdapterPoolSpec.model_validate({**SPEC, "engine": {**SPEC["engine"], **engine}})


def test_the_pool_is_its_agents_picked_by_its_router(api_server_errors) -> None:
    ref = PoolRef("llama", "serving", "uid-1")
    pool = build_inference_pool(ref, _spec(), GATEWAY)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == "llama" and pool["metadata"]["namespace"] == "serving"
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "AdapterPool"  # deleted with the pool
    pods = build_statefulset(ref, _spec(), GATEWAY, 1)["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pods.items()  # exactly the agents' pods
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]  # the port the agents register
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "llama-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}
    assert api_server_errors(pool, schema=_schema()) == []


def test_a_vllm_pool_targets_the_vllm_port_and_failure_mode_follows_the_chart(api_server_errors) -> None:
    config = OperatorConfig(inference_pool=True, picker_port=9100, picker_failure_mode="FailOpen")
    pool = build_inference_pool(PoolRef("v", "ns", "u"), _spec(backend="vllm"), config)
    assert pool["spec"]["targetPorts"] == [{"number": _spec(backend="vllm").engine.vllm.port}]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["port"] == {"number": 9100} and ref["failureMode"] == "FailOpen"
    assert api_server_errors(pool, schema=_schema()) == []


def test_several_pools_get_one_each_and_none_without_the_chart_asking() -> None:
    pools = [pool_objects(PoolRef(name, "ns", name), _spec(), GATEWAY, 1)[-1] for name in ("llama", "qwen")]
    assert [(p["metadata"]["name"], p["spec"]["endpointPickerRef"]["name"]) for p in pools] == \
        [("llama", "llama-epp"), ("qwen", "qwen-epp")]
    assert pools[0]["spec"]["selector"] != pools[1]["spec"]["selector"]
    kinds = [o["kind"] for o in pool_objects(PoolRef("llama", "ns", "u"), _spec(), OperatorConfig(), 1)]
    assert "InferencePool" not in kinds


# (the field, its bad value (None: left out), the mirrored rules' message, the API server's message)
REFUSED = [
    (("endpointPickerRef", "failureMode"), "Sometimes", "Sometimes", 'Unsupported value: "Sometimes"'),
    (("targetPorts",), [], "non-empty", "should have at least 1 items"),
    (("targetPorts",), [{"number": p} for p in range(8001, 8010)], "too long", "must have at most 8 items"),
    (("targetPorts",), [{"number": 8000}, {"number": 8000}], "port number must be unique",
     "port number must be unique"),
    (("endpointPickerRef", "port"), None, "port is required", "port is required when kind is 'Service'"),
    (("selector", "matchLabels"), {"app": "-bad-"}, "does not match", "should match"),
]


def _broken(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    pool = build_inference_pool(PoolRef("llama", "ns", "u"), _spec(), GATEWAY)
    node = pool["spec"]
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return pool


@pytest.mark.parametrize("path,value,message,_", REFUSED)
def test_the_crd_refuses_what_gie_refuses(api_server_errors, path, value, message, _) -> None:
    errors = api_server_errors(_broken(path, value), schema=_schema())
    assert any(message in e for e in errors), errors


# ---- on a real API server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dry_run_create() -> Callable[[dict[str, Any]], tuple[dict[str, Any] | None, str]]:
    """Sends an object to the real API server as a server-side dry-run create in `default`; returns
    (the object as the server would store it, None when refused; the server's message)."""
    if not os.environ.get("KUBECONFIG"):
        pytest.skip("needs KUBECONFIG (a real API server)")
    ensure_inference_pool_crd()

    def create(obj: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        obj = copy.deepcopy(obj)
        obj["metadata"]["namespace"] = "default"
        out = kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", namespace="default",
                      stdin=json.dumps(obj), check=False)
        return (json.loads(out.stdout) if out.returncode == 0 else None), out.stderr.strip()

    return create


@pytest.mark.parametrize("backend,config", [("", GATEWAY), ("vllm", OperatorConfig(
    inference_pool=True, picker_port=9100, picker_failure_mode="FailOpen"))])
def test_the_api_server_stores_the_operators_pools_as_built(dry_run_create, backend, config) -> None:
    pool = build_inference_pool(PoolRef("llama", "serving", "uid-1"), _spec(**({"backend": backend} if backend
                                                                                 else {})), config)
    stored, message = dry_run_create(pool)
    assert stored is not None, message
    assert stored["spec"] == pool["spec"]  # nothing pruned, nothing defaulted: the operator writes it all
    assert stored["metadata"]["ownerReferences"] == pool["metadata"]["ownerReferences"]


@pytest.mark.parametrize("path,value,_,message", REFUSED)
def test_the_api_server_refuses_what_gie_refuses(dry_run_create, path, value, _, message) -> None:
    stored, answer = dry_run_create(_broken(path, value))
    assert stored is None and message in answer, answer


def test_the_api_server_defaults_what_the_operator_may_leave_out(dry_run_create) -> None:
    """GIE's defaults, as the server applies them (a pool written by hand, as docs/gateway.md shows)."""
    pool = build_inference_pool(PoolRef("llama", "ns", "u"), _spec(), GATEWAY)
    for key in ("group", "kind", "failureMode"):
        del pool["spec"]["endpointPickerRef"][key]
    del pool["spec"]["appProtocol"]
    stored, message = dry_run_create(pool)
    assert stored is not None, message
    assert stored["spec"]["appProtocol"] == "http"
    assert {k: stored["spec"]["endpointPickerRef"][k] for k in ("group", "kind", "failureMode")} == \
        {"group": "", "kind": "Service", "failureMode": "FailClose"}
    assert stored["spec"] == decode(pool, _schema())[0]["spec"]  # the mirrored rules default alike


def test_config_from_the_charts_environment() -> None:
    config = OperatorConfig.from_env({"LORAPLEX_INFERENCE_POOL": "true", "LORAPLEX_PICKER_PORT": "9003",
                                      "LORAPLEX_PICKER_FAILURE_MODE": "FailOpen"})
    assert (config.inference_pool, config.picker_port, config.picker_failure_mode) == (True, 9003, "FailOpen")
    assert OperatorConfig.from_env({}).inference_pool is False
    with pytest.raises(ValueError, match="FailOpen or FailClose"):
        OperatorConfig.from_env({"LORAPLEX_PICKER_FAILURE_MODE": "open"})


def test_the_pool_handler_applies_it_last() -> None:
    world = World("http://127.0.0.1:9")
    world.deps.config = OperatorConfig(registration_batch_seconds=0, inference_pool=True)
    world.create("AdapterPool", "tiny", SPEC, "pool-uid")
    world.call(handlers.pool_changed, "AdapterPool", "tiny")
    assert [o["kind"] for o in world.kube.applied] == ["ConfigMap", "Service", "PodDisruptionBudget",
                                                       "StatefulSet", "InferencePool"]
    pool = world.kube.objects[("InferencePool", NS, "tiny")]
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "pool-uid"


def test_missing_gie_crds_fail_the_pool_with_the_api_servers_answer() -> None:
    """The kind is unknown to the API server: the pool's other objects are applied, and its status says
    which object failed and why (the chart's CRD check prevents this at install)."""
    world = World("http://127.0.0.1:9")
    world.deps.config = OperatorConfig(registration_batch_seconds=0, inference_pool=True)
    world.kube.refuse["InferencePool"] = KubeError(404, "no matches for kind InferencePool in version "
                                                        "inference.networking.k8s.io/v1")
    world.create("AdapterPool", "tiny", SPEC, "pool-uid")
    with pytest.raises(kopf.TemporaryError, match="InferencePool tiny: no matches"):
        world.call(handlers.pool_changed, "AdapterPool", "tiny")
    assert [o["kind"] for o in world.kube.applied] == ["ConfigMap", "Service", "PodDisruptionBudget", "StatefulSet"]
