"""The CPU quick start (examples/quickstart-cpu): its adapters' declared digests and ranks are what
the pool's init container writes, and the pool becomes pods that generate the model and serve it
with the CPU agent image (tests/k8s/test_real_node.py runs it on a real node)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml
from loraplex_operator.config import OperatorConfig
from loraplex_operator.pool_objects import PoolRef, build_statefulset

from loraplex.spec.crd import AdapterPool, LoRADeployment

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart-cpu"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((QUICKSTART / name).read_text()) if d]


def test_the_adapters_declare_the_digests_and_ranks_the_init_container_writes(tiny_model) -> None:
    """make-tiny-model is seeded: the session's tiny model (8 adapters, same seed and shapes) has the
    quick start's four as its first four."""
    adapters = [LoRADeployment.model_validate(d) for d in _docs("loradeployments.yaml")]
    assert len(adapters) == 4
    ranks = tiny_model.adapter_ranks()
    for adapter in adapters:
        name = adapter.metadata["name"]
        weights = Path(tiny_model.adapters[name]) / "adapter_model.safetensors"
        assert adapter.spec.adapter.sha256 == hashlib.sha256(weights.read_bytes()).hexdigest(), name
        assert adapter.spec.adapter.rank == ranks[name]
        assert adapter.spec.adapter.source == f"file:///models/tiny/adapters/{name}"
        assert adapter.spec.pool == "tiny"


def test_the_pool_generates_its_model_and_runs_the_cpu_image() -> None:
    pool = AdapterPool.model_validate(_docs("adapterpool.yaml")[0])
    config = OperatorConfig(agent_image="agent:1", agent_cpu_image="agent-cpu:1")
    pod = build_statefulset(PoolRef("tiny", "default", "uid"), pool.spec, config, 2)["spec"]["template"]["spec"]
    (make,) = pod["initContainers"]
    assert make["image"] == "agent-cpu:1" and make["args"][:2] == ["make-tiny-model", "/models/tiny"]
    agent = pod["containers"][0]
    assert agent["image"] == "agent-cpu:1" and "nvidia.com/gpu" not in str(agent["resources"])
    assert {"name": "models", "mountPath": "/models"} in agent["volumeMounts"]
    assert pool.spec.base_model.source == "file:///models/tiny/base"
