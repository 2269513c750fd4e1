"""Pure builders: the Kubernetes objects of one AdapterPool, as plain dicts ready for server-side apply.

StatefulSet (stable server names, one agent per pod), headless Service (stable DNS names for the
router and for peer fetches), ConfigMap (the pool's agent settings, read as environment), and a
PodDisruptionBudget. Every object carries an owner reference to the pool, so deleting the pool
deletes them. A change of the spec changes the pod template (directly, or through the ConfigMap hash
annotation), and the StatefulSet rolls its pods one at a time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from loraplex.spec.agent_flags import agent_flags, configmap_data
from loraplex.spec.crd import AdapterPoolSpec
from loraplex_operator import names
from loraplex_operator.config import OperatorConfig
from loraplex_operator.vllm_objects import (
    AGENT_RESOURCES,
    PLUGIN_DIR,
    plugin_data,
    plugin_volume,
    uses_vllm,
    vllm_agent_args,
    vllm_container,
    vllm_settings,
)

MODELS_DIR = "/var/lib/loraplex/models"
ADAPTERS_DIR = "/var/lib/loraplex/adapters"
SHM_DIR = "/dev/shm"
USER_ID = 10001  # the non-root user of the images (Dockerfile)
# The pod's own volumes. Users add theirs in servers.volumes / volumeMounts: names with our prefix
# and mount paths over or under ours are refused (VOLUME_CONFLICT), never merged into a pod the
# API server would reject.
OWN_PREFIX = "loraplex-"
MODELS_VOLUME, ADAPTERS_VOLUME, SHM_VOLUME = f"{OWN_PREFIX}models", f"{OWN_PREFIX}adapters", f"{OWN_PREFIX}dshm"
OWN_MOUNTS = {MODELS_VOLUME: MODELS_DIR, ADAPTERS_VOLUME: ADAPTERS_DIR, SHM_VOLUME: SHM_DIR}
VOLUME_CONFLICT = "VolumeConflict"


@dataclass(frozen=True)
class PoolRef:
    name: str
    namespace: str
    uid: str


def _nested(a: str, b: str) -> bool:
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def volume_conflicts(spec: AdapterPoolSpec) -> str:
    """Why the user's volumes cannot join the pod ('' when they can)."""
    problems = [f"volume {v.get('name')!r} uses the reserved prefix {OWN_PREFIX!r}" for v in spec.servers.volumes
                if str(v.get("name", "")).startswith(OWN_PREFIX)]
    for mount in spec.servers.volume_mounts:
        path = str(mount.get("mountPath", ""))
        problems += [f"volumeMount {mount.get('name')!r} at {path!r} overlaps the agent's {own!r}"
                     for own in [*OWN_MOUNTS.values(), PLUGIN_DIR] if path and _nested(path, own)]
    return "; ".join(problems)


def _metadata(pool: PoolRef, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": pool.namespace, "labels": names.pool_labels(pool.name),
            "ownerReferences": [names.owner_reference("AdapterPool", pool.name, pool.uid)]}


BASE_MODEL_DIR = f"{MODELS_DIR}/base"


def model_path(source: str) -> str:
    """Where the agent finds the base model: the path of a file:// source, else the folder the
    fetch-model init container downloads an hf:// source into."""
    return source.removeprefix("file://") if source.startswith("file://") else BASE_MODEL_DIR


def fetch_model_container(spec: AdapterPoolSpec, image: str) -> dict[str, Any] | None:
    """An init container that downloads an hf://org/name[@revision] base model (HF_TOKEN from
    servers.env when the repository is gated). Restarted pods find it already there."""
    source = spec.base_model.source
    if not source.startswith("hf://"):
        return None
    repo, _, revision = source.removeprefix("hf://").partition("@")
    command = ["hf", "download", repo.strip("/"), "--local-dir", BASE_MODEL_DIR]
    if revision:
        command += ["--revision", revision]
    return {"name": "fetch-model", "image": image, "imagePullPolicy": spec.servers.image_pull_policy,
            "command": command, "env": [{"name": "HF_HOME", "value": f"{MODELS_DIR}/.hf"}, *spec.servers.env],
            "volumeMounts": [{"name": MODELS_VOLUME, "mountPath": MODELS_DIR}],
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}


