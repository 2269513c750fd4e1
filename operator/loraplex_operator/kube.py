"""The operator's only doors to the Kubernetes API, behind two small protocols so that the reconcile
functions take them as arguments (tests pass a recorder; there is no cluster on a laptop).

`KubernetesApi` does server-side apply with one field manager, so re-applying an unchanged object is
a no-op and fields that others own (e.g. an HPA's replicas) are not fought over."""

from __future__ import annotations

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


class KubeApi(Protocol):
    def apply(self, obj: dict[str, Any]) -> None:
        """Server-side apply (create or update) of one object."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""

    def patch_status(self, ref: ObjectRef, status: dict[str, Any]) -> None:
        """Merge-patches the status subresource."""


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
        resource = self._resource(obj["apiVersion"], obj["kind"])
        self._dynamic.server_side_apply(resource, body=obj, namespace=obj["metadata"].get("namespace"),
                                        field_manager=MANAGER, force_conflicts=True)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.dynamic.exceptions import NotFoundError

        try:
            return self._dynamic.get(self._resource(api_version, kind), name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def patch_status(self, ref: ObjectRef, status: dict[str, Any]) -> None:
        resource = self._resource(ref.api_version, ref.kind).subresources["status"]
        self._dynamic.patch(resource, body={"status": status}, name=ref.name, namespace=ref.namespace,
                            content_type="application/merge-patch+json")


class KopfEvents:
    """Posts Kubernetes Events through kopf's own queue (works from sync handlers in threads)."""

    def post(self, ref: ObjectRef, event: Event) -> None:
        import kopf

        kopf.event(ref.body(), type=event.type, reason=event.reason, message=event.message)
