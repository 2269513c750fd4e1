"""The Kubernetes resources `AdapterPool` and `LoRADeployment` (group loraplex.io, v1alpha1).

These pydantic models are the single source of truth: the CRD schemas in `crds/` are generated from
them (`loraplex.spec.crd_schema`), the operator reads specs and writes statuses through them, and the
local stack (`loraplex up -f DIR`) validates the same YAML files without an API server.

Rules that a structural schema cannot express (min <= max, the source scheme allow-list) are written
once as `CelRule`s: the rule text goes into the CRD as `x-kubernetes-validations`, and the Python
predicate next to it runs in a pydantic validator, so both paths reject the same objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from loraplex.spec.engine_settings import ENGINE_SETTINGS
from loraplex.spec.names import MAX_POOL_NAME_LENGTH, POOL_NAME_PATTERN, is_pool_name

GROUP = "loraplex.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Schemes an adapter may come from: those the agents fetch (loraplex_agent.cluster). A `file://` path
# is read inside the agent pod (a mounted volume); the others with credentials from the environment.
SOURCE_SCHEMES = ("file", "https", "s3", "gs", "hf")
# The base model is read from a mounted folder, or downloaded from the Hugging Face Hub by an init
# container of each server.
BASE_MODEL_SCHEMES = ("file", "hf")
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SHA256_HEX = r"^[a-f0-9]{64}$"
MAX_SOURCE_LENGTH = 2048  # bounds the cost of the CEL rule that checks the scheme

Phase = Literal["Pending", "Loading", "Ready", "Failed"]
PoolPhase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]
# An int-or-string Kubernetes quantity such as 1, "500m" or "16Gi".
Quantity = Annotated[int | str, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]


@dataclass(frozen=True)
class CelRule:
    """A validation rule in CEL (for the API server) and the same rule in Python (for local mode)."""

    rule: str
    message: str
    check: Callable[[Any], bool]


def has_scheme(source: str, schemes: tuple[str, ...]) -> bool:
    return any(source.startswith(f"{scheme}://") for scheme in schemes)


def _scheme_rule(schemes: tuple[str, ...]) -> CelRule:
    rule = " || ".join(f"self.source.startsWith('{s}://')" for s in schemes)
    message = "source must start with one of " + ", ".join(f"{s}://" for s in schemes)
    return CelRule(rule, message, lambda m: has_scheme(m.source, schemes))


def _add_cel_rules(schema: dict[str, Any], cls: type) -> None:
    rules = [{"rule": r.rule, "message": r.message} for r in getattr(cls, "cel_rules", ())]
    rules += [{"rule": rule, "message": message} for rule, message in getattr(cls, "transition_rules", ())]
    if rules:
        schema["x-kubernetes-validations"] = rules


class CrdModel(BaseModel):
    """camelCase on the wire, snake_case in Python, unknown fields rejected (like `kubectl --validate=strict`)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              json_schema_extra=_add_cel_rules)
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()
    # Rules over `oldSelf` (updates only): the API server checks them; there is no Python twin.
    transition_rules: ClassVar[tuple[tuple[str, str], ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> CrdModel:
        for rule in self.cel_rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self

    def to_k8s(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    def to_patch(self) -> dict[str, Any]:
        """As `to_k8s`, but top-level fields that are unset become null, so that a JSON merge patch
        removes them (a status field that no longer applies must disappear, not linger)."""
        out = self.to_k8s()
        for name, info in type(self).model_fields.items():
            alias = info.alias or name
            if getattr(self, name) is None:
                out[alias] = None
        return out


class Condition(CrdModel):
    """A standard Kubernetes condition (`type` is unique within a list)."""

    type: str = Field(min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field("", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str | None = Field(None, description="RFC 3339 time of the last status change")
    observed_generation: int | None = Field(None, ge=0)


def _conditions_field() -> Any:
    return Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})


# ----------------------------------------------------------------------------------------------------
# AdapterPool: a set of identical GPU servers (node agents) for one base model.


class BaseModelSpec(CrdModel):
    """The base model every server of the pool loads."""

    name: str = Field(min_length=1, max_length=253,
                      description="Name of the base model in the API (the `model` of base-model requests)")
    source: str = Field(max_length=MAX_SOURCE_LENGTH,
                        description="Where the weights are: hf://org/name[@revision] (downloaded by each "
                                    "server) or file:///path/in/the/pod (a volume in servers.volumes)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "bfloat16"

    cel_rules = (_scheme_rule(BASE_MODEL_SCHEMES),)


class Toleration(CrdModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Resources(CrdModel):
    """Container resources besides the GPUs (those come from `gpusPerServer`)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


class SecretRef(CrdModel):
    name: str = Field(min_length=1, max_length=253)


class ModelCache(CrdModel):
    """A PersistentVolumeClaim per server (a StatefulSet volumeClaimTemplate) for the base model."""

    size: Quantity = Field(description="Storage to request, e.g. 40Gi: the model's size with room to spare")
    storage_class_name: str | None = Field(None, max_length=253, description="Default: the cluster's default class")



class ServersSpec(CrdModel):
    """The StatefulSet of node agents. Server names are stable: `<pool>-0`, `<pool>-1`, ..."""

    replicas: int | None = Field(None, ge=0, description="Servers now (default: minReplicas); the "
                                 "autoscaler and `kubectl scale` move it between minReplicas and maxReplicas")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    gpus_per_server: int = Field(1, ge=0, description="nvidia.com/gpu per server; 0 runs on CPU")
    image: str | None = Field(None, max_length=1024, description="Agent image; default: the operator's")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    env: list[dict[str, Any]] = Field(default_factory=list, description="Extra container env (EnvVar objects)")
    volumes: list[dict[str, Any]] = Field(default_factory=list, description="Extra pod volumes")
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list, description="Extra agent volume mounts")
    init_containers: list[dict[str, Any]] = Field(
        default_factory=list, description="Init containers run before the agent (Container objects); one "
        "without an image runs the agent's image, e.g. `loraplex make-tiny-model` into a volume")
    service_account_name: str | None = Field(None, pattern=DNS_LABEL, max_length=63)
    max_unavailable: int = Field(1, ge=0, description="Servers a voluntary disruption may take down")
    image_pull_secrets: list[SecretRef] = Field(default_factory=list, description="Secrets to pull the "
                                                "images with; default: the operator's (the chart's imagePullSecrets)")
    affinity: dict[str, Any] = Field(default_factory=dict, description="Pod affinity (an Affinity object)")
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list, description="Spread of the servers over nodes or zones (TopologySpreadConstraint objects)")
    priority_class_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)
    pod_annotations: dict[str, str] = Field(default_factory=dict, description="Annotations of every server pod")
    pod_labels: dict[str, str] = Field(default_factory=dict, description="More labels of every server pod "
                                       "(the pool's own labels win)")
    model_cache: ModelCache | None = Field(None, description="A volume per server that keeps a downloaded "
                                           "hf:// base model across pod restarts and rescheduling")

    cel_rules = (
        CelRule("self.minReplicas <= self.maxReplicas", "minReplicas must not exceed maxReplicas",
                lambda m: m.min_replicas <= m.max_replicas),
        CelRule("!has(self.replicas) || (self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas)",
                "replicas must lie between minReplicas and maxReplicas",
                lambda m: m.replicas is None or m.min_replicas <= m.replicas <= m.max_replicas),
    )
    # A StatefulSet's volume claims are fixed once it exists.
    transition_rules = (("has(self.modelCache) == has(oldSelf.modelCache) && "
                         "(!has(self.modelCache) || self.modelCache == oldSelf.modelCache)",
                         "modelCache cannot be added, changed or removed once the pool exists; "
                         "delete and re-create the pool to change it"),)

    @property
    def desired_replicas(self) -> int:
        return self.min_replicas if self.replicas is None else self.replicas


# vLLM's --max-lora-rank must be one of these (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"


class VllmSpec(CrdModel):
    """The vLLM server of each pod when `engine.backend` is vllm: a second container beside the agent."""

    image: str | None = Field(None, min_length=1, max_length=1024,
                              description="vLLM OpenAI server image, unmodified (run as `python3 -m "
                                          "vllm.entrypoints.openai.api_server`); default: the operator's "
                                          "(Helm value operator.vllmImage)")
    args: list[str] = Field(default_factory=list, description="More vLLM flags, after the ones the operator "
                            "derives from the pool (they win), e.g. --gpu-memory-utilization=0.85")
    env: list[dict[str, Any]] = Field(default_factory=list, description="Extra env of the vLLM container (EnvVar objects)")
    port: int = Field(8001, ge=1024, le=65535, description="Port of the vLLM server in the pod (the agent has 8000)")
    scheduler_cls: str | None = Field(None, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$",
                                      description="vLLM's --scheduler-cls, e.g. loraplex_vllm_scheduler.SJFScheduler "
                                                  "(docs/vllm.md)")

    cel_rules = (CelRule("self.port != 8000", "vllm.port 8000 is the agent's", lambda m: m.port != 8000),)


class EngineSpec(CrdModel):
    """Settings of the engine in each agent (the `loraplex agent` flags of the same names)."""

    backend: Literal["loraplex", "vllm"] = Field(
        "loraplex", description="loraplex: our engine in the agent; vllm: an unmodified vLLM OpenAI server beside "
                                "the agent (the vllm block), which registers it and loads its adapters")

    # Declared in loraplex.spec.engine_settings, with the agent's flags of the same names.
    max_model_len: int | None = ENGINE_SETTINGS["max_model_len"].crd_field()
    max_lora_rank: int = ENGINE_SETTINGS["max_lora_rank"].crd_field()
    max_loras: int = ENGINE_SETTINGS["max_loras"].crd_field()
    max_num_seqs: int = ENGINE_SETTINGS["max_num_seqs"].crd_field()
    max_num_batched_tokens: int = ENGINE_SETTINGS["max_num_batched_tokens"].crd_field()
    long_prefill_token_threshold: int = ENGINE_SETTINGS["long_prefill_token_threshold"].crd_field()
    block_size: int = ENGINE_SETTINGS["block_size"].crd_field()
    kv_cache_memory_gib: float | None = ENGINE_SETTINGS["kv_cache_memory_gib"].crd_field()
    scheduler: str = ENGINE_SETTINGS["scheduler"].crd_field()
    scheduler_options: dict[str, str] = Field(default_factory=dict, description="Knobs of the scheduler by name, "
                                              "e.g. refresh_s: '60' (--scheduler-option)")
    memory_policy: str = ENGINE_SETTINGS["memory_policy"].crd_field()
    prefix_cache: bool = Field(True, description="Reuse the KV of earlier requests of the same adapter")
    memory_options: dict[str, str] = Field(default_factory=dict, description="Knobs of the memory policy by "
                                           "name, e.g. busy: '0.9' (--memory-option)")
    extra_args: list[str] = Field(default_factory=list, description="More agent flags, passed verbatim")
    max_cpu_loras: int | None = Field(None, ge=1, description="vllm: adapters its CPU LoRA cache holds (default "
                                      "maxLoras); the placement assigns a server at most this many")
    vllm: VllmSpec = Field(default_factory=VllmSpec)

    cel_rules = (
        CelRule("self.backend != 'vllm' || self.maxLoraRank in " + str(list(VLLM_LORA_RANKS)),
                "with backend vllm, maxLoraRank must be one of vLLM's: " + ", ".join(map(str, VLLM_LORA_RANKS)),
                lambda m: m.backend != "vllm" or m.max_lora_rank in VLLM_LORA_RANKS),
        CelRule("!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras", "maxCpuLoras must be at least maxLoras",
                lambda m: m.max_cpu_loras is None or m.max_cpu_loras >= m.max_loras),
    )

    @property
    def adapter_slots(self) -> int:
        """Adapters one server holds at once: vLLM's max_cpu_loras; 0 (no limit) for our engine."""
        return (self.max_cpu_loras or self.max_loras) if self.backend == "vllm" else 0


class SloSpec(CrdModel):
    ttft_p95_seconds: float = Field(2.0, gt=0)
    tbt_p95_seconds: float | None = Field(None, gt=0)


class PlacementSpec(CrdModel):
    """How adapters are spread over the servers, and how the pool is sized."""

    policy: str = Field("loraserve", pattern=r"^[a-z][a-z0-9-]{0,31}$",
                        description="Placement policy by name: loraserve, min-cost-flow, replicate-all, random, contiguous")
    interval_seconds: int = Field(60, ge=5, le=86400)
    autoscale: bool = Field(True, description="Scale servers between min and max from the required-server estimate")
    scale_down_delay_seconds: int = Field(300, ge=0, description="Fewer servers must suffice this long before scaling down")
    # The same default as loraplex.placement.DEFAULT_HYSTERESIS (spec stays independent of placement).
    hysteresis: float = Field(0.1, ge=0, le=1, description="loraserve: a server keeps its adapters while its "
                              "load stays within this fraction above the target; 0 repacks every interval")
    slo: SloSpec = Field(default_factory=SloSpec)


class SizingSpec(CrdModel):
    """How `status.requiredServers`, the autoscaler's target, is estimated: from the placement's
    load (Σ demand over each rank's operating point), or by the digital twin's minimum-GPU planner."""

    estimator: Literal["placement", "planner"] = Field(
        "placement", description="placement: the placement's load estimate; planner: the twin's minimum-GPU plan")
    profile: str | None = Field(None, min_length=1, max_length=1024,
                                description="planner: latency profile of one server, a shipped name (e.g. "
                                            "cpu-tiny) or a path in the operator image")
    oracle_seconds: float = Field(60.0, ge=1, le=3600,
                                  description="planner: simulated seconds of each twin run the planner makes")
    # Demand is counted in tokens (prompt + output); these turn tokens/s into the requests/s the planner takes.
    prompt_tokens: int = Field(1024, ge=1, description="planner: mean prompt length of a request, in tokens")
    output_tokens: int = Field(128, ge=1, description="planner: mean output length of a request, in tokens")

    cel_rules = (CelRule("self.estimator != 'planner' || has(self.profile)",
                         "sizing.profile is required when sizing.estimator is planner",
                         lambda m: m.estimator != "planner" or m.profile is not None),)


# The router's profiles by name: the keys of loraplex.routing.pipeline.PROFILES (spec stays independent of
# routing; a test keeps the two equal). The CRD's enum refuses any other name; the model takes any
# well-formed one, so that a name that gets past an older or newer CRD makes the pool
# Failed/InvalidRouting with the routers' list (and `loraplex up` refuses it with the same words).
ROUTING_PROFILES = ("loraserve", "load-aware", "least-loaded", "rank-aware", "prefix-aware",
                    "prefix-rank-aware")


class RoutingSpec(CrdModel):
    """How the pool's routers pick a server for each request: the router's --profile and --routing-option,
    carried to every router of the pool in the routing table."""

    profile: str = Field(pattern=r"^[a-z][a-z0-9-]{0,31}$", json_schema_extra={"enum": list(ROUTING_PROFILES)},
                         description="loraserve (phi-weighted random), load-aware (phi + queue depth + "
                                     "residency), least-loaded (shortest queue), rank-aware (Toppings: the least "
                                     "extra per-token latency, with an SLO filter), prefix-aware or "
                                     "prefix-rank-aware (first the servers holding the request's longest cached "
                                     "prefix, under a load ceiling); docs/router.md")
    options: dict[str, str] = Field(default_factory=dict, description="Knobs of the profile by name, the keys "
                                    "--routing-option takes, e.g. slo_tpot_s: '0.05', latency_profile: "
                                    "whatif-h100-llama8b or load_slack: '2'; an unknown key or a bad value makes the pool "
                                    "Failed/InvalidRouting")


class AdapterPoolSpec(CrdModel):
    base_model: BaseModelSpec
    servers: ServersSpec = Field(default_factory=ServersSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    sizing: SizingSpec = Field(default_factory=SizingSpec)
    routing: RoutingSpec | None = Field(None, description="The routers' profile for this pool; absent: each "
                                        "router's own --profile and --routing-option flags decide")


class ServerStatus(CrdModel):
    name: str
    ready: bool = False
    adapters: int = Field(0, ge=0, description="Adapters assigned to this server")
    weight: float = Field(0.0, ge=0, description="Sum of the traffic fractions assigned to this server")


class AdapterPoolStatus(CrdModel):
    phase: PoolPhase = "Pending"
    replicas: int = Field(0, ge=0, description="Servers the StatefulSet is asked to run")
    ready_replicas: int = Field(0, ge=0)
    selector: str = Field("", description="Label selector of the servers (for the scale subresource)")
    applied_hash: str = Field("", description="Digest of the objects last applied for the pool (an unchanged "
                              "pool is not applied again when the operator restarts)")
    routing_version: int | None = Field(None, ge=0)
    required_servers: int | None = Field(None, ge=0, description="Servers the workload needs, by the estimate")
    adapters: int = Field(0, ge=0, description="Adapters in the routing table")
    servers: list[ServerStatus] = Field(default_factory=list)
    last_placement_time: str | None = None
    below_since: str | None = Field(None, description="Since when fewer servers would do (scale-down delay)")
    overloaded_servers: list[str] = Field(default_factory=list, description="Servers the last placement "
                                          "loaded beyond its balanced share: too few servers can hold their ranks")
    max_server_load: float | None = Field(None, ge=0, description="The busiest server's forecast load at the last "
                                          "placement; 1.0 is what one server sustains under the SLO")
    planned_adapter_slots: list[int] = Field(default_factory=list, description="sizing.estimator planner: the "
                                             "adapter slots (A_max) of each planned server")
    observed_generation: int | None = Field(None, ge=0)
    conditions: list[Condition] = _conditions_field()


class AdapterPool(CrdModel):
    """A pool of identical GPU servers for one base model; adapters are placed on its servers."""

    KIND: ClassVar[str] = "AdapterPool"
    api_version: Literal["loraplex.io/v1alpha1"] = API_VERSION
    kind: Literal["AdapterPool"] = "AdapterPool"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: AdapterPoolSpec
    status: AdapterPoolStatus | None = None

    # The name is the Service's and the StatefulSet's (loraplex.spec.names). A root rule may read
    # metadata.name; the Python twin lets a manifest without a name pass (the local stack says so).
    cel_rules = (CelRule(
        f"size(self.metadata.name) <= {MAX_POOL_NAME_LENGTH} && self.metadata.name.matches('{POOL_NAME_PATTERN}')",
        f"metadata.name must be a DNS-1035 label of at most {MAX_POOL_NAME_LENGTH} characters (lowercase "
        "letters, digits and '-', starting with a letter): it names the pool's Service and StatefulSet",
        lambda m: "name" not in m.metadata or is_pool_name(m.metadata["name"])),)


# ----------------------------------------------------------------------------------------------------
# LoRADeployment: one adapter served by one pool.


class AdapterSource(CrdModel):
    source: str = Field(max_length=MAX_SOURCE_LENGTH,
                        description="A PEFT adapter folder: hf://org/name[@revision], s3://bucket/prefix, "
                                    "gs://bucket/prefix, https://host/path or file:///path/in/the/pod")
    sha256: str | None = Field(None, pattern=SHA256_HEX,
                               description="Expected digest of adapter_model.safetensors; checked on load")
    rank: int | None = Field(None, ge=1, le=512, description="Declared rank; checked against the weights")
    credentials_secret_ref: SecretRef | None = Field(
        None, description="Secret with key HF_TOKEN (a bearer token) the operator uses to read hf:// and "
                          "https:// sources; the agents fetch with their own environment (servers.env)")

    cel_rules = (_scheme_rule(SOURCE_SCHEMES),)


class TrafficSpec(CrdModel):
    expected_tokens_per_second: float = Field(0.0, ge=0, description="Demand forecast before any is observed")


class ReplicasSpec(CrdModel):
    min: int = Field(1, ge=1, description="Servers that always hold the adapter")
    max: int | None = Field(None, ge=1, description="At most this many servers; default: no limit")

    cel_rules = (CelRule("!has(self.max) || self.min <= self.max", "replicas.min must not exceed replicas.max",
                         lambda m: m.max is None or m.min <= m.max),)


class LoRADeploymentSpec(CrdModel):
    pool: str = Field(pattern=DNS_LABEL, max_length=63, description="Name of the AdapterPool (same namespace)")
    adapter: AdapterSource
    traffic: TrafficSpec = Field(default_factory=TrafficSpec)
    replicas: ReplicasSpec = Field(default_factory=ReplicasSpec)

    transition_rules = (
        ("self.pool == oldSelf.pool", "spec.pool is immutable; delete the LoRADeployment and create it again"),)


class PlacementEntry(CrdModel):
    server: str
    weight: float = Field(ge=0, le=1, description="Fraction of this adapter's traffic sent to the server")


class ObservedDemand(CrdModel):
    tokens_per_second: float = Field(0.0, ge=0)
    window_seconds: float = Field(0.0, ge=0)


class LoRADeploymentStatus(CrdModel):
    phase: Phase = "Pending"
    reason: str = ""
    message: str = ""
    rank: int | None = Field(None, ge=1)
    digest: str | None = None
    placement: list[PlacementEntry] = Field(default_factory=list)
    weights: str = Field("", description="The placement as text, e.g. 'pool-0=0.60,pool-1=0.40'")
    ready_servers: int = Field(0, ge=0, description="Assigned servers that hold the adapter")
    observed_demand: ObservedDemand | None = Field(None, description="Tokens/s the routers counted, as of the "
                                                   "last placement")
    observed_generation: int | None = Field(None, ge=0)
    conditions: list[Condition] = _conditions_field()


class LoRADeployment(CrdModel):
    """One LoRA adapter served by an AdapterPool; requests name it in the `model` field."""

    KIND: ClassVar[str] = "LoRADeployment"
    api_version: Literal["loraplex.io/v1alpha1"] = API_VERSION
    kind: Literal["LoRADeployment"] = "LoRADeployment"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: LoRADeploymentSpec
    status: LoRADeploymentStatus | None = None


RESOURCES: dict[str, type[CrdModel]] = {"AdapterPool": AdapterPool, "LoRADeployment": LoRADeployment}


def parse_resource(obj: dict[str, Any]) -> AdapterPool | LoRADeployment:
    """Validate one manifest (a dict from YAML) as the API server would; raises ValueError."""
    kind = obj.get("kind")
    if obj.get("apiVersion") != API_VERSION or kind not in RESOURCES:
        raise ValueError(f"not a Loraplex resource: apiVersion={obj.get('apiVersion')!r} kind={kind!r} "
                         f"(expected {API_VERSION} {' or '.join(RESOURCES)})")
    model = RESOURCES[kind].model_validate(obj)
    assert isinstance(model, AdapterPool | LoRADeployment)
    return model