def agent_settings(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig) -> dict[str, str]:
    """The ConfigMap data: environment of every agent of the pool (the args refer to it as $(VAR))."""
    data = {
        "LORAPLEX_POOL": pool.name,
        "LORAPLEX_REDIS_URL": config.redis_url,
        "LORAPLEX_HEARTBEAT_TTL": f"{config.heartbeat_ttl_seconds:g}",
        "LORAPLEX_MODEL": model_path(spec.base_model.source),
        "LORAPLEX_ADAPTER_DIR": ADAPTERS_DIR,
        "LORAPLEX_MODEL_DIR": MODELS_DIR,
        "HF_HOME": f"{MODELS_DIR}/.hf",
        **configmap_data(agent_flags(spec)),
    }
    if uses_vllm(spec):
        data.update(vllm_settings(spec))
    return data


def config_hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def build_configmap(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(pool, names.configmap_name(pool.name)),
            "data": agent_settings(pool, spec, config)}


def build_vllm_plugin_configmap(pool: PoolRef) -> dict[str, Any]:
    """The plug-in module the vLLM containers load (`--middleware loraplex_vllm.LoraplexMiddleware`)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(pool, names.vllm_plugin_configmap_name(pool.name)), "data": plugin_data()}


def build_service(pool: PoolRef, spec: AdapterPoolSpec | None = None) -> dict[str, Any]:
    """Headless; a vLLM pool's Service also names the vLLM port (the ServiceMonitor scrapes its metrics)."""
    ports = [{"name": names.AGENT_PORT_NAME, "port": names.AGENT_PORT, "targetPort": names.AGENT_PORT_NAME}]
    if spec is not None and uses_vllm(spec):
        ports.append({"name": names.VLLM_PORT_NAME, "port": spec.engine.vllm.port, "targetPort": names.VLLM_PORT_NAME})
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(pool, names.service_name(pool.name)),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": names.selector_labels(pool.name), "ports": ports}}


def build_pdb(pool: PoolRef, spec: AdapterPoolSpec) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _metadata(pool, names.pdb_name(pool.name)),
            "spec": {"maxUnavailable": spec.servers.max_unavailable,
                     "selector": {"matchLabels": names.selector_labels(pool.name)}}}


def agent_args(spec: AdapterPoolSpec) -> list[str]:
    """`loraplex agent` flags: where the agent is, then the pool's settings (loraplex.spec.agent_flags,
    as `loraplex up` passes them), their values read from the ConfigMap environment so that one edit of
    the ConfigMap (and its hash) is the whole change; `engine.extra_args` last."""
    flags = [f for f in agent_flags(spec) if not f.launch_only]
    backend = [arg for f in flags if f.flag == "--backend" for arg in f.argv()]  # first: `agent --backend vllm`
    settings = [arg for f in flags if f.flag != "--backend" for arg in f.argv(by_env=True)]
    return ["agent", *backend, "--model", "$(LORAPLEX_MODEL)", "--host", "0.0.0.0", "--port", str(names.AGENT_PORT),
            "--redis-url", "$(LORAPLEX_REDIS_URL)", "--pool", "$(LORAPLEX_POOL)",
            "--server-id", "$(POD_NAME)", "--advertise-url", "$(LORAPLEX_ADVERTISE_URL)",
            "--heartbeat-ttl", "$(LORAPLEX_HEARTBEAT_TTL)", "--adapter-store", "$(LORAPLEX_ADAPTER_DIR)",
            *(vllm_agent_args() if uses_vllm(spec) else []), *settings, *spec.engine.extra_args]


def _env(pool: PoolRef, config: OperatorConfig, spec: AdapterPoolSpec) -> list[dict[str, Any]]:
    fqdn = f"$(POD_NAME).{names.service_name(pool.name)}.$(POD_NAMESPACE).svc"
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "LORAPLEX_ADVERTISE_URL", "value": f"http://{fqdn}:{names.AGENT_PORT}"},
    ]
    if uses_vllm(spec):  # the router sends requests to the vLLM container
        env.append({"name": "LORAPLEX_VLLM_ADVERTISE_URL", "value": f"http://{fqdn}:{spec.engine.vllm.port}"})
    if config.agent_api_key_secret:
        env.append({"name": "LORAPLEX_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": config.agent_api_key_secret, "key": "api-key"}}})
    return env + list(spec.servers.env)


