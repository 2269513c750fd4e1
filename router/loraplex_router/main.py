"""`loraplex router`: build the app from command-line arguments and serve it with uvicorn."""

from __future__ import annotations

import argparse

import uvicorn

from loraplex.cli import CommandError
from loraplex.routing.pipeline import make_profile, parse_weights
from loraplex.routing.redis_store import RedisRoutingStore
from loraplex.spec.errors import LoraplexError
from loraplex_router.app import RouterSettings, create_app
from loraplex_router.auth import KeyRing, load_keys


def profile_from_args(args: argparse.Namespace):
    try:
        scorers = parse_weights(args.scorers) if args.scorers else None
        return make_profile(args.profile, scorers=scorers, picker=args.picker)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    try:
        keys = load_keys(args.api_keys) if args.api_keys else KeyRing()
    except LoraplexError as exc:
        raise CommandError(exc.message) from exc
    if args.max_attempts < 1:
        raise CommandError("--max-attempts must be at least 1")
    return RouterSettings(profile=profile_from_args(args), keys=keys, base_model=args.base_model,
                          poll_interval_s=args.poll_interval, connect_timeout_s=args.connect_timeout,
                          max_attempts=args.max_attempts)


def run(args: argparse.Namespace) -> int:
    try:
        store = RedisRoutingStore.from_url(args.redis_url, args.pool)
    except ValueError as exc:
        raise CommandError(f"bad --redis-url or --pool: {exc}") from exc
    app = create_app(store, settings_from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    store.close()
    return 0
