"""A real Prometheus for tests, configured the way the Prometheus Operator configures it for a
ServiceMonitor: one scrape job per endpoint, whose relabelings select the Service's endpoints (its
labels, the port name, the namespaces) and then apply the monitor's own `relabelings`.

Kubernetes service discovery is replaced by static targets that carry the same `__meta_kubernetes_*`
labels the endpoints role would give them (a Service's and a pod's labels, the pod name, the port
name), so selection and relabeling run unchanged in Prometheus itself.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_RELABEL_KEYS = {"sourceLabels": "source_labels", "separator": "separator", "targetLabel": "target_label",
                 "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}


def sanitize(label: str) -> str:
    """A Kubernetes label name as Prometheus' service discovery spells it in a meta label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


@dataclass(frozen=True)
class Target:
    """One endpoint of a Service, as the Kubernetes endpoints role would discover it."""

    address: str
    namespace: str
    service: str
    pod: str
    port_name: str
    service_labels: Mapping[str, str] = field(default_factory=dict)
    pod_labels: Mapping[str, str] = field(default_factory=dict)

    def meta(self) -> dict[str, str]:
        labels = {"__meta_kubernetes_namespace": self.namespace, "__meta_kubernetes_service_name": self.service,
                  "__meta_kubernetes_pod_name": self.pod, "__meta_kubernetes_endpoint_port_name": self.port_name}
        for kind, values in (("service", self.service_labels), ("pod", self.pod_labels)):
            for name, value in values.items():
                labels[f"__meta_kubernetes_{kind}_label_{sanitize(name)}"] = value
                labels[f"__meta_kubernetes_{kind}_labelpresent_{sanitize(name)}"] = "true"
        return labels


def relabel_config(rule: Mapping[str, Any]) -> dict[str, Any]:
    """A ServiceMonitor RelabelConfig (camelCase) as Prometheus' relabel_config."""
    unknown = set(rule) - set(_RELABEL_KEYS)
    if unknown:
        raise ValueError(f"relabeling field(s) {sorted(unknown)} are not supported here")
    out = {_RELABEL_KEYS[key]: value for key, value in rule.items()}
    if "action" in out:
        out["action"] = str(out["action"]).lower()
    return out


def _selection(monitor: Mapping[str, Any], endpoint: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The operator's own relabelings: keep the matching Services' endpoints on the named port, then
    the standard target labels (namespace, service, pod, endpoint)."""
    spec = monitor["spec"]
    rules: list[dict[str, Any]] = []
    for name, value in spec["selector"].get("matchLabels", {}).items():
        rules.append({"action": "keep", "regex": f"({re.escape(value)});true",
                      "source_labels": [f"__meta_kubernetes_service_label_{sanitize(name)}",
                                        f"__meta_kubernetes_service_labelpresent_{sanitize(name)}"]})
    if spec["selector"].get("matchExpressions"):
        raise ValueError("selector.matchExpressions is not supported here")
    namespaces = spec.get("namespaceSelector", {})
    if not namespaces.get("any"):
        allowed = namespaces.get("matchNames") or [monitor["metadata"]["namespace"]]
        rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_namespace"],
                      "regex": "|".join(re.escape(n) for n in allowed)})
    rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                  "regex": re.escape(endpoint["port"])})
    for source, target in (("namespace", "namespace"), ("service_name", "service"), ("pod_name", "pod"),
                           ("service_name", "job")):
        rules.append({"source_labels": [f"__meta_kubernetes_{source}"], "target_label": target})
    rules.append({"target_label": "endpoint", "replacement": endpoint["port"]})
    return rules


def scrape_jobs(monitor: Mapping[str, Any], targets: Sequence[Target]) -> list[dict[str, Any]]:
    """Prometheus scrape jobs for a ServiceMonitor, over every candidate target."""
    meta = monitor["metadata"]
    jobs = []
    for i, endpoint in enumerate(monitor["spec"]["endpoints"]):
        jobs.append({
            "job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{i}",
            "scrape_interval": endpoint.get("interval", "15s"),
            "scrape_timeout": endpoint.get("scrapeTimeout", endpoint.get("interval", "10s")),
            "metrics_path": endpoint.get("path", "/metrics"),
            "static_configs": [{"targets": [t.address], "labels": t.meta()} for t in targets],
            "relabel_configs": _selection(monitor, endpoint)
                               + [relabel_config(r) for r in endpoint.get("relabelings", [])],
        })
    return jobs


class Prometheus:
    """A prometheus process on 127.0.0.1 with a generated config, and its HTTP API."""

    def __init__(self, binary: str, jobs: list[dict[str, Any]], workdir: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.workdir = workdir
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs}))
        self.log = workdir / "prometheus.log"
        self.argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> Prometheus:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"prometheus was not ready within {timeout_s} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:  # a bad query: Prometheus says why in the body
            raise AssertionError(f"{path} {params}: {exc.code} {exc.read().decode(errors='replace')}") from exc
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to now (a scalar comes back as one unlabelled series)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": match})

    def active_targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]

    def wait_scraped_since(self, since: float, jobs: int, timeout_s: float = 30.0) -> None:
        """Until every active target of `jobs` jobs was scraped, and up, after the time `since`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            targets = self.active_targets()
            fresh = [t for t in targets if t["health"] == "up" and _epoch(t["lastScrape"]) > since]
            if targets and len(fresh) == len(targets) and len({t["scrapePool"] for t in targets}) == jobs:
                return
            time.sleep(0.2)
        raise AssertionError(f"targets not all scraped within {timeout_s} s: {self.active_targets()}")


def _epoch(rfc3339: str) -> float:
    """Seconds since the epoch of Prometheus' RFC 3339 timestamps (nanoseconds, a Z or an offset)."""
    from datetime import datetime

    text = re.sub(r"(\.\d{6})\d+", r"\1", rfc3339.replace("Z", "+00:00"))
    return datetime.fromisoformat(text).timestamp()