def _resources(spec: AdapterPoolSpec) -> dict[str, Any]:
    requests = dict(spec.servers.resources.requests)
    limits = dict(spec.servers.resources.limits)
    if spec.servers.gpus_per_server > 0:
        limits["nvidia.com/gpu"] = spec.servers.gpus_per_server
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": names.AGENT_PORT_NAME}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 5}


def _mounts(spec: AdapterPoolSpec) -> list[dict[str, Any]]:
    return [{"name": name, "mountPath": path} for name, path in OWN_MOUNTS.items()] + list(spec.servers.volume_mounts)


def _security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _containers(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig) -> list[dict[str, Any]]:
    """The agent; with engine.backend vllm, the vLLM server beside it (which gets the GPUs)."""
    agent = _container(pool, spec, config)
    if not uses_vllm(spec):
        return [agent]
    vllm = vllm_container(spec, config.vllm_image, model_path(spec.base_model.source), _mounts(spec), ADAPTERS_DIR,
                          _resources(spec), _security(), f"{MODELS_DIR}/.hf")
    return [{**agent, "resources": AGENT_RESOURCES}, vllm]


def _container(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig) -> dict[str, Any]:
    return {
        "name": "agent",
        "image": spec.servers.image or config.agent_image,
        "imagePullPolicy": spec.servers.image_pull_policy,
        "args": agent_args(spec),
        "envFrom": [{"configMapRef": {"name": names.configmap_name(pool.name)}}],
        "env": _env(pool, config, spec),
        "ports": [{"name": names.AGENT_PORT_NAME, "containerPort": names.AGENT_PORT}],
        "resources": _resources(spec),
        # Downloading and loading a large base model can take many minutes: the startup probe
        # allows 30 minutes before liveness takes over.
        "startupProbe": _probe("/health", 10, 180),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "volumeMounts": _mounts(spec),
        "securityContext": _security(),
    }


def _pod_spec(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig) -> dict[str, Any]:
    servers = spec.servers
    image = servers.image or config.agent_image
    pod: dict[str, Any] = {
        "containers": _containers(pool, spec, config),
        "securityContext": {"runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID,
                            "fsGroup": USER_ID},
        "terminationGracePeriodSeconds": 60,  # lets running requests finish
        "volumes": [{"name": MODELS_VOLUME, "emptyDir": {}}, {"name": ADAPTERS_VOLUME, "emptyDir": {}},
                    {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}] + list(servers.volumes),
    }
    if uses_vllm(spec):
        pod["volumes"].append(plugin_volume(pool.name))
    fetch = fetch_model_container(spec, image)
    if fetch is not None:
        pod["initContainers"] = [fetch]
    if servers.node_selector:
        pod["nodeSelector"] = dict(servers.node_selector)
    if servers.tolerations:
        pod["tolerations"] = [t.to_k8s() for t in servers.tolerations]
    if servers.service_account_name:
        pod["serviceAccountName"] = servers.service_account_name
    return pod


def build_statefulset(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig, replicas: int) -> dict[str, Any]:
    settings = agent_settings(pool, spec, config)
    settings_hash = config_hash({**settings, **plugin_data()} if uses_vllm(spec) else settings)
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _metadata(pool, names.statefulset_name(pool.name)),
        "spec": {
            "replicas": replicas,
            "serviceName": names.service_name(pool.name),
            # Servers are independent: start and stop them in parallel; updates still roll one by one.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
            "selector": {"matchLabels": names.selector_labels(pool.name)},
            "template": {
                "metadata": {"labels": names.pool_labels(pool.name),
                             "annotations": {names.CONFIG_HASH_ANNOTATION: settings_hash}},
                "spec": _pod_spec(pool, spec, config),
            },
        },
    }


def pool_objects(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig, replicas: int) -> list[dict[str, Any]]:
    """Everything the pool owns, in the order to apply it (the ConfigMap before the pods that read it)."""
    plugin = [build_vllm_plugin_configmap(pool)] if uses_vllm(spec) else []
    return [build_configmap(pool, spec, config), *plugin, build_service(pool, spec), build_pdb(pool, spec),
            build_statefulset(pool, spec, config, replicas)]
