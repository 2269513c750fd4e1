"""`loraplex router`: build the app from command-line arguments and serve it with uvicorn.

Whatever can fail at start (arguments, the port, Redis) is checked before uvicorn starts and fails
with one line, never a traceback.
"""

from __future__ import annotations

import argparse
import logging

import uvicorn

from loraplex.routing.choice import RoutingChoice, build_profile
from loraplex.routing.outliers import OutlierConfig
from loraplex.routing.pipeline import Profile, parse_weights
from loraplex.routing.rank_aware import parse_options
from loraplex.spec.errors import CommandError, LoraplexError
from loraplex.startup import listen_socket, open_store
from loraplex_router.app import RouterSettings, create_app
from loraplex_router.auth import KeyRing, load_keys


def profile_from_args(args: argparse.Namespace) -> Profile:
    """The flags' profile; the routing table's choice replaces it while the table names one."""
    try:
        scorers = parse_weights(args.scorers) if args.scorers else None
        choice = RoutingChoice(args.profile, parse_options(getattr(args, "routing_option", None) or []))
        return build_profile(choice, scorers=scorers, picker=args.picker)
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
    with listen_socket(args.host, args.port) as sock:
        # Redis may start after the router (a fresh install): wait for it, answering /ready 503.
        store = open_store(args.redis_url, args.pool, required=False)
        try:
            server = uvicorn.Server(uvicorn.Config(create_app(store, settings), log_level=args.log_level,
                                                  access_log=False))
            logging.getLogger("uvicorn.error").info("router listening on http://%s:%d", args.host, args.port)
            server.run(sockets=[sock])
        finally:
            store.close()
    return 0
