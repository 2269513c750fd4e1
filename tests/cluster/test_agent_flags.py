"""Every field of an AdapterPool's `spec.engine` reaches the agents, in Kubernetes (the operator's pod)
and locally (`loraplex up -f`): both translate through loraplex.spec.agent_flags. Each field is set to
a value other than its default, the agent's own parser reads the command line each mode makes, and
the setting must come out. A new engine field fails here until it is given a row."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from loraplex_local.stack import LocalStack, ManifestError, StackConfig
from loraplex_operator.config import OperatorConfig
from loraplex_operator.pool_objects import PoolRef, agent_settings, build_statefulset

from loraplex.cli import CommandRegistry
from loraplex.spec.crd import AdapterPoolSpec, EngineSpec, VllmSpec
from loraplex.util.args import existing_dir, existing_file

REF = PoolRef("tiny", "serving", "uid-1")
CONFIG = OperatorConfig(redis_url="redis://redis:6379/0", agent_image="agent:1")
BASE = {"baseModel": {"name": "tiny-llama", "source": "hf://meta/llama"}}

# field (camelCase, as in YAML): (value, the agent's argparse dest, what it must read)
ENGINE = {
    "maxModelLen": (512, "max_model_len", 512),
    "maxLoraRank": (32, "max_lora_rank", 32),
    "maxLoras": (4, "max_loras", 4),
    "maxNumSeqs": (7, "max_num_seqs", 7),
    "maxNumBatchedTokens": (256, "max_num_batched_tokens", 256),
    "longPrefillTokenThreshold": (128, "long_prefill_token_threshold", 128),
    "blockSize": (32, "block_size", 32),
    "kvCacheMemoryGib": (3.5, "kv_cache_memory", 3.5),
    "scheduler": ("chameleon", "scheduler", "chameleon"),
    "schedulerOptions": ({"refresh_s": "60"}, "scheduler_option", ["refresh_s=60"]),
    "memoryPolicy": ("lru-static", "memory_policy", "lru-static"),
    "prefixCache": (False, "no_prefix_cache", True),
    "memoryOptions": ({"busy": "0.9"}, "memory_option", ["busy=0.9"]),
    "extraArgs": (["--num-blocks", "64"], "num_blocks", 64),
}
# Fields a row's value needs beside it (the options of a policy other than the default)
COMPANIONS = {"schedulerOptions": {"scheduler": "chameleon"}}
BASE_MODEL = {"name": ("other-llama", "served_model_name", "other-llama"),
              "dtype": ("float32", "dtype", "float32")}
# With backend vllm: what the agent reads, locally (where it starts the vLLM server itself) and in a pod.
VLLM_AGENT = {"backend": ("vllm", "backend", "vllm"), "maxCpuLoras": (12, "max_cpu_loras", 12)}
VLLM_LAUNCH = {"schedulerCls": ("plugin.Scheduler", "vllm_scheduler_cls", "plugin.Scheduler"),
               "args": (["--enforce-eager"], "vllm_arg", ["--enforce-eager"])}
# In a pod these go to the vLLM container (its image, environment and port), not to the agent.
VLLM_CONTAINER_ONLY = {"image", "env", "port"}


def _agent_parser() -> argparse.ArgumentParser:
    """The agent's own parser, less its checks that a path exists: the paths are the pod's."""
    from loraplex_agent import cli

    registry = CommandRegistry()
    cli.register(registry)
    _without_path_checks(registry.parser)
    return registry.parser


def _without_path_checks(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if action.type in (existing_dir, existing_file):
            action.type = None
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _without_path_checks(sub)


def _parse(argv: list[str]) -> argparse.Namespace:
    return _agent_parser().parse_args(argv)


def _spec(engine: dict[str, Any] | None = None, **base_model: Any) -> AdapterPoolSpec:
    return AdapterPoolSpec.model_validate({"baseModel": {**BASE["baseModel"], **base_model}, "engine": engine or {}})


def _pod_agent(spec: AdapterPoolSpec) -> argparse.Namespace:
    """The agent container's args with every $(VAR) replaced from the ConfigMap and the pod's env."""
    agent = build_statefulset(REF, spec, CONFIG, replicas=1)["spec"]["template"]["spec"]["containers"][0]
    env = agent_settings(REF, spec, CONFIG) | {e["name"]: e.get("value", "") for e in agent["env"]}
    return _parse([re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a) for a in agent["args"]])


def _local_agent(spec: AdapterPoolSpec, folder: Path) -> argparse.Namespace:
    pool = {"apiVersion": "loraplex.io/v1alpha1", "kind": "AdapterPool", "metadata": {"name": "tiny"},
            "spec": spec.model_dump(by_alias=True, exclude_none=True)}
    (folder / "pool.yaml").write_text(yaml.safe_dump(pool))
    stack = LocalStack(StackConfig(manifests=folder, workdir=folder / "work"))
    argv = stack._agent_argv(Path("/models/tiny"), "tiny-0", 0)
    return _parse(argv[argv.index("agent"):])


MODES = {"kubernetes": lambda spec, tmp_path: _pod_agent(spec), "local": _local_agent}


def test_every_engine_field_has_a_row():
    engine_rows = set(ENGINE) | set(VLLM_AGENT) | {"vllm"}
    assert {f.alias for f in EngineSpec.model_fields.values()} == engine_rows
    assert {f.alias for f in VllmSpec.model_fields.values()} == set(VLLM_LAUNCH) | VLLM_CONTAINER_ONLY


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("field", ENGINE)
def test_an_engine_field_reaches_the_agent(mode, field, tmp_path):
    value, dest, expected = ENGINE[field]
    companions = COMPANIONS.get(field, {})
    default = getattr(MODES[mode](_spec(companions), tmp_path), dest)
    assert default != expected, "the row's value must differ from the default to show anything"
    assert getattr(MODES[mode](_spec({field: value, **companions}), tmp_path), dest) == expected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("field", BASE_MODEL)
def test_a_base_model_field_reaches_the_agent(mode, field, tmp_path):
    value, dest, expected = BASE_MODEL[field]
    assert getattr(MODES[mode](_spec(**{field: value}), tmp_path), dest) == expected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("field", VLLM_AGENT)
def test_a_vllm_field_reaches_the_agent(mode, field, tmp_path):
    value, dest, expected = VLLM_AGENT[field]
    assert getattr(MODES[mode](_spec({"backend": "vllm", "maxLoraRank": 16, field: value}), tmp_path), dest) == expected


@pytest.mark.parametrize("field", VLLM_LAUNCH)
def test_a_vllm_server_field_reaches_the_local_agent_and_the_pods_vllm_container(field, tmp_path):
    value, dest, expected = VLLM_LAUNCH[field]
    spec = _spec({"backend": "vllm", "maxLoraRank": 16, "vllm": {field: value}})
    assert getattr(_local_agent(spec, tmp_path), dest) == expected
    vllm = build_statefulset(REF, spec, CONFIG, replicas=1)["spec"]["template"]["spec"]["containers"][1]
    assert all(str(v) in " ".join(vllm["args"]) for v in (expected if isinstance(expected, list) else [expected]))


def test_the_vllm_server_is_sized_by_the_pool_in_both_modes(tmp_path):
    spec = _spec({"backend": "vllm", "maxLoraRank": 16, "maxModelLen": 512, "maxNumSeqs": 7}, dtype="float32")
    local = _local_agent(spec, tmp_path)
    assert (local.max_model_len, local.max_num_seqs, local.dtype) == (512, 7, "float32")
    args = build_statefulset(REF, spec, CONFIG, replicas=1)["spec"]["template"]["spec"]["containers"][1]["args"]
    flags = dict(zip(args, args[1:], strict=False))
    assert (flags["--max-model-len"], flags["--max-num-seqs"], flags["--dtype"]) == ("512", "7", "float32")


def test_up_refuses_an_engine_policy_the_agents_would_refuse(tmp_path):
    with pytest.raises(ManifestError, match="engine: "):
        _local_agent(_spec({"memoryPolicy": "no-such-policy"}), tmp_path)


def test_up_starts_agents_with_the_pools_memory_and_scheduler(tmp_path):
    spec = _spec({"memoryPolicy": "lru-static", "prefixCache": False, "scheduler": "chameleon",
                  "kvCacheMemoryGib": 2})
    agent = _local_agent(spec, tmp_path)
    assert (agent.memory_policy, agent.no_prefix_cache, agent.scheduler, agent.kv_cache_memory) == \
        ("lru-static", True, "chameleon", 2.0)
