"""The CRDs: generated from the models and in sync (ours and kopf's peering CRDs); structural; every
default accepted as the API server checks it; the resources of the docs and examples accepted, and
bad ones refused the same way by the API-server path (tests/support/api_server.py: pruning, defaulting,
schema, CEL) and the pydantic path (`loraplex up`)."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from api_server import (
    crd_documents,
    default,
    default_errors,
    documented_resources,
    schema_of,
    structural_errors,
    walk,
)
from pydantic import ValidationError

from loraplex.routing import keys
from loraplex.spec import names
from loraplex.spec.adapter import validate_adapter_name
from loraplex.spec.crd import AdapterPool, LoRADeployment, ServersSpec, parse_resource
from loraplex.spec.crd_schema import (
    HEADER,
    crd_files,
    crd_manifests,
    kopf_peering_crds,
    render,
    stale_crds,
    stored_default,
    write_crds,
)

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
    assert sorted(p.name for p in (ROOT / directory).glob("*.yaml")) == sorted(crd_files())


def test_stale_crds_sees_missing_changed_and_leftover_files(tmp_path: Path) -> None:
    write_crds(tmp_path)
    assert stale_crds(tmp_path) == []
    (tmp_path / "kopf-peerings.yaml").unlink()
    (tmp_path / "adapterpools.yaml").write_text(HEADER + "changed: true\n")
    (tmp_path / "old-name.yaml").write_text(HEADER + "kind: CustomResourceDefinition\n")  # a renamed file
    (tmp_path / "mine.yaml").write_text("kind: ConfigMap\n")  # not generated: left alone
    assert {p.name for p in stale_crds(tmp_path)} == {"kopf-peerings.yaml", "adapterpools.yaml", "old-name.yaml"}
    write_crds(tmp_path)
    assert stale_crds(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == sorted([*crd_files(),
                                                                                               "mine.yaml"])


def test_crds_cover_our_resources_and_kopfs_peerings() -> None:
    names = [d["metadata"]["name"] for d in crd_documents()]
    assert sorted(names) == ["adapterpools.loraplex.io", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev",
                             "loradeployments.loraplex.io"]
    assert [d["metadata"]["name"] for d in kopf_peering_crds()] == ["clusterkopfpeerings.kopf.dev",
                                                                  "kopfpeerings.kopf.dev"]


CRDS = {d["metadata"]["name"]: d for d in crd_documents()}


def _schema(crd_name: str) -> dict[str, Any]:
    return CRDS[crd_name]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("crd_name", sorted(CRDS))
def test_schema_is_structural(crd_name: str) -> None:
    assert CRDS[crd_name]["apiVersion"] == "apiextensions.k8s.io/v1"
    assert structural_errors(_schema(crd_name)) == []


@pytest.mark.parametrize("crd_name", sorted(CRDS))
def test_every_default_passes_the_api_servers_check(crd_name: str) -> None:
    """The check that refused `default: {}` on spec.servers: each literal as it is (nested defaults not
    applied), pruned, against its node's schema and every CEL rule of that node and below."""
    assert default_errors(_schema(crd_name)) == []


def test_the_check_refuses_empty_object_defaults() -> None:
    """The defect this guards against: `{}` as the default of an object with rules over its fields."""
    schema = copy.deepcopy(schema_of("AdapterPool"))
    spec = schema["properties"]["spec"]["properties"]
    spec["servers"]["default"] = {}
    spec["sizing"]["default"] = {"estimator": "planner"}
    spec["engine"]["default"] = {"maxLoraRank": 64, "unknownField": 1}
    spec["placement"]["default"] = {"intervalSeconds": 1}
    errors = default_errors(schema)
    assert any("spec.servers.default" in e and "minReplicas" in e for e in errors), errors
    assert "spec.sizing.default: sizing.profile is required when sizing.estimator is planner" in errors
    assert "spec.engine.default: must not have unknown fields" in errors
    assert any(e.startswith("spec.placement.default: intervalSeconds") for e in errors), errors


def test_object_defaults_are_what_the_server_stores() -> None:
    """Every object default is complete: defaulting it again adds nothing, so an omitted block and one
    written `{}` are stored alike; and it is the model's own default."""
    checked = 0
    for crd_name in CRDS:
        for path, node in walk(_schema(crd_name)):
            if isinstance(node.get("default"), dict):
                assert default(copy.deepcopy(node["default"]), node) == node["default"], path
                checked += 1
    assert checked >= 6
    spec = schema_of("AdapterPool")["properties"]["spec"]["properties"]
    assert spec["servers"]["default"] == stored_default(ServersSpec().to_k8s(), spec["servers"])
    assert spec["servers"]["default"]["minReplicas"] <= spec["servers"]["default"]["maxReplicas"]


def test_api_server_defaults_match_the_models(api_server_defaults) -> None:
    spec_schema = schema_of("AdapterPool")["properties"]["spec"]
    defaulted = api_server_defaults(POOL)
    assert defaulted["spec"] == stored_default(AdapterPool.model_validate(POOL).spec.to_k8s(), spec_schema)
    assert api_server_defaults(_with(POOL, "spec.servers", {}))["spec"] == defaulted["spec"]
    spec_schema = schema_of("LoRADeployment")["properties"]["spec"]
    defaulted = api_server_defaults(ADAPTER)
    assert defaulted["spec"] == stored_default(LoRADeployment.model_validate(ADAPTER).spec.to_k8s(), spec_schema)


DOCUMENTED = documented_resources()


