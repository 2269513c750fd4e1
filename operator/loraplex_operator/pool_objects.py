"""Pure builders: the Kubernetes objects of one AdapterPool, as plain dicts ready for server-side apply.

StatefulSet (stable server names, one agent per pod), headless Service (stable DNS names for the
router and for peer fetches), ConfigMap (the pool's agent settings, read as environment), a
PodDisruptionBudget, and, when the chart asks for it, a Gateway API InferencePool (docs/gateway.md). Every object carries an owner reference to the pool, so deleting the pool
deletes them. A change of the spec changes the pod template (directly, or through the ConfigMap hash
annotation), and the StatefulSet rolls its pods one at a time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplex.pool.refusal import (
    ADAPTERS_DIR,
    ADAPTERS_VOLUME,
    MODELS_DIR,
    MODELS_VOLUME,
    OWN_MOUNTS,
    SHM_VOLUME,
)
from loraplex.spec.agent_flags import agent_flags, configmap_data
from loraplex.spec.crd import AdapterPoolSpec
from loraplex_operator import names
from loraplex_operator.config import OperatorConfig
from loraplex_operator.vllm_objects import (
    AGENT_RESOURCES,
    plugin_data,
    plugin_volume,
    uses_vllm,
    vllm_agent_args,
    vllm_container,
    vllm_settings,
)

USER_ID = 10001  # the non-root user of the images (Dockerfile)
# The pod's own volumes (loraplex.pool.refusal). Users add theirs in servers.volumes / volumeMounts:
# names with our prefix and mount paths over or under ours are refused there (spec_failure), never
# merged into a pod the API server would reject.


@dataclass(frozen=True)
class PoolRef:
    name: str
    namespace: str
    uid: str


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
    return data | dict(_backend(pool, spec, config).settings)


def config_hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def build_configmap(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(pool, names.configmap_name(pool.name)),
            "data": agent_settings(pool, spec, config)}


def build_service(pool: PoolRef, backend: BackendParts | None = None) -> dict[str, Any]:
    """Headless; a vLLM pool's Service also names the vLLM port (the ServiceMonitor scrapes its metrics)."""
    ports = [{"name": names.AGENT_PORT_NAME, "port": names.AGENT_PORT, "targetPort": names.AGENT_PORT_NAME},
             *(backend.service_ports if backend else ())]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(pool, names.service_name(pool.name)),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": names.selector_labels(pool.name), "ports": ports}}


def build_pdb(pool: PoolRef, spec: AdapterPoolSpec) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _metadata(pool, names.pdb_name(pool.name)),
            "spec": {"maxUnavailable": spec.servers.max_unavailable,
                     "selector": {"matchLabels": names.selector_labels(pool.name)}}}


def agent_args(spec: AdapterPoolSpec, backend_args: Sequence[str] = ()) -> list[str]:
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
            *backend_args, *settings, *spec.engine.extra_args]


def _pod_url(pool: PoolRef, port: int) -> str:
    """The pod's own address as the router and its peers reach it (through the headless Service)."""
    return f"http://$(POD_NAME).{names.service_name(pool.name)}.$(POD_NAMESPACE).svc:{port}"


def _env(pool: PoolRef, config: OperatorConfig, spec: AdapterPoolSpec, backend: BackendParts) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "LORAPLEX_ADVERTISE_URL", "value": _pod_url(pool, names.AGENT_PORT)},
        *backend.agent_env,
    ]
    if config.agent_api_key_secret:
        env.append({"name": "LORAPLEX_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": config.agent_api_key_secret, "key": "api-key"}}})
    if config.redis_password_secret:
        env.append({"name": "LORAPLEX_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
            "name": config.redis_password_secret, "key": "redis-password"}}})
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


