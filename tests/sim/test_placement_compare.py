"""Rank-skewed workloads and the throughput-at-SLO comparison of placement policies in the twin:
the rank popularities, common random numbers across rates, the bisection, and a tiny end-to-end
`loraplex bench placement-twin` (table shape and monotone probes; no timed or ratio assertions)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from loraplex_bench.placement_compare import Probe, bisect_rate, make_contenders

from loraplex.cli import main
from loraplex.sim.lengths import Lengths
from loraplex.sim.rank_skew import RankSkew, SkewedWorkload, rank_mix

FIXED = Lengths(profile="fixed", prompt_len=32, output_len=8)


def test_rank_shares_follow_the_papers_definitions():
    start_end = np.array([0.0, 1.0])
    shifting = RankSkew("shifting_skew").shares(5, start_end)
    assert shifting[0] == pytest.approx([0.125, 0.125, 0.125, 0.125, 0.5])
    assert shifting[1] == pytest.approx([0.5, 0.125, 0.125, 0.125, 0.125])
    # LoRAServe §IV: at alpha = 1 rank 8 gets 43.8 % and rank 128 gets 8.8 %
    power = RankSkew("power", alpha=1.0).shares(5, start_end)[0]
    assert power[0] == pytest.approx(0.438, abs=1e-3) and power[-1] == pytest.approx(0.0876, abs=1e-3)
    exponential = RankSkew("exponential", lam=0.5).shares(5, start_end)[0]
    assert np.all(np.diff(exponential) < 0) and exponential.sum() == pytest.approx(1.0)
    assert RankSkew("uniform").shares(4, start_end)[1] == pytest.approx([0.25] * 4)
    with pytest.raises(ValueError, match="unknown rank popularity"):
        RankSkew("zipf")


def test_traces_share_random_numbers_across_rates_and_follow_the_rank_mix():
    workload = SkewedWorkload(RankSkew("power"), adapters=50, duration_s=200, lengths=FIXED)
    slow, fast = workload.at(10), workload.at(20)
    assert 1800 < len(slow.requests) < 2200 and 3700 < len(fast.requests) < 4300
    for a, b in zip(slow.requests[:500], fast.requests[:500], strict=True):
        assert (a.adapter, a.rank, a.prompt_len) == (b.adapter, b.rank, b.prompt_len)
        assert b.arrival_s == pytest.approx(a.arrival_s / 2)
    mix = rank_mix(fast, workload.ranks)
    assert mix[8] == pytest.approx(0.438, abs=0.03) and mix[128] == pytest.approx(0.088, abs=0.02)
    assert fast.workload["rank_popularity"]["mode"] == "power"


def test_shifting_skew_moves_traffic_from_the_top_rank_to_the_bottom_one():
    trace = SkewedWorkload(RankSkew("shifting_skew"), adapters=50, duration_s=400, lengths=FIXED).at(10)
    first = [r.rank for r in trace.requests if r.arrival_s < 80]
    last = [r.rank for r in trace.requests if r.arrival_s > 320]
    assert first.count(128) > 2 * first.count(8) and last.count(8) > 2 * last.count(128)


def _threshold(limit: float):
    return lambda rps: Probe(rps, rps <= limit, None, rps > limit, 0)


@pytest.mark.parametrize("limit", [3.0, 0.7, 40.0])
def test_bisection_finds_the_threshold_and_widens_its_bracket(limit):
    search = bisect_rate(_threshold(limit), 1.0, 8.0, rel_tol=0.02)
    assert limit / 1.02 <= search.max_rps <= limit
    met = [p.rps for p in search.probes if p.met]
    failed = [p.rps for p in search.probes if not p.met]
    assert max(met) == search.max_rps and max(met) < min(failed)


def test_bisection_reports_zero_below_its_floor_and_rejects_a_bad_bracket():
    assert bisect_rate(_threshold(0.01), 1.0, 8.0).max_rps == 0.0
    with pytest.raises(ValueError):
        bisect_rate(_threshold(1.0), 4.0, 2.0)


def test_contenders_name_each_loraserve_hysteresis():
    labels = [c.label for c in make_contenders(["loraserve", "random"], [0.0, 0.1])]
    assert labels == ["loraserve(h=0)", "loraserve(h=0.1)", "random"]
    labels = [c.label for c in make_contenders(["loraserve", "min-cost-flow"], [0.1])]
    assert labels == ["loraserve(h=0.1)", "min-cost-flow(h=0.1)"]
    with pytest.raises(ValueError, match="unknown placement"):
        make_contenders(["best-fit"])


def test_bench_placement_twin_prints_a_table_of_monotone_searches(tmp_path, capsys):
    out = tmp_path / "compare.json"
    assert main(["bench", "placement-twin", "--servers", "2", "--adapters", "10", "--ranks", "8,128",
                 "--workloads", "uniform,shifting_skew", "--duration", "10", "--interval", "5",
                 "--lengths", "fixed", "--prompt-len", "32", "--output-len", "8", "--rel-tol", "0.25",
                 "--slo-ttft", "0.5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "max_lora_rank raised from the profiled 64 to 128" in text
    lines = text.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("workload")):]
    header = table[0].split()
    assert header[:5] == ["workload", "loraserve(h=0)", "loraserve(h=0.1)", "random", "replicate-all"]
    assert header[5:] == ["loraserve(h=0)/random", "loraserve(h=0)/replicate-all",
                          "loraserve(h=0.1)/random", "loraserve(h=0.1)/replicate-all"]
    rows = [line.split() for line in table[2:4]]
    assert [row[0] for row in rows] == ["uniform", "shifting_skew"]
    costs = lines[next(i for i, line in enumerate(lines) if "moves/h" in line):]
    assert costs[0].split() == ["workload", "contender", "max", "rps", "moves/h", "placement", "ms"]
    assert [row.split()[1] for row in costs[2:6]] == ["loraserve(h=0)", "loraserve(h=0.1)", "random", "replicate-all"]
    for row in rows:
        assert len(row) == len(header) and all(float(x) > 0 for x in row[1:5])
        assert all(x == "-" or x.endswith("x") for x in row[5:])
    doc = json.loads(out.read_text())
    for workload in doc["workloads"]:
        for search in workload["searches"].values():
            met = [p["rps"] for p in search["probes"] if p["met"]]
            failed = [p["rps"] for p in search["probes"] if not p["met"]]
            assert met and failed and max(met) == search["max_rps"] < min(failed)
