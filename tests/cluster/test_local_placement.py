"""`loraplex up` places as the operator does: the pool's policy and hysteresis, each LoRADeployment's
replicas.min and replicas.max. The stack's own controller runs here over the in-process store, with
three registered servers and no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex_local.stack import LocalStack, StackConfig

from loraplex.routing.memory_store import InMemoryRoutingStore
from loraplex.routing.records import ServerRecord
from loraplex.util.clock import ManualClock

SERVERS = ("s0", "s1", "s2")


def write_manifests(folder: Path, source: Path, policy: str, replicas: dict[str, str]) -> None:
    (folder / "pool.yaml").write_text(
        "apiVersion: loraplex.io/v1alpha1\nkind: AdapterPool\nmetadata: {name: tiny}\nspec:\n"
        "  baseModel: {name: tiny-llama, source: \"file:///unused\"}\n"
        f"  placement: {{policy: {policy}, intervalSeconds: 30, hysteresis: 0.35}}\n")
    for name in ("free", *replicas):
        bounds = f"  replicas: {replicas[name]}\n" if name in replicas else ""
        (folder / f"{name}.yaml").write_text(
            f"apiVersion: loraplex.io/v1alpha1\nkind: LoRADeployment\nmetadata: {{name: {name}}}\n"
            f"spec:\n  pool: tiny\n  adapter: {{source: \"file://{source}\"}}\n{bounds}")


def placed(tmp_path: Path, tiny_model, policy: str, replicas: dict[str, str]) -> tuple[LocalStack, dict]:
    """The stack's controller after one placement, and {adapter: set of servers} of its table."""
    write_manifests(tmp_path, next(iter(tiny_model.adapters.values())), policy, replicas)
    stack = LocalStack(StackConfig(manifests=tmp_path, workdir=tmp_path / "work"))
    stack.store = InMemoryRoutingStore("tiny", ManualClock())
    for sid in SERVERS:
        stack.store.register_server(ServerRecord(sid, f"http://127.0.0.1/{sid}", max_rank=64), ttl_s=60)
    stack.apply_manifests()
    stack.controller = stack.build_controller()
    assert stack.controller.run_once().outcome == "published"
    table = stack.store.read_table()
    return stack, {name: {r.server for r in table.routes(name)} for name in table.entries}


def test_replicas_min_and_the_pools_hysteresis_reach_the_placement(tmp_path, tiny_model):
    stack, routes = placed(tmp_path, tiny_model, "loraserve", {"triple": "{min: 3}", "pair": "{min: 2, max: 2}"})
    assert stack.controller.policy.inner.hysteresis == pytest.approx(0.35)
    assert len(routes["triple"]) == 3 and len(routes["pair"]) == 2 and len(routes["free"]) == 1


def test_replicas_max_caps_every_policy(tmp_path, tiny_model):
    _, routes = placed(tmp_path, tiny_model, "replicate-all", {"capped": "{max: 1}", "two": "{max: 2}"})
    assert len(routes["free"]) == 3  # replicate-all: every server
    assert len(routes["capped"]) == 1 and len(routes["two"]) == 2


def test_edited_replicas_take_effect_at_the_next_placement(tmp_path, tiny_model):
    stack, routes = placed(tmp_path, tiny_model, "replicate-all", {"capped": "{max: 1}"})
    assert len(routes["capped"]) == 1
    write_manifests(tmp_path, next(iter(tiny_model.adapters.values())), "replicate-all", {"capped": "{max: 2}"})
    stack.tick()  # sees the changed folder and applies it; the placement itself is not due yet
    stack.controller.run_once()
    assert len(stack.store.read_table().routes("capped")) == 2


def test_a_bad_manifest_is_reported_once_and_holds_up_no_other_file(tmp_path, tiny_model, caplog):
    """A typo in one LoRADeployment: one line (file, field, what is wrong), logged once and again only when
    the error changes; a good file added beside it is applied at the next tick."""
    stack, _ = placed(tmp_path, tiny_model, "replicate-all", {})
    source = next(iter(tiny_model.adapters.values()))
    bad = tmp_path / "typo.yaml"
    bad.write_text("apiVersion: loraplex.io/v1alpha1\nkind: LoRADeployment\nmetadata: {name: typo}\n"
                   f"spec:\n  pool: tiny\n  adapter: {{source: \"file://{source}\"}}\n"
                   "  traffic: {expectedTokensPerSecnd: 5}\n")
    caplog.set_level("ERROR", logger="loraplex.up")
    for _ in range(3):
        stack.tick()
    reported = [r.getMessage() for r in caplog.records]
    assert len(reported) == 1 and "\n" not in reported[0], reported
    assert str(bad) in reported[0] and "spec.traffic.expectedTokensPerSecnd" in reported[0]
    (tmp_path / "good.yaml").write_text(
        "apiVersion: loraplex.io/v1alpha1\nkind: LoRADeployment\nmetadata: {name: good}\n"
        f"spec:\n  pool: tiny\n  adapter: {{source: \"file://{source}\"}}\n")
    stack.tick()
    assert {"free", "good"} <= {a.name for a in stack.store.adapters()}
    assert "typo" not in {a.name for a in stack.store.adapters()}
    assert len(caplog.records) == 1  # the bad file did not change: not reported again
    bad.write_text(bad.read_text().replace("expectedTokensPerSecnd: 5", "expectedTokensPerSecond: -5"))
    stack.tick()
    assert len(caplog.records) == 2 and "expectedTokensPerSecond" in caplog.records[1].getMessage()


@pytest.mark.parametrize("backend", ["loraplex", "vllm"])
def test_an_activated_lora_is_not_applied_on_the_vllm_backend(tmp_path, tiny_alora_model, caplog, backend):
    """As the operator fails its LoRADeployment: on --backend vllm an aLoRA manifest is reported (one line)
    and stays out of the registry, while the standard LoRA beside it is applied."""
    write_manifests(tmp_path, tiny_alora_model.adapters["lora00-r8"], "loraserve", {})
    (tmp_path / "checker.yaml").write_text(
        "apiVersion: loraplex.io/v1alpha1\nkind: LoRADeployment\nmetadata: {name: checker}\n"
        f"spec:\n  pool: tiny\n  adapter: {{source: \"file://{tiny_alora_model.adapters['alora00-r8']}\"}}\n")
    stack = LocalStack(StackConfig(manifests=tmp_path, workdir=tmp_path / "work", backend=backend))
    stack.store = InMemoryRoutingStore("tiny", ManualClock())
    caplog.set_level("ERROR", logger="loraplex.up")
    stack.apply_manifests()
    checker = stack.store.get_adapter("checker")
    assert stack.store.get_adapter("free") is not None
    if backend == "loraplex":
        assert checker is not None and checker.is_alora and not caplog.records
    else:
        assert checker is None
        [message] = [r.getMessage() for r in caplog.records]
        assert "checker.yaml" in message and "activated LoRA" in message and "vllm" in message
