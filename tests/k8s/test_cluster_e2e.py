"""End to end against a real API server (runs only when KUBECONFIG is set): install the CRDs as the
docs say (`kubectl apply --server-side -f crds/`), run `loraplex operator` on this machine with a
local redis-server, and use the cluster as a user would, with kubectl and the Kubernetes client.

No GPU pods need to start, and no kubelet either: test agents heartbeat server records into the
pool's registry, as the agents of `<pool>-0`, `<pool>-1` would, and mark those pods Ready through
the pod status subresource (a server serves only with a Ready pod and a fresh heartbeat).

    KUBECONFIG=~/.kube/config pytest -m cluster tests/k8s/test_cluster_e2e.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube import kubectl
from waiting import wait_for

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs KUBECONFIG (a real cluster)")]

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION = "loraplex.io", "v1alpha1"
DIGEST = "e" * 64


@pytest.fixture(scope="session")
def crds() -> None:
    """The documented install without Helm: every CRD in crds/, kopf's peering CRDs among them."""
    from kubernetes import config

    config.load_kube_config()
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    for crd in ("adapterpools.loraplex.io", "loradeployments.loraplex.io", "clusterkopfpeerings.kopf.dev"):
        kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")


@pytest.fixture
def namespace(crds: None) -> Iterator[str]:
    name = f"loraplex-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


class Operator:
    """`loraplex operator` as a process; its log is checked for tracebacks when it stops."""

    def __init__(self, namespace: str, redis_url: str, log: Path, *extra: str) -> None:
        env = {**os.environ, "LORAPLEX_REDIS_URL": redis_url, "LORAPLEX_TICK_SECONDS": "1",
               "LORAPLEX_PEERING": f"e2e-{namespace}"}
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "operator", f"--namespace={namespace}",
                                      "--liveness=http://127.0.0.1:0/healthz", *extra],
                                     env=env, stdout=self._out, stderr=subprocess.STDOUT)

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._out.close()
        return self.log.read_text()


@pytest.fixture
def start_operator(namespace: str, redis_url: str, tmp_path: Path) -> Iterator[Callable[..., Operator]]:
    started: list[Operator] = []

    def start(*extra: str) -> Operator:
        op = Operator(namespace, redis_url, tmp_path / f"operator-{len(started)}.log", *extra)
        started.append(op)
        return op

    yield start
    if started:  # what carries the operator's finalizers goes while the operator still runs
        kubectl("delete", "loradeployments.loraplex.io,adapterpools.loraplex.io", "--all", "--timeout=90s",
                namespace=namespace, check=False)
    for op in started:
        log = op.stop()
        assert "Traceback" not in log, log[-4000:]


@pytest.fixture
def operator(start_operator: Callable[..., Operator]) -> Operator:
    return start_operator("--standalone")


def apply(namespace: str, *objects: dict[str, Any]) -> None:
    kubectl("apply", "-f", "-", namespace=namespace, stdin=yaml.safe_dump_all(objects))


def pool(name: str = "tiny", **spec: Any) -> dict[str, Any]:
    body = {"baseModel": {"name": "tiny", "source": "file:///models/tiny"},
            # No node matches: on a cluster with a real node no kubelet runs (or reports on) these
            # pods, so the test agents' status patches stand (test_real_node.py runs real pods).
            "servers": {"minReplicas": 2, "maxReplicas": 2, "gpusPerServer": 0,
                        "nodeSelector": {"loraplex.io/e2e": "stand-in-agents"}},
            "placement": {"intervalSeconds": 5, "autoscale": False}}
    for section, values in spec.items():
        body[section] = {**body.get(section, {}), **values}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "AdapterPool", "metadata": {"name": name}, "spec": body}


def adapter(name: str, rank: int = 8, pool_name: str = "tiny", source: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"pool": pool_name, "adapter": {"source": source or f"file:///adapters/{name}"}}
    if source is None:
        spec["adapter"] |= {"sha256": DIGEST, "rank": rank}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LoRADeployment", "metadata": {"name": name}, "spec": spec}


