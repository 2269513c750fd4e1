"""The operator's world as its kopf handlers see it, without a cluster: real kopf Body/Patch/Memo
objects, real in-memory routing stores and the real Deps; only the Kubernetes API is replaced.
`RecordingKube` keeps applied objects in a dict and merges status patches into them, as the API
server would. Shared by the tests of tests/k8s."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
from typing import Any

import kopf
from loraplex_operator import handlers
from loraplex_operator.adapter_status import Event
from loraplex_operator.config import OperatorConfig
from loraplex_operator.deps import Deps
from loraplex_operator.inspect_source import SourceInspector
from loraplex_operator.kube import KubeError, ObjectRef

from loraplex.routing import InMemoryRoutingStore, ServerRecord
from loraplex.util.clock import ManualClock

NS = "serving"
T0 = 1_700_000_000.0


def bump(obj: dict[str, Any]) -> None:
    """A new resourceVersion, as the API server gives every write."""
    meta = obj.setdefault("metadata", {})
    meta["resourceVersion"] = str(int(meta.get("resourceVersion", "0")) + 1)


def merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """JSON merge patch (RFC 7386), as the API server applies kopf's patches."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


class RecordingKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.applied: list[dict[str, Any]] = []
        self.status_patches: list[str] = []  # names of the objects whose status was patched, in order
        self.refuse: dict[str, KubeError] = {}  # kind -> the error its apply answers

    def apply(self, obj: dict[str, Any]) -> None:
        if obj["kind"] in self.refuse:
            raise self.refuse[obj["kind"]]
        self.applied.append(copy.deepcopy(obj))
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.objects[key] = merge(self.objects.get(key, {}), copy.deepcopy(obj))

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def patch_status(self, ref: ObjectRef, status: dict[str, Any]) -> None:
        self.status_patches.append(ref.name)
        obj = self.objects[(ref.kind, ref.namespace, ref.name)]
        merge(obj, {"status": status})
        bump(obj)


# kopf posts events through a queue it finds in a context variable of the handler's context: a
# thread the handler starts does not inherit it (kopf.event raises LookupError there), and neither
# does this recorder.
_HANDLER_CONTEXT: contextvars.ContextVar[str] = contextvars.ContextVar("handler")


class RecordingEvents:
    def __init__(self) -> None:
        self.posted: list[tuple[str, Event]] = []

    def post(self, ref: ObjectRef, event: Event) -> None:
        _HANDLER_CONTEXT.get()  # LookupError outside a handler's context, as with kopf.event
        self.posted.append((ref.name, event))

    def reasons(self, name: str) -> list[str]:
        return [e.reason for n, e in self.posted if n == name]


