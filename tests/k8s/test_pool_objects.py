"""The pure builders of a pool's objects."""

from __future__ import annotations

import pytest
import yaml
from loraplex_operator.config import OperatorConfig
from loraplex_operator.pool_objects import PoolRef, agent_settings, build_statefulset, pool_objects

from loraplex.pool import INVALID_ENGINE, spec_failure
from loraplex.spec.crd import AdapterPoolSpec

REF = PoolRef("llama", "serving", "uid-1")
CONFIG = OperatorConfig(redis_url="redis://redis:6379/0", agent_image="agent:1", agent_api_key_secret="agent-key")


def _spec(**changes) -> AdapterPoolSpec:
    doc = {"baseModel": {"name": "meta/llama", "source": "hf://meta/llama@v2"},
           "servers": {"minReplicas": 1, "maxReplicas": 6, "gpusPerServer": 2,
                       "nodeSelector": {"gpu": "h100"},
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                       "resources": {"requests": {"cpu": "4", "memory": "32Gi"}}},
           "engine": {"maxLoraRank": 32, "maxModelLen": 4096}}
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return AdapterPoolSpec.model_validate(doc)


def test_objects_in_apply_order_with_owner_references() -> None:
    objs = pool_objects(REF, _spec(), CONFIG, replicas=3)
    assert [o["kind"] for o in objs] == ["ConfigMap", "Service", "PodDisruptionBudget", "StatefulSet"]
    for o in objs:
        meta = o["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["ownerReferences"] == [{"apiVersion": "loraplex.io/v1alpha1", "kind": "AdapterPool",
                                            "name": "llama", "uid": "uid-1", "controller": True,
                                            "blockOwnerDeletion": True}]
        assert meta["labels"]["loraplex.io/pool"] == "llama"
        yaml.safe_load(yaml.safe_dump(o))  # plain data, serialisable as a manifest


