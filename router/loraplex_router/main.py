"""`loraplex router`: build the app from command-line arguments and serve it with uvicorn.

Whatever can fail at start (arguments, the port, Redis) is checked before uvicorn starts and fails
with one line, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import random

import uvicorn

from loraplex.routing.choice import RoutingChoice, build_profile
from loraplex.routing.outliers import OutlierConfig
from loraplex.routing.pipeline import Profile, parse_weights
from loraplex.routing.rank_aware import parse_options
from loraplex.spec.errors import CommandError, LoraplexError
from loraplex.startup import listen_socket, open_store
from loraplex_router.app import RouterSettings, create_app
from loraplex_router.auth import KeyRing, load_keys
from loraplex_router.extproc.decision import PickerSettings
from loraplex_router.extproc.server import ExtProcConfig, picker_service


def profile_from_args(args: argparse.Namespace) -> Profile:
    """The flags' profile; the routing table's choice replaces it while the table names one."""
    try:
        scorers = parse_weights(args.scorers) if args.scorers else None
        choice = RoutingChoice(args.profile, parse_options(getattr(args, "routing_option", None) or []))
        seed = getattr(args, "seed", None)
        rng = random.Random(seed) if seed is not None else None
        return build_profile(choice, rng, scorers=scorers, picker=args.picker)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    try:
        keys = load_keys(args.api_keys) if args.api_keys else KeyRing()
    except LoraplexError as exc:
        raise CommandError(exc.message) from exc
    if args.max_attempts < 1:
        raise CommandError("--max-attempts must be at least 1")
    if args.max_request_bytes < 1:
        raise CommandError("--max-request-bytes must be at least 1")
    if not args.ttfb_deadline >= 0:
        raise CommandError("--ttfb-deadline must be >= 0 (0: no deadline)")
    return RouterSettings(profile=profile_from_args(args), profile_name=args.profile, keys=keys,
                          base_model=args.base_model, poll_interval_s=args.poll_interval,
                          connect_timeout_s=args.connect_timeout,
                          max_attempts=args.max_attempts, max_request_bytes=args.max_request_bytes,
                          ttfb_deadline_s=args.ttfb_deadline, outliers=outliers_from_args(args))


def extproc_from_args(args: argparse.Namespace) -> ExtProcConfig | None:
    """The endpoint picker's settings, None when --extproc-port is 0."""
    if not 0 <= args.extproc_port <= 65535:
        raise CommandError("--extproc-port must be a port number (0: no endpoint picker)")
    if args.extproc_shed_queue_depth < 0:
        raise CommandError("--extproc-shed-queue-depth must be >= 0 (0: never shed)")
    if not args.extproc_port:
        return None
    if args.extproc_port == args.port:
        raise CommandError("--extproc-port must differ from --port")
    picker = PickerSettings(args.max_request_bytes, args.max_attempts - 1, args.extproc_shed_queue_depth)
    return ExtProcConfig(args.extproc_host or args.host, args.extproc_port, picker)


def check_args(args: argparse.Namespace) -> None:
    """What `loraplex router` refuses of its parsed flags (CommandError, one line), without starting it:
    `loraplex up` checks its --router-arg with it before anything starts."""
    settings_from_args(args)
    extproc_from_args(args)


def outliers_from_args(args: argparse.Namespace) -> OutlierConfig:
    if args.eject_after < 0:
        raise CommandError("--eject-after must be >= 0 (0: never eject)")
    if not args.ejection_time > 0:
        raise CommandError("--ejection-time must be positive")
    if not 0 <= args.max_ejected_fraction <= 1:
        raise CommandError("--max-ejected-fraction must be between 0 and 1")
    return OutlierConfig(consecutive=args.eject_after, base_ejection_s=args.ejection_time,
                         max_ejected_fraction=args.max_ejected_fraction)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    extproc = extproc_from_args(args)
    services = []
    if extproc is not None:
        with listen_socket(extproc.host, extproc.port):
            pass  # taken: fail here with one line, before anything starts
        services.append(picker_service(extproc, settings.keys, settings.poll_interval_s))
    with listen_socket(args.host, args.port) as sock:
        # Redis may start after the router (a fresh install): wait for it, answering /ready 503.
        store = open_store(args.redis_url, args.pool, required=False)
        try:
            app = create_app(store, settings, services)
            server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level,
                                                  access_log=False))
            logging.getLogger("uvicorn.error").info("router listening on http://%s:%d", args.host, args.port)
            server.run(sockets=[sock])
        finally:
            store.close()
    return 0