def test_the_docs_and_examples_show_whole_resources() -> None:
    files = {key.split("#")[0] for key in DOCUMENTED}
    assert {"examples/adapterpool.yaml", "examples/adapterpool-planner.yaml", "examples/loradeployment-hf.yaml",
            "examples/loradeployment-s3.yaml", "examples/quickstart-cpu/adapterpool.yaml",
            "examples/quickstart-cpu/loradeployments.yaml", "docs/kubernetes.md", "docs/local.md"} <= files, files
    assert len(DOCUMENTED) >= 7


@pytest.mark.parametrize("key", sorted(DOCUMENTED))
def test_documented_resources_are_accepted_by_both_paths(key: str, api_server_errors) -> None:
    obj = DOCUMENTED[key]
    assert api_server_errors(obj) == [], key
    parse_resource(obj)


def test_crd_names_columns_and_subresources() -> None:
    pool = yaml.safe_load(render(crd_manifests()["adapterpools.yaml"]))
    version = pool["spec"]["versions"][0]
    assert pool["spec"]["names"]["shortNames"] == ["apool"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.servers.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert {"Phase", "Ready", "Required", "Routing"} <= set(columns)
    assert columns["Servers"] == ".status.replicas"  # spec.servers.replicas is blank unless set
    adapter = crd_manifests()["loradeployments.yaml"]
    columns = {c["name"]: c["jsonPath"] for c in adapter["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["Rank"] == ".status.rank"
    assert columns["Weights"] == ".status.weights" and "status" in adapter["spec"]["versions"][0]["subresources"]


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
    (ADAPTER, "spec.adapter.source", "ftp://x/y", "source must start with one of file://, https://, s3://, gs://, hf://"),
    (ADAPTER, "spec.adapter.source", "/abs/path", "source must start with"),
    (ADAPTER, "spec.adapter.sha256", "abc", "abc"),
    (ADAPTER, "spec.replicas", {"min": 3, "max": 2}, "replicas.min must not exceed replicas.max"),
    (ADAPTER, "spec.replicas.min", 0, "min"),
    (ADAPTER, "spec.pool", "Not_A_Label", "Not_A_Label"),
    (ADAPTER, "spec.traffic.expectedTokensPerSecond", -1, "-1"),
    (POOL, "metadata.name", "a.b", "metadata.name must be a DNS-1035 label"),  # a Service name has no dots
    (POOL, "metadata.name", "a" * 53, "metadata.name must be a DNS-1035 label of at most 52"),
    (POOL, "metadata.name", "p" * 60, "metadata.name must be a DNS-1035 label of at most 52"),
    (POOL, "metadata.name", "1pool", "metadata.name must be a DNS-1035 label"),  # starts with a digit
]


@pytest.mark.parametrize(("base", "path", "value", "message"), BAD, ids=[f"{b['kind']}:{p}={str(v)[:12]}" for b, p, v, _ in BAD])
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


@pytest.mark.parametrize("name", ["p", "llama3-8b", "a" * 52, "a-" * 25 + "b1"])
def test_pool_names_of_up_to_52_characters_are_accepted_by_both_paths(api_server_errors, name: str) -> None:
    pool = _with(POOL, "metadata.name", name)
    assert api_server_errors(pool) == []
    assert parse_resource(pool).metadata["name"] == name
    assert keys.validate_pool_name(name) == name


@pytest.mark.parametrize("name", ["a.b", "a" * 53])
def test_pool_names_a_service_or_statefulset_cannot_have_are_refused(api_server_errors, name: str) -> None:
    """Both are valid object names (DNS-1123 subdomains): only the CRD's root rule refuses them."""
    pool = _with(POOL, "metadata.name", name)
    assert api_server_errors(pool) == [AdapterPool.cel_rules[0].message]
    with pytest.raises(ValidationError, match="DNS-1035"):
        parse_resource(pool)


def test_the_pool_name_rule_lives_in_one_place() -> None:
    assert keys.validate_pool_name is names.validate_pool_name
    root_rules = schema_of("AdapterPool")["x-kubernetes-validations"]
    assert [r["rule"] for r in root_rules] == [r.rule for r in AdapterPool.cel_rules]
    assert names.POOL_NAME_PATTERN in root_rules[0]["rule"] and str(names.MAX_POOL_NAME_LENGTH) in root_rules[0]["rule"]
    with pytest.raises(ValueError, match="DNS-1035"):
        keys.PoolKeys("a.b")


def _subdomain(rng: random.Random) -> str:
    def label() -> str:
        inner = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789-") for _ in range(rng.randint(0, 20)))
        return rng.choice("az09") + (inner + rng.choice("az09") if inner else "")
    name = label()
    while rng.random() < 0.5 and len(name) < 200:
        name += "." + label()
    return name


def test_every_name_kubernetes_gives_a_lora_deployment_is_an_adapter_name(api_server_errors) -> None:
    """A LoRADeployment's name is the adapter's name. Kubernetes allows DNS-1123 subdomains of up to 253
    characters; validate_adapter_name accepts all of them, so the CRD needs no root rule on the name."""
    rng = random.Random(7)
    samples = [_subdomain(rng) for _ in range(300)] + ["a", "0", "a.b", "sql-expert.v2", ("a" * 62 + ".") * 4 + "a"]
    for name in samples:
        assert len(name) <= 253
        validate_adapter_name(name)
        assert api_server_errors(_with(ADAPTER, "metadata.name", name)) == [], name
    assert "x-kubernetes-validations" not in schema_of("LoRADeployment")
    for bad in ["A", "a_b", "-a", "a" * 254]:  # refused by the server's own check of metadata.name
        assert api_server_errors(_with(ADAPTER, "metadata.name", bad)), bad
