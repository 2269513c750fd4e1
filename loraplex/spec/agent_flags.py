"""The one translation of an AdapterPool's spec into the flags of its `loraplex agent` processes.

The operator writes them into the agents' pod (each value through the pool's ConfigMap, so that one
edit of the ConfigMap and its hash is the whole change) and `loraplex up -f` passes them to the
local agents; both call `agent_flags`, so a field of `spec.engine` cannot reach one and not the
other. The flags that say where an agent is (model folder, ports, Redis, server id) are each mode's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.spec.crd import AdapterPoolSpec, EngineSpec
from loraplex.spec.engine_settings import AGENT_SETTINGS, ENGINE_SETTINGS


@dataclass(frozen=True)
class AgentFlag:
    """One agent flag. `value` None: a switch (the flag alone). `env`: the variable that carries the
    value in Kubernetes (the pod's args say `$(env)`); None: the value is written into the args.
    `launch_only`: read only by an agent that starts its vLLM server itself (`loraplex up`); in a pod
    the vLLM container is given it instead (the operator builds that container)."""

    flag: str
    value: str | None = None
    env: str | None = None
    launch_only: bool = False

    def argv(self, *, by_env: bool = False) -> list[str]:
        """The flag and its value (`$(env)` with `by_env` when the value travels in the environment)."""
        if self.value is None:
            return [self.flag]
        return [self.flag, f"$({self.env})" if by_env and self.env else self.value]


def agent_flags(spec: AdapterPoolSpec) -> list[AgentFlag]:
    """Every agent flag the pool spec makes, `engine.extra_args` excluded (they come last, verbatim)."""
    engine = spec.engine
    flags = [AgentFlag("--served-model-name", spec.base_model.name, "LORAPLEX_SERVED_MODEL_NAME")]
    if engine.backend == "vllm":
        return flags + _vllm_flags(spec)
    return flags + _shared_flags(spec) + _loraplex_flags(engine)


def _shared_flags(spec: AdapterPoolSpec) -> list[AgentFlag]:
    """What both backends' engines are sized by."""
    dtype = AGENT_SETTINGS["dtype"]
    return [AgentFlag(dtype.flag, spec.base_model.dtype, dtype.env),
            *_settings(spec.engine, "max_lora_rank", "max_loras", "max_num_seqs", "max_model_len")]


def _loraplex_flags(engine: EngineSpec) -> list[AgentFlag]:
    """Our engine's batching, memory and scheduling."""
    flags = _settings(engine, "max_num_batched_tokens", "long_prefill_token_threshold", "block_size", "scheduler",
                      "memory_policy", "kv_cache_memory_gib")
    if not engine.prefix_cache:
        flags.append(AgentFlag(AGENT_SETTINGS["no_prefix_cache"].flag))
    for name, options in (("scheduler_option", engine.scheduler_options), ("memory_option", engine.memory_options)):
        flags += [AgentFlag(AGENT_SETTINGS[name].flag, f"{key}={value}") for key, value in sorted(options.items())]
    return flags


# What an agent beside a running vLLM server still reads: the adapters it admits and loads.
_VLLM_AGENT_READS = frozenset({"--max-lora-rank", "--max-loras"})


def _vllm_flags(spec: AdapterPoolSpec) -> list[AgentFlag]:
    """The agent beside a vLLM server: the adapters its CPU cache holds; the rest sizes the server."""
    engine = spec.engine
    flags = [AgentFlag("--backend", "vllm"),
             AgentFlag("--max-cpu-loras", str(engine.adapter_slots), "LORAPLEX_MAX_CPU_LORAS")]
    flags += [AgentFlag(f.flag, f.value, f.env, launch_only=f.flag not in _VLLM_AGENT_READS)
              for f in _shared_flags(spec)]
    if engine.vllm.scheduler_cls:
        flags.append(AgentFlag("--vllm-scheduler-cls", engine.vllm.scheduler_cls, launch_only=True))
    # `--vllm-arg=--x`: written apart, the agent's parser would take `--x` for a flag of its own
    return flags + [AgentFlag(f"--vllm-arg={arg}", launch_only=True) for arg in engine.vllm.args]


def _settings(engine: EngineSpec, *names: str) -> list[AgentFlag]:
    """The declared settings (loraplex.spec.engine_settings) that are set, each with its ConfigMap variable."""
    flags = []
    for name in names:
        setting, value = ENGINE_SETTINGS[name], getattr(engine, name)
        if value is not None:
            flags.append(AgentFlag(setting.flag, f"{value:g}" if isinstance(value, float) else str(value), setting.env))
    return flags


def configmap_data(flags: list[AgentFlag]) -> dict[str, str]:
    """The environment the pod's `$(VAR)` args refer to."""
    return {f.env: f.value for f in flags if f.env is not None and f.value is not None and not f.launch_only}
