"""Pure builders of what a pool with `engine.backend: vllm` adds to its pods: a second container, the
unmodified vLLM OpenAI server (image and flags from `engine.vllm`), and the ConfigMap with Loraplex's
plug-in module that the server loads through its `--middleware` hook.

The vLLM container gets the GPUs and `servers.resources`; it reads the base model from the same volume
as the agent (the fetch-model init container or the user's volume) and the adapters the agent fetched
from the shared adapter volume, read-only. Runtime LoRA updating is switched on in its environment
and only answers the pod's loopback (the plug-in), where the agent loads and unloads. The agent
registers the vLLM server's address, so the router sends requests straight to it.
"""

from __future__ import annotations

from typing import Any

from loraplex.backends.vllm import VllmLaunch, plugin_sources, vllm_argv, vllm_env
from loraplex.pool.refusal import PLUGIN_DIR
from loraplex.spec.crd import AdapterPoolSpec
from loraplex_operator import names

PLUGIN_VOLUME = "loraplex-vllm-plugin"
VLLM_HOME = "/tmp/vllm-home"  # the image's HOME may not be writable for the pod's non-root user
AGENT_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}}  # the agent beside vLLM serves no model


def uses_vllm(spec: AdapterPoolSpec) -> bool:
    return spec.engine.backend == "vllm"


def vllm_launch(spec: AdapterPoolSpec, model_dir: str) -> VllmLaunch:
    engine = spec.engine
    return VllmLaunch(python="python3", model=model_dir, served_model_name=spec.base_model.name, host="0.0.0.0",
                      port=engine.vllm.port, agent_url=f"http://127.0.0.1:{names.AGENT_PORT}",
                      dtype=spec.base_model.dtype, max_model_len=engine.max_model_len,
                      max_num_seqs=engine.max_num_seqs, max_loras=engine.max_loras,
                      max_lora_rank=engine.max_lora_rank, max_cpu_loras=engine.adapter_slots,
                      extra_args=tuple(engine.vllm.args), scheduler_cls=engine.vllm.scheduler_cls)


def vllm_settings(spec: AdapterPoolSpec) -> dict[str, str]:
    """ConfigMap entries the agent needs beside a vLLM server, besides its flags' (read as $(VAR))."""
    return {"LORAPLEX_BACKEND": "vllm", "LORAPLEX_VLLM_URL": f"http://127.0.0.1:{spec.engine.vllm.port}"}


def vllm_agent_args() -> list[str]:
    """Where the agent finds the pod's vLLM server, and where the router is to send requests."""
    return ["--vllm-url", "$(LORAPLEX_VLLM_URL)", "--vllm-advertise-url", "$(LORAPLEX_VLLM_ADVERTISE_URL)"]


def vllm_container(spec: AdapterPoolSpec, image: str, model_dir: str, mounts: list[dict[str, Any]], read_only: str,
                   resources: dict[str, Any], security: dict[str, Any], hf_home: str) -> dict[str, Any]:
    """The vLLM server; `image` unless the pool names one. `mounts`: the agent's own volumes (models, adapters, shm) plus the user's; the
    one at `read_only` (the agent's adapter store) is mounted read-only."""
    launch = vllm_launch(spec, model_dir)
    argv = vllm_argv(launch)
    env = [{"name": k, "value": v} for k, v in sorted(vllm_env(launch, PLUGIN_DIR).items())]
    env += [{"name": "HOME", "value": VLLM_HOME}, {"name": "HF_HOME", "value": hf_home}]
    own = [{**m, "readOnly": True} if m["mountPath"] == read_only else m for m in mounts]
    return {
        "name": "vllm",
        "image": spec.engine.vllm.image or image,
        "imagePullPolicy": spec.servers.image_pull_policy,
        "command": argv[:3],
        "args": argv[3:],
        "env": env + list(spec.servers.env) + list(spec.engine.vllm.env),
        "ports": [{"name": names.VLLM_PORT_NAME, "containerPort": launch.port}],
        "resources": resources,
        "startupProbe": _probe(180, 10),   # loading a large model takes minutes: 30 before liveness
        "readinessProbe": _probe(3, 5),
        "livenessProbe": _probe(6, 10),
        "volumeMounts": [*own, {"name": PLUGIN_VOLUME, "mountPath": PLUGIN_DIR, "readOnly": True}],
        "securityContext": security,
    }


def _probe(failures: int, period: int) -> dict[str, Any]:
    return {"httpGet": {"path": "/health", "port": names.VLLM_PORT_NAME}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 5}


def plugin_volume(pool: str) -> dict[str, Any]:
    return {"name": PLUGIN_VOLUME, "configMap": {"name": names.vllm_plugin_configmap_name(pool)}}


def plugin_data() -> dict[str, str]:
    return plugin_sources()
