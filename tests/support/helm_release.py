"""The chart as the real-node tests install it (tests/k8s/test_real_node.py, test_gateway_node.py): with
Helm's own library, as `helm install` would, into a namespace of the test's, with the CPU quick
start's values and LORAPLEX_E2E_VALUES on top."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube import GROUP, get_json, kubectl
from tools import require_module

from loraplex.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "loraplex"
# The marks of a test that needs a cluster with a node that runs the images (`pytestmark = REAL_NODE`)
REAL_NODE = [pytest.mark.cluster, pytest.mark.skipif(
    not (os.environ.get("KUBECONFIG") and os.environ.get("LORAPLEX_E2E_NODE")),
    reason="needs LORAPLEX_E2E_NODE=1 and KUBECONFIG naming a cluster with a node that runs the images")]
CRDS = ["adapterpools.loraplex.io", "loradeployments.loraplex.io", "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev"]


def e2e_values(**more: Any) -> dict[str, Any]:
    """examples/helm/values-cpu.yaml, then LORAPLEX_E2E_VALUES (a YAML file of more values, e.g.
    redis.image on an air-gapped node), then `more`; a mapping merges one level deep."""
    values: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "helm" / "values-cpu.yaml").read_text())
    extra = os.environ.get("LORAPLEX_E2E_VALUES")
    layers = [yaml.safe_load(Path(extra).read_text()) if extra else {}, more]
    for layer in layers:
        for key, value in layer.items():
            values[key] = {**values.get(key, {}), **value} if isinstance(value, dict) else value
    return values


class Release:
    """One release of the chart, installed with Helm's own library."""

    def __init__(self, name: str, namespace: str, values: dict[str, Any]) -> None:
        self.helm = require_module("helm_python", "helm-python-sdk, Helm's library: pip install -e '.[dev]'")
        self.name, self.namespace, self.values = name, namespace, values
        self.installed = False

    def config(self):  # noqa: ANN201 (helm_python's Config)
        return self.helm.Config(kubeconfig_path=os.environ["KUBECONFIG"], namespace=self.namespace)

    def install(self) -> None:
        adopt_existing_crds(self.name, self.namespace)
        with self.config() as cfg:
            assert cfg.install(str(CHART), self.name, self.values, namespace=self.namespace, create_namespace=True,
                               timeout=300)["status"] == "deployed"
        self.installed = True

    def upgrade(self, values: dict[str, Any]) -> dict[str, Any]:
        self.values = {**self.values, **values}
        with self.config() as cfg:
            return cfg.upgrade(str(CHART), self.name, self.values, namespace=self.namespace, timeout=300)

    def uninstall(self) -> None:
        with self.config() as cfg:
            cfg.uninstall(self.name, timeout=300)
        self.installed = False


def adopt_existing_crds(release: str, namespace: str) -> None:
    """CRDs another install left (they are kept on uninstall; `kubectl apply --server-side -f crds/`
    made them for test_cluster_e2e.py) join this release, as Helm requires: its labels, and their
    fields owned by Helm's field manager (helm-python-sdk's Helm applies as the process' name), so that
    a changed CRD installs and upgrades without a server-side-apply conflict with kubectl."""
    existing = [crd for crd in CRDS if kubectl("get", "crd", crd, check=False).returncode == 0]
    if existing:  # first the fields (this drops the labels Helm's manager set before), then the labels
        kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={Path(sys.executable).name}",
                "-f", str(CHART / "files" / "crds"))
    for crd in existing:
        kubectl("label", "--overwrite", "crd", crd, "app.kubernetes.io/managed-by=Helm")
        kubectl("annotate", "--overwrite", "crd", crd, f"meta.helm.sh/release-name={release}",
                f"meta.helm.sh/release-namespace={namespace}")


def remove(chart: Release, pool_namespace: str, *namespaces: str) -> None:
    """Removes what a test left: the pools and adapters of `pool_namespace` while the release's operator
    still finalizes them, the release, the finalizers of what is left, then the namespaces."""
    if chart.installed:
        kubectl("delete", f"loradeployments.{GROUP},adapterpools.{GROUP}", "--all", "--timeout=120s",
                namespace=pool_namespace, check=False)
        chart.uninstall()
    for kind in (f"loradeployments.{GROUP}", f"adapterpools.{GROUP}"):  # no operator left to finalize
        for name in kubectl("get", kind, "-o", "name", namespace=pool_namespace, check=False).stdout.split():
            kubectl("patch", name, "--type=merge", "-p", '{"metadata":{"finalizers":[]}}', namespace=pool_namespace,
                    check=False)
    for ns in namespaces:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)


def keep_logs(*namespaces: str) -> None:
    """Every pod's log (and the previous container's) in these namespaces, into LORAPLEX_E2E_LOGS if set."""
    folder = os.environ.get("LORAPLEX_E2E_LOGS")
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    for ns in namespaces:
        for pod in kubectl("get", "pods", "-o", "name", namespace=ns, check=False).stdout.split():
            for previous in ("", "--previous"):
                out = kubectl("logs", pod, "--all-containers", *([previous] if previous else []), namespace=ns,
                              check=False)
                if out.stdout:
                    name = f"{ns}_{pod.removeprefix('pod/')}{previous.replace('--', '_')}.log"
                    (Path(folder) / name).write_text(out.stdout)


@contextmanager
def service_address(namespace: str, service: str, port: int) -> Iterator[str]:
    """`host:port` of a Service's port: its ClusterIP where this machine reaches it (it is the node:
    kube-proxy's rules apply to it), else a `kubectl port-forward` to it."""
    cluster_ip = get_json("service", service, namespace=namespace)["spec"]["clusterIP"]
    try:
        socket.create_connection((cluster_ip, port), timeout=3).close()
    except OSError:
        with port_forward(namespace, service, port) as address:
            yield address
        return
    yield f"{cluster_ip}:{port}"


@contextmanager
def port_forward(namespace: str, service: str, port: int) -> Iterator[str]:
    """`kubectl port-forward svc/<service>` to a local port, as the README does; `127.0.0.1:<port>`."""
    local = free_port()
    forward = subprocess.Popen(["kubectl", "-n", namespace, "port-forward", f"svc/{service}", f"{local}:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"127.0.0.1:{local}"
    finally:
        forward.terminate()
        forward.wait(10)
