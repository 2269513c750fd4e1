"""The router's subcommand, `loraplex router`. Arguments are declared here; the command imports its
module only when it runs (`loraplex up`, which checks --router-arg with them, lives in local/)."""

from __future__ import annotations

import argparse

from loraplex.cli import CommandRegistry, run_module
from loraplex.routing.flags import add_routing_args
from loraplex.util.args import existing_file

DEFAULT_MAX_REQUEST_BYTES = 8 << 20


def register(registry: CommandRegistry) -> None:
    registry.add("router", "Run the router: an OpenAI-compatible endpoint in front of a pool of agents",
                 add_router_args, run_module("loraplex_router.main"),
                 check=run_module("loraplex_router.main", "check_args"))


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the pool's routing store")
    p.add_argument("--pool", default="default", help="pool name (the AdapterPool's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--base-model", default=None, help="name of the base model in the API; default: the "
                   "name the agents register")
    p.add_argument("--api-keys", type=existing_file, default=None, metavar="FILE", help="YAML/JSON file of API keys with "
                   "per-key adapter lists (see docs/router.md); default: no authentication")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between store polls")
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--max-attempts", type=int, default=3, help="servers tried per request before 502")
    _outlier_args(p)
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="largest request body; a larger one is answered 413 without being read to the end "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES >> 20} MiB: a prompt filling a 128k-token context "
                        "is about 0.5 MB as text and 1 MB as token ids, so this leaves room many times over, "
                        "while no request makes the router buffer more; the agents' default is the same)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--seed", type=int, default=None, help="seed the routing profile's random source, so a run "
                   "repeats its picks (benchmarks); default: unseeded")
    _extproc_args(p)
    add_routing_args(p)


def _extproc_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--extproc-port", type=int, default=0, metavar="PORT",
                   help="also serve the Gateway API Inference Extension's endpoint picker (Envoy ext_proc v3, "
                   "gRPC) on this port, for an InferencePool's endpointPickerRef; 0: off (docs/gateway.md)")
    p.add_argument("--extproc-host", default=None, help="the picker's address; default: --host")
    p.add_argument("--extproc-shed-queue-depth", type=int, default=0, metavar="N",
                   help="the picker answers 429 when every server it may choose has N or more open requests; "
                   "0: never shed")


def _outlier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ttfb-deadline", type=float, default=10.0, metavar="SECONDS",
                   help="a streamed request whose first chunk has not come after this long is given up and sent "
                   "to another server (nothing has reached the client). Default 10 s: a long prompt's prefill on "
                   "a busy CPU agent takes seconds, so this leaves room, and a server that stopped altogether "
                   "(its heartbeat late too) is left much sooner; the deadline also grows to 4 x the recent p90 "
                   "time to first chunk when every server gets slow, so overload is not answered with retries. "
                   "A non-streamed answer comes whole, so past the deadline its server's /health is probed "
                   "instead (once per deadline): no 200 within 2 s and the request goes elsewhere. 0: no deadline")
    p.add_argument("--eject-after", type=int, default=3, metavar="N",
                   help="eject a server (no requests for a while) after N deadline misses (a failed /health "
                   "probe included) or broken connections in a row; at once when a connection is refused or its "
                   "heartbeat is late while it keeps a request waiting. 0: never eject")
    p.add_argument("--ejection-time", type=float, default=5.0, metavar="SECONDS",
                   help="the first ejection's length; the k-th in a row lasts k times this (at most 60 s). A server "
                   "ejected for a late heartbeat is back as soon as it heartbeats again")
    p.add_argument("--max-ejected-fraction", type=float, default=0.5, metavar="F",
                   help="at most this fraction of the live servers is ejected at once (at least one, never all)")