@dataclass(frozen=True)
class BackendParts:
    """What the pool's engine backend adds to its objects: nothing for our engine. Every difference of
    a pool with `engine.backend: vllm` is made in `_backend`, so the builders have no branch on it."""

    settings: Mapping[str, str] = field(default_factory=dict)  # more ConfigMap entries
    agent_args: tuple[str, ...] = ()             # where the agent finds its server
    agent_env: tuple[dict[str, Any], ...] = ()
    agent_resources: dict[str, Any] | None = None  # the agent's instead of servers.resources (the server gets those)
    containers: tuple[dict[str, Any], ...] = ()  # beside the agent
    volumes: tuple[dict[str, Any], ...] = ()
    service_ports: tuple[dict[str, Any], ...] = ()
    objects: tuple[dict[str, Any], ...] = ()     # applied after the ConfigMap, before the pods
    hashed: Mapping[str, str] = field(default_factory=dict)  # more data whose change rolls the pods


def _backend(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig) -> BackendParts:
    if not uses_vllm(spec):
        return BackendParts()
    port = spec.engine.vllm.port
    server = vllm_container(spec, config.vllm_image, model_path(spec.base_model.source), _mounts(spec), ADAPTERS_DIR,
                            _resources(spec), _security(), f"{MODELS_DIR}/.hf")
    # the plug-in module the vLLM containers load (`--middleware loraplex_vllm.LoraplexMiddleware`)
    plugin = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": _metadata(pool, names.vllm_plugin_configmap_name(pool.name)), "data": plugin_data()}
    return BackendParts(
        settings=vllm_settings(spec), agent_args=tuple(vllm_agent_args()),
        # the router sends requests to the vLLM container
        agent_env=({"name": "LORAPLEX_VLLM_ADVERTISE_URL", "value": _pod_url(pool, port)},),
        agent_resources=AGENT_RESOURCES, containers=(server,), volumes=(plugin_volume(pool.name),),
        service_ports=({"name": names.VLLM_PORT_NAME, "port": port, "targetPort": names.VLLM_PORT_NAME},),
        objects=(plugin,), hashed=plugin_data())


def _container(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig, backend: BackendParts) -> dict[str, Any]:
    """The agent (with engine.backend vllm, beside the vLLM server, which gets the GPUs)."""
    return {
        "name": "agent",
        "image": agent_image(spec, config),
        "imagePullPolicy": spec.servers.image_pull_policy,
        "args": agent_args(spec, backend.agent_args),
        "envFrom": [{"configMapRef": {"name": names.configmap_name(pool.name)}}],
        "env": _env(pool, config, spec, backend),
        "ports": [{"name": names.AGENT_PORT_NAME, "containerPort": names.AGENT_PORT}],
        "resources": backend.agent_resources or _resources(spec),
        # Downloading and loading a large base model can take many minutes: the startup probe
        # allows 30 minutes before liveness takes over.
        "startupProbe": _probe("/health", 10, 180),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "volumeMounts": _mounts(spec),
        "securityContext": _security(),
    }


def agent_image(spec: AdapterPoolSpec, config: OperatorConfig) -> str:
    """The pool's own image, else the operator's CUDA or CPU agent image by gpusPerServer."""
    return spec.servers.image or config.agent_image_for(spec.servers.gpus_per_server)


