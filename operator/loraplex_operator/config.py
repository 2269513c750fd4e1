"""Operator-wide settings: what every pool shares (the Redis URL, the default agent image). They come
from flags or environment variables that the Helm chart sets."""

from __future__ import annotations

import os
from dataclasses import dataclass

from loraplex.routing.keys import validate_pool_name
from loraplex.spec.crd import DEFAULT_VLLM_IMAGE


@dataclass(frozen=True)
class OperatorConfig:
    redis_url: str = "redis://loraplex-redis:6379/0"
    agent_image: str = "ghcr.io/loraplex/loraplex-agent:0.1.0"  # pools with GPUs
    agent_cpu_image: str = "ghcr.io/loraplex/loraplex-agent-cpu:0.1.0"  # pools with gpusPerServer 0
    vllm_image: str = DEFAULT_VLLM_IMAGE  # the vLLM container of pools with engine.backend vllm and no engine.vllm.image
    # Secret (in the pool's namespace) with key `api-key`: the bearer key of the agents' load/unload
    # endpoints. Empty: the agents run without one.
    agent_api_key_secret: str = ""
    # Secret (in the pool's namespace) with key `redis-password`, for a Redis that requires one: the
    # agents read it as LORAPLEX_REDIS_PASSWORD. Empty: no password.
    redis_password_secret: str = ""
    image_pull_secrets: tuple[str, ...] = ()  # of pools that name none themselves
    heartbeat_ttl_seconds: float = 15.0
    tick_seconds: float = 5.0  # how often each pool's timer wakes to check whether placement is due
    # A pool's registrations (LoRADeployments created or changed) go in one batch, one table version,
    # at most this often; the first after a quiet spell goes at once.
    registration_batch_seconds: float = 1.0
    peering: str = "loraplex"
    # The operator's requests to the API server (both clients together): this many a second on
    # average and this many at once, to stay under its priority-and-fairness limits. 0: no limit.
    kube_qps: float = 200.0
    kube_burst: int = 400
    # An InferencePool (Gateway API Inference Extension) per pool, its endpoint picker the pool's router
    # on `picker_port` behind the Service <pool>-epp (the chart's gateway.inferencePool values).
    inference_pool: bool = False
    picker_port: int = 9002
    picker_failure_mode: str = "FailClose"

    def agent_image_for(self, gpus_per_server: int) -> str:
        return self.agent_image if gpus_per_server > 0 else self.agent_cpu_image

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        for secret in (self.agent_api_key_secret, self.redis_password_secret, *self.image_pull_secrets):
            if secret:
                validate_pool_name(secret)  # a DNS label, like every Secret name we accept
        if self.tick_seconds <= 0 or self.heartbeat_ttl_seconds <= 0:
            raise ValueError("tick and heartbeat TTL must be positive")
        if self.registration_batch_seconds < 0:
            raise ValueError(f"LORAPLEX_REGISTRATION_BATCH_SECONDS must be >= 0, got {self.registration_batch_seconds}")
        if self.picker_failure_mode not in ("FailOpen", "FailClose"):
            raise ValueError(f"LORAPLEX_PICKER_FAILURE_MODE must be FailOpen or FailClose, got "
                             f"{self.picker_failure_mode!r}")
        if not 0 < self.picker_port < 65536:
            raise ValueError(f"LORAPLEX_PICKER_PORT must be a port number, got {self.picker_port}")
        if self.kube_qps < 0 or self.kube_burst < 1:
            raise ValueError(f"LORAPLEX_KUBE_QPS must be >= 0 and LORAPLEX_KUBE_BURST >= 1, got {self.kube_qps} "
                             f"and {self.kube_burst}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorConfig:
        env = os.environ if environ is None else environ
        defaults = cls()
        return cls(
            redis_url=env.get("LORAPLEX_REDIS_URL", defaults.redis_url),
            agent_image=env.get("LORAPLEX_AGENT_IMAGE", defaults.agent_image),
            agent_cpu_image=env.get("LORAPLEX_AGENT_CPU_IMAGE", defaults.agent_cpu_image),
            vllm_image=env.get("LORAPLEX_VLLM_IMAGE") or defaults.vllm_image,
            agent_api_key_secret=env.get("LORAPLEX_AGENT_API_KEY_SECRET", ""),
            redis_password_secret=env.get("LORAPLEX_REDIS_PASSWORD_SECRET", ""),
            image_pull_secrets=tuple(n for n in env.get("LORAPLEX_IMAGE_PULL_SECRETS", "").split(",") if n),
            heartbeat_ttl_seconds=float(env.get("LORAPLEX_HEARTBEAT_TTL", defaults.heartbeat_ttl_seconds)),
            tick_seconds=float(env.get("LORAPLEX_TICK_SECONDS", defaults.tick_seconds)),
            registration_batch_seconds=float(env.get("LORAPLEX_REGISTRATION_BATCH_SECONDS",
                                                     defaults.registration_batch_seconds)),
            peering=env.get("LORAPLEX_PEERING", defaults.peering),
            kube_qps=float(env.get("LORAPLEX_KUBE_QPS", defaults.kube_qps)),
            kube_burst=int(env.get("LORAPLEX_KUBE_BURST", defaults.kube_burst)),
            inference_pool=env.get("LORAPLEX_INFERENCE_POOL", "").lower() in ("1", "true"),
            picker_port=int(env.get("LORAPLEX_PICKER_PORT", defaults.picker_port)),
            picker_failure_mode=env.get("LORAPLEX_PICKER_FAILURE_MODE", defaults.picker_failure_mode),
        )
