"""The user's whole path on a cluster with a real node (kubelet + container runtime): images built
from the Dockerfile, `helm install`, the CPU quick start applied exactly as the README says, every
adapter served through the router Service, the dashboard's queries answered by a Prometheus that
scrapes the pods, and then the faults a cluster meets: an agent pod deleted under traffic, the
operator restarted, Redis restarted, the pool scaled up and down, adapters deleted, `helm upgrade`
and `helm uninstall`.

The tests run in file order against one release, and only where the environment names such a
cluster:

    LORAPLEX_E2E_NODE=1 KUBECONFIG=~/.kube/config pytest -m cluster tests/k8s/test_real_node.py

    LORAPLEX_E2E_BUILD_FLAGS  flags of scripts/build-images.sh to build and load the images first,
                              e.g. "--tool buildah --load containerd"; unset: they are on the node
    LORAPLEX_E2E_VALUES       a YAML file of more chart values (e.g. redis.image on an air-gapped node)
    LORAPLEX_E2E_REPORT       a JSON file for the figures (docs/benchmarks.md)
    LORAPLEX_E2E_LOGS         a folder for every Loraplex pod's log, kept before the namespaces go

The router Service is reached at its ClusterIP when this machine is the node (kube-proxy's rules
apply to it), else through `kubectl port-forward`, as the README does.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from dashboard import check_panel, queries
from helm_release import (
    CHART,
    CRDS,
    REAL_NODE,
    Release,
    e2e_values,
    keep_logs,
    port_forward,
    remove,
    service_address,
)
from kube import GROUP, get_json, kubectl
from loraplex_bench.closed_loop import ClosedLoop
from prometheus import Prometheus, Target, scrape_jobs
from tools import require_module, require_tool
from waiting import wait_for

from loraplex.ports import free_port

pytestmark = REAL_NODE  # pytest.mark.cluster, run only with LORAPLEX_E2E_NODE and KUBECONFIG set

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart-cpu"
POOL = "tiny"
RUN = uuid.uuid4().hex[:5]
RELEASE, SYSTEM_NS, USER_NS = "loraplex", f"lpx-{RUN}", f"lpx-qs-{RUN}"
ROUTER = "loraplex-router"  # the release name holds the chart's, so objects are named loraplex-<part>
READY_TIMEOUT_S = 900  # image start, model generation, the CPU kernel's first build, on 2 cores


def _adapters() -> list[str]:
    docs = yaml.safe_load_all((QUICKSTART / "loradeployments.yaml").read_text())
    return [d["metadata"]["name"] for d in docs if d]


ADAPTERS = _adapters()


@pytest.fixture(scope="module")
def report() -> Iterator[dict[str, Any]]:
    figures: dict[str, Any] = {"run": RUN}
    yield figures
    if os.environ.get("LORAPLEX_E2E_REPORT"):
        Path(os.environ["LORAPLEX_E2E_REPORT"]).write_text(json.dumps(figures, indent=2))


@pytest.fixture(scope="module")
def images(report: dict[str, Any]) -> None:
    flags = os.environ.get("LORAPLEX_E2E_BUILD_FLAGS")
    if flags is None:
        return
    out = subprocess.run([str(ROOT / "scripts" / "build-images.sh"), *shlex.split(flags)], cwd=ROOT,
                         capture_output=True, text=True, timeout=5400)
    assert out.returncode == 0, out.stderr[-6000:]
    report["images"] = [dict(zip(("image", "size", "build"), line.split("\t"), strict=True))
                        for line in out.stdout.splitlines() if line.count("\t") == 2]


@dataclass
class Outcomes:
    """What a closed loop of clients saw: completed requests, and failures before or after the first
    streamed chunk (only the latter may happen when a server goes away)."""

    ok: int = 0
    lost: list[str] = field(default_factory=list)
    broken_streams: list[str] = field(default_factory=list)


class Traffic(ClosedLoop):
    """Clients sending plain and streamed completions to every adapter until the `with` block ends."""

    def __init__(self, url: str, clients: int = 3) -> None:
        super().__init__(clients)
        self.url, self.outcomes = url, Outcomes()

    def session(self) -> AbstractContextManager[openai.OpenAI]:
        return nullcontext(_client(self.url))

    def send(self, session: openai.OpenAI, i: int) -> None:
        model, stream, started = ADAPTERS[i % len(ADAPTERS)], i % 2 == 0, False
        try:
            if stream:
                for _chunk in session.completions.create(model=model, prompt="def f(x):", max_tokens=16, stream=True):
                    started = True
            else:
                session.completions.create(model=model, prompt="def f(x):", max_tokens=16)
        except openai.OpenAIError as exc:
            with self.lock:
                (self.outcomes.broken_streams if started else self.outcomes.lost).append(f"{model}: {exc}")
            return
        with self.lock:
            self.outcomes.ok += 1


@contextmanager
def _router_url() -> Iterator[str]:
    """The router Service: its ClusterIP where this machine reaches it (it is the node), else a
    `kubectl port-forward` to it."""
    with service_address(SYSTEM_NS, ROUTER, 80) as address:
        yield f"http://{address}"


@contextmanager
def _port_forward() -> Iterator[str]:
    with port_forward(SYSTEM_NS, ROUTER, 80) as address:
        yield f"http://{address}"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _serves(url: str, model: str) -> bool:
    """Whether one completion of `model` succeeds; why not is printed (pytest shows it on a failure)."""
    try:
        return bool(_client(url).completions.create(model=model, prompt="def", max_tokens=2).choices)
    except openai.OpenAIError as exc:
        print(f"{time.strftime('%H:%M:%S')} {model}: {type(exc).__name__}: {exc}")
        return False


def _phases() -> dict[str, str]:
    items = get_json(f"loradeployments.{GROUP}", namespace=USER_NS).get("items", [])
    return {i["metadata"]["name"]: (i.get("status") or {}).get("phase", "") for i in items}


def _pool_status() -> dict[str, Any]:
    return get_json(f"adapterpools.{GROUP}", POOL, namespace=USER_NS).get("status") or {}


def _ready_agents() -> int:
    sts = get_json("statefulset", POOL, namespace=USER_NS)
    return (sts.get("status") or {}).get("readyReplicas", 0)


@pytest.fixture(scope="module")
def release(images: None, report: dict[str, Any]) -> Iterator[Release]:
    chart = Release(RELEASE, SYSTEM_NS, e2e_values())
    started = time.monotonic()
    chart.install()
    report["install_s"] = round(time.monotonic() - started, 1)
    report["install_started"] = started
    try:
        yield chart
    finally:
        keep_logs(SYSTEM_NS, USER_NS)
        remove(chart, USER_NS, USER_NS, SYSTEM_NS)


@pytest.fixture(scope="module")
def quickstart(release: Release, report: dict[str, Any]) -> Iterator[str]:
    """The quick start applied as the README says (in a namespace of its own, away from the chart's),
    every LoRADeployment Ready, and the router Service's URL."""
    kubectl("create", "namespace", USER_NS)
    kubectl("apply", "-f", str(QUICKSTART), namespace=USER_NS)
    wait_for("every LoRADeployment Ready", lambda: set(_phases().values()) == {"Ready"} and len(_phases()) == 4,
             timeout=READY_TIMEOUT_S, interval=2)
    report["ready_after_install_s"] = round(time.monotonic() - report["install_started"], 1)
    with _router_url() as url:
        wait_for("a first completion", lambda: _serves(url, ADAPTERS[0]), timeout=120)
        report["first_completion_after_install_s"] = round(time.monotonic() - report["install_started"], 1)
        yield url


def test_every_adapter_serves_completions_and_streams(quickstart: str) -> None:
    client = _client(quickstart)
    served = {m.id for m in client.models.list().data}
    assert set(ADAPTERS) | {POOL} <= served
    for model in [*ADAPTERS, POOL]:
        text = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=8, temperature=0)
        assert text.usage.completion_tokens > 0, model
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8, stream=True))
        assert chunks and chunks[-1].choices[-1].finish_reason in {"length", "stop"}, model
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=1)


