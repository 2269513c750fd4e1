"""The minimum-GPU planner: greedy FFD with testing points over a twin oracle or the ML surrogate."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from loraplex.cli import main
from loraplex.latency.profile import Memory, Profile
from loraplex.sim.metrics import RequestResult, Slo
from loraplex.sim.planner import AdapterDemand, PlanError, TwinOracle, WorkloadSummary, plan
from loraplex.sim.planner.compare import check_plan, split_by_gpu
from loraplex.sim.planner.floor import server_floor
from loraplex.sim.planner.greedy import priority_sort
from loraplex.sim.planner.oracle import GpuLoad, attainment_by, gpu_trace
from loraplex.sim.trace import Trace, write_trace
from loraplex.sim.workload import Adapters, Lengths, WorkloadSpec, generate

ENGINE = dict(max_model_len=1024, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
              max_loras=8, max_lora_rank=64, scheduler="fifo", residency="lru")
PROFILE = Profile(name="test", model="m", hardware="h", engine=ENGINE,
                  memory=Memory(kv_tokens_base=65536, kv_tokens_per_slot_rank=8.0),
                  coefficients={"intercept": 0.005, "batch": 2e-4, "prefill_tokens": 1e-4, "loads": 0.01,
                                "load_rank_sum": 2e-4})


def workload(rps: float, adapters: int, seed: int = 0) -> WorkloadSpec:
    return WorkloadSpec(seed=seed, duration_s=120, rps=rps, lengths=Lengths(profile="fixed", prompt_len=96, output_len=24),
                        adapters=Adapters(count=adapters, popularity={"mode": "zipf", "zipf_s": 0.8}))


def test_priority_order_is_rank_descending_with_zigzag_rates():
    adapters = tuple(AdapterDemand(f"a{i}", r, rate) for i, (r, rate) in
                     enumerate([(8, 1.0), (8, 3.0), (8, 2.0), (16, 0.5), (16, 0.1), (8, 4.0)]))
    assert [a.name for a in priority_sort(adapters)] == ["a3", "a4", "a5", "a0", "a1", "a2"]


def test_plans_never_starve_in_the_twin():
    for rps, count in ((20.0, 40), (40.0, 80)):
        trace = generate(workload(rps, count))
        result = plan(WorkloadSummary.from_trace(trace), PROFILE, TwinOracle(PROFILE, duration_s=60))
        verdict = check_plan(result, trace, PROFILE, Slo(ttft_s=2.0))
        assert not verdict.starved
        assert sorted(result.assignment) == sorted(trace.adapters())
        assert 1 <= result.num_gpus < count and all(a >= 8 for a in result.a_max)


def test_slot_cap_bounds_a_max_and_the_plan_still_does_not_starve():
    trace = generate(workload(30.0, 120))
    result = plan(WorkloadSummary.from_trace(trace), PROFILE, TwinOracle(PROFILE, duration_s=60), max_slots=12)
    assert max(result.a_max) <= 12
    assert not check_plan(result, trace, PROFILE, Slo(ttft_s=2.0)).starved
    with pytest.raises(ValueError, match="max_slots"):
        plan(WorkloadSummary.from_trace(trace), PROFILE, max_slots=0)


def test_plan_command_compares(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(generate(workload(15.0, 40)), trace)
    out = tmp_path / "plan.json"
    assert main(["sim", "plan", "--trace", str(trace), "--profile", "cpu-tiny", "--max-loras", "8", "--compare",
                 "--random-seeds", "2", "--oracle-duration", "30", "--out", str(out), "--json"]) == 0
    doc = json.loads(out.read_text())
    assert doc == json.loads(capsys.readouterr().out)
    assert not doc["planner"]["starved_in_twin"] and max(doc["planner"]["a_max"]) <= 8
    assert doc["slo_target"] == min(0.95, doc["planner"]["slo_attainment"]) and "assignment" not in doc
    baselines = doc["baselines"]
    assert len(baselines["replicate-all"]["per_seed"]) == 1 and len(baselines["random"]["per_seed"]) == 2
    for b in baselines.values():  # each count is the fewest servers that reach the same SLO target
        assert b["gpus"] >= 1 and min(b["slo_attainment"]) >= doc["slo_target"]
        for count, trials in zip(b["per_seed"], b["trials"], strict=True):  # the search's runs are on record
            assert {(t["servers"], t["passed"]) for t in trials} >= {(count, True)}
            assert all(not t["passed"] for t in trials if t["servers"] < count)
    assert 1 <= doc["server_floor"] <= min([doc["planner"]["gpus"]] + [b["gpus"] for b in baselines.values()])


def test_plan_command_with_the_distilled_surrogate(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(generate(workload(15.0, 40)), trace)
    args = ["sim", "plan", "--trace", str(trace), "--profile", "cpu-tiny", "--max-loras", "8", "--oracle", "tree",
            "--oracle-duration", "10", "--json"]
    assert main([*args, "--surrogate-samples", "30"]) in (0, 1)  # 1: the surrogate's plan starved in the twin
    doc = json.loads(capsys.readouterr().out)
    assert doc["oracle"] == "tree" and doc["planner"]["gpus"] >= 1
    assert main([*args, "--surrogate-samples", "3"]) == 2
    assert "--surrogate-samples must be at least 10" in capsys.readouterr().err


def test_the_server_floor_is_the_rate_over_one_single_adapter_servers_capacity():
    summary = WorkloadSummary.from_trace(generate(workload(100.0, 40)))
    slo = Slo(ttft_s=2.0)
    floor = server_floor(summary, PROFILE, slo, 0.95, duration_s=60)
    assert floor == server_floor(summary, PROFILE, slo, 0.95, duration_s=60)  # deterministic
    total = sum(a.rate_rps for a in summary.adapters)
    oracle = TwinOracle(PROFILE, 60, headroom=1.0, slo=slo, slo_target=0.95)

    def one_server(rate: float) -> GpuLoad:
        return GpuLoad((AdapterDemand("x", 8, rate),), 1, summary.prompt_len, summary.output_len, summary.length_rows)

    # floor - 1 servers would each carry more than the rate that starves a single-adapter server
    assert floor > 1 and oracle.starves(one_server(total / (floor - 1)))
    assert floor <= plan(summary, PROFILE, TwinOracle(PROFILE, 60)).num_gpus
    light = WorkloadSummary.from_trace(generate(workload(2.0, 10)))
    assert server_floor(light, PROFILE, slo, 0.95, duration_s=60) == 1


def test_more_load_needs_more_gpus():
    light = plan(WorkloadSummary.from_trace(generate(workload(5.0, 40))), PROFILE, TwinOracle(PROFILE, 30))
    heavy = plan(WorkloadSummary.from_trace(generate(workload(100.0, 40))), PROFILE, TwinOracle(PROFILE, 30))
    assert light.num_gpus < heavy.num_gpus


def test_an_adapter_that_overloads_a_gpu_alone_is_split_over_gpus():
    trace = generate(workload(10.0, 10))
    hot = trace.requests[0].adapter
    assert hot is not None
    summary = WorkloadSummary(tuple(AdapterDemand(a.name, a.rank, 200.0 if a.name == hot else a.rate_rps)
                                    for a in WorkloadSummary.from_trace(trace).adapters), 96, 24)
    result = plan(summary, PROFILE, TwinOracle(PROFILE, 30))
    shares = result.assignment[hot]
    assert result.replicated == [hot] and len(shares) >= 2 and sum(shares.values()) == pytest.approx(1.0)
    assert all(len(gpus) == 1 and sum(gpus.values()) == 1.0 for a, gpus in result.assignment.items() if a != hot)
    # the requests of the hot adapter are dealt to its GPUs by their shares
    requests = [replace(r, adapter=hot, rank=trace.adapters()[hot]) for r in trace.requests]
    parts = split_by_gpu(result, Trace(requests, {}))
    for gpu, share in shares.items():
        assert len(parts[gpu]) == pytest.approx(share * len(requests), abs=1)
    assert not check_plan(result, trace, PROFILE, Slo(ttft_s=2.0)).starved


def test_an_adapter_that_fits_no_gpu_is_an_error():
    huge = WorkloadSummary((AdapterDemand("huge", 10_000, 1.0), AdapterDemand("cold", 8, 0.1)), 96, 24)
    with pytest.raises(PlanError, match="adapter huge .* does not fit a GPU even with 1/64 of its requests"):
        plan(huge, PROFILE, TwinOracle(PROFILE, 20))
    with pytest.raises(PlanError, match="left over after 1 GPUs"):
        plan(WorkloadSummary.from_trace(generate(workload(200.0, 40))), PROFILE, TwinOracle(PROFILE, 60), max_gpus=1)


def test_the_surrogate_learns_from_twin_runs():
    pytest.importorskip("sklearn")
    from loraplex.sim.planner.surrogate import distill, train_surrogate, twin_dataset

    x, tps, starved = twin_dataset(PROFILE, 30, 96, 24, rate_scale=1.0, duration_s=10)
    assert x.shape == (30, 7) and 0 < starved.sum() < 30
    light = WorkloadSummary.from_trace(generate(workload(2.0, 16)))
    for model in (train_surrogate(x, tps, starved), distill(x, tps, starved, max_depth=3)):
        assert (model.classifier.predict(x) == starved).mean() > 0.9
        result = plan(light, PROFILE, model)
        assert sorted(result.assignment) == sorted(a.name for a in light.adapters)


def test_slo_aware_oracle_leaves_out_requests_the_horizon_cut_off():
    def result(arrival: float, ttft: float | None, e2e: float | None) -> RequestResult:
        return RequestResult("r", "a", arrival, 10, 500, 1 if ttft is not None else 0, ttft, e2e, None)

    results = [result(1.0, 0.5, 20.0),  # met
               result(50.0, 0.5, None),  # first token in time, still generating at the horizon: met
               result(55.0, 3.0, None),  # first token too late: missed
               result(40.0, None, None),  # waited past its deadline: missed
               result(59.0, None, None)]  # deadline after the horizon: not counted
    assert attainment_by(results, Slo(2.0), 60.0) == pytest.approx(2 / 4)


def test_slo_aware_plans_do_not_fail_on_long_replies():
    # Replies that outlast the oracle's horizon (~4 s each, ~7% of a 60 s run) once counted as SLO
    # misses, and an adapter at light load "starved a GPU on its own".
    spec = WorkloadSpec(seed=0, duration_s=120, rps=4.0, lengths=Lengths(profile="fixed", prompt_len=64, output_len=800),
                        adapters=Adapters(count=4, popularity={"mode": "zipf", "zipf_s": 0.8}))
    trace = generate(spec)
    oracle = TwinOracle(PROFILE, duration_s=60, slo=Slo(2.0), slo_target=0.95)
    assert plan(WorkloadSummary.from_trace(trace), PROFILE, oracle).num_gpus >= 1


def test_bursty_arrivals_are_measured_and_make_a_gpu_fuller():
    spec = workload(60.0, 40)
    bursty_spec = spec.model_copy(update={"arrivals": spec.arrivals.model_copy(update={"process": "gamma", "cv": 3.0})})
    smooth, bursty = (WorkloadSummary.from_trace(generate(s)) for s in (spec, bursty_spec))
    assert smooth.arrival_cv == 1.0 and 2.5 <= bursty.arrival_cv <= 3.5
    oracle = TwinOracle(PROFILE, 60, headroom=1.0, slo=Slo(ttft_s=0.5), slo_target=0.95)
    share = bursty.adapters[::2]  # a GPU with half of the adapters
    loads = [GpuLoad.of(s, share, 8) for s in (replace(bursty, arrival_cv=1.0), bursty)]
    runs = [gpu_trace(g, 600, 0) for g in loads]
    expected = sum(a.rate_rps for a in share) * 600
    assert all(len(r.requests) == pytest.approx(expected, rel=0.15) for r in runs)  # the GPU's share of the rate
    gaps = [np.diff([q.arrival_s for q in r.requests]) for r in runs]
    assert gaps[1].std() / gaps[1].mean() > 1.3 * gaps[0].std() / gaps[0].mean()  # and of the bursts
    assert oracle.starves(loads[1]) and not oracle.starves(loads[0])  # bursts miss the SLO where Poisson meets it
