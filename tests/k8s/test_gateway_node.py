"""The router as the endpoint picker of the user's own gateway, on a cluster with a real node (kubelet +
container runtime): `helm install` with the gateway values (gateway.inferencePool.enabled) into the
namespace of the CPU quick start's pool, as docs/gateway.md says; the InferencePool the operator makes
for the pool; the picker's Service Ready; and requests routed by a gRPC client that speaks ext_proc to
that Service as Envoy does (loraplex_bench.gateway_client, the one tests/router/test_extproc.py and
`loraplex bench picker` use), each forwarded to the endpoint the picker names and served there.

No gateway binary can be installed here (docs/gateway.md), so that client plays the gateway's part.
GIE's InferencePool CRD is installed from tests/k8s/fixtures unless the cluster has GIE's own. The
images must be on the node (scripts/build-images.sh first). Runs only where the environment names
such a cluster, as tests/k8s/test_real_node.py does:

    LORAPLEX_E2E_NODE=1 KUBECONFIG=~/.kube/config pytest -m cluster tests/k8s/test_gateway_node.py

The picker Service is reached at its ClusterIP when this machine is the node, else through `kubectl
port-forward`; the agents at their pod IPs (the endpoints the picker names), which the node reaches.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from gie import CRD, ensure_inference_pool_crd
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helm_release import REAL_NODE, Release, e2e_values, keep_logs, remove, service_address
from kube import GROUP, get_json, kubectl
from loraplex_bench.gateway_client import Exchange, Gateway
from waiting import wait_for

pytestmark = REAL_NODE  # pytest.mark.cluster, run only with LORAPLEX_E2E_NODE and KUBECONFIG set

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart-cpu"
POOL = "tiny"
EPP = f"{POOL}-epp"          # the chart's picker Service: <router.pool>-epp
PICKER_PORT = 9002           # gateway.inferencePool.pickerPort's default
RUN = uuid.uuid4().hex[:5]
RELEASE, NS = "loraplex", f"lpx-gw-{RUN}"  # the pool and the release share the namespace, as GIE requires
READY_TIMEOUT_S = 900        # image start, model generation, the CPU kernel's first build, on 2 cores
ADAPTERS = [d["metadata"]["name"] for d in yaml.safe_load_all((QUICKSTART / "loradeployments.yaml").read_text())
            if d]


def _phases() -> dict[str, str]:
    items = get_json(f"loradeployments.{GROUP}", namespace=NS).get("items", [])
    return {i["metadata"]["name"]: (i.get("status") or {}).get("phase", "") for i in items}


def _inference_pool() -> dict[str, Any]:
    return get_json(CRD, POOL, namespace=NS)


def _pods(selector: dict[str, str]) -> list[dict[str, Any]]:
    labels = ",".join(f"{k}={v}" for k, v in selector.items())
    return get_json("pods", "-l", labels, namespace=NS).get("items", [])


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _endpoints(pool: dict[str, Any]) -> set[str]:
    """`podIP:port` of the pool's Ready pods on its target ports: what a gateway may be told to use."""
    ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    return {f"{pod['status']['podIP']}:{port}" for pod in _pods(pool["spec"]["selector"]["matchLabels"])
            if _ready(pod) and pod["status"].get("podIP") for port in ports}


@pytest.fixture(scope="module")
def release(report: dict[str, Any]) -> Iterator[Release]:
    report["inference_pool_crd"] = ensure_inference_pool_crd()
    chart = Release(RELEASE, NS, e2e_values(gateway={"inferencePool": {"enabled": True}}))
    started = time.monotonic()
    chart.install()
    report["install_s"] = round(time.monotonic() - started, 1)
    try:
        yield chart
    finally:
        keep_logs(NS)
        remove(chart, NS, NS)


@pytest.fixture(scope="module")
def report() -> Iterator[dict[str, Any]]:
    figures: dict[str, Any] = {"run": RUN}
    yield figures
    if os.environ.get("LORAPLEX_E2E_REPORT"):  # beside test_real_node.py's figures, under a key of its own
        path = Path(os.environ["LORAPLEX_E2E_REPORT"]).with_suffix(".gateway.json")
        path.write_text(json.dumps(figures, indent=2))


@pytest.fixture(scope="module")
def quickstart(release: Release, report: dict[str, Any]) -> None:
    """The CPU quick start applied in the release's namespace, every LoRADeployment Ready."""
    started = time.monotonic()
    kubectl("apply", "-f", str(QUICKSTART), namespace=NS)
    wait_for("every LoRADeployment Ready", lambda: set(_phases().values()) == {"Ready"} and len(_phases()) == 4,
             timeout=READY_TIMEOUT_S, interval=2)
    report["ready_s"] = round(time.monotonic() - started, 1)


