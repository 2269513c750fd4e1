"""Refusing an AdapterPool spec that cannot be served as written, one function for both drivers: the
operator turns the pool Failed with the reason (and makes no pods), `loraplex up` refuses to start
(or, for an edited file, keeps the pool it applied before) and says why in one line.

The agent pod's own volumes are part of the spec's contract: a user's volume may not take their
prefix, nor a mount path over or under theirs (the API server would reject the pod)."""

from __future__ import annotations

from loraplex.engine.policy_check import engine_error
from loraplex.routing.choice import pool_routing, routing_error
from loraplex.spec.crd import AdapterPoolSpec

VOLUME_CONFLICT = "VolumeConflict"
INVALID_ENGINE = "InvalidEngine"
INVALID_ROUTING = "InvalidRouting"

# Where the agent pod mounts its own volumes (the operator's pod builders use these names and paths).
OWN_PREFIX = "loraplex-"
MODELS_DIR = "/var/lib/loraplex/models"
ADAPTERS_DIR = "/var/lib/loraplex/adapters"
SHM_DIR = "/dev/shm"
PLUGIN_DIR = "/opt/loraplex/vllm-plugin"  # the vLLM plugin of a vllm-backend pod
MODELS_VOLUME, ADAPTERS_VOLUME, SHM_VOLUME = f"{OWN_PREFIX}models", f"{OWN_PREFIX}adapters", f"{OWN_PREFIX}dshm"
OWN_MOUNTS = {MODELS_VOLUME: MODELS_DIR, ADAPTERS_VOLUME: ADAPTERS_DIR, SHM_VOLUME: SHM_DIR}


def spec_failure(spec: AdapterPoolSpec) -> tuple[str, str]:
    """(reason, message) when the spec cannot be served as written; ("", "") when it can."""
    conflicts = volume_conflicts(spec)
    if conflicts:
        return VOLUME_CONFLICT, conflicts
    error = engine_error(spec.engine)  # the agents would refuse it at start-up, one crash loop per pod
    if error:
        return INVALID_ENGINE, f"engine: {error}"
    error = routing_error(pool_routing(spec))  # the router's own check: it would refuse the choice
    if error:
        return INVALID_ROUTING, f"routing: {error}"
    return "", ""


def volume_conflicts(spec: AdapterPoolSpec) -> str:
    """Why the user's volumes cannot join the pod ('' when they can)."""
    problems = [f"volume {v.get('name')!r} uses the reserved prefix {OWN_PREFIX!r}" for v in spec.servers.volumes
                if str(v.get("name", "")).startswith(OWN_PREFIX)]
    for mount in spec.servers.volume_mounts:
        path = str(mount.get("mountPath", ""))
        problems += [f"volumeMount {mount.get('name')!r} at {path!r} overlaps the agent's {own!r}"
                     for own in [*OWN_MOUNTS.values(), PLUGIN_DIR] if path and _nested(path, own)]
    return "; ".join(problems)


def _nested(a: str, b: str) -> bool:
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)
