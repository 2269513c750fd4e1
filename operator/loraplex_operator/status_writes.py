"""Writing the statuses of many LoRADeployments at once (a pool's tick): only those that changed,
several PATCHes in flight, and a refused one left for the next tick instead of ending this one."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from loraplex.spec.crd import LoRADeploymentStatus
from loraplex_operator.adapter_status import Event
from loraplex_operator.deps import Deps
from loraplex_operator.kube import KubeError, ObjectRef

log = logging.getLogger(__name__)

# PATCHes in flight at once: thousands of adapters turning Ready together are written at the rate
# the operator's Throttle allows, not one round trip at a time (under a storm the API server takes
# 100 ms or more to answer each; eight in flight wrote 60 a second).
CONCURRENT_WRITES = 32


@dataclass(frozen=True)
class StatusWrite:
    target: ObjectRef
    previous: LoRADeploymentStatus | None
    status: LoRADeploymentStatus
    events: Sequence[Event]


def write_statuses(deps: Deps, writes: Sequence[StatusWrite]) -> None:
    """Patches each status (and posts its events) unless the object already has it, or this
    operator wrote exactly this status last (the watch has not brought it back yet)."""
    due = [w for w in writes if _changed(deps, w)]
    if len(due) <= 1:
        written = [_write(deps, w) for w in due]
    else:
        with ThreadPoolExecutor(max_workers=min(CONCURRENT_WRITES, len(due)), thread_name_prefix="status") as pool:
            written = list(pool.map(lambda w: _write(deps, w), due))
    for w, ok in zip(due, written, strict=True):
        for event in w.events if ok else ():  # from this thread: kopf's event queue lives in its context
            deps.events.post(w.target, event)


def _changed(deps: Deps, w: StatusWrite) -> bool:
    new = w.status.to_k8s()
    return not ((w.previous is not None and w.previous.to_k8s() == new) or deps.written.get(w.target.uid) == new)


def _write(deps: Deps, w: StatusWrite) -> bool:
    try:
        deps.kube.patch_status(w.target, w.status.to_patch())
    except KubeError as exc:
        log.warning("status of %s/%s not written (retried at the next tick): %s", w.target.namespace,
                    w.target.name, exc)
        deps.refreshed.pop(w.target.uid, None)
        return False
    deps.written[w.target.uid] = w.status.to_k8s()
    return True
