"""`--plots DIR` of the sweeping benchmarks: a non-empty PNG per result series, from the result
structures the commands produce (the end-to-end runs of `bench engine` and `bench schedulers` check
theirs through the command)."""

from __future__ import annotations

from pathlib import Path

from loraplex_bench.gpu import AttentionTiming, DecodeResult, gpu_series
from loraplex_bench.placement_compare import Search
from loraplex_bench.report import Series, plot_series
from loraplex_bench.routing_compare import PlacementResult, RoutingProbe, WorkloadResult, routing_series
from loraplex_bench.soak import rss_series

from loraplex.sim.rank_skew import RankSkew, SkewedWorkload


def _written(series: list[Series], folder: Path) -> dict[str, int]:
    plot_series(series, folder)
    return {p.name: p.stat().st_size for p in folder.iterdir()}


def test_routing_writes_a_png_per_metric_and_placement(tmp_path: Path) -> None:
    probes = [RoutingProbe(rps, rps < 3, 0.1 * rps, False, 0, p95_tbt_s=0.01 * rps, slo_attainment=1 - rps / 10)
              for rps in (1.0, 2.0, 4.0)]
    searches = {"rank-aware": Search(2.0, probes), "least-loaded": Search(1.0, probes[:2])}
    result = WorkloadResult(SkewedWorkload(RankSkew("power")), None, 32.0,
                            [PlacementResult("loraserve", searches, {})])
    pngs = _written(routing_series(result), tmp_path)
    assert set(pngs) == {f"routing-power-loraserve-{m}-vs-rps.png" for m in ("p95-tbt", "p95-ttft", "slo-attainment")}
    assert all(pngs.values())


def test_gpu_and_soak_series(tmp_path: Path) -> None:
    decode = [DecodeResult(batch, adapters, False, 0.01, batch / 0.01, 1000, 0.5)
              for batch in (1, 4) for adapters in (0, 4)]
    attention = [AttentionTiming("decode", b, 96, 1e-4 * b, 2e-4 * b) for b in (1, 4)] + [
        AttentionTiming("prefill", 1, 96, 1e-3, 1e-3)]
    samples = [{"t": t, "router": 50_000 + t, "redis": None if t == 10 else 8000} for t in (0, 10, 20)]
    pngs = _written([*gpu_series(decode, attention), rss_series(samples)], tmp_path)
    assert set(pngs) == {"gpu-decode-tokens-per-s-vs-batch.png", "gpu-decode-bandwidth-fraction-vs-batch.png",
                         "gpu-decode-attention-time-vs-batch.png", "soak-rss-vs-time.png"}
    assert all(pngs.values())


def test_a_series_without_points_writes_nothing(tmp_path: Path) -> None:
    assert plot_series([Series("empty", "nothing measured", "load", "TTFT (s)", {"fifo": []})], tmp_path) == []
    assert not list(tmp_path.iterdir())
