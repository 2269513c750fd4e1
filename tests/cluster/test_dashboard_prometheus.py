"""The chart's Grafana dashboard against a real Prometheus that scrapes a real local stack.

The chart is rendered with its ServiceMonitors on; each becomes a Prometheus scrape job with the
relabelings the Prometheus Operator would generate (tests/support/prometheus.py). The targets are the
stack's router and agents, carrying the Service and pod labels the chart (router) and the operator
(agents) give them, so the monitors' selectors and relabelings are what decides what is scraped and
how it is labelled. After some traffic through the router, every query of every panel (and of every
template variable) must return at least one series, with the labels it groups by."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from dashboard import check_panel, dashboard, queries
from prometheus import Prometheus, Target, scrape_jobs
from tools import require_module, require_tool

from loraplex.ports import free_port_block

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "loraplex"
POOL = "tiny"
RELEASE, RELEASE_NAMESPACE, POOL_NAMESPACE = "lp", "serving", "team-a"
ADAPTERS = [f"ad{i}" for i in range(4)]

helm = require_module("helm_python", "helm-python-sdk, Helm's engine: pip install -e '.[dev]'")


def _stack_manifests(folder: Path, tiny_model) -> None:
    (folder / "pool.yaml").write_text(
        "apiVersion: loraplex.io/v1alpha1\nkind: AdapterPool\nmetadata: {name: tiny}\nspec:\n"
        f"  baseModel: {{name: tiny-llama, source: \"file://{tiny_model.base_dir}\", dtype: float32}}\n"
        "  engine: {maxLoraRank: 64, maxLoras: 2, maxNumSeqs: 4, maxModelLen: 128}\n")
    sources = list(tiny_model.adapters.values())
    for i, name in enumerate(ADAPTERS):  # on both agents, so both are picked and both serve adapters
        (folder / f"{name}.yaml").write_text(
            f"apiVersion: loraplex.io/v1alpha1\nkind: LoRADeployment\nmetadata: {{name: {name}}}\n"
            f"spec:\n  pool: {POOL}\n  adapter: {{source: \"file://{sources[i]}\"}}\n  replicas: {{min: 2}}\n")


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, free_port) -> Iterator[Any]:
    from loraplex_local.stack import StackConfig, running_stack

    folder = tmp_path_factory.mktemp("dashboard-manifests")
    _stack_manifests(folder, tiny_model)
    config = StackConfig(agents=2, manifests=folder, router_port=free_port(), agent_base_port=free_port_block(2),
                         redis_port=free_port(), heartbeat_interval_s=0.5, heartbeat_ttl_s=3.0,
                         workdir=tmp_path_factory.mktemp("dashboard-stack"), agent_args=["--num-blocks", "200"])
    with running_stack(config) as stack:
        yield stack


def _render_chart() -> list[dict[str, Any]]:
    values = {"metrics": {"serviceMonitor": {"enabled": True, "interval": "1s"}}, "router": {"pool": POOL}}
    out = helm.Chart.load(str(CHART)).render(values=values, name=RELEASE, namespace=RELEASE_NAMESPACE)
    return [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]


def _router_target(docs: list[dict[str, Any]], stack) -> Target:
    """The router as the chart deploys it: its Service's labels and port, its pods' labels."""
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-router"))
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
    return Target(address=stack.router_url.removeprefix("http://"), namespace=RELEASE_NAMESPACE,
                  service=service["metadata"]["name"], pod=f"{deployment['metadata']['name']}-7d9f8-x2x4z",
                  port_name=service["spec"]["ports"][0]["name"], service_labels=service["metadata"]["labels"],
                  pod_labels=deployment["spec"]["template"]["metadata"]["labels"])


def _agent_targets(stack) -> list[Target]:
    """Each agent as the operator deploys it: the pool's headless Service, the StatefulSet's pods
    (pod name = server id)."""
    from loraplex_operator.config import OperatorConfig
    from loraplex_operator.pool_objects import PoolRef, build_service, build_statefulset

    ref = PoolRef(POOL, POOL_NAMESPACE, "uid-1")
    service = build_service(ref)
    config = OperatorConfig(redis_url="redis://redis:6379/0", agent_image="agent:1")
    pods = build_statefulset(ref, stack.manifests.pool.spec, config, len(stack.agents))["spec"]["template"]
    return [Target(address=stack.agent_url(server).removeprefix("http://"), namespace=POOL_NAMESPACE,
                   service=service["metadata"]["name"], pod=server, port_name=service["spec"]["ports"][0]["name"],
                   service_labels=service["metadata"]["labels"], pod_labels=pods["metadata"]["labels"])
            for server in stack.agents]


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory, free_port) -> Iterator[Prometheus]:
    binary = require_tool("prometheus", "apt-get install prometheus")
    docs = _render_chart()
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    targets = [_router_target(docs, stack), *_agent_targets(stack)]
    jobs = [job for monitor in monitors for job in scrape_jobs(monitor, targets)]
    server = Prometheus(binary, jobs, tmp_path_factory.mktemp("prometheus"), free_port()).start()
    try:
        yield server
    finally:
        server.stop()


def _traffic(stack, rounds: int) -> None:
    """Plain and streamed requests to every adapter and the base model, and one unknown model."""
    client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for _ in range(rounds):
        for model in [*ADAPTERS, "tiny-llama"]:
            client.completions.create(model=model, prompt="def add(a, b):", max_tokens=4, temperature=0)
            chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, stream=True)
            assert list(chunks)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-adapter", prompt="x", max_tokens=1)


@pytest.fixture(scope="module")
def scraped(stack, prometheus) -> Prometheus:
    """Prometheus after two rounds of traffic, each followed by a scrape of every target, so that
    every counter has grown between two samples."""
    with ThreadPoolExecutor(2) as clients:
        for _ in range(2):
            for done in [clients.submit(_traffic, stack, 1) for _ in range(2)]:
                done.result()
            prometheus.wait_scraped_since(time.time(), jobs=2)
    return prometheus


def test_every_target_is_selected_by_its_service_monitor(scraped, stack):
    """The routers' monitor picks the router only, the agents' monitor every agent (in another
    namespace), and the relabelings give each series its pool (and each agent its server)."""
    by_job: dict[str, set[str]] = {}
    for target in scraped.active_targets():
        labels = target["labels"]
        assert labels["pool"] == POOL, labels
        by_job.setdefault(target["scrapePool"], set()).add(labels.get("server") or labels["service"])
    assert sorted(by_job.values(), key=len) == [{f"{RELEASE}-loraplex-router"}, set(stack.agents)], by_job


def test_template_variables_have_values(scraped):
    variables = {v["name"]: v for v in dashboard()["templating"]["list"] if v["type"] == "query"}
    assert set(variables) == {"pool", "adapter"}
    for name, variable in variables.items():
        metric, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"]).groups()
        values = scraped.label_values(label, metric)
        assert values, name
    assert scraped.label_values("pool", "vllm:num_requests_running") == [POOL]
    assert set(ADAPTERS) <= set(scraped.label_values("model", "loraplex_router_requests_total"))


@pytest.mark.parametrize("title, expr", queries(), ids=[title for title, _ in queries()])
def test_every_panel_query_returns_series(scraped, title: str, expr: str):
    """The pool variable set to the stack's pool (a router series without a pool label would vanish
    here), the adapter variable to All."""
    check_panel(scraped, title, expr, POOL)