@pytest.fixture(scope="module")
def picker(quickstart: None, report: dict[str, Any]) -> Iterator[str]:
    """The picker Service's address, once it has a Ready endpoint (a router pod) and has routed a first
    request that its agent served (the agents' first CPU kernel build may still be under way)."""
    started = time.monotonic()
    wait_for("the picker Service's endpoints Ready", lambda: _service_ready(EPP), timeout=300, interval=2)
    with service_address(NS, EPP, PICKER_PORT) as address:
        wait_for("a first request routed by the picker and served", lambda: _served(address), timeout=300,
                 interval=3)
        report["first_served_through_the_picker_s"] = round(time.monotonic() - started, 1)
        yield address


def _service_ready(service: str) -> bool:
    slices = get_json("endpointslices", "-l", f"kubernetes.io/service-name={service}", namespace=NS)
    return any((e.get("conditions") or {}).get("ready") for s in slices.get("items", [])
               for e in s.get("endpoints") or [])


def test_helm_install_with_the_gateway_values_makes_the_pools_inference_pool(quickstart: None) -> None:
    wait_for("the InferencePool", lambda: bool(_inference_pool()), timeout=120, interval=1)
    pool = _inference_pool()
    owner = pool["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("AdapterPool", POOL)  # deleted with the pool
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": EPP,
                                                 "port": {"number": PICKER_PORT}, "failureMode": "FailClose"}
    assert get_json("service", EPP, namespace=NS)["spec"]["ports"][0]["port"] == PICKER_PORT
    agents = get_json("statefulset", POOL, namespace=NS)["spec"]["replicas"]
    wait_for("every agent of the pool Ready", lambda: len(_endpoints(pool)) == agents, timeout=READY_TIMEOUT_S,
             interval=2)
    selected = {p["metadata"]["name"] for p in _pods(pool["spec"]["selector"]["matchLabels"])}
    assert selected == {f"{POOL}-{i}" for i in range(agents)}  # exactly the pool's agents


def test_the_pickers_pod_is_ready_and_its_grpc_health_serves(picker: str) -> None:
    """GIE's three health services, as a gateway (and the kubelet's gRPC probe) asks them."""
    channel = grpc.insecure_channel(picker)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
    finally:
        channel.close()
    router_pods = _pods(get_json("service", EPP, namespace=NS)["spec"]["selector"])
    assert router_pods and all(_ready(p) for p in router_pods)


def _served(picker: str) -> bool:
    """Whether one request routed by the picker is served; why not is printed (pytest shows it on a failure)."""
    try:
        [ex] = _send(picker, [_completion(ADAPTERS[0])])
    except (grpc.RpcError, httpx.HTTPError) as exc:  # the picker or the agent not answering yet: try again
        print(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}")
        return False
    if ex.status != 200:
        print(f"{time.strftime('%H:%M:%S')} {ex.status} from {ex.served or ex.destination}: {ex.body[:300]!r}")
    return ex.status == 200


def _send(picker: str, bodies: list[bytes]) -> list[Exchange]:
    async def go() -> list[Exchange]:
        gateway = Gateway(picker)
        try:
            return [await gateway.send(body, pieces=8) for body in bodies]
        finally:
            await gateway.close()

    return asyncio.run(go())


def _completion(model: str, **extra: Any) -> bytes:
    return json.dumps({"model": model, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0,
                       **extra}).encode()


def test_requests_the_picker_routes_are_served_by_the_agent_it_names(picker: str, report: dict[str, Any]) -> None:
    pool = _inference_pool()
    endpoints = _endpoints(pool)
    models = [*ADAPTERS, POOL]
    exchanges = _send(picker, [_completion(m) for m in models] * 3)
    for model, ex in zip(models * 3, exchanges, strict=True):
        assert not ex.immediate and ex.status == 200, (model, ex.status, ex.body[:300])
        named = ex.destination.split(",")
        assert ex.destination == ex.metadata and set(named) <= endpoints, (named, endpoints)
        assert ex.served == named[0]  # the primary served: no agent failed
        doc = json.loads(ex.body)
        assert doc["choices"] and doc["usage"]["completion_tokens"] > 0, (model, doc)
    report["served_by"] = sorted({ex.served for ex in exchanges})


def test_a_streamed_request_passes_through_the_picker(picker: str) -> None:
    [ex] = _send(picker, [_completion(ADAPTERS[0], stream=True)])
    assert ex.status == 200 and ex.served in _endpoints(_inference_pool())
    events = [line.removeprefix("data: ") for line in ex.body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    assert any(json.loads(e)["choices"] for e in events[:-1])


def test_an_unknown_adapter_is_answered_by_the_gateway_with_the_pickers_404(picker: str) -> None:
    [ex] = _send(picker, [_completion("no-such-adapter")])
    assert ex.immediate and ex.status == 404
    assert json.loads(ex.body)["error"]["code"] == "model_not_found"
