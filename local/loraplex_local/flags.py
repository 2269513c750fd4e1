"""`loraplex up`'s flags, checked before anything starts: its own, and those it passes on to the agents
(--agent-arg) and the router (--router-arg), each checked by that command's own parser."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.cli import build_registry
from loraplex.placement.policy import POLICY_NAMES
from loraplex.spec.errors import CommandError

# Router flags the stack sets itself: it connects the router to its Redis and pool, and waits on its port.
STACK_ROUTER_FLAGS = ("--redis-url", "--pool", "--port")
# Agent flags the stack sets itself (stack._agent_argv): where each agent listens and is reached, its model,
# pool, adapter store and heartbeats, its backend and the vLLM server beside it.
STACK_AGENT_FLAGS = ("--host", "--port", "--model", "--redis-url", "--pool", "--server-id", "--advertise-url",
                     "--adapter-store", "--heartbeat-interval", "--heartbeat-ttl", "--backend", "--vllm-port",
                     "--vllm-log", "--vllm-python")
ROUTER_POLL_INTERVAL_S = 0.5  # how often the stack's router reads the registry (the agents' heartbeats)


@dataclass
class StackConfig:
    agents: int = 3
    manifests: Path | None = None
    model: Path | None = None            # the base model folder; default: the tiny model
    pool: str | None = None
    router_port: int = 8080
    agent_base_port: int = 8100
    redis_port: int = 6390
    redis_url: str | None = None         # use a running Redis instead of starting one
    placement: str | None = None
    placement_interval_s: float | None = None
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 6.0
    workdir: Path = Path(".loraplex")
    agent_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 180.0
    backend: str | None = None           # loraplex or vllm; default: the AdapterPool's engine.backend
    vllm_args: list[str] = field(default_factory=list)  # extra flags of every vLLM server
    vllm_python: str | None = None       # interpreter with vllm (default: env LORAPLEX_VLLM_PYTHON)
    restart: bool = False                # restart children that exit (`loraplex up`); else only say so


MODEL_CONFIG = "config.json"
ADAPTER_CONFIG = "adapter_config.json"


def base_model_folder(folder: Path) -> Path:
    """The base model's folder that `--model` names (the folder itself, or its base/ as make-tiny-model
    writes it); CommandError when it is none, before anything starts: the agents would fail later."""
    model = folder / "base" if (folder / "base").is_dir() else folder
    if (model / ADAPTER_CONFIG).is_file():
        raise CommandError(f"--model {folder}: an adapter folder ({ADAPTER_CONFIG}); --model takes the base "
                           f"model's folder ({MODEL_CONFIG}), adapters come from -f or the model folder's adapters/")
    if not (model / MODEL_CONFIG).is_file():
        raise CommandError(f"--model {folder}: no {MODEL_CONFIG}; --model takes a Hugging Face model folder "
                           "(`loraplex make-tiny-model models/tiny` makes the tiny one)")
    return model


def router_args_from(args: argparse.Namespace) -> list[str]:
    """The router's flags: the routing ones, then --router-arg verbatim (last: a later flag wins in
    argparse). CommandError, before anything starts, for what `loraplex router` would refuse."""
    router_args = ["--profile", args.profile]
    if args.scorers:
        router_args += ["--scorers", args.scorers]
    if args.picker:
        router_args += ["--picker", args.picker]
    for option in args.routing_option:
        router_args += ["--routing-option", option]
    _refuse_owned("--router-arg", args.router_arg, STACK_ROUTER_FLAGS)
    router_args += args.router_arg
    build_registry("router").check_args("router", router_args)
    return router_args


def agent_args_from(args: argparse.Namespace) -> list[str]:
    """--agent-arg verbatim. CommandError, before anything starts, for what `loraplex agent` would refuse
    (checked with the agent's own parser, through the command registry of the core: a component imports
    no other component) and for a flag the stack sets itself."""
    _refuse_owned("--agent-arg", args.agent_arg, STACK_AGENT_FLAGS)
    build_registry("agent").check_args("agent", args.agent_arg)
    return list(args.agent_arg)


def _refuse_owned(option: str, values: list[str], owned: tuple[str, ...]) -> None:
    taken = [value for value in values if value.split("=", 1)[0] in owned]
    if taken:
        raise CommandError(f"{option}={taken[0]}: `loraplex up` sets it itself (its own flags: "
                           "`loraplex up --help`)")


def config_from_args(args: argparse.Namespace) -> StackConfig:
    if args.agents < 1:
        raise CommandError("--agents must be at least 1")
    manifests = Path(args.manifests) if args.manifests else None
    if manifests is not None and not manifests.is_dir():
        raise CommandError(f"-f {args.manifests}: not a folder")
    if args.placement is not None and args.placement not in POLICY_NAMES:
        raise CommandError(f"--placement: unknown placement policy {args.placement!r}; choose one of "
                           f"{', '.join(POLICY_NAMES)}")
    if args.placement_interval is not None and not args.placement_interval > 0:
        raise CommandError("--placement-interval must be positive")
    if not args.heartbeat_ttl > 0:
        raise CommandError("--heartbeat-ttl must be positive")
    if args.model:
        base_model_folder(Path(args.model))
    return StackConfig(agents=args.agents, manifests=manifests, model=Path(args.model) if args.model else None,
                       pool=args.pool, router_port=args.port, agent_base_port=args.agent_base_port,
                       redis_port=args.redis_port, redis_url=args.redis_url, placement=args.placement,
                       placement_interval_s=args.placement_interval, heartbeat_ttl_s=args.heartbeat_ttl,
                       workdir=Path(args.workdir), agent_args=agent_args_from(args),
                       router_args=router_args_from(args),
                       backend=getattr(args, "backend", None), vllm_args=list(getattr(args, "vllm_arg", [])),
                       vllm_python=getattr(args, "vllm_python", None), restart=True)
