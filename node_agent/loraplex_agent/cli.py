"""The agent's subcommands. Arguments are declared here so that `loraplex --help` stays fast;
each command imports its (torch-using) module only when it runs."""

from __future__ import annotations

import argparse
import importlib
import os

from loraplex.cli import CommandRegistry, run_module
from loraplex.spec.engine_settings import add_agent_settings, add_engine_settings
from loraplex.util.args import existing_dir

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
DEFAULT_STALL_TIMEOUT_S = 60.0  # far above any step's duration (chunked prefill bounds a step's tokens)


def register(registry: CommandRegistry) -> None:
    registry.add("make-tiny-model", "Write a tiny random Llama model and random PEFT adapters "
                 "(tests, demos and benchmarks use it; nothing is downloaded)",
                 _tiny_model_args, run_module("loraplex_agent.tools.tiny_model"))
    registry.add("agent", "Run the node agent: the engine behind an OpenAI-compatible server (or, with "
                 "--backend vllm, beside an unmodified vLLM server)", _agent_args, _run_agent)
    registry.add("profile", "Time the real engine over a grid and fit the digital twin's latency profile "
                 "(or, with --check, measure the twin's fidelity)", _profile_args, run_module("loraplex_agent.tools.profile"))


def _run_agent(args: argparse.Namespace) -> int:
    """Our engine, or the sidecar of a vLLM server (which imports no torch)."""
    module = "loraplex_agent.vllm_backend.server" if args.backend == "vllm" else "loraplex_agent.api.server"
    return importlib.import_module(module).run(args)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine settings shared by the agent, `loraplex profile` and the benchmarks."""
    add_engine_settings(p)  # the ones an AdapterPool's spec.engine sets too
    add_agent_settings(p)  # the engine's own


def _tiny_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="output folder: OUT/base holds the model, OUT/adapters/* the adapters")
    p.add_argument("--adapters", type=int, default=4, help="number of random PEFT adapters")
    p.add_argument("--alora-adapters", type=int, default=0,
                   help="number of activated LoRA adapters (aloraNN: loraNN's weights, invoked by '<|check|>\\n')")
    p.add_argument("--ranks", default="8,16,32,64", help="adapter ranks, cycled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8000)


def _agent_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=existing_dir, required=True, help="local Hugging Face model folder")
    p.add_argument("--served-model-name", default=None, help="name of the base model in the API")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   help="a PEFT adapter folder to load at start (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="bearer key required by every /v1 endpoint, inference included (as vLLM's --api-key)")
    p.add_argument("--admin-api-key", default=os.environ.get("LORAPLEX_API_KEY"), metavar="KEY",
                   help="bearer key required by the admin endpoints only: adapter load/unload and peer adapter "
                        "fetches (env LORAPLEX_API_KEY; the operator sets it from agentApiKeySecret). Default: "
                        "--api-key")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="largest request body; a larger one is answered 413 without being read to the end "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES >> 20} MiB: a prompt filling a 128k-token context "
                        "is about 0.5 MB as text and 1 MB as token ids, so this leaves room many times over, "
                        "while no request makes the server buffer more)")
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S, metavar="SECONDS",
                   help="an engine step running longer than this (a hung device) makes /health answer 503 and "
                        "takes the agent out of its pool's registry until the step ends; 0: never "
                        f"(default {DEFAULT_STALL_TIMEOUT_S:g} s, far above any step's duration)")
    add_engine_args(p)
    p.set_defaults(max_lora_rank=None)  # sized from the --adapter folders (loraplex_agent.api.server)
    _backend_args(p)
    _cluster_args(p)


def _backend_args(p: argparse.ArgumentParser) -> None:
    """--backend vllm: the agent beside an unmodified vLLM OpenAI server (docs/vllm.md)."""
    g = p.add_argument_group("engine backend")
    g.add_argument("--backend", choices=["loraplex", "vllm"], default=os.environ.get("LORAPLEX_BACKEND", "loraplex"),
                   help="loraplex: our engine in this process; vllm: a vLLM OpenAI server beside the agent, which "
                        "registers it in the pool and loads its adapters (needs --redis-url)")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="a flag for the vLLM server the agent starts (repeatable), e.g. --vllm-arg=--enforce-eager; "
                        "they come after the agent's own, so they win")
    g.add_argument("--vllm-url", default=os.environ.get("LORAPLEX_VLLM_URL"),
                   help="a vLLM server already running beside the agent (in Kubernetes the pod's second "
                        "container), on the loopback; without it the agent starts one")
    g.add_argument("--vllm-advertise-url", default=os.environ.get("LORAPLEX_VLLM_ADVERTISE_URL"),
                   help="URL the router sends requests to (default: the vLLM server's own URL)")
    g.add_argument("--vllm-host", default=None, help="address the started vLLM server listens on (default: --host)")
    g.add_argument("--vllm-port", type=int, default=None, help="port of the started vLLM server (default: --port + 1)")
    g.add_argument("--vllm-python", default=None,
                   help="interpreter with vllm installed (default: env LORAPLEX_VLLM_PYTHON, else this one)")
    g.add_argument("--vllm-log", default=None, help="the started vLLM server's log file (default: in $TMPDIR)")
    g.add_argument("--vllm-scheduler-cls", default=None, metavar="CLASS",
                   help="vLLM's --scheduler-cls, e.g. loraplex_vllm_scheduler.SJFScheduler (docs/vllm.md)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="vllm: adapters its CPU LoRA cache holds (default: --max-loras); the placement assigns the "
                        "server at most this many")


def _cluster_args(p: argparse.ArgumentParser) -> None:
    """Pool membership (loraplex_agent.cluster); without --redis-url the agent runs alone."""
    from loraplex_agent.cluster.limits import DEFAULT_MAX_BYTES, DEFAULT_SCHEMES

    g = p.add_argument_group("pool membership (with --redis-url)")
    g.add_argument("--redis-url", default=os.environ.get("LORAPLEX_REDIS_URL"),
                   help="join a pool through this Redis: register, heartbeat, prefetch assigned adapters, "
                   "serve them to peers (env LORAPLEX_REDIS_URL)")
    g.add_argument("--pool", default=os.environ.get("LORAPLEX_POOL", "default"), help="pool name")
    g.add_argument("--server-id", default=os.environ.get("LORAPLEX_SERVER_ID"),
                   help="this server's stable id (default: the host name)")
    g.add_argument("--advertise-url", default=os.environ.get("LORAPLEX_ADVERTISE_URL"),
                   help="URL the router and peers use to reach this agent (default: http://HOST:PORT)")
    g.add_argument("--adapter-store", default=None, help="folder for fetched adapters "
                   "(default: $TMPDIR/loraplex-adapters/SERVER_ID; a tmpfs keeps them in memory)")
    g.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds between heartbeats")
    g.add_argument("--heartbeat-ttl", type=float, default=10.0,
                   help="the registry forgets a silent server after this many seconds")
    g.add_argument("--source-schemes", default=",".join(sorted(DEFAULT_SCHEMES)),
                   help="adapter source schemes allowed (add http only for trusted local sources)")
    g.add_argument("--max-adapter-bytes", type=float, default=DEFAULT_MAX_BYTES,
                   help="largest adapter the agent fetches, in bytes")


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=existing_dir, required=True, help="local Hugging Face model folder")
    p.add_argument("--adapters", default=None, help="folder of PEFT adapters; default: MODEL/../adapters")
    p.add_argument("--out", default=None, help="write the profile (or the --check table) as JSON here")
    p.add_argument("--name", default=None, help="profile name; default: the --out file's stem")
    p.add_argument("--quick", action="store_true", help="a small grid (tests)")
    p.add_argument("--check", default=None, metavar="PROFILE",
                   help="compare this profile's twin with the real engine at three loads instead")
    p.add_argument("--duration", type=float, default=60.0, help="--check: seconds of trace per load")
    p.add_argument("--loads", default="0.25,0.5,0.75", help="--check: loads, as fractions of the twin's saturation rate")
    p.add_argument("--wall-clock", action="store_true",
                   help="time steps in wall time (default: the engine thread's CPU time; needs --threads 1)")
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(threads=1)  # profile and use alike: the CPU time of one thread is the steady signal
