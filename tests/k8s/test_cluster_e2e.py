"""End to end against a real API server (runs only when KUBECONFIG is set, e.g. a kind cluster):
install the CRDs, run `loraplex operator` on this machine with a local redis-server, apply a pool and
two adapters, and see the StatefulSet, the statuses and the routing table.

No GPU pods need to start: the test heartbeats two server records into the pool's registry, as the
agents of llama3-0 and llama3-1 would, so placement has servers to use.

    KUBECONFIG=~/.kube/config pytest -m cluster tests/k8s/test_cluster_e2e.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs KUBECONFIG (a real cluster)")]

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION = "loraplex.io", "v1alpha1"


def _wait(what: str, probe: Callable[[], Any], timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(1.0)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def namespace() -> Iterator[str]:
    from kubernetes import client, config

    config.load_kube_config()
    subprocess.run(["kubectl", "apply", "--server-side", "-f", str(ROOT / "crds")], check=True)
    name = f"loraplex-e2e-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api()
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


@pytest.fixture
def operator(namespace: str, redis_url: str) -> Iterator[None]:
    env = {**os.environ, "LORAPLEX_REDIS_URL": redis_url, "LORAPLEX_TICK_SECONDS": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "operator", "--standalone",
                             f"--namespace={namespace}", "--liveness=http://127.0.0.1:0/healthz"], env=env)
    yield
    proc.terminate()
    proc.wait(timeout=30)


def _custom(kind_plural: str, namespace: str, body: dict[str, Any]) -> None:
    from kubernetes import client

    client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, kind_plural, body)


def _status(kind_plural: str, namespace: str, name: str) -> dict[str, Any]:
    from kubernetes import client

    obj = client.CustomObjectsApi().get_namespaced_custom_object(GROUP, VERSION, namespace, kind_plural, name)
    return obj.get("status") or {}


def test_pool_and_two_adapters(namespace: str, operator: None, redis_url: str) -> None:
    from kubernetes import client

    from loraplex.routing import ServerRecord
    from loraplex.routing.redis_store import RedisRoutingStore

    _custom("adapterpools", namespace, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "AdapterPool", "metadata": {"name": "llama3"},
        "spec": {"baseModel": {"name": "tiny", "source": "file:///models/tiny"},
                 "servers": {"replicas": 2, "minReplicas": 2, "maxReplicas": 2, "gpusPerServer": 0},
                 "placement": {"intervalSeconds": 5}}})
    sts = _wait("the StatefulSet", lambda: _read_sts(namespace))
    assert sts.spec.replicas == 2 and sts.spec.service_name == "llama3"

    store = RedisRoutingStore.from_url(redis_url, "llama3")
    for i in range(2):
        store.register_server(ServerRecord(f"llama3-{i}", f"http://llama3-{i}:8000", 64), ttl_s=300)
    for name, digest in (("sql", "a"), ("chat", "b")):
        _custom("loradeployments", namespace, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "LoRADeployment", "metadata": {"name": name},
            "spec": {"pool": "llama3", "adapter": {"source": f"s3://bucket/{name}", "sha256": digest * 64, "rank": 8}}})
    for name in ("sql", "chat"):
        status = _wait(f"{name} placed", lambda n=name: (s := _status("loradeployments", namespace, n)).get("weights") and s)
        assert status["phase"] == "Loading" and status["rank"] == 8
    table = store.read_table()
    assert set(table.entries) == {"sql", "chat"}
    pool = _wait("pool status", lambda: _status("adapterpools", namespace, "llama3").get("routingVersion") and
                 _status("adapterpools", namespace, "llama3"))
    assert pool["adapters"] == 2

    client.CustomObjectsApi().delete_namespaced_custom_object(GROUP, VERSION, namespace, "loradeployments", "sql")
    _wait("sql out of the table", lambda: "sql" not in (store.read_table().entries))
    store.close()


def _read_sts(namespace: str) -> Any:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        return client.AppsV1Api().read_namespaced_stateful_set("llama3", namespace)
    except ApiException:
        return None
