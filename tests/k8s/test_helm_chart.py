"""The Helm chart: values schema, templates rendered and linted by the real Helm engine (the
helm-python-sdk package embeds Helm's Go library, `helm lint` included; the tests are skipped where it
is not installed), the CRDs it installs, the dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from loraplex.spec.crd_schema import crd_files

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "loraplex"


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def test_default_values_validate_against_the_schema() -> None:
    jsonschema.Draft7Validator(_schema()).validate(_values())


@pytest.mark.parametrize("bad", [
    {"redis": {"enabled": False, "externalUrl": ""}},
    {"redis": {"externalUrl": "http://not-redis"}},
    {"operator": {"replicas": 0}},
    {"operator": {"watchNamespaces": ["Bad_NS"]}},
    {"router": {"profile": "fastest"}},
    {"routr": {}},
    {"redis": {"auth": {"existingSecret": "Bad_Name"}}},
    {"router": {"podDisruptionBudget": {"maxUnavailable": -1}}},
])
def test_bad_values_are_refused(bad: dict[str, Any]) -> None:
    values = _values()
    for key, sub in bad.items():
        values[key] = {**values.get(key, {}), **sub}
    assert list(jsonschema.Draft7Validator(_schema()).iter_errors(values))


def test_chart_files_parse() -> None:
    yaml.safe_load((CHART / "Chart.yaml").read_text())
    for path in (CHART / "files" / "crds").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] == "CustomResourceDefinition", path


helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")

VALUE_SETS = {
    "defaults": {},
    "namespaced": {"operator": {"watchNamespaces": ["team-a", "team-b"]},
                   "metrics": {"serviceMonitor": {"enabled": True}},
                   "router": {"autoscaling": {"enabled": True}, "apiKeysSecret": "router-keys"}},
    "external-redis": {"redis": {"enabled": False, "externalUrl": "redis://redis.infra:6379/1"},
                       "crds": {"install": False}, "metrics": {"grafanaDashboard": {"enabled": False}}},
    "secured": {"redis": {"auth": {"existingSecret": "redis-auth"}}, "networkPolicy": {"enabled": True},
                "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}]},
    "gateway": {"gateway": {"inferencePool": {"enabled": True, "checkCRDs": False, "failureMode": "FailOpen"}},
                "networkPolicy": {"enabled": True}},
    # the documented value files (README, docs/kubernetes.md)
    **{f"examples/{p.name}": yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples" / "helm").glob("*.yaml"))},
}


def _render(values: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values=values, name="lp", namespace="serving")
    return {Path(path).name: [d for d in yaml.safe_load_all(text) if d] for path, text in out.items()
            if not path.endswith("NOTES.txt")}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    return request.param, _render(VALUE_SETS[request.param])


def test_every_rendered_document_is_a_kubernetes_object(rendered) -> None:
    _, files = rendered
    for name, docs in files.items():
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(doc), name
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", doc["metadata"]["name"]), doc["metadata"]


def _kinds(files: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for docs in files.values():
        for doc in docs:
            out.setdefault(doc["kind"], []).append(doc)
    return out


def test_defaults_install_everything() -> None:
    kinds = _kinds(_render({}))
    crds = {d["metadata"]["name"]: d for d in kinds["CustomResourceDefinition"]}
    assert len(crds) == len(kinds["CustomResourceDefinition"])  # each CRD once (kopf's included)
    generated = [manifest for manifests in crd_files().values() for manifest in manifests]
    assert sorted(crds) == sorted(m["metadata"]["name"] for m in generated)
    for manifest in generated:
        assert crds[manifest["metadata"]["name"]] == manifest  # the chart ships the generated CRDs
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= set(crds)
    deployments = {d["metadata"]["name"]: d for d in kinds["Deployment"]}
    operator = deployments["lp-loraplex-operator"]["spec"]
    assert operator["replicas"] == 2  # two replicas, one active through kopf peering
    container = operator["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/loraplex/loraplex-operator:0.1.0"
    env = {e["name"]: e["value"] for e in container["env"]}
    # namespace-qualified: agents of pools in any namespace reach it
    assert env["LORAPLEX_REDIS_URL"] == "redis://lp-loraplex-redis.serving.svc:6379/0"
    assert env["LORAPLEX_AGENT_IMAGE"] == "ghcr.io/loraplex/loraplex-agent:0.1.0"
    assert env["LORAPLEX_AGENT_CPU_IMAGE"] == "ghcr.io/loraplex/loraplex-agent-cpu:0.1.0"
    assert env["LORAPLEX_REDIS_PASSWORD_SECRET"] == env["LORAPLEX_IMAGE_PULL_SECRETS"] == ""
    assert [p["spec"]["maxUnavailable"] for p in kinds["PodDisruptionBudget"]] == [1]  # the routers'
    assert "NetworkPolicy" not in kinds
    router = deployments["lp-loraplex-router"]["spec"]["template"]["spec"]["containers"][0]
    assert "--pool=llama3-8b" in router["args"]
    assert operator["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert {d["kind"] for d in kinds["ClusterRole"]} and "Role" not in kinds
    dashboard = kinds["ConfigMap"][0]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["loraplex.json"])["uid"] == "loraplex"


def test_namespaced_operator_gets_roles_and_monitors() -> None:
    kinds = _kinds(_render(VALUE_SETS["namespaced"]))
    assert sorted(r["metadata"]["namespace"] for r in kinds["Role"]) == ["team-a", "team-b"]
    rules = [rule for rule in kinds["ClusterRole"][0]["rules"]]
    assert [r["resources"] for r in rules] == [["customresourcedefinitions"]]  # nothing cluster-wide else
    assert len(kinds["ServiceMonitor"]) == 2 and "HorizontalPodAutoscaler" in kinds
    deployments = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in kinds["Deployment"]}
    operator_args = deployments["lp-loraplex-operator"]["containers"][0]["args"]
    assert "--namespace=team-a" in operator_args and "--namespace=team-b" in operator_args
    router = deployments["lp-loraplex-router"]
    assert "--api-keys=/etc/loraplex/api-keys.yaml" in router["containers"][0]["args"]
    assert router["volumes"] == [{"name": "tmp", "emptyDir": {}}, {"name": "api-keys", "secret": {"secretName": "router-keys"}}]


def test_redis_auth_network_policies_and_pull_secrets() -> None:
    kinds = _kinds(_render(VALUE_SETS["secured"]))
    deployments = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in kinds["Deployment"]}
    password = {"name": "LORAPLEX_REDIS_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "redis-password"}}}
    for name in ("redis", "router", "operator"):
        container = deployments[f"lp-loraplex-{name}"]["containers"][0]
        assert password in container["env"], name
    redis = deployments["lp-loraplex-redis"]["containers"][0]
    assert redis["args"][-2:] == ["--requirepass", "$(LORAPLEX_REDIS_PASSWORD)"]
    operator = deployments["lp-loraplex-operator"]
    env = {e["name"]: e.get("value") for e in operator["containers"][0]["env"]}
    assert env["LORAPLEX_REDIS_PASSWORD_SECRET"] == "redis-auth"  # the agents read the same Secret
    assert env["LORAPLEX_IMAGE_PULL_SECRETS"] == "regcred,mirror"
    assert operator["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    policies = {p["metadata"]["name"]: p["spec"] for p in kinds["NetworkPolicy"]}
    assert sorted(policies) == ["lp-loraplex-operator", "lp-loraplex-redis", "lp-loraplex-router"]
    redis_from = policies["lp-loraplex-redis"]["ingress"][0]["from"][0]
    assert redis_from == {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "loraplex"}}}


def test_external_redis_and_no_crds() -> None:
    kinds = _kinds(_render(VALUE_SETS["external-redis"]))
    assert "CustomResourceDefinition" not in kinds and "ConfigMap" not in kinds
    names = {d["metadata"]["name"] for d in kinds["Deployment"]}
    assert "lp-loraplex-redis" not in names
    router = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "lp-loraplex-router")
    assert "--redis-url=redis://redis.infra:6379/1" in router["spec"]["template"]["spec"]["containers"][0]["args"]


def test_gateway_values_serve_the_picker_and_let_the_operator_make_inference_pools() -> None:
    kinds = _kinds(_render(VALUE_SETS["gateway"]))
    deployments = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in kinds["Deployment"]}
    router = deployments["lp-loraplex-router"]["containers"][0]
    assert "--extproc-port=9002" in router["args"]
    assert {"name": "epp", "containerPort": 9002} in router["ports"]
    services = {s["metadata"]["name"]: s["spec"] for s in kinds["Service"]}
    picker = services["llama3-8b-epp"]  # the name the operator's InferencePool refers to
    assert picker["ports"] == [{"name": "grpc-ext-proc", "port": 9002, "targetPort": "epp", "appProtocol": "http2"}]
    assert picker["selector"]["app.kubernetes.io/component"] == "router"
    env = {e["name"]: e.get("value") for e in deployments["lp-loraplex-operator"]["containers"][0]["env"]}
    assert (env["LORAPLEX_INFERENCE_POOL"], env["LORAPLEX_PICKER_PORT"], env["LORAPLEX_PICKER_FAILURE_MODE"]) == \
        ("true", "9002", "FailOpen")
    rules = kinds["ClusterRole"][0]["rules"]
    assert {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
            "verbs": ["get", "create", "patch"]} in rules
    router_policy = next(p for p in kinds["NetworkPolicy"] if p["metadata"]["name"] == "lp-loraplex-router")
    assert {"port": 9002, "protocol": "TCP"} in router_policy["spec"]["ingress"][0]["ports"]
    defaults = _kinds(_render({}))
    assert all(not s["metadata"]["name"].endswith("-epp") for s in defaults["Service"])
    env = {e["name"]: e.get("value") for e in next(d for d in defaults["Deployment"] if d["metadata"]["name"]
                                                   == "lp-loraplex-operator")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LORAPLEX_INFERENCE_POOL"] == "false"


def test_missing_gie_crds_fail_the_install_in_one_line() -> None:
    """Without a cluster Helm sees no InferencePool API, as on a cluster without GIE's CRDs."""
    with pytest.raises(helm.HelmRenderError) as failed:
        _render({"gateway": {"inferencePool": {"enabled": True}}})
    message = str(failed.value)
    assert "\n" not in message.strip() and "Gateway API Inference Extension CRDs" in message


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_helm_lint_strict_finds_nothing_but_the_icon(values: str) -> None:
    """`helm lint --strict --kube-version v1.36.0` (Helm's own lint package): warnings fail too."""
    report = helm.lint(str(CHART), VALUE_SETS[values], strict=True, kube_version="v1.36.0")
    assert report["errors"] == [], report
    assert [m["error"] for m in report["messages"]] == ["icon is recommended"], report