class World:
    """The cluster as the handlers see it, plus helpers that play the API server's part."""

    def __init__(self, base_url: str) -> None:
        self.clock = ManualClock(T0)
        self.kube = RecordingKube()
        self.events = RecordingEvents()
        self.stores: dict[str, InMemoryRoutingStore] = {}
        # The test server speaks http://; the inspector is told to treat it as the Hub endpoint.
        inspector = SourceInspector(hf_endpoint=base_url)
        # Registrations at once: each handler call runs its own event loop (no batch to wait for).
        self.deps = Deps(OperatorConfig(registration_batch_seconds=0), self.kube, self.events, self.clock, self._store, inspector)
        self.memo = kopf.Memo(deps=self.deps)
        self.ready_pods: dict[str, set[str]] = {}  # pool -> pods whose Ready condition is True

    def _store(self, pool: str) -> InMemoryRoutingStore:
        return self.stores.setdefault(pool, InMemoryRoutingStore(pool, self.clock))

    def create(self, kind: str, name: str, spec: dict[str, Any], uid: str) -> None:
        self.kube.objects[(kind, NS, name)] = {
            "apiVersion": "loraplex.io/v1alpha1", "kind": kind,
            "metadata": {"name": name, "namespace": NS, "uid": uid, "generation": 1, "resourceVersion": "1"}, "spec": spec, "status": {}}

    def call(self, handler: Any, kind: str, name: str, **extra: Any) -> kopf.Patch:
        """Calls a handler as kopf does, with every index of the handlers module (kopf passes each
        index to every handler as a keyword argument)."""
        obj = self.kube.objects[(kind, NS, name)]
        body = kopf.Body(copy.deepcopy(obj))
        patch = kopf.Patch()
        if handler is handlers.pool_timer:  # each call is a tick here (tick_due is tested on its own)
            self.memo.deps.ticked.clear()
        token = _HANDLER_CONTEXT.set(name)
        try:
            called = handler(**self._kwargs(body, name, patch, {**self._indexes(), **extra}))
            if inspect.iscoroutine(called):  # an async handler: kopf awaits it in its loop
                asyncio.run(called)
        finally:
            _HANDLER_CONTEXT.reset(token)
            if dict(patch):  # kopf applies the patch even when the handler asks for a retry
                merge(obj, dict(patch))
                bump(obj)
        return patch

    def call_together(self, handler: Any, kind: str, names: list[str]) -> None:
        """Calls an async handler for each object at once in one event loop, as kopf does when the
        objects' events arrive together (kopf runs one handler per object concurrently)."""
        indexes = self._indexes()  # as kopf's indexes were when the events arrived

        async def one(name: str) -> None:
            obj = self.kube.objects[(kind, NS, name)]
            body, patch = kopf.Body(copy.deepcopy(obj)), kopf.Patch()
            _HANDLER_CONTEXT.set(name)  # in this task's own context
            try:
                await handler(**self._kwargs(body, name, patch, indexes))
            finally:
                if dict(patch):
                    merge(obj, dict(patch))
                    bump(obj)

        async def every() -> None:
            await asyncio.gather(*(one(name) for name in names))

        asyncio.run(every())

    def _indexes(self) -> dict[str, Any]:
        return {"adapters_by_pool": self.index(), "pools_by_name": self.pools_index(),
                "ready_pods_by_pool": self.pods_index(), "statefulsets_by_pool": self.statefulsets_index()}

    def _kwargs(self, body: kopf.Body, name: str, patch: kopf.Patch, indexes: dict[str, Any]) -> dict[str, Any]:
        return {"body": body, "spec": body.spec, "meta": body.meta, "status": body.status, "name": name,
                "namespace": NS, "patch": patch, "memo": self.memo, "logger": None, **indexes}

    def index(self) -> dict[tuple[str, str], list[Any]]:
        out: dict[tuple[str, str], list[Any]] = {}
        for (kind, _, name), obj in self.kube.objects.items():
            if kind == "LoRADeployment":
                body = kopf.Body(copy.deepcopy(obj))
                for key, value in (handlers.adapters_by_pool(spec=body.spec, status=body.status, meta=body.meta,
                                                             name=name, namespace=NS) or {}).items():
                    out.setdefault(key, []).append(value)
        return out

    def pools_index(self) -> dict[tuple[str, str], list[Any]]:
        out: dict[tuple[str, str], list[Any]] = {}
        for (kind, _, name), obj in self.kube.objects.items():
            if kind == "AdapterPool":
                body = kopf.Body(copy.deepcopy(obj))
                for key, value in handlers.pools_by_name(spec=body.spec, name=name, namespace=NS).items():
                    out.setdefault(key, []).append(value)
        return out

    def statefulsets_index(self) -> dict[tuple[str, str], list[str]]:
        return {(ns, name): [name] for (kind, ns, name) in self.kube.objects if kind == "StatefulSet"}

    def pods_index(self) -> dict[tuple[str, str], list[str]]:
        return {(NS, pool): sorted(pods) for pool, pods in self.ready_pods.items() if pods}

    def tick(self, pool: str) -> kopf.Patch:
        return self.call(handlers.pool_timer, "AdapterPool", pool)

    def heartbeat(self, pool: str, sid: str, holds: tuple[str, ...] = (), max_rank: int = 64,
                  pod_ready: bool = True, refused: tuple[tuple[str, str, str], ...] = (),
                  invocations: tuple[tuple[str, str, tuple[int, ...]], ...] = ()) -> None:
        """The server's agent heartbeats (`refused`: the (adapter, digest, why) its engine refused to
        load; `invocations`: the (adapter, digest, invocation) of activated LoRAs it loaded whose record
        lacks it); its pod is Ready unless `pod_ready` is False."""
        record = ServerRecord(sid, f"http://{sid}:8000", max_rank, host_adapters=holds, heartbeat_at=self.clock.now(),
                              refused=refused, invocations=invocations)
        self._store(pool).register_server(record, ttl_s=30)
        pods = self.ready_pods.setdefault(pool, set())
        if pod_ready:
            pods.add(sid)
        else:
            pods.discard(sid)

    def status(self, kind: str, name: str) -> dict[str, Any]:
        return self.kube.objects[(kind, NS, name)]["status"]
