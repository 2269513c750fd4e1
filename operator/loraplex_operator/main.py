"""`loraplex operator`: run the kopf operator.

Leader election is kopf peering: every replica gets a random priority, and a replica pauses while it
sees a peer with a higher one, so with two replicas exactly one acts and the other takes over
within the peering lifetime when the first dies."""

from __future__ import annotations

import argparse
import logging
import random
from typing import Any

from loraplex.spec.errors import CommandError
from loraplex.util.clock import WallClock
from loraplex_operator.config import OperatorConfig
from loraplex_operator.deps import Deps
from loraplex_operator.inspect_source import SourceInspector
from loraplex_operator.kopf_startup import share_toggle_waits
from loraplex_operator.kube import KopfEvents, KubeError, KubernetesApi
from loraplex_operator.throttle import QuietRetries, Throttle

MAX_PRIORITY = 1 << 30


def build_deps(config: OperatorConfig) -> Deps:
    from loraplex.routing.redis_store import RedisRoutingStore
    from loraplex.startup import redis_password

    throttle = Throttle(config.kube_qps, config.kube_burst)
    return Deps(config=config, kube=KubernetesApi(throttle=throttle), events=KopfEvents(), clock=WallClock(),
                store_factory=lambda pool: RedisRoutingStore.from_url(config.redis_url, pool,
                                                                      password=redis_password()),
                inspector=SourceInspector(), throttle=throttle)


def peering_objects(name: str, namespaces: list[str]) -> list[dict[str, Any]]:
    """kopf's peering objects, created at start so that peering is on from the first replica."""
    if not namespaces:
        return [{"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}]
    return [{"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": name, "namespace": ns}}
            for ns in namespaces]


def run(args: argparse.Namespace) -> int:
    import kopf

    from loraplex_operator import handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = OperatorConfig.from_env()
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    if args.redis_url:
        config = OperatorConfig(**{**config.__dict__, "redis_url": args.redis_url})
    priority = args.priority if args.priority is not None else random.SystemRandom().randrange(MAX_PRIORITY)
    namespaces = [ns for ns in (args.namespace or []) if ns]
    peering = args.peering or config.peering
    deps = _deps_or_refuse(config)
    quiet = QuietRetries(deps.throttle)  # kopf's objects' logger posts its lines as Events too: filter there
    for target in (logging.getLogger("kopf.objects"), *logging.getLogger().handlers):
        target.addFilter(quiet)
    if not args.standalone:
        _start_peering(deps, peering, namespaces)
    share_toggle_waits()
    # kopf makes peering mandatory whenever it is given a peering name: none when standalone.
    kopf.run(clusterwide=not namespaces, namespaces=namespaces, standalone=args.standalone,
             priority=priority, peering_name=None if args.standalone else peering,
             liveness_endpoint=args.liveness, memo=kopf.Memo(deps=deps))
    return 0


def _deps_or_refuse(config: OperatorConfig) -> Deps:
    """The dependencies, or one line when there is no cluster to talk to (no kubeconfig, none reachable)."""
    from kubernetes.config import ConfigException

    try:
        return build_deps(config)
    except ConfigException as exc:
        raise CommandError(f"no Kubernetes credentials: not in a pod, and no kubeconfig (KUBECONFIG or "
                           f"~/.kube/config): {exc}") from None
    except Exception as exc:  # urllib3 / the client's discovery: the API server did not answer
        raise CommandError(f"cannot reach the Kubernetes API server: {type(exc).__name__}: {exc}") from None


def _start_peering(deps: Deps, peering: str, namespaces: list[str]) -> None:
    """Creates the peering objects; without kopf's peering CRDs kopf would wait silently forever."""
    for obj in peering_objects(peering, namespaces):
        try:
            deps.kube.apply(obj)
        except KubeError as exc:
            if exc.status == 404:
                raise CommandError("kopf's peering CRDs are not installed: `kubectl apply --server-side -f crds/` "
                                   "(or install the Helm chart), or run a single replica with --standalone") from exc
            raise CommandError(f"cannot create the peering object {obj['metadata']['name']!r}: {exc}") from exc
