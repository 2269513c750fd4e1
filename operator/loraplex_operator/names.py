"""Names and labels of the objects the operator owns. Server names are the pod names of the
StatefulSet (`<pool>-0`, `<pool>-1`, ...), so a server keeps its id across restarts."""

from __future__ import annotations

from loraplex.spec.crd import API_VERSION, GROUP

POOL_LABEL = f"{GROUP}/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
AGENT_COMPONENT = "agent"
MANAGER = "loraplex-operator"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
AGENT_PORT = 8000
AGENT_PORT_NAME = "http"
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"  # GIE's InferencePool (the user installs its CRD)
VLLM_PORT_NAME = "vllm"  # the vLLM server of a pool with engine.backend vllm (its port: engine.vllm.port)


def statefulset_name(pool: str) -> str:
    return pool


def service_name(pool: str) -> str:
    """The headless Service: pods are reachable as <pool>-<i>.<pool>.<namespace>.svc."""
    return pool


def configmap_name(pool: str) -> str:
    return f"{pool}-agent"


def vllm_plugin_configmap_name(pool: str) -> str:
    return f"{pool}-vllm-plugin"


def picker_service_name(pool: str) -> str:
    """The Service of the pool's endpoint picker (its router's ext_proc port; the chart makes it)."""
    return f"{pool}-epp"


def inference_pool_name(pool: str) -> str:
    return pool


def pdb_name(pool: str) -> str:
    return pool


def server_name(pool: str, ordinal: int) -> str:
    return f"{pool}-{ordinal}"


def selector_labels(pool: str) -> dict[str, str]:
    return {POOL_LABEL: pool, COMPONENT_LABEL: AGENT_COMPONENT}


def pool_labels(pool: str) -> dict[str, str]:
    return {**selector_labels(pool), "app.kubernetes.io/name": "loraplex-agent",
            "app.kubernetes.io/instance": pool, "app.kubernetes.io/part-of": "loraplex",
            "app.kubernetes.io/managed-by": MANAGER}


def selector_string(pool: str) -> str:
    """The label selector as text (the scale subresource wants it in status.selector)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(pool).items()))


def owner_reference(kind: str, name: str, uid: str) -> dict[str, object]:
    return {"apiVersion": API_VERSION, "kind": kind, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}
