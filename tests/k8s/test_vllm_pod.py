"""A pool with `engine.backend: vllm`: the pure builders render a two-container pod (the agent beside an
unmodified vLLM server), the plug-in ConfigMap and the vLLM port; the CRD refuses what vLLM cannot
run; the chart passes the operator its default vLLM image and scrapes the vLLM containers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from loraplex_operator.adapter_reconcile import adapter_view
from loraplex_operator.adapter_status import adapter_status, out_of_slots
from loraplex_operator.config import OperatorConfig
from loraplex_operator.pool_objects import (
    PoolRef,
    agent_settings,
    build_statefulset,
    pool_objects,
)
from loraplex_operator.table_edits import sync_with_registry

from loraplex.backends.vllm import MIDDLEWARE, plugin_sources
from loraplex.pool import volume_conflicts
from loraplex.routing import AdapterRecord, RoutingTable, ServerRecord, make_entry
from loraplex.spec.crd import DEFAULT_VLLM_IMAGE, AdapterPool, AdapterPoolSpec, LoRADeploymentSpec

ROOT = Path(__file__).resolve().parents[2]
REF = PoolRef("llama", "serving", "uid-1")
CONFIG = OperatorConfig(redis_url="redis://redis:6379/0", agent_image="agent:1")


def _spec(**engine) -> AdapterPoolSpec:
    return AdapterPoolSpec.model_validate({
        "baseModel": {"name": "meta/llama", "source": "hf://meta/llama"},
        "servers": {"gpusPerServer": 1, "resources": {"requests": {"cpu": "8", "memory": "64Gi"}},
                    "env": [{"name": "HF_TOKEN", "value": "t"}],
                    "volumes": [{"name": "cache", "emptyDir": {}}], "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]},
        "engine": {"backend": "vllm", "maxLoraRank": 32, "maxLoras": 4, "maxCpuLoras": 12, "maxModelLen": 4096,
                   "vllm": {"args": ["--gpu-memory-utilization=0.85"], "env": [{"name": "VLLM_LOGGING_LEVEL",
                                                                               "value": "DEBUG"}]}, **engine}})


def _pod(spec: AdapterPoolSpec) -> dict:
    return build_statefulset(REF, spec, CONFIG, replicas=2)["spec"]["template"]["spec"]


def test_the_pod_runs_the_agent_beside_an_unmodified_vllm_server() -> None:
    pod = _pod(_spec())
    agent, vllm = pod["containers"]
    assert (agent["name"], vllm["name"]) == ("agent", "vllm")
    assert vllm["image"] == DEFAULT_VLLM_IMAGE and agent["image"] == "agent:1"
    assert vllm["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    args = vllm["args"]
    flags = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and not args[i + 1].startswith("--")}
    assert flags["--model"] == "/var/lib/loraplex/models/base" and flags["--served-model-name"] == "meta/llama"
    assert (flags["--host"], flags["--port"]) == ("0.0.0.0", "8001")
    assert (flags["--max-loras"], flags["--max-lora-rank"], flags["--max-cpu-loras"]) == ("4", "32", "12")
    assert flags["--max-model-len"] == "4096" and flags["--middleware"] == MIDDLEWARE and "--enable-lora" in args
    assert args[-1] == "--gpu-memory-utilization=0.85"  # the pool's own flags come last and win
    # The GPUs and the pool's resources go to vLLM; the agent beside it asks for little.
    assert vllm["resources"]["limits"] == {"nvidia.com/gpu": 1} and vllm["resources"]["requests"]["cpu"] == "8"
    assert "nvidia.com/gpu" not in str(agent["resources"])
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"  # answered on the loopback only (the plug-in)
    assert env["PYTHONPATH"] == "/opt/loraplex/vllm-plugin" and env["LORAPLEX_AGENT_URL"] == "http://127.0.0.1:8000"
    assert env["HF_TOKEN"] == "t" and env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert vllm["readinessProbe"]["httpGet"] == {"path": "/health", "port": "vllm"}
    assert vllm["securityContext"]["allowPrivilegeEscalation"] is False


def test_both_containers_share_the_model_and_the_adapters() -> None:
    pod = _pod(_spec())
    agent, vllm = pod["containers"]
    mounts = {m["mountPath"]: m for m in vllm["volumeMounts"]}
    assert mounts["/var/lib/loraplex/adapters"]["readOnly"] is True  # the agent fetches, vLLM reads
    assert {"/var/lib/loraplex/models", "/cache", "/dev/shm"} <= set(mounts)
    assert mounts["/opt/loraplex/vllm-plugin"]["name"] == "loraplex-vllm-plugin"
    assert {m["mountPath"] for m in agent["volumeMounts"]} >= {"/var/lib/loraplex/adapters", "/cache"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["loraplex-vllm-plugin"] == {"name": "loraplex-vllm-plugin",
                                               "configMap": {"name": "llama-vllm-plugin"}}
    assert pod["initContainers"][0]["name"] == "fetch-model"  # hf:// still downloaded once, for both


def test_the_agent_registers_the_vllm_server_for_the_router() -> None:
    spec = _spec()
    agent = _pod(spec)["containers"][0]
    args = agent["args"]
    assert args[:3] == ["agent", "--backend", "vllm"]
    assert args[args.index("--vllm-url") + 1] == "$(LORAPLEX_VLLM_URL)"
    assert args[args.index("--vllm-advertise-url") + 1] == "$(LORAPLEX_VLLM_ADVERTISE_URL)"
    env = {e["name"]: e for e in agent["env"]}
    assert env["LORAPLEX_VLLM_ADVERTISE_URL"]["value"] == "http://$(POD_NAME).llama.$(POD_NAMESPACE).svc:8001"
    settings = agent_settings(REF, spec, CONFIG)
    assert settings["LORAPLEX_VLLM_URL"] == "http://127.0.0.1:8001" and settings["LORAPLEX_MAX_CPU_LORAS"] == "12"
    used = {a[2:-1] for a in args if a.startswith("$(")}
    assert used <= set(settings) | set(env), used - set(settings) - set(env)
    assert agent["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 while vLLM is not healthy


def test_the_pool_objects_add_the_plugin_and_the_vllm_port() -> None:
    objs = pool_objects(REF, _spec(), CONFIG, replicas=1)
    assert [o["kind"] for o in objs] == ["ConfigMap", "ConfigMap", "Service", "PodDisruptionBudget", "StatefulSet"]
    plugin = objs[1]
    assert plugin["metadata"]["name"] == "llama-vllm-plugin" and plugin["data"] == plugin_sources()
    assert set(plugin["data"]) == {"loraplex_vllm.py", "loraplex_vllm_scheduler.py"}
    ports = {p["name"]: p["port"] for p in objs[2]["spec"]["ports"]}
    assert ports == {"http": 8000, "vllm": 8001}
    for o in objs:
        yaml.safe_load(yaml.safe_dump(o))
    ours = pool_objects(REF, _spec(backend="loraplex"), CONFIG, replicas=1)
    assert [o["kind"] for o in ours] == ["ConfigMap", "Service", "PodDisruptionBudget", "StatefulSet"]
    assert len(ours[-1]["spec"]["template"]["spec"]["containers"]) == 1


def test_switching_the_backend_or_vllm_flags_rolls_the_pods() -> None:
    def annotations(spec: AdapterPoolSpec) -> dict:
        return build_statefulset(REF, spec, CONFIG, 2)["spec"]["template"]["metadata"]["annotations"]

    assert annotations(_spec()) != annotations(_spec(backend="loraplex"))
    assert annotations(_spec()) != annotations(_spec(maxCpuLoras=16))
    assert _pod(_spec())["containers"][1]["args"] != _pod(_spec(vllm={"args": ["--enforce-eager"]}))["containers"][1]["args"]


def test_the_pool_image_wins_over_the_operator_default() -> None:
    pod = _pod(_spec(vllm={"image": "registry.local/vllm:0.32.0-cu128"}))
    assert pod["containers"][1]["image"] == "registry.local/vllm:0.32.0-cu128"
    other = OperatorConfig.from_env({"LORAPLEX_VLLM_IMAGE": "mirror/vllm-openai:v0.32.0"})
    sts = build_statefulset(REF, _spec(), other, 1)
    assert sts["spec"]["template"]["spec"]["containers"][1]["image"] == "mirror/vllm-openai:v0.32.0"


@pytest.mark.parametrize(("engine", "says"), [
    ({"maxLoraRank": 48}, "maxLoraRank must be one of vLLM's"),
    ({"maxLoras": 8, "maxCpuLoras": 4}, "maxCpuLoras must be at least maxLoras"),
    ({"vllm": {"port": 8000}}, "vllm.port 8000 is the agent's"),
])
def test_what_vllm_cannot_run_is_refused(engine: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _spec(**engine)


def test_user_mounts_may_not_cover_the_plugin() -> None:
    spec = AdapterPoolSpec.model_validate({
        "baseModel": {"name": "m", "source": "file:///m"}, "engine": {"backend": "vllm"},
        "servers": {"volumeMounts": [{"name": "x", "mountPath": "/opt/loraplex"}]}})
    assert "/opt/loraplex/vllm-plugin" in volume_conflicts(spec)


def test_the_example_vllm_pool_is_valid() -> None:
    pool = AdapterPool.model_validate(yaml.safe_load((ROOT / "examples" / "adapterpool-vllm.yaml").read_text()))
    assert pool.spec.engine.backend == "vllm" and pool.spec.engine.adapter_slots >= pool.spec.engine.max_loras


helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")


def _render(values: dict) -> list[dict]:
    chart = helm.Chart.load(str(ROOT / "helm" / "loraplex"))
    return [d for path, text in chart.render(values=values, name="lp", namespace="serving").items()
            if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]


def _operator_env(docs: list[dict]) -> dict[str, str | None]:
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("operator"))
    return {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_the_chart_gives_the_operator_its_vllm_image_and_scrapes_vllm() -> None:
    docs = _render({"operator": {"vllmImage": "mirror/vllm-openai:v0.32.0"},
                    "metrics": {"serviceMonitor": {"enabled": True}}})
    assert _operator_env(docs)["LORAPLEX_VLLM_IMAGE"] == "mirror/vllm-openai:v0.32.0"
    agents = next(d for d in docs if d["kind"] == "ServiceMonitor" and d["metadata"]["name"].endswith("agents"))
    assert [e["port"] for e in agents["spec"]["endpoints"]] == ["http", "vllm"]
    env = _operator_env(_render({}))
    assert OperatorConfig.from_env({k: v for k, v in env.items() if v is not None}).vllm_image == DEFAULT_VLLM_IMAGE


# ---- adapter slots in the operator's statuses and fast table edits ---------------------------------

D = "sha256:" + "c" * 64


def _vllm_server(sid: str, slots: int, rank: int = 64) -> ServerRecord:
    return ServerRecord(sid, f"http://{sid}:8001", rank, backend="vllm", agent_url=f"http://{sid}:8000",
                        max_adapters=slots)


def test_an_adapter_without_a_free_slot_is_failed_until_one_frees() -> None:
    full = RoutingTable(4, 0.0, {f"a{i}": make_entry(f"a{i}", D, 8, [("p-0", 1.0)]) for i in range(2)}).validate()
    record = AdapterRecord("late", D, 8, 1000, "hf://o/late")
    spec = LoRADeploymentSpec.model_validate({"pool": "p", "adapter": {"source": "hf://o/late"}})
    view = adapter_view("late", spec, 1, record, full, [_vllm_server("p-0", slots=2)])
    status, events = adapter_status(view, None, now=0)
    assert (status.phase, status.reason) == ("Failed", "NoAdapterSlots") and "maxCpuLoras" in status.message
    assert [(e.type, e.reason) for e in events] == [("Warning", "NoAdapterSlots")]
    roomy = adapter_view("late", spec, 1, record, full, [_vllm_server("p-0", slots=2), _vllm_server("p-1", slots=2)])
    assert adapter_status(roomy, status, now=1)[0].reason == "AwaitingPlacement"  # p-1 has room: not stuck
    assert out_of_slots(8, [ServerRecord("p-0", "http://p-0", 64)], full) is False  # our engine: no limit


def test_a_new_adapter_is_routed_at_once_only_to_a_free_slot() -> None:
    table = RoutingTable(1, 0.0, {"a0": make_entry("a0", D, 8, [("p-0", 1.0)])}).validate()
    servers = [_vllm_server("p-0", slots=1), _vllm_server("p-1", slots=1)]
    records = [AdapterRecord("a0", D, 8, 1, "hf://o/a0"), AdapterRecord("a1", D, 8, 1, "hf://o/a1"),
               AdapterRecord("a2", D, 8, 1, "hf://o/a2")]
    synced = sync_with_registry(table, records, servers, now=1.0)
    assert {a: e.servers for a, e in synced.entries.items()} == {"a0": ("p-0",), "a1": ("p-1",)}  # a2 waits
