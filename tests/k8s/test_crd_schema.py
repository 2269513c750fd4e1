"""The CRDs: generated from the models and in sync; structural; good resources accepted and bad ones
refused the same way by the API-server path (schema + CEL) and the pydantic path (`loraplex up`)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from loraplex.spec.crd import AdapterPool, LoRADeployment, parse_resource
from loraplex.spec.crd_schema import crd_manifests, render, stale_crds

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("cel", reason="the CEL rules are checked with the `cel` package (common-expression-language)")

POOL = {"apiVersion": "loraplex.io/v1alpha1", "kind": "AdapterPool", "metadata": {"name": "p"},
        "spec": {"baseModel": {"name": "tiny", "source": "file:///models/tiny"}}}
ADAPTER = {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRADeployment", "metadata": {"name": "a"},
           "spec": {"pool": "p", "adapter": {"source": "hf://org/adapter"}}}


def _with(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return out


@pytest.mark.parametrize("directory", ["crds", "helm/loraplex/files/crds"])
def test_generated_files_are_in_sync(directory: str) -> None:
    assert stale_crds(ROOT / directory) == [], "run `loraplex crds generate`"


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(node, dict):
        return []
    out = [(path, node)]
    for name, sub in node.get("properties", {}).items():
        out += _walk(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        out += _walk(node.get(key), f"{path}[{key}]")
    return out


@pytest.mark.parametrize("file_name", ["adapterpools.yaml", "loradeployments.yaml"])
def test_schema_is_structural(file_name: str) -> None:
    schema = crd_manifests()[file_name]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "title" not in node and "const" not in node, path
        assert node.get("additionalProperties") is not False, path
        assert "type" in node or node.get("x-kubernetes-int-or-string") or \
            node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_crd_names_columns_and_subresources() -> None:
    pool = yaml.safe_load(render(crd_manifests()["adapterpools.yaml"]))
    version = pool["spec"]["versions"][0]
    assert pool["spec"]["names"]["shortNames"] == ["apool"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.servers.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert {"Phase", "Ready", "Required", "Routing"} <= {c["name"] for c in version["additionalPrinterColumns"]}
    adapter = crd_manifests()["loradeployments.yaml"]
    columns = {c["name"]: c["jsonPath"] for c in adapter["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["Rank"] == ".status.rank"
    assert columns["Weights"] == ".status.weights" and "status" in adapter["spec"]["versions"][0]["subresources"]


def test_examples_are_accepted_by_both_paths(examples, api_server_errors) -> None:
    assert set(examples) >= {"adapterpool.yaml", "loradeployment-hf.yaml", "loradeployment-s3.yaml"}
    for name, obj in examples.items():
        assert api_server_errors(obj) == [], name
        parse_resource(obj)


def _no_empty(value: Any) -> Any:
    """Empty lists and maps mean the same as absent ones (the API server does not add them)."""
    if isinstance(value, dict):
        return {k: _no_empty(v) for k, v in value.items() if v not in ({}, [])}
    return value


def test_api_server_defaults_match_the_models(api_server_defaults) -> None:
    defaulted = api_server_defaults(copy.deepcopy(POOL))
    assert defaulted["spec"] == _no_empty(AdapterPool.model_validate(POOL).spec.to_k8s())
    defaulted = api_server_defaults(copy.deepcopy(ADAPTER))
    assert defaulted["spec"] == _no_empty(LoRADeployment.model_validate(ADAPTER).spec.to_k8s())


BAD = [
    (POOL, "spec.servers.minReplicas", 5, "minReplicas must not exceed maxReplicas"),
    (POOL, "spec.servers.replicas", 9, "replicas must lie between minReplicas and maxReplicas"),
    (POOL, "spec.baseModel.source", "s3://bucket/model", "source must start with one of file://, hf://"),
    (POOL, "spec.engine.maxLoraRank", 1024, "1024"),
    (POOL, "spec.placement.intervalSeconds", 1, "interval"),
    (POOL, "spec.placement.hysteresis", 1.5, "hysteresis"),
    (POOL, "spec.placement.hysteresis", -0.1, "hysteresis"),
    (POOL, "spec.servers.gpus", 1, "gpus"),  # unknown field (kubectl validates strictly)
    (POOL, "spec.baseModel.dtype", "int4", "int4"),
    (ADAPTER, "spec.adapter.source", "ftp://x/y", "source must start with one of file://, https://, s3://, hf://"),
    (ADAPTER, "spec.adapter.source", "/abs/path", "source must start with"),
    (ADAPTER, "spec.adapter.sha256", "abc", "abc"),
    (ADAPTER, "spec.replicas", {"min": 3, "max": 2}, "replicas.min must not exceed replicas.max"),
    (ADAPTER, "spec.replicas.min", 0, "min"),
    (ADAPTER, "spec.pool", "Not_A_Label", "Not_A_Label"),
    (ADAPTER, "spec.traffic.expectedTokensPerSecond", -1, "-1"),
]


@pytest.mark.parametrize(("base", "path", "value", "message"), BAD, ids=[f"{b['kind']}:{p}={v}" for b, p, v, _ in BAD])
def test_bad_resources_are_refused_by_both_paths(api_server_errors, base, path, value, message) -> None:
    obj = _with(base, path, value)
    errors = api_server_errors(obj)
    leaf = path.split(".")[-1]
    assert any(message in e or leaf in e for e in errors), errors
    with pytest.raises(ValidationError):
        parse_resource(obj)


def test_pool_is_immutable_on_update_only(api_server_errors) -> None:
    moved = _with(ADAPTER, "spec.pool", "other")
    assert api_server_errors(moved) == []  # a create may name any pool
    assert api_server_errors(moved, old=ADAPTER) == ["spec.pool is immutable; delete the LoRADeployment and "
                                                     "create it again"]
    assert api_server_errors(_with(ADAPTER, "spec.traffic.expectedTokensPerSecond", 9), old=ADAPTER) == []


def test_parse_resource_refuses_other_kinds() -> None:
    with pytest.raises(ValueError, match="not a Loraplex resource"):
        parse_resource({"apiVersion": "v1", "kind": "ConfigMap"})


def test_pool_hysteresis_defaults_to_the_placement_default(api_server_defaults) -> None:
    from loraplex.placement import DEFAULT_HYSTERESIS

    defaulted = api_server_defaults(copy.deepcopy(POOL))
    assert defaulted["spec"]["placement"]["hysteresis"] == DEFAULT_HYSTERESIS
    assert AdapterPool.model_validate(POOL).spec.placement.hysteresis == DEFAULT_HYSTERESIS
