"""The router's subcommands: `loraplex router`, `loraplex up` and `loraplex bench router`.
Arguments are declared here; each command imports its module only when it runs."""

from __future__ import annotations

import argparse
import importlib

from loraplex.cli import CommandRegistry

DEFAULT_MAX_REQUEST_BYTES = 8 << 20


def register(registry: CommandRegistry) -> None:
    registry.add("router", "Run the router: an OpenAI-compatible endpoint in front of a pool of agents",
                 _router_args, _run("loraplex_router.main"))
    registry.add("up", "Run the whole system on this machine: Redis, N agents on the tiny model, the "
                 "placement controller and the router; applies AdapterPool/LoRADeployment YAML",
                 _up_args, _run("loraplex_router.local_stack"))
    registry.add("bench router", "Measure the router's added latency and throughput against calling an "
                 "agent directly", _bench_args, _run("loraplex_router.bench"))


def _run(module: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).run(args)
    return run


def add_routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="loraserve", help="routing profile: loraserve (φ-weighted random) "
                   "or load-aware (φ + queue depth + residency)")
    p.add_argument("--scorers", default=None, metavar="NAME=W,...",
                   help="override the profile's scorer weights, e.g. phi=1,queue=1,residency=0.5")
    p.add_argument("--picker", default=None, help="override the profile's picker: weighted-random or max-score")


def _router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the pool's routing store")
    p.add_argument("--pool", default="default", help="pool name (the AdapterPool's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--base-model", default=None, help="name of the base model in the API; default: the "
                   "name the agents register")
    p.add_argument("--api-keys", default=None, metavar="FILE", help="YAML/JSON file of API keys with "
                   "per-key adapter lists (see docs/router.md); default: no authentication")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between store polls")
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--max-attempts", type=int, default=3, help="servers tried per request before 502")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="largest request body; a larger one is answered 413 without being read to the end "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES >> 20} MiB: a prompt filling a 128k-token context "
                        "is about 0.5 MB as text and 1 MB as token ids, so this leaves room many times over, "
                        "while no request makes the router buffer more; the agents' default is the same)")
    p.add_argument("--log-level", default="info")
    add_routing_args(p)


def _up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agents", type=int, default=3, help="number of agents")
    p.add_argument("-f", "--file", dest="manifests", default=None, metavar="DIR",
                   help="folder of AdapterPool / LoRADeployment YAML, watched for changes; default: one "
                   "deployment per adapter of the model folder (the tiny model's 4)")
    p.add_argument("--model", default=None, help="base model folder; default: the tiny model in "
                   "./models/tiny (made with `loraplex make-tiny-model` if missing)")
    p.add_argument("--pool", default=None, help="pool name; default: the AdapterPool in -f, else 'local'")
    p.add_argument("--port", type=int, default=8080, help="router port")
    p.add_argument("--agent-base-port", type=int, default=8100, help="agents listen on this port and up")
    p.add_argument("--redis-port", type=int, default=6390)
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting redis-server")
    p.add_argument("--placement", default=None, help="placement policy; default: the AdapterPool's, "
                   "else loraserve")
    p.add_argument("--placement-interval", type=float, default=None, help="seconds between placements")
    p.add_argument("--heartbeat-ttl", type=float, default=6.0)
    p.add_argument("--workdir", default=".loraplex", help="logs and fetched adapters go here")
    p.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every agent (repeatable), e.g. --agent-arg=--num-blocks=64")
    add_routing_args(p)


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=400, help="requests per measurement")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients for the throughput run")
    p.add_argument("--upstream", choices=["echo", "agent"], default="echo",
                   help="echo: a minimal OpenAI-shaped server (isolates the router's own cost); "
                   "agent: a real agent on the tiny model")
    p.add_argument("--model", default=None, help="model folder for --upstream agent; default: ./models/tiny")
    p.add_argument("--stream", action="store_true", help="measure streaming requests")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", default=None, help="write the results as JSON here")
