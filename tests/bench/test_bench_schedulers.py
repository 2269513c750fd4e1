"""`loraplex bench schedulers`: chameleon, fifo, sjf and vtc on one trace at loads relative to FIFO's
saturation, in the twin and on the real engine; one table per side, JSON, bad input is one line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from loraplex_bench.scheduler_compare import (
    TWIN_STOP_ID,
    StopAtLength,
    TraceSpec,
    at_rate,
    choose_adapters,
    drive,
    slo_throughput,
    started_ahead,
    unit_trace,
)

from loraplex.cli import main
from loraplex.engine.messages import ExecutorResult, ScheduledChunk, SchedulerOutput
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request, SampledToken
from loraplex.latency.profile import load_profile
from loraplex.sim.replay import register_adapters
from loraplex.sim.server import make_sim_engine, sim_prompt

SCHEDULERS = {"chameleon", "fifo", "sjf", "vtc"}
TINY_TWIN = ["bench", "schedulers", "--side", "twin", "--requests", "60", "--adapters", "10",
             "--unloaded-requests", "8", "--lengths", "uniform", "--loads", "0.5,1.2"]


def test_twin_side_runs_every_scheduler_on_the_same_requests(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "schedulers.json"
    assert main([*TINY_TWIN, "--json", str(out), "--plots", str(tmp_path / "plots")]) == 0
    printed = capsys.readouterr().out
    pngs = {p.name: p.stat().st_size for p in (tmp_path / "plots").iterdir()}
    assert {"schedulers-twin-unified-ttft-p99-vs-load.png", "schedulers-twin-unified-goodput-tokens-per-s-vs-load.png",
            "schedulers-twin-unified-slo-attainment-vs-load.png"} <= set(pngs) and all(pngs.values())
    assert "TTFT p99" in printed and "throughput at the SLO" in printed and "chameleon vs fifo" in printed
    report = json.loads(out.read_text())
    [twin] = report["blocks"]
    assert twin["side"] == "twin" and twin["memory_policy"] == "unified"
    assert twin["settings"]["profile"] == "whatif-h100-llama8b" and twin["saturation_rps"] > 0
    assert twin["slo_basis"] == "ttft" and twin["slo_ttft_s"] == pytest.approx(5 * twin["unloaded_mean_s"])
    runs = twin["runs"]
    expected = {(load, s): 1 for load in (0.5, 1.2) for s in SCHEDULERS}
    assert Counter((r["load"], r["scheduler"]) for r in runs) == expected
    assert len({r["digest"] for r in runs}) == 1  # same ids, adapters, prompts and generated lengths
    assert all(r["finished"] == r["requests"] == runs[0]["requests"] > 0 for r in runs)
    assert all(r["p99_ttft_vs_fifo"] == 1.0 for r in runs if r["scheduler"] == "fifo")
    assert {k["scheduler"] for k in twin["slo_throughput"]} == SCHEDULERS
    assert all(k["method"] == "search" and k["probes"] for k in twin["slo_throughput"])
    assert report["goal"]["slo_throughput_ratio"] == 2.0 and report["parameters"]["requests"] == 60


def test_default_lengths_are_the_azure_conversations(tmp_path: Path) -> None:
    out = tmp_path / "azure.json"
    assert main(["bench", "schedulers", "--side", "twin", "--requests", "30", "--adapters", "5",
                 "--unloaded-requests", "4", "--schedulers", "fifo,chameleon", "--loads", "1",
                 "--slo-throughput", "grid", "--json", str(out)]) == 0
    [twin] = json.loads(out.read_text())["blocks"]
    assert twin["settings"]["spec"]["lengths"] == "azure23_conv"
    assert {k["method"] for k in twin["slo_throughput"]} == {"grid"}


def test_generated_workloads_each_get_a_block_and_the_ratio_summary(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "workloads.json"
    assert main(["bench", "schedulers", "--side", "twin", "--workloads", "uniform-50x16-128,code-200x8-32",
                 "--requests", "40", "--unloaded-requests", "4", "--schedulers", "fifo,chameleon",
                 "--loads", "0.9", "--slo-throughput", "grid", "--saturation-rps", "5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ratios to FIFO at the same load" in printed and "over time" in printed
    blocks = json.loads(out.read_text())["blocks"]
    assert [b["settings"]["workload"] for b in blocks] == ["uniform-50x16-128", "code-200x8-32"]
    assert blocks[1]["settings"]["spec"]["lengths"]["profile"] == "azure23_code"
    assert all(b["saturation_rps"] == 5 for b in blocks)
    for run in (r for b in blocks for r in b["runs"]):
        assert run["wait_p99_s"] is not None and run["small_ttft_p99_s"] is not None
        assert len(run["ttft_p99_over_time_s"]) == 5
        assert set(run["admission_limits"]) <= {"budget", "seats", "kv", "adapter", "policy"}


def test_ranks_are_equally_popular_and_zipf_within_a_rank() -> None:
    ranks = np.repeat([8, 16], 5)
    chosen = choose_adapters(ranks, (8, 16), 1.0, 20000, np.random.default_rng(0))
    counts = np.bincount(chosen, minlength=10)
    assert abs(counts[:5].sum() - counts[5:].sum()) < 600  # 10000 each, give or take
    assert list(counts[:5]) == sorted(counts[:5], reverse=True)  # most popular first within a rank
    assert counts[0] / counts[4] == pytest.approx(5, rel=0.2)  # Zipf(1): p_1 / p_5 = 5


def test_requests_stop_at_their_trace_length_under_a_context_cap() -> None:
    profile = load_profile("whatif-h100-llama8b")
    trace = at_rate(unit_trace(TraceSpec(requests=20, adapters=4, lengths="uniform", seed=3)), 5.0)
    core, clock = make_sim_engine(profile, profile.engine_config(memory_policy="unified", max_lora_rank=128))
    ids = register_adapters(core, trace.adapters())
    log = drive(core, trace, ids, sim_prompt, lambda t: clock.advance(max(0.0, t - clock.now())), "context",
                TWIN_STOP_ID)
    lengths = {r.request_id: r for r in trace.requests}
    for request in log.requests:
        asked = lengths[request.request_id]
        assert len(request.output_token_ids) == asked.output_len
        assert request.sampling.max_tokens == core.config.max_model_len - asked.prompt_len


class Fixed:
    """An executor that samples token 7 for every chunk that samples."""

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        return ExecutorResult(sampled={c.request_id: SampledToken(7) for c in output.chunks if c.sample})


def test_stop_at_length_times_the_executor_on_the_given_clock_and_counts_its_tokens() -> None:
    ticks = iter([10.0, 10.5, 20.0, 20.25])  # the run's clock (CPU time under --engine-clock cpu-steps)
    stops = StopAtLength(Fixed(), stop_id=99, timer=lambda: next(ticks))
    stops.targets["a"] = 2

    def chunk(request_id: str, tokens: int, done: int) -> ScheduledChunk:
        return ScheduledChunk(request_id, [5] * tokens, 0, [0], -1, True, SamplingParams(), num_output_tokens=done)

    first = stops.execute(SchedulerOutput([chunk("a", 6, 0), chunk("b", 3, 0)]))
    second = stops.execute(SchedulerOutput([chunk("a", 1, 1)]))
    assert first.sampled["a"].token_id == 7 and second.sampled["a"].token_id == 99  # the 2nd output token stops it
    assert stops.seconds == 0.75 and stops.tokens == 10


def test_slo_throughput_bisects_between_the_grid_loads() -> None:
    knee = 0.9  # P99 TTFT is 1 s below 0.9 x saturation and 10 s above
    result = slo_throughput("x", {0.5: 1.0, 1.2: 10.0}, 2.0, 10.0, lambda load: 1.0 if load <= knee else 10.0)
    assert result.load == pytest.approx(knee, rel=0.04) and result.load <= knee
    assert result.rps == pytest.approx(10 * result.load) and not result.capped
    grid = slo_throughput("x", {0.5: 1.0, 1.2: 1.0}, 2.0, 10.0, None)
    assert grid.load == 1.2 and grid.capped and grid.method == "grid"


@pytest.mark.parametrize(("flags", "message"), [
    (["--schedulers", "sjf,vtc"], "must include fifo"),
    (["--schedulers", "fifo,lottery"], "unknown ['lottery']"),
    (["--workloads", "paper,nope"], "--workloads: unknown ['nope']"),
    (["--loads", "0,1"], "--loads must be positive"),
    (["--loads", "half"], "--loads must be comma-separated"),
    (["--max-tokens", "-3"], "--max-tokens"),
    (["--scheduler-option", "chameleon:bogus=1"], "unknown scheduler option"),
    (["--scheduler-option", "slo_s=1"], "SCHED:KEY=VALUE"),
    (["--memory-policy", "unified,huge"], "--memory-policy"),
    (["--max-lora-rank", "64"], "at most --max-lora-rank 64"),
    (["--requests", "0"], "--requests must be positive"),
    (["--engine-repeats", "0"], "--engine-repeats must be positive"),
    (["--profile", "no-such-profile"], "not found"),
    (["--lengths", "azure23_conv", "--traces-dir", "/nonexistent"], "not found"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(flags: list[str], message: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    assert main([*TINY_TWIN, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_started_ahead_counts_requests_that_passed_an_earlier_arrival() -> None:
    def request(name: str, arrival: float, started: float | None) -> Request:
        r = Request(name, [5, 6], SamplingParams(max_tokens=1), arrival_time=arrival)
        r.first_scheduled_time = started
        return r

    in_order = [request("a", 0.0, 0.1), request("b", 1.0, 1.5), request("c", 2.0, 2.0)]
    assert started_ahead(in_order) == 0
    # c and d passed b; f passed e, which never started (it waits for ever); e itself is not ahead
    passed = [request("a", 0.0, 0.1), request("b", 1.0, 3.0), request("c", 2.0, 2.5), request("d", 2.5, 2.6),
              request("e", 2.7, None), request("f", 2.8, 4.0)]
    assert started_ahead(passed) == 3


@pytest.mark.parametrize("clock", ["steps", "cpu-steps", "wall"])
def test_engine_side_smoke(clock: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("torch", reason="the real-engine side needs torch")
    out = tmp_path / "engine.json"
    assert main(["bench", "schedulers", "--side", "engine", "--adapters", "3", "--engine-requests", "8",
                 "--engine-unloaded-requests", "2", "--engine-length-scale", "0.03", "--lengths", "uniform",
                 "--loads", "1", "--schedulers", "fifo,chameleon", "--engine-repeats", "2", "--engine-clock", clock,
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "scaled DOWN" in printed and "each round (ABBA order)" in printed and "idle steps/seats/tokens" in printed
    assert ("step-interleaved" in printed) == (clock != "wall")
    [engine] = json.loads(out.read_text())["blocks"]
    assert engine["side"] == "engine" and engine["settings"]["emulated_h2d_gbps"] > 0
    assert engine["settings"]["clock"] == clock
    assert {r["scheduler"] for r in engine["runs"]} == {"fifo", "chameleon"}
    assert all(r["rounds"] == 2 and r["round"] is None for r in engine["runs"])  # each row pools both rounds
    rounds = engine["rounds"]
    assert sorted((r["round"], r["scheduler"]) for r in rounds) == [(0, "chameleon"), (0, "fifo"),
                                                                   (1, "chameleon"), (1, "fifo")]
    assert all(r["throughput_vs_fifo"] == 1.0 for r in rounds if r["scheduler"] == "fifo")
    assert all(r["execute_us_per_token"] > 0 for r in rounds)
    # the two schedulers of a round share its rate (on the step clock, FIFO's capacity measured in that round)
    assert all(len({r["rps"] for r in rounds if r["round"] == k}) == 1 for k in (0, 1))
    # work-conserving but for FIFO's own stop: an aged request refused KV pages keeps the pages that free
    assert all(r["idle"]["steps"] == r["idle"]["reasons"].get("aged", 0) for r in rounds if r["scheduler"] == "chameleon")
    for pooled in engine["runs"]:
        mine = [r for r in rounds if r["scheduler"] == pooled["scheduler"]]
        assert pooled["requests"] == sum(r["requests"] for r in mine)
        assert pooled["idle"]["steps"] == sum(r["idle"]["steps"] for r in mine)
    assert len({r["digest"] for r in rounds}) == 1
    assert all(r["finished"] == r["requests"] > 0 for r in engine["runs"])
    assert all(k["method"] == "grid" for k in engine["slo_throughput"])