def status(namespace: str, plural: str, name: str) -> dict[str, Any]:
    out = kubectl("get", f"{plural}.{GROUP}", name, "-o", "json", namespace=namespace, check=False)
    return (json.loads(out.stdout).get("status") or {}) if out.returncode == 0 else {}


def phase(namespace: str, name: str) -> tuple[str, str]:
    s = status(namespace, "loradeployments", name)
    return s.get("phase", ""), s.get("reason", "")


def statefulset(namespace: str, name: str = "tiny") -> dict[str, Any] | None:
    out = kubectl("get", "statefulset", name, "-o", "json", namespace=namespace, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


class Agents:
    """Test agents of one pool: they heartbeat (holding what the table assigns them) until stopped,
    and can mark their pods Ready."""

    def __init__(self, redis_url: str, namespace: str, pool_name: str = "tiny", servers: int = 2,
                 max_rank: int = 64) -> None:
        from loraplex.routing.redis_store import RedisRoutingStore

        self.namespace, self.pool, self.max_rank = namespace, pool_name, max_rank
        self.ids = [f"{pool_name}-{i}" for i in range(servers)]
        self.store = RedisRoutingStore.from_url(redis_url, pool_name)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from loraplex.routing import ServerRecord

        while not self._stop.is_set():
            table = self.store.read_table()
            for sid in self.ids:
                holds = tuple(table.assignments(sid)) if table else ()
                record = ServerRecord(sid, f"http://{sid}:8000", self.max_rank, host_adapters=holds,
                                      heartbeat_at=time.time())
                self.store.register_server(record, ttl_s=4)
            self._stop.wait(0.5)

    def pods_ready(self) -> None:
        body = json.dumps({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
        for sid in self.ids:
            wait_for(f"pod {sid}", lambda s=sid: kubectl("get", "pod", s, namespace=self.namespace, check=False)
                  .returncode == 0)
            kubectl("patch", "pod", sid, "--subresource=status", "--type=merge", "-p", body, namespace=self.namespace)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.store.close()


@pytest.fixture
def agents(redis_url: str, namespace: str) -> Iterator[Callable[..., Agents]]:
    made: list[Agents] = []

    def make(**kwargs: Any) -> Agents:
        made.append(Agents(redis_url, namespace, **kwargs))
        return made[-1]

    yield make
    for a in made:
        a.stop()


def test_the_path_without_helm_elects_a_leader_and_reconciles(namespace: str, start_operator: Callable[..., Operator]
                                                              ) -> None:
    start_operator()  # peering on: kopf's peering CRDs came from crds/
    apply(namespace, pool())
    sts = wait_for("the StatefulSet", lambda: statefulset(namespace))
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "tiny"


def test_standalone_reconciles(namespace: str, operator: Operator) -> None:
    apply(namespace, pool())
    wait_for("the StatefulSet", lambda: statefulset(namespace))


def test_a_statefulset_deleted_by_hand_comes_back(namespace: str, operator: Operator) -> None:
    apply(namespace, pool())
    first = wait_for("the StatefulSet", lambda: statefulset(namespace))
    kubectl("delete", "statefulset", "tiny", "--wait=true", namespace=namespace)
    again = wait_for("it again", lambda: (s := statefulset(namespace)) and s["metadata"]["uid"] != first["metadata"]["uid"]
                  and s)
    assert again["spec"]["replicas"] == 2


def test_both_example_pools_get_their_statefulset(namespace: str, operator: Operator) -> None:
    for example in ("adapterpool.yaml", "adapterpool-planner.yaml"):
        kubectl("apply", "-f", str(ROOT / "examples" / example), namespace=namespace)
    for name in ("llama3-8b", "tiny"):
        sts = wait_for(f"the StatefulSet {name}", lambda n=name: statefulset(namespace, n))
        volumes = [v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]]
        assert len(volumes) == len(set(volumes))
    time.sleep(3)
    assert status(namespace, "adapterpools", "tiny")["phase"] != "Failed"


def test_names_the_operator_cannot_use_are_refused(namespace: str, operator: Operator) -> None:
    for bad in ("a.b", "p" * 53):
        out = kubectl("apply", "-f", "-", namespace=namespace, check=False, stdin=yaml.safe_dump(pool(bad)))
        assert out.returncode != 0 and "name" in out.stderr, out.stderr
    longest = "p" * 52
    apply(namespace, pool(longest))
    wait_for("its pods", lambda: kubectl("get", "pod", f"{longest}-0", namespace=namespace, check=False).returncode == 0)


def test_an_unreachable_source_keeps_one_reason(namespace: str, operator: Operator) -> None:
    apply(namespace, pool(), adapter("far", source="https://127.0.0.1:1/far"))
    wait_for("a status", lambda: phase(namespace, "far")[0])
    seen = set()
    for _ in range(8):  # eight pool ticks
        seen.add(phase(namespace, "far"))
        time.sleep(1)
    assert seen == {("Pending", "SourceUnreachable")}
    events = kubectl("get", "events", "--field-selector", "involvedObject.name=far", "-o", "json",
                     namespace=namespace)
    assert [e["reason"] for e in json.loads(events.stdout)["items"]] == ["SourceUnreachable"]


def test_readiness_needs_a_ready_pod_and_a_heartbeat(namespace: str, operator: Operator,
                                                     agents: Callable[..., Agents]) -> None:
    apply(namespace, pool(), adapter("a"))
    wait_for("the StatefulSet", lambda: statefulset(namespace))
    serving = agents()  # heartbeats while the pods are Pending
    time.sleep(4)
    assert phase(namespace, "a")[0] == "Pending" and status(namespace, "adapterpools", "tiny")["readyReplicas"] == 0
    serving.pods_ready()
    wait_for("Ready", lambda: phase(namespace, "a") == ("Ready", "Serving"))
    columns = kubectl("get", "apool", "tiny", "--no-headers", namespace=namespace).stdout.split()
    assert columns[:6] == ["tiny", "Ready", "2", "2", "1", "1"]  # NAME PHASE READY SERVERS REQUIRED ADAPTERS


def test_pool_changes_reach_its_adapters(namespace: str, redis_url: str, operator: Operator,
                                         agents: Callable[..., Agents]) -> None:
    apply(namespace, pool(), adapter("big", rank=32))
    agents().pods_ready()
    wait_for("Ready", lambda: phase(namespace, "big") == ("Ready", "Serving"))
    apply(namespace, pool(engine={"maxLoraRank": 16}))
    wait_for("Failed", lambda: phase(namespace, "big") == ("Failed", "RankTooLarge"))
    columns = kubectl("get", "lora", "big", "--no-headers", namespace=namespace).stdout.split()
    assert columns[:4] == ["big", "tiny", "Failed", "32"]  # NAME POOL PHASE RANK

    from loraplex.routing.redis_store import RedisRoutingStore

    store = RedisRoutingStore.from_url(redis_url, "tiny")
    assert store.get_adapter("big") is None and "big" not in store.read_table().entries
    apply(namespace, pool(engine={"maxLoraRank": 64}))
    wait_for("Ready again", lambda: phase(namespace, "big") == ("Ready", "Serving"))
    store.close()


def test_a_deleted_pool_leaves_no_state(namespace: str, redis_url: str, operator: Operator,
                                        agents: Callable[..., Agents]) -> None:
    import redis

    apply(namespace, pool(), adapter("a"))
    serving = agents()
    serving.pods_ready()
    wait_for("Ready", lambda: phase(namespace, "a") == ("Ready", "Serving"))
    serving.stop()
    kubectl("delete", "apool", "tiny", "--timeout=60s", namespace=namespace)
    wait_for("PoolNotFound", lambda: phase(namespace, "a") == ("Pending", "PoolNotFound"))
    client = redis.Redis.from_url(redis_url)
    assert list(client.scan_iter(match="loraplex:{tiny}:*")) == []
    client.close()
    kubectl("delete", "lora", "a", "--timeout=60s", namespace=namespace)  # its finalizer completes


def test_deleting_the_namespace_completes(namespace: str, operator: Operator, agents: Callable[..., Agents]) -> None:
    apply(namespace, pool(), *(adapter(f"a{i}") for i in range(5)))
    agents().pods_ready()
    wait_for("Ready", lambda: all(phase(namespace, f"a{i}")[0] == "Ready" for i in range(5)))
    kubectl("delete", "namespace", namespace, "--timeout=120s")


def test_a_pools_routing_reaches_its_table_and_a_bad_one_fails_the_pool(namespace: str, redis_url: str,
                                                                         operator: Operator,
                                                                         agents: Callable[..., Agents]) -> None:
    from loraplex.routing.choice import RoutingChoice
    from loraplex.routing.redis_store import RedisRoutingStore

    unknown = kubectl("apply", "-f", "-", namespace=namespace, check=False,
                      stdin=yaml.safe_dump(pool(routing={"profile": "fastest"})))
    assert unknown.returncode != 0 and "fastest" in unknown.stderr, unknown.stderr  # the CRD's enum
    chosen = {"profile": "rank-aware", "options": {"slo_tpot_s": "0.05"}}
    apply(namespace, pool(routing=chosen), adapter("a"))
    agents().pods_ready()
    store = RedisRoutingStore.from_url(redis_url, "tiny")
    published = RoutingChoice("rank-aware", {"slo_tpot_s": "0.05"})
    wait_for("the table naming the pool's routing", lambda: (t := store.read_table()) is not None
          and t.routing == published)
    apply(namespace, pool(routing={"profile": "rank-aware", "options": {"slo_tpot_s": "fast"}}))
    ready = wait_for("Failed/InvalidRouting", lambda: next(
        (c for c in status(namespace, "adapterpools", "tiny").get("conditions", [])
         if c["type"] == "Ready" and c["reason"] == "InvalidRouting"), None))
    assert "slo_tpot_s='fast' is not a number" in ready["message"]
    assert status(namespace, "adapterpools", "tiny")["phase"] == "Failed"
    assert store.read_table().routing == published  # the routers keep the last good choice
    store.close()


def test_helm_install_upgrade_and_uninstall_keep_what_users_made(namespace: str) -> None:
    """The chart with Helm's own library (helm-python-sdk): install takes over the CRDs (`kubectl
    apply` installed them for the other tests; Helm adopts objects labelled for its release, as a
    user moving to the chart would), upgrade updates them, uninstall leaves the CRDs and the users'
    objects in place."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's library) is not installed")
    crds = [f"{p}.loraplex.io" for p in ("adapterpools", "loradeployments")] + \
        [f"{p}.kopf.dev" for p in ("clusterkopfpeerings", "kopfpeerings")]
    release = f"lp-{namespace[-6:]}"
    for crd in crds:
        kubectl("label", "--overwrite", "crd", crd, "app.kubernetes.io/managed-by=Helm")
        kubectl("annotate", "--overwrite", "crd", crd, f"meta.helm.sh/release-name={release}",
                f"meta.helm.sh/release-namespace={namespace}")
    chart = str(ROOT / "helm" / "loraplex")
    with helm.Config(kubeconfig_path=os.environ["KUBECONFIG"], namespace=namespace) as cfg:
        installed = cfg.install(chart, release, {}, namespace=namespace, timeout=120)
        assert installed["status"] == "deployed"
        for kind in ("deployment", "service", "configmap"):
            assert kubectl("get", kind, "-l", f"app.kubernetes.io/instance={release}", "-o", "name",
                           namespace=namespace).stdout.strip(), kind
        apply(namespace, pool(), adapter("a"))
        upgraded = cfg.upgrade(chart, release, {"router": {"replicas": 1}}, namespace=namespace, timeout=120)
        assert upgraded["status"] == "deployed" and upgraded["revision"] == 2
        cfg.uninstall(release, timeout=120)
    for crd in crds:
        kept = json.loads(kubectl("get", "crd", crd, "-o", "json").stdout)
        assert "deletionTimestamp" not in kept["metadata"]
    assert kubectl("get", "apool", "tiny", namespace=namespace).returncode == 0
    assert kubectl("get", "lora", "a", namespace=namespace).returncode == 0
    assert not kubectl("get", "deployment", "-o", "name", namespace=namespace).stdout.strip()