def _volumes(spec: AdapterPoolSpec, backend: BackendParts) -> list[dict[str, Any]]:
    """The pod's volumes; with servers.modelCache the models volume is the server's own claim instead."""
    models = [] if spec.servers.model_cache else [{"name": MODELS_VOLUME, "emptyDir": {}}]
    return [*models, {"name": ADAPTERS_VOLUME, "emptyDir": {}}, {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
            *spec.servers.volumes, *backend.volumes]


def _init_containers(spec: AdapterPoolSpec, image: str) -> list[dict[str, Any]]:
    """The user's init containers (those without an image run the agent's), then the model fetch."""
    own = [{"image": image, "imagePullPolicy": spec.servers.image_pull_policy, **c} for c in spec.servers.init_containers]
    fetch = fetch_model_container(spec, image)
    return own + ([fetch] if fetch is not None else [])


def _scheduling(spec: AdapterPoolSpec, config: OperatorConfig) -> dict[str, Any]:
    """Where and how the pods are placed and pulled: only the fields that are set."""
    servers = spec.servers
    pull_secrets = [s.name for s in servers.image_pull_secrets] or list(config.image_pull_secrets)
    fields: dict[str, Any] = {
        "nodeSelector": dict(servers.node_selector), "tolerations": [t.to_k8s() for t in servers.tolerations],
        "affinity": dict(servers.affinity), "topologySpreadConstraints": list(servers.topology_spread_constraints),
        "priorityClassName": servers.priority_class_name, "serviceAccountName": servers.service_account_name,
        "imagePullSecrets": [{"name": name} for name in pull_secrets],
    }
    return {key: value for key, value in fields.items() if value}


def _pod_spec(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig, backend: BackendParts) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "containers": [_container(pool, spec, config, backend), *backend.containers],
        "securityContext": {"runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID,
                            "fsGroup": USER_ID},
        "terminationGracePeriodSeconds": 60,  # lets running requests finish
        "volumes": _volumes(spec, backend),
        **_scheduling(spec, config),
    }
    init = _init_containers(spec, agent_image(spec, config))
    if init:
        pod["initContainers"] = init
    return pod


def _claim_templates(pool: PoolRef, spec: AdapterPoolSpec) -> list[dict[str, Any]]:
    cache = spec.servers.model_cache
    if cache is None:
        return []
    claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": cache.size}}}
    if cache.storage_class_name:
        claim["storageClassName"] = cache.storage_class_name
    return [{"metadata": {"name": MODELS_VOLUME, "labels": names.pool_labels(pool.name)}, "spec": claim}]


def _template_metadata(pool: PoolRef, spec: AdapterPoolSpec, settings_hash: str) -> dict[str, Any]:
    servers = spec.servers
    return {"labels": {**servers.pod_labels, **names.pool_labels(pool.name)},
            "annotations": {**servers.pod_annotations, names.CONFIG_HASH_ANNOTATION: settings_hash}}


def build_statefulset(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig, replicas: int) -> dict[str, Any]:
    backend = _backend(pool, spec, config)
    settings_hash = config_hash({**agent_settings(pool, spec, config), **backend.hashed})
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
            "template": {"metadata": _template_metadata(pool, spec, settings_hash),
                         "spec": _pod_spec(pool, spec, config, backend)},
            **({"volumeClaimTemplates": claims} if (claims := _claim_templates(pool, spec)) else {}),
        },
    }


def build_inference_pool(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig) -> dict[str, Any]:
    """The pool as a Gateway API InferencePool: its agents' pods, on the port they registered (the vLLM
    server's with engine.backend vllm), picked by the pool's router on its ext_proc port."""
    port = spec.engine.vllm.port if uses_vllm(spec) else names.AGENT_PORT
    picker = {"group": "", "kind": "Service", "name": names.picker_service_name(pool.name),
              "port": {"number": config.picker_port}, "failureMode": config.picker_failure_mode}
    return {"apiVersion": names.INFERENCE_POOL_API, "kind": "InferencePool",
            "metadata": _metadata(pool, names.inference_pool_name(pool.name)),
            "spec": {"selector": {"matchLabels": names.selector_labels(pool.name)},
                     "targetPorts": [{"number": port}], "appProtocol": "http", "endpointPickerRef": picker}}


def pool_objects(pool: PoolRef, spec: AdapterPoolSpec, config: OperatorConfig, replicas: int) -> list[dict[str, Any]]:
    """Everything the pool owns, in the order to apply it (the ConfigMap before the pods that read it;
    the InferencePool last, when the operator makes one: its CRD may be missing, and the rest stands)."""
    backend = _backend(pool, spec, config)
    gateway = [build_inference_pool(pool, spec, config)] if config.inference_pool else []
    return [build_configmap(pool, spec, config), *backend.objects, build_service(pool, backend), build_pdb(pool, spec),
            build_statefulset(pool, spec, config, replicas), *gateway]
