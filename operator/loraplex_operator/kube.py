"""The operator's only doors to the Kubernetes API, behind two small protocols so that the reconcile
functions take them as arguments (tests pass a recorder; there is no cluster on a laptop).

`KubernetesApi` does server-side apply with one field manager, so re-applying an unchanged object is
a no-op and fields that others own (e.g. an HPA's replicas) are not fought over."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Protocol

from loraplex_operator.adapter_status import Event
from loraplex_operator.names import MANAGER


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str = ""

    def body(self) -> dict[str, Any]:
        """A minimal body that kopf accepts as the subject of an event."""
        meta = {"name": self.name, "namespace": self.namespace}
        if self.uid:
            meta["uid"] = self.uid
        return {"apiVersion": self.api_version, "kind": self.kind, "metadata": meta}


class KubeError(RuntimeError):
    """The API server refused a request (`status`: its HTTP status; `message`: what it said)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class KubeApi(Protocol):
    """Every method may raise KubeError."""

    def apply(self, obj: dict[str, Any]) -> None:
        """Server-side apply (create or update) of one object."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""

    def patch_status(self, ref: ObjectRef, status: dict[str, Any]) -> None:
        """Merge-patches the status subresource; an object deleted meanwhile is not an error."""


class EventSink(Protocol):
    def post(self, ref: ObjectRef, event: Event) -> None: ...


class KubernetesApi:
    """KubeApi over the official client's dynamic client (in-cluster or kubeconfig credentials)."""

    def __init__(self, api_client: Any = None) -> None:
        from kubernetes import client, config, dynamic

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self._dynamic = dynamic.DynamicClient(api_client)

    def _resource(self, api_version: str, kind: str) -> Any:
        return self._dynamic.resources.get(api_version=api_version, kind=kind)

    def apply(self, obj: dict[str, Any]) -> None:
        with _refusals():
            resource = self._resource(obj["apiVersion"], obj["kind"])
            self._dynamic.server_side_apply(resource, body=obj, namespace=obj["metadata"].get("namespace"),
                                            field_manager=MANAGER, force_conflicts=True)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.dynamic.exceptions import NotFoundError

        with _refusals():
            try:
                return self._dynamic.get(self._resource(api_version, kind), name=name, namespace=namespace).to_dict()
            except NotFoundError:
                return None

    def patch_status(self, ref: ObjectRef, status: dict[str, Any]) -> None:
        from kubernetes.dynamic.exceptions import NotFoundError

        with _refusals():
            resource = self._resource(ref.api_version, ref.kind).subresources["status"]
            with suppress(NotFoundError):  # deleted while its pool's tick ran
                self._dynamic.patch(resource, body={"status": status}, name=ref.name, namespace=ref.namespace,
                                    content_type="application/merge-patch+json")


@contextmanager
def _refusals() -> Iterator[None]:
    """The client's errors as KubeError, with the API server's own message."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError

    try:
        yield
    except ResourceNotFoundError as exc:  # the kind itself is unknown: a CRD is not installed
        raise KubeError(404, str(exc)) from exc
    except (DynamicApiError, ApiException) as exc:
        raise KubeError(int(getattr(exc, "status", 0) or 0), _message(exc)) from exc


def _message(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    try:
        return str(json.loads(body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(getattr(exc, "reason", "") or exc)


class KopfEvents:
    """Posts Kubernetes Events through kopf's own queue (works from sync handlers in threads)."""

    def post(self, ref: ObjectRef, event: Event) -> None:
        import kopf

        kopf.event(ref.body(), type=event.type, reason=event.reason, message=event.message)