def test_statefulset_has_stable_names_gpus_and_scheduling() -> None:
    sts = build_statefulset(REF, _spec(), CONFIG, replicas=3)
    spec = sts["spec"]
    assert sts["metadata"]["name"] == "llama" and spec["serviceName"] == "llama" and spec["replicas"] == 3
    pod = spec["template"]["spec"]
    agent = pod["containers"][0]
    assert agent["image"] == "agent:1"
    assert agent["resources"] == {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"nvidia.com/gpu": 2}}
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["securityContext"]["runAsNonRoot"] is True
    args = agent["args"]
    assert args[:3] == ["agent", "--model", "$(LORAPLEX_MODEL)"]
    assert args[args.index("--server-id") + 1] == "$(POD_NAME)"
    assert args[args.index("--max-model-len") + 1] == "$(LORAPLEX_MAX_MODEL_LEN)"
    env = {e["name"]: e for e in agent["env"]}
    assert env["LORAPLEX_ADVERTISE_URL"]["value"] == "http://$(POD_NAME).llama.$(POD_NAMESPACE).svc:8000"
    assert env["LORAPLEX_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "agent-key", "key": "api-key"}
    fetch = pod["initContainers"][0]
    assert fetch["command"] == ["hf", "download", "meta/llama", "--local-dir", "/var/lib/loraplex/models/base", "--revision", "v2"]


def test_every_agent_arg_variable_is_defined() -> None:
    sts = build_statefulset(REF, _spec(engine__kvCacheMemoryGib=20), CONFIG, replicas=1)
    agent = sts["spec"]["template"]["spec"]["containers"][0]
    defined = set(agent_settings(REF, _spec(engine__kvCacheMemoryGib=20), CONFIG)) | {e["name"] for e in agent["env"]}
    used = {a[2:-1] for a in agent["args"] if a.startswith("$(")}
    assert used <= defined, used - defined


def test_spec_change_rolls_the_pods() -> None:
    before = build_statefulset(REF, _spec(), CONFIG, 2)["spec"]["template"]
    after = build_statefulset(REF, _spec(engine__maxLoras=16), CONFIG, 2)["spec"]["template"]
    assert before["metadata"]["annotations"] != after["metadata"]["annotations"]  # config hash changed
    same = build_statefulset(REF, _spec(), CONFIG, 5)["spec"]["template"]
    assert same == before  # scaling alone does not restart servers


def test_file_model_needs_no_download_and_cpu_pool_no_gpu() -> None:
    spec = _spec(baseModel__source="file:///models/tiny", servers__gpusPerServer=0)
    pod = build_statefulset(REF, spec, CONFIG, 1)["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert "limits" not in pod["containers"][0]["resources"]
    assert agent_settings(REF, spec, CONFIG)["LORAPLEX_MODEL"] == "/models/tiny"


def test_service_is_headless_and_pdb_limits_disruption() -> None:
    _, service, pdb, _ = pool_objects(REF, _spec(servers__maxUnavailable=2), CONFIG, 2)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == pdb["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["maxUnavailable"] == 2


def test_engine_memory_and_policy_options_reach_the_agent_flags() -> None:
    spec = _spec(engine__memoryPolicy="lru-static", engine__prefixCache=False,
                 engine__scheduler="chameleon", engine__schedulerOptions={"refresh_s": "60"},
                 engine__memoryOptions={})
    args = build_statefulset(REF, spec, CONFIG, replicas=1)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert agent_settings(REF, spec, CONFIG)["LORAPLEX_MEMORY_POLICY"] == "lru-static"
    assert "--no-prefix-cache" in args
    assert args[args.index("--scheduler-option") + 1] == "refresh_s=60"
    defaults = build_statefulset(REF, _spec(), CONFIG, replicas=1)["spec"]["template"]["spec"]["containers"][0]
    assert "--no-prefix-cache" not in defaults["args"] and "--scheduler-option" not in defaults["args"]


@pytest.mark.parametrize("engine", [{"scheduler": "nope"}, {"memoryPolicy": "lru"},
                                    {"scheduler": "fifo", "schedulerOptions": {"refresh_s": "60"}},
                                    {"memoryOptions": {"busy": "1.5"}}])
def test_unknown_policies_and_bad_options_fail_the_pool_with_the_reason(engine) -> None:
    reason, message = spec_failure(_spec(**{f"engine__{k}": v for k, v in engine.items()}))
    assert reason == INVALID_ENGINE and message.startswith("engine: ")
    assert spec_failure(_spec(engine__scheduler="chameleon", engine__schedulerOptions={"refresh_s": "60"})) == ("", "")


def test_cpu_pools_get_the_cpu_agent_image_and_gpu_pools_the_cuda_one() -> None:
    config = OperatorConfig(agent_image="agent:1", agent_cpu_image="agent-cpu:1")
    image = lambda spec: build_statefulset(REF, spec, config, 1)["spec"]["template"]["spec"]["containers"][0]["image"]  # noqa: E731
    assert image(_spec()) == "agent:1"
    assert image(_spec(servers__gpusPerServer=0)) == "agent-cpu:1"
    assert image(_spec(servers__gpusPerServer=0, servers__image="mine:2")) == "mine:2"


def test_pod_scheduling_pull_secrets_annotations_and_labels_reach_the_pod() -> None:
    affinity = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}]
    spec = _spec(servers__affinity=affinity, servers__topologySpreadConstraints=spread,
                 servers__priorityClassName="llm-serving", servers__podAnnotations={"team": "ml"},
                 servers__podLabels={"cost-center": "42", "loraplex.io/pool": "not-mine"},
                 servers__imagePullSecrets=[{"name": "own-creds"}])
    template = build_statefulset(REF, spec, OperatorConfig(image_pull_secrets=("chart-creds",)), 1)["spec"]["template"]
    pod = template["spec"]
    assert pod["affinity"] == affinity and pod["topologySpreadConstraints"] == spread
    assert pod["priorityClassName"] == "llm-serving"
    assert pod["imagePullSecrets"] == [{"name": "own-creds"}]  # the pool's own win over the chart's
    assert template["metadata"]["annotations"]["team"] == "ml"
    assert template["metadata"]["labels"]["cost-center"] == "42"
    assert template["metadata"]["labels"]["loraplex.io/pool"] == "llama"  # the selector's labels cannot be replaced
    default = build_statefulset(REF, _spec(), OperatorConfig(image_pull_secrets=("chart-creds",)), 1)
    assert default["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "chart-creds"}]
    assert "affinity" not in default["spec"]["template"]["spec"]


def test_init_containers_without_an_image_run_the_agents_image() -> None:
    make = {"name": "make-model", "args": ["make-tiny-model", "/models/tiny"],
            "volumeMounts": [{"name": "models", "mountPath": "/models"}]}
    other = {"name": "other", "image": "busybox:1", "command": ["true"]}
    spec = _spec(baseModel={"name": "tiny", "source": "file:///models/tiny/base"}, servers__initContainers=[make, other],
                 servers__volumes=[{"name": "models", "emptyDir": {}}])
    init = build_statefulset(REF, spec, CONFIG, 1)["spec"]["template"]["spec"]["initContainers"]
    assert init[0] == {**make, "image": "agent:1", "imagePullPolicy": "IfNotPresent"}
    assert init[1]["image"] == "busybox:1"
    assert len(init) == 2  # a file:// model needs no fetch


def test_model_cache_is_a_claim_per_server_in_place_of_the_empty_dir() -> None:
    sts = build_statefulset(REF, _spec(servers__modelCache={"size": "40Gi", "storageClassName": "fast"}), CONFIG, 2)
    claims = sts["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["loraplex-models"]
    assert claims[0]["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "40Gi"}},
                                 "storageClassName": "fast"}
    volumes = {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert "loraplex-models" not in volumes  # the claim provides it
    fetch = sts["spec"]["template"]["spec"]["initContainers"][-1]
    assert {"name": "loraplex-models", "mountPath": "/var/lib/loraplex/models"} in fetch["volumeMounts"]
    assert "volumeClaimTemplates" not in build_statefulset(REF, _spec(), CONFIG, 2)["spec"]


def test_agents_read_the_redis_password_from_the_secret() -> None:
    config = OperatorConfig(redis_password_secret="redis-auth")
    env = build_statefulset(REF, _spec(), config, 1)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "LORAPLEX_REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "redis-password"}}} in env
    assert "redis-auth" not in str(agent_settings(REF, _spec(), config))  # nothing secret in the ConfigMap
