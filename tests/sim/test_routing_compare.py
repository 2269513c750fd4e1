"""Rank-aware routing in the cluster twin (the router's own pipeline, reading each server's live
batch) and a tiny end-to-end `loraplex bench routing` (shape of its output; no timed assertions:
the latencies compared are the twin's simulated ones)."""

from __future__ import annotations

import json

import pytest
from loraplex_bench.routing_compare import no_lora_step_s, with_rank_term

from loraplex.cli import main
from loraplex.latency.profile import load_profile
from loraplex.placement.operating_points import DEFAULT_GPU
from loraplex.routing.rank_aware import LatencyModel, RankAwareConfig
from loraplex.sim.cluster import ClusterConfig, _Cluster, simulate_cluster
from loraplex.sim.lengths import Lengths
from loraplex.sim.rank_skew import RankSkew, SkewedWorkload

FIXED = Lengths(profile="fixed", prompt_len=256, output_len=128)


@pytest.fixture(scope="module")
def bgmv_profile():
    return with_rank_term(load_profile("whatif-h100-llama8b"), "bgmv")


def _run(profile, trace, routing, **config):
    return simulate_cluster(trace, profile, ClusterConfig(
        servers=4, placement="replicate-all", routing=routing, interval_s=30, operating_points=DEFAULT_GPU,
        engine_overrides={"max_lora_rank": 128}, **config))


def test_rank_aware_keeps_ranks_apart_and_lowers_time_between_tokens(bgmv_profile):
    # ranks 8 and 128 equally popular, every server holds every adapter: φ routing mixes them on every
    # server, so every rank-8 request pays the rank-128 padding of the BGMV step
    trace = SkewedWorkload(RankSkew("uniform"), 20, ranks=(8, 128), duration_s=30, lengths=FIXED).at(14)
    runs = {routing: _run(bgmv_profile, trace, routing) for routing in ("loraserve", "least-loaded", "rank-aware")}
    for run in runs.values():
        assert run.summary.finished == len(trace.requests) and not run.summary.starved
    tbt = {routing: run.summary.tpot_s for routing, run in runs.items()}
    assert tbt["rank-aware"]["p95"] < 0.95 * tbt["loraserve"]["p95"]
    assert tbt["rank-aware"]["p95"] < tbt["least-loaded"]["p95"]
    assert tbt["rank-aware"]["mean"] < 0.9 * min(tbt["loraserve"]["mean"], tbt["least-loaded"]["mean"])


def test_the_twin_routes_with_its_profiles_model_unless_told_otherwise(bgmv_profile):
    trace = SkewedWorkload(RankSkew("power"), 20, ranks=(8, 128), duration_s=10, lengths=FIXED).at(8)
    cluster = _Cluster(trace, bgmv_profile, ClusterConfig(servers=2, routing="rank-aware",
                                                          operating_points=DEFAULT_GPU,
                                                          engine_overrides={"max_lora_rank": 128}))
    scorer = cluster.router.scorers[0][0]
    assert scorer.config.model == LatencyModel.from_coefficients(bgmv_profile.coefficients, bgmv_profile.name)
    assert cluster.router.reads_batch and cluster.router.fallback is not None
    given = RankAwareConfig(LatencyModel({"intercept": 0.02}), slo_tpot_s=0.05)
    cluster = _Cluster(trace, bgmv_profile, ClusterConfig(servers=2, routing="rank-aware", rank_aware=given,
                                                          operating_points=DEFAULT_GPU,
                                                          engine_overrides={"max_lora_rank": 128}))
    assert cluster.router.scorers[0][0].config is given


def test_batches_from_heartbeats_plus_the_requests_routed_since_still_route_well(bgmv_profile):
    trace = SkewedWorkload(RankSkew("uniform"), 20, ranks=(8, 128), duration_s=30, lengths=FIXED).at(14)
    live, beats = _run(bgmv_profile, trace, "rank-aware"), _run(bgmv_profile, trace, "rank-aware", batch_refresh_s=2.0)
    phi = _run(bgmv_profile, trace, "loraserve")
    assert beats.summary.finished == len(trace.requests)
    assert beats.results != live.results  # the stale batches did change picks
    assert beats.summary.tpot_s["p95"] < phi.summary.tpot_s["p95"]


def test_rank_terms_replace_the_profiles_and_the_slo_reference_has_none():
    base = load_profile("cpu-tiny")
    bgmv = with_rank_term(base, "bgmv")
    assert "rank_sum" not in bgmv.coefficients and "prefill_rank_tokens" not in bgmv.coefficients
    assert bgmv.coefficients["batch_x_max_rank"] == pytest.approx(1e-3 / 256)
    assert with_rank_term(base, "mbgmv").coefficients["rank_sum"] == pytest.approx(2.34375e-6)
    assert with_rank_term(base, "profile") is base
    with pytest.raises(ValueError, match="unknown rank term"):
        with_rank_term(base, "sgmv")
    c = base.coefficients
    assert no_lora_step_s(base, 32) == pytest.approx(c["intercept"] + 32 * c["batch"])


def test_bench_routing_end_to_end(tmp_path, capsys):
    out = tmp_path / "routing.json"
    code = main(["bench", "routing", "--workloads", "uniform", "--ranks", "8,128", "--adapters", "10",
                 "--servers", "2", "--duration", "10", "--lengths", "fixed", "--prompt-len", "128",
                 "--output-len", "32", "--placements", "replicate-all", "--rel-tol", "0.5", "--json", str(out),
                 "--plots", str(tmp_path / "plots")])
    assert code == 0
    pngs = {p.name: p.stat().st_size for p in (tmp_path / "plots").iterdir()}
    assert set(pngs) == {f"routing-uniform-replicate-all-{m}-vs-rps.png" for m in ("p95-tbt", "p95-ttft", "slo-attainment")}
    assert all(pngs.values())
    printed = capsys.readouterr().out
    assert "rank-aware/loraserve rps" in printed and "P95 TBT" in printed
    doc = json.loads(out.read_text())
    assert doc["parameters"]["routings"] == ["rank-aware", "loraserve", "least-loaded"] and doc["slo"]["tbt_p95_s"] > 0
    [workload] = doc["workloads"]
    [placed] = workload["placements"]
    assert placed["placement"] == "replicate-all"
    assert set(placed["searches"]) == {"rank-aware", "loraserve", "least-loaded"}
    for search in placed["searches"].values():
        passing = [p["rps"] for p in search["probes"] if p["met"]]
        failing = [p["rps"] for p in search["probes"] if not p["met"]]
        assert not passing or not failing or max(passing) < min(failing)
        assert search["max_rps"] == (max(passing) if passing else 0.0)
    for probes in placed["at_rates"].values():
        assert set(probes) == {"rank-aware", "loraserve", "least-loaded"}
    assert main(["bench", "routing", "--routings", "fastest"]) == 2
    assert "unknown routing profiles" in capsys.readouterr().err
