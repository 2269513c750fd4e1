"""Workload generator checks (workloads.md §5): skew, burstiness, lengths, compatibility modes, drift."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loraplex.sim.arrivals import Arrivals, Diurnal, arrival_times
from loraplex.sim.azure import load_azure
from loraplex.sim.drift import Drift, RandomWalk, Surge
from loraplex.sim.lengths import Lengths, sample_lengths
from loraplex.sim.popularity import Popularity, punica_batch_counts, weights
from loraplex.sim.trace import Trace, TraceRequest, read_trace, write_trace
from loraplex.sim.workload import Adapters, WorkloadSpec, adapter_ranks, generate

FIXED = Lengths(profile="fixed")


def test_head_tail_top5_share_matches_loraserve():
    spec = WorkloadSpec(duration_s=2000, rps=25, lengths=FIXED, adapters=Adapters(count=1000))
    counts = Counter(r.adapter for r in generate(spec).requests)
    top5 = sum(n for _, n in counts.most_common(5)) / sum(counts.values())
    assert abs(top5 - 0.724) < 0.02
    assert max(weights(Popularity(), 1000)[5:]) < 0.01  # every tail adapter well under 1%


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_gamma_interarrival_cv(cv):
    rng = np.random.default_rng(1)
    gaps = np.diff(arrival_times(Arrivals(process="gamma", cv=cv), 20.0, 3000.0, rng))
    assert abs(gaps.std() / gaps.mean() - cv) < 0.1 * cv


def test_poisson_index_of_dispersion_is_one():
    times = arrival_times(Arrivals(process="poisson"), 10.0, 5000.0, np.random.default_rng(2))
    counts = np.bincount(times.astype(int), minlength=5000)
    assert abs(counts.var() / counts.mean() - 1) < 0.1
    assert abs(len(times) / 5000 - 10) < 0.3


def test_diurnal_rate_keeps_the_mean_and_the_peak_to_trough():
    spec = Arrivals(diurnal=Diurnal(period_s=1000, peak_to_trough=3.0))
    times = arrival_times(spec, 50.0, 1000.0, np.random.default_rng(3))
    counts = np.bincount((times // 100).astype(int), minlength=10)
    assert abs(len(times) / 1000 - 50) < 1.5
    assert 2.0 < counts.max() / counts.min() < 4.0


def test_joint_resample_reproduces_the_azure_quantiles():
    lengths = Lengths(profile="azure23_conv", max_model_len=100_000)
    prompt, output = sample_lengths(lengths, 100_000, np.random.default_rng(4))
    trace = load_azure("conv")
    for ours, theirs in ((prompt, trace.prompt_len), (output, trace.output_len)):
        grid = np.unique(theirs)
        ks = np.abs(np.searchsorted(np.sort(ours), grid, side="right") / len(ours)
                    - np.searchsorted(np.sort(theirs), grid, side="right") / len(theirs)).max()
        assert ks < 0.01
    assert np.percentile(output, 50) == pytest.approx(129, abs=3)


def test_lengths_are_shaved_to_fit_the_context():
    prompt, output = sample_lengths(Lengths(profile="fixed", prompt_len=3000, output_len=1000, max_model_len=2048),
                                    10, np.random.default_rng(0))
    assert (prompt + output <= 2047).all() and prompt[0] == 1535 and output[0] == 511


def test_slora_power_alpha_one_is_uniform():
    spec = WorkloadSpec(duration_s=2000, rps=10, lengths=FIXED,
                        adapters=Adapters(count=20, popularity=Popularity(mode="slora_power", slora_alpha=1.0)))
    counts = np.asarray(list(Counter(r.adapter for r in generate(spec).requests).values()))
    expected = counts.sum() / 20
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert len(counts) == 20 and chi2 < 43.8  # chi-square, 19 dof, p = 0.001


def test_punica_geometric_batch():
    assert punica_batch_counts(32) == [11, 7, 5, 3, 2, 2, 1, 1]
    assert list(weights(Popularity(mode="punica"), 4) * 7) == pytest.approx([3, 2, 1, 1])


def test_drift_moves_traffic_but_not_the_total_rate():
    drift = Drift(step_s=60, surge=Surge(count=1, at=(0.4, 0.4), ramp_s=0, factor=(50, 50), hold_s=(400, 400)),
                  random_walk=RandomWalk(sigma=0.1))
    base = WorkloadSpec(duration_s=2000, rps=20, lengths=FIXED, adapters=Adapters(count=50))
    flat, drifted = generate(base), generate(base.model_copy(update={"drift": drift}))
    assert [r.arrival_s for r in flat.requests] == [r.arrival_s for r in drifted.requests]
    top = Counter(r.adapter for r in drifted.requests if 900 <= r.arrival_s < 1100).most_common(1)[0]
    before = sum(1 for r in drifted.requests if r.arrival_s < 700 and r.adapter == top[0])
    assert top[1] / 200 > 5 * before / 700  # the surging adapter's rate jumps


def test_rank_mix_and_determinism(tmp_path):
    spec = WorkloadSpec(seed=7, duration_s=100, rps=5, lengths=FIXED,
                        adapters=Adapters(count=10, ranks=[8, 64], rank_weights=[0.8, 0.2]))
    assert sorted(Counter(adapter_ranks(spec.adapters, 7).tolist()).items()) == [(8, 8), (64, 2)]
    first = generate(spec)
    write_trace(first, tmp_path / "t.jsonl")
    again = read_trace(tmp_path / "t.jsonl")
    assert again.requests == generate(spec).requests == first.requests
    assert WorkloadSpec.model_validate(again.workload) == spec


def test_replay_scales_the_azure_hour_to_the_target_rate():
    spec = WorkloadSpec(duration_s=600, rps=2.0, arrivals=Arrivals(process="replay", replay_service="code"),
                        lengths=Lengths(profile="replay", max_model_len=100_000), adapters=Adapters(count=4))
    trace = generate(spec)
    assert abs(len(trace.requests) / 600 - 2.0) < 0.5
    azure = load_azure("code")
    assert trace.requests[0].prompt_len == azure.prompt_len[0]


def test_bad_traces_get_clear_errors(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"trace_version": 1, "workload": {}}\n{"request_id": "a", "arrival_s": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: missing field 'prompt_len'"):
        read_trace(path)
    with pytest.raises(ValueError, match="rank must be 0 exactly when adapter is null"):
        TraceRequest("x", 0.0, None, 8, 1, 1)
    assert Trace([TraceRequest("b", 2.0, "a", 8, 1, 1), TraceRequest("c", 1.0, None, 0, 1, 1)]).duration_s == 2.0


@pytest.mark.parametrize("service", ["conv", "code"])
def test_the_shipped_traces_are_the_published_csvs(service):
    source = Path(__file__).resolve().parents[3] / "shared" / "traces" / f"AzureLLMInferenceTrace_{service}.csv"
    if not source.is_file():
        pytest.skip("the published CSVs are not beside the checkout to compare with")
    shipped = load_azure(service)
    published = load_azure(service, source.parent)
    assert len(shipped) == len(published) > 1000
    assert (shipped.prompt_len == published.prompt_len).all() and (shipped.output_len == published.output_len).all()
    assert (shipped.arrival_s == published.arrival_s).all()