def test_helm_lint_refuses_values_the_schema_refuses() -> None:
    report = helm.lint(str(CHART), {"routr": {}}, strict=True)
    assert any("routr" in e for e in report["errors"]), report


def test_every_crd_survives_helm_uninstall(rendered) -> None:
    """CRDs under templates/ (so `helm upgrade` updates them), each with the keep policy (so `helm
    uninstall` does not delete them and with them every AdapterPool and LoRADeployment)."""
    _, files = rendered
    crds = [d for docs in files.values() for d in docs if d["kind"] == "CustomResourceDefinition"]
    for crd in crds:
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep", crd["metadata"]["name"]
    assert not helm.Chart.load(str(CHART)).crds  # nothing in the chart's crds/ folder (never upgraded)


def _known_metrics() -> set[str]:
    from loraplex_router.metrics import RouterMetrics

    names = set()
    for family in RouterMetrics().registry.collect():  # families without samples yet carry their type
        names |= {family.name, f"{family.name}_total", f"{family.name}_bucket"}
    agent_source = (ROOT / "node_agent" / "loraplex_agent" / "api" / "metrics.py").read_text()
    for name in re.findall(r'"((?:vllm|loraplex):[a-z0-9_]+)"', agent_source):
        names |= {name, f"{name}_total", f"{name}_bucket"}
    return names


def test_dashboard_uses_only_metrics_that_exist() -> None:
    dashboard = json.loads((CHART / "dashboards" / "loraplex.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {m for e in exprs for m in re.findall(r"((?:vllm:|loraplex:|loraplex_router_)[a-z0-9_:]+)", e)}
    assert used - _known_metrics() == set()
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for needed in ("TTFT", "TBT", "E2E", "per adapter", "Queue", "cache hit rate", "loads/s", "Routing table version",
                   "per server"):
        assert needed in titles, needed
