"""`loraplex up`, the local driver of the pool control plane. Arguments are declared here; the command
imports its module only when it runs."""

from __future__ import annotations

import argparse

from loraplex.cli import CommandRegistry, run_module
from loraplex.routing.flags import add_routing_args
from loraplex.util.args import existing_dir


def register(registry: CommandRegistry) -> None:
    registry.add("up", "Run the whole system on this machine: Redis, N agents on the tiny model, the "
                 "placement controller and the router; applies AdapterPool/LoRADeployment YAML",
                 _up_args, run_module("loraplex_local.stack"))


def _up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agents", type=int, default=3, help="number of agents")
    p.add_argument("-f", "--file", dest="manifests", type=existing_dir, default=None, metavar="DIR",
                   help="folder of AdapterPool / LoRADeployment YAML, watched for changes; default: one "
                   "deployment per adapter of the model folder (the tiny model's 4)")
    p.add_argument("--model", type=existing_dir, default=None, help="base model folder; default: the tiny model in "
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
                   help="extra argument for every agent (repeatable), any `loraplex agent` flag but those the stack "
                        "sets itself (--port, --model, --redis-url, --pool...), e.g. --agent-arg=--num-blocks=64")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the router (repeatable), any `loraplex router` flag, e.g. "
                        "--router-arg=--ttfb-deadline=30 or --router-arg=--api-keys=keys.yaml")
    p.add_argument("--backend", choices=["loraplex", "vllm"], default=None,
                   help="the agents' engine: ours, or an unmodified vLLM server beside each agent (default: the "
                        "AdapterPool's engine.backend, else loraplex); docs/vllm.md")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for every vLLM server (repeatable), e.g. --vllm-arg=--enforce-eager")
    p.add_argument("--vllm-python", default=None,
                   help="interpreter with vllm installed (default: env LORAPLEX_VLLM_PYTHON, else ./.venv-vllm)")
    add_routing_args(p)