def test_the_port_forward_of_the_readme_reaches_the_router(quickstart: str) -> None:
    with _port_forward() as url:
        wait_for("the port-forward", lambda: _serves(url, ADAPTERS[1]), timeout=60)


def _targets(service_ns: str, service_name: str, port_name: str) -> list[Target]:
    """The Service's pods on its named port, as Prometheus' endpoints role would discover them."""
    service = get_json("service", service_name, namespace=service_ns)
    target_port = next(p for p in service["spec"]["ports"] if p["name"] == port_name)["targetPort"]
    selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
    pods = [p for p in get_json("pods", "-l", selector, namespace=service_ns).get("items", []) if p["status"].get("podIP")]
    return [Target(address=f"{pod['status']['podIP']}:{_container_port(pod, target_port)}", namespace=service_ns,
                   service=service_name, pod=pod["metadata"]["name"], port_name=port_name,
                   service_labels=service["metadata"].get("labels", {}), pod_labels=pod["metadata"].get("labels", {}))
            for pod in pods]


def _container_port(pod: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", []) if p.get("name") == port)


def test_the_dashboard_queries_are_answered_by_a_prometheus_scraping_the_pods(quickstart: str, tmp_path) -> None:
    binary = require_tool("prometheus", "apt-get install prometheus")
    helm = require_module("helm_python", "helm-python-sdk, Helm's library: pip install -e '.[dev]'")
    values = {**e2e_values(), "metrics": {"serviceMonitor": {"enabled": True, "interval": "1s"}}}
    rendered = helm.Chart.load(str(CHART)).render(values=values, name=RELEASE, namespace=SYSTEM_NS)
    monitors = [d for path, text in rendered.items() if not path.endswith("NOTES.txt")
                for d in yaml.safe_load_all(text) if d and d["kind"] == "ServiceMonitor"]
    targets = _targets(SYSTEM_NS, ROUTER, "http") + _targets(USER_NS, POOL, "http")
    jobs = [job for monitor in monitors for job in scrape_jobs(monitor, targets)]
    server = Prometheus(binary, jobs, tmp_path, free_port()).start()
    try:
        for _ in range(2):
            with Traffic(quickstart, clients=2):
                time.sleep(4)
            server.wait_scraped_since(time.time(), jobs=2, timeout_s=60)
        for title, expr in queries():
            check_panel(server, title, expr, POOL)
    finally:
        server.stop()


def test_an_agent_pod_deleted_under_traffic_loses_no_request_and_rejoins(quickstart: str, report) -> None:
    with Traffic(quickstart) as traffic:
        time.sleep(3)
        kubectl("delete", "pod", f"{POOL}-0", "--wait=false", namespace=USER_NS)
        wait_for("the pod to go", lambda: _ready_agents() < 2, timeout=120)
        time.sleep(5)
    outcomes = traffic.outcomes
    report["agent_deleted"] = {"ok": outcomes.ok, "lost": len(outcomes.lost), "broken_streams": len(outcomes.broken_streams)}
    assert outcomes.ok > 0 and outcomes.lost == [], outcomes.lost[:5]
    wait_for("the pod to come back Ready", lambda: _ready_agents() == 2, timeout=READY_TIMEOUT_S, interval=2)
    wait_for("the pool to count it", lambda: _pool_status().get("readyReplicas") == 2, timeout=120)
    with Traffic(quickstart) as traffic:
        time.sleep(5)
    assert traffic.outcomes.lost == [] and traffic.outcomes.broken_streams == []


def test_an_agent_pod_killed_under_traffic_loses_no_request_before_its_first_byte(quickstart: str, report) -> None:
    """No grace: the container is killed with its requests; those not yet answered are retried on
    the other server, only streams already under way may break."""
    with Traffic(quickstart) as traffic:
        time.sleep(3)
        kubectl("delete", "pod", f"{POOL}-1", "--grace-period=0", "--force", namespace=USER_NS)
        time.sleep(10)
    outcomes = traffic.outcomes
    report["agent_killed"] = {"ok": outcomes.ok, "lost": len(outcomes.lost), "broken_streams": len(outcomes.broken_streams)}
    assert outcomes.ok > 0 and outcomes.lost == [], outcomes.lost[:5]
    wait_for("the pod to come back Ready", lambda: _ready_agents() == 2, timeout=READY_TIMEOUT_S, interval=2)


def test_a_restarted_operator_takes_over_and_readies_a_new_adapter(quickstart: str, report) -> None:
    kubectl("delete", "pod", "-l", "app.kubernetes.io/component=operator", "--wait=true", namespace=SYSTEM_NS)
    kubectl("rollout", "status", "deployment/loraplex-operator", "--timeout=300s", namespace=SYSTEM_NS)
    started = time.monotonic()
    doc = next(d for d in yaml.safe_load_all((QUICKSTART / "loradeployments.yaml").read_text()) if d)
    doc["metadata"]["name"] = "lora00-copy"
    kubectl("apply", "-f", "-", namespace=USER_NS, stdin=yaml.safe_dump(doc))
    wait_for("the new adapter Ready", lambda: _phases().get("lora00-copy") == "Ready", timeout=180, interval=1)
    wait_for("the new adapter served", lambda: _serves(quickstart, "lora00-copy"), timeout=60)
    report["new_adapter_after_operator_restart_s"] = round(time.monotonic() - started, 1)


def test_serving_resumes_after_a_redis_restart(quickstart: str, report) -> None:
    kubectl("delete", "pod", "-l", "app.kubernetes.io/component=redis", "--wait=true", namespace=SYSTEM_NS)
    started = time.monotonic()
    kubectl("rollout", "status", "deployment/loraplex-redis", "--timeout=300s", namespace=SYSTEM_NS)
    wait_for("every adapter served again", lambda: all(_serves(quickstart, m) for m in ADAPTERS), timeout=180)
    report["serving_after_redis_restart_s"] = round(time.monotonic() - started, 1)


def test_the_pool_scales_up_and_down_without_losing_requests(quickstart: str) -> None:
    kubectl("patch", f"adapterpools.{GROUP}", POOL, "--type=merge", "-p", '{"spec":{"servers":{"replicas":3}}}',
            namespace=USER_NS)
    wait_for("a third agent Ready", lambda: _ready_agents() == 3, timeout=READY_TIMEOUT_S, interval=2)
    wait_for("the pool to count it", lambda: _pool_status().get("readyReplicas") == 3, timeout=120)
    with Traffic(quickstart) as traffic:
        kubectl("patch", f"adapterpools.{GROUP}", POOL, "--type=merge", "-p", '{"spec":{"servers":{"replicas":2}}}',
                namespace=USER_NS)
        wait_for("back to two agents", lambda: len(get_json("pods", "-l", f"loraplex.io/pool={POOL}",
                                                             namespace=USER_NS).get("items", [])) == 2, timeout=180)
        time.sleep(3)
    assert traffic.outcomes.ok > 0 and traffic.outcomes.lost == [], traffic.outcomes.lost[:5]


def test_a_deleted_adapter_is_no_longer_served(quickstart: str) -> None:
    kubectl("delete", f"loradeployments.{GROUP}", "lora00-copy", ADAPTERS[-1], namespace=USER_NS)
    wait_for("the router to forget them", lambda: not _serves(quickstart, ADAPTERS[-1]), timeout=120)
    with pytest.raises(openai.NotFoundError):
        _client(quickstart).completions.create(model="lora00-copy", prompt="x", max_tokens=1)
    assert all(_serves(quickstart, m) for m in ADAPTERS[:-1])


def test_helm_upgrade_rolls_the_routers_to_a_changed_value(quickstart: str, release: Release) -> None:
    keep_logs(SYSTEM_NS, USER_NS)  # the routers so far: the upgrade replaces them
    upgraded = release.upgrade({"router": {**release.values["router"], "ttfbDeadline": 20}})
    assert upgraded["status"] == "deployed" and upgraded["revision"] == 2
    kubectl("rollout", "status", f"deployment/{ROUTER}", "--timeout=300s", namespace=SYSTEM_NS)
    router = get_json("deployment", ROUTER, namespace=SYSTEM_NS)
    assert "--ttfb-deadline=20" in router["spec"]["template"]["spec"]["containers"][0]["args"]
    wait_for("serving after the upgrade", lambda: all(_serves(quickstart, m) for m in ADAPTERS[:-1]), timeout=120)


def test_helm_uninstall_keeps_the_crds_and_the_users_objects(quickstart: str, release: Release) -> None:
    keep_logs(SYSTEM_NS, USER_NS)  # the routers' and Redis' logs go with the release
    release.uninstall()
    for crd in CRDS:
        assert "deletionTimestamp" not in get_json("crd", crd)["metadata"], crd
    assert _pool_status() and set(_phases()) == set(ADAPTERS[:-1])
    wait_for("the release's workloads to go", lambda: not kubectl("get", "deployment", "-o", "name",
                                                                   namespace=SYSTEM_NS).stdout.strip(), timeout=120)
