"""The pure builders of a pool's objects."""

from __future__ import annotations

import pytest
import yaml
from loraplex_operator.config import OperatorConfig
from loraplex_operator.pool_objects import PoolRef, agent_settings, build_statefulset, pool_objects
from loraplex_operator.pool_reconcile import INVALID_ENGINE, spec_failure

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
