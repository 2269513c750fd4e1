"""The operator's only doors to the Kubernetes API, behind two small protocols so that the reconcile
functions take them as arguments (tests pass a recorder; there is no cluster on a laptop).

`KubernetesApi` does server-side apply with one field manager, so re-applying an unchanged object is
a no-op and fields that others own (e.g. an HPA's replicas) are not fought over."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from loraplex_operator.adapter_status import Event
from loraplex_operator.names import MANAGER
from loraplex_operator.throttle import Throttle

T = TypeVar("T")
# Waits before the retries of a request answered 429 that named no Retry-After (seconds).
THROTTLED_BACKOFFS = (1.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0)


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

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.retry_after = status, message, retry_after


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
    """KubeApi over the official client's dynamic client (in-cluster or kubeconfig credentials). Each
    request waits for the Throttle's token; one answered 429 is retried after its Retry-After."""

    def __init__(self, api_client: Any = None, throttle: Throttle | None = None) -> None:
        from kubernetes import client, config, dynamic

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self._dynamic = dynamic.DynamicClient(api_client)
        self._throttle = throttle or Throttle(0, 1)

    def _send(self, request: Callable[[], T]) -> T:
        return throttled_call(request, self._throttle)

    def _resource(self, api_version: str, kind: str) -> Any:
        return self._dynamic.resources.get(api_version=api_version, kind=kind)

    def apply(self, obj: dict[str, Any]) -> None:
        with _refusals():
            resource = self._resource(obj["apiVersion"], obj["kind"])
        self._send(lambda: self._dynamic.server_side_apply(
            resource, body=obj, namespace=obj["metadata"].get("namespace"), field_manager=MANAGER,
            force_conflicts=True))

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.dynamic.exceptions import NotFoundError

        with _refusals():
            resource = self._resource(api_version, kind)

        def get() -> dict[str, Any] | None:
            try:
                return self._dynamic.get(resource, name=name, namespace=namespace).to_dict()
            except NotFoundError:
                return None
        return self._send(get)

    def patch_status(self, ref: ObjectRef, status: dict[str, Any]) -> None:
        from kubernetes.dynamic.exceptions import NotFoundError

        with _refusals():
            resource = self._resource(ref.api_version, ref.kind).subresources["status"]

        def patch() -> None:
            with suppress(NotFoundError):  # deleted while its pool's tick ran
                self._dynamic.patch(resource, body={"status": status}, name=ref.name, namespace=ref.namespace,
                                    content_type="application/merge-patch+json")
        self._send(patch)


def throttled_call(request: Callable[[], T], throttle: Throttle, sleep: Callable[[float], None] = time.sleep) -> T:
    """Sends the request when the throttle says; one answered 429 is retried after the Retry-After it
    names (else after the next of THROTTLED_BACKOFFS), counted in the throttle rather than logged."""
    for backoff in (*THROTTLED_BACKOFFS, None):
        sleep(throttle.delay())
        try:
            with _refusals():
                return request()
        except KubeError as exc:
            if exc.status != 429 or backoff is None:
                raise
            throttle.throttled()
            sleep(exc.retry_after if exc.retry_after is not None else backoff)
    raise AssertionError("unreachable")


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
        raise KubeError(int(getattr(exc, "status", 0) or 0), _message(exc), _retry_after(exc)) from exc


def _retry_after(exc: Exception) -> float | None:
    """The Retry-After the API server sent with a 429, in seconds."""
    headers = getattr(exc, "headers", None) or {}
    try:
        return float(headers["Retry-After"])
    except (KeyError, TypeError, ValueError):
        return None


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


def throttled_session(info: Any, throttle: Throttle) -> Any:
    """kopf's session (a kopf.AiohttpSession) for these credentials (a kopf.ConnectionInfo), built as
    kopf builds its own, but whose requests take the Throttle's token first (watches excepted: one
    long request each)."""
    import asyncio

    import aiohttp
    import kopf

    async def wait_turn(_session: Any, _ctx: Any, params: aiohttp.TraceRequestStartParams) -> None:
        if params.url.query.get("watch") != "true" and (delay := throttle.delay()) > 0:
            await asyncio.sleep(delay)  # not even a yield without one: kopf may close the session meanwhile

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(wait_turn)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=info.as_ssl_context()),
                                    headers=info.as_http_headers(), auth=info.as_aiohttp_basic_auth(),
                                    proxy=info.proxy_url, trust_env=info.trust_env, trace_configs=[trace])
    return kopf.AiohttpSession(aiohttp_session=session, server=info.server, priority=info.priority,
                               default_namespace=info.default_namespace, expiration=info.expiration)
