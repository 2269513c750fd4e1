"""`sim plan --sessions`: the fewest servers a multi-turn chat workload needs, per router profile, from
session cluster twin runs (the real placement, router, prefix index and engine core)."""

from __future__ import annotations

import json

import pytest

from loraplex.cli import main
from loraplex.latency.profile import Memory, Profile
from loraplex.placement import OperatingPoints
from loraplex.sim.metrics import Slo
from loraplex.sim.planner.sessions import plan_sessions
from loraplex.sim.sessions import SessionSpec, make_sessions

# A server on which prefill dominates (0.3 ms a prompt token, 1 ms a sequence in the batch): what a
# re-sent history costs when it is not in the prefix cache where it lands.
ENGINE = dict(max_model_len=2048, block_size=16, max_num_seqs=64, max_num_batched_tokens=512, max_loras=8,
              max_lora_rank=16, scheduler="fifo", residency="lru")
PROFILE = Profile(name="test", model="m", hardware="h", engine=ENGINE, memory=Memory(kv_tokens_base=65536),
                  coefficients={"intercept": 0.005, "batch": 1e-3, "prefill_tokens": 3e-4, "loads": 0.01})
POINTS = OperatingPoints({8: 6000.0, 16: 6000.0}, "test")  # the placement's estimate: 8 servers


@pytest.mark.slow
def test_prefix_aware_routing_needs_fewer_servers_on_long_conversations() -> None:
    # 8 turns a session on average, each re-sending its history; every adapter on 3 servers (min-cost-flow
    # spreads φ evenly): φ-random routing finds a history where it lands about half the time, prefix-aware
    # routing nearly always, so its servers spend less on prefill and keep up with one server fewer.
    workload = make_sessions(SessionSpec(num_adapters=6, ranks=(8, 16), num_sessions=240, rate=48.0, mean_turns=8,
                                         think_mean_s=0.5, length_scale=0.5, max_model_len=2048, seed=1))
    plans = plan_sessions(workload, PROFILE, ["loraserve", "prefix-aware"], Slo(2.0), 0.9, [8],
                                 placement="min-cost-flow", limit=8, points=POINTS)
    base, ours = plans
    # the placement's estimate (the searches start at it, capped by the limit of 8) counts every history
    # token as work under loraserve, and leaves out what the index predicts cached under prefix-aware
    assert ours.placement_estimate < base.placement_estimate
    assert ours.servers < base.servers
    assert ours.prefix_hit_rate > base.prefix_hit_rate + 0.2
    for plan in plans:  # each count passes, and one server fewer was tried and failed
        assert plan.slo_attainment >= 0.9 and plan.slots == 8
        assert (plan.servers, 8, True) in {(t.servers, t.slots, t.passed) for t in plan.trials}
        assert any(t.servers == plan.servers - 1 and not t.passed for t in plan.trials)
        assert len({(t.servers, t.slots) for t in plan.trials}) == len(plan.trials) < 5  # halved, no count twice


def write_spec(tmp_path, text: str) -> str:
    path = tmp_path / "sessions.yaml"
    path.write_text(text)
    return str(path)


def test_plan_command_sizes_a_session_workload(tmp_path, capsys) -> None:
    spec = write_spec(tmp_path, "num_adapters: 4\nranks: [8]\nnum_sessions: 40\nrate: 4\nmean_turns: 3\n"
                                "think_mean_s: 1\nlength_scale: 0.5\n")
    out = tmp_path / "plan.json"
    assert main(["sim", "plan", "--sessions", spec, "--profile", "whatif-h100-llama8b", "--max-loras", "8",
                 "--routing", "loraserve,prefix-aware", "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(out.read_text())
    assert doc["sessions"]["max_model_len"] == 4096  # the profile's
    assert doc["max_loras"] == 8 and doc["num_sessions"] == 40
    for routing in ("loraserve", "prefix-aware"):
        plan = doc["routings"][routing]
        assert 1 <= plan["servers"] <= plan["placement_estimate"] and plan["slo_attainment"] >= 0.95
        assert {(t["servers"], t["passed"]) for t in plan["trials"]} >= {(plan["servers"], True)}


@pytest.mark.parametrize("text, flags, message", [
    ("rate: 4\nturns: 3\n", [], "unknown field(s) turns"),
    ("rate: fast\n", [], "rate: Input should be a valid number"),
    ("rate: 0\n", [], "invalid session workload setting(s): rate"),
    ("- 1\n", [], "expected a mapping"),
    ("max_model_len: 8192\n", [], "max_model_len 8192 is above profile whatif-h100-llama8b's 4096"),
    ("rate: 4\n", ["--routing", "loraserve,nearest"], "--routing: unknown profile(s) nearest"),
    ("rate: 4\n", ["--placement", "best"], "--placement: unknown policy best"),
    ("rate: 4\n", ["--compare"], "--compare is for --trace"),
    ("rate: 4\n", ["--max-loras", "512"], "--max-loras 512: slots of rank 128"),
])
def test_bad_session_input_is_one_line(tmp_path, capsys, text, flags, message) -> None:
    spec = write_spec(tmp_path, text)
    assert main(["sim", "plan", "--sessions", spec, "--profile", "whatif-h100-llama8b", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_plan_takes_a_trace_or_sessions_not_both(tmp_path, capsys) -> None:
    spec = write_spec(tmp_path, "rate: 4\n")
    assert main(["sim", "plan", "--sessions", spec, "--trace", spec]) == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and len(err.strip().splitlines()) == 1
