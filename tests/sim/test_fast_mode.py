"""The fast mode (spans of plain decode steps at once) against the exact mode (every step through
the engine) on ten traces: single server and cluster, each memory policy and scheduler, steady,
bursty and drifting arrivals. Throughput, P50/P99 TTFT and TPOT and SLO attainment agree within 1%
(the issue's bar); in fact every request's timings are identical."""

from __future__ import annotations

import numpy as np
import pytest

from loraplex.latency.profile import Profile, load_profile
from loraplex.sim.arrivals import Arrivals
from loraplex.sim.cluster import ClusterConfig, simulate_cluster
from loraplex.sim.drift import Drift, Surge
from loraplex.sim.executor import DUMMY_TOKEN
from loraplex.sim.metrics import Slo, Summary
from loraplex.sim.replay import make_request, register_adapters
from loraplex.sim.server import make_sim_engine, sim_prompt, simulate_server
from loraplex.sim.trace import Trace
from loraplex.sim.workload import Adapters, Lengths, WorkloadSpec, generate

BURSTY = Arrivals(process="gamma", cv=3.0)
SURGE = Drift(step_s=5.0, surge=Surge(count=2, at=(0.2, 0.4), ramp_s=2.0, hold_s=(10.0, 20.0)))
CPU_LENGTHS = Lengths(profile="uniform", uniform_range=(8, 300), max_model_len=2048)
H100_LENGTHS = Lengths(profile="azure23_conv", max_model_len=4096)

# (profile, servers, rps, scheduler, memory policy, arrivals, drift, routing)
CASES = [
    ("cpu-tiny", 1, 6, "fifo", "lru-static", Arrivals(), None, None),
    ("cpu-tiny", 1, 6, "sjf", "unified", Arrivals(), None, None),
    ("cpu-tiny", 1, 6, "vtc", "no-cache", BURSTY, None, None),
    ("cpu-tiny", 1, 6, "chameleon", "unified", Arrivals(), SURGE, None),
    ("whatif-h100-llama8b", 1, 8, "fifo", "unified", BURSTY, None, None),
    ("whatif-h100-llama8b", 1, 8, "chameleon", "lru-static", Arrivals(), SURGE, None),
    ("cpu-tiny", 3, 15, "fifo", "lru-static", BURSTY, None, "loraserve"),
    ("whatif-h100-llama8b", 3, 24, "sjf", "unified", Arrivals(), SURGE, "rank-aware"),
    ("cpu-tiny", 3, 15, "vtc", "unified", Arrivals(), SURGE, "load-aware"),
    ("whatif-h100-llama8b", 3, 24, "fifo", "lru-static", BURSTY, None, "least-loaded"),
]


def metrics(summary: Summary) -> dict[str, float]:
    return {"throughput": summary.throughput_tokens_per_s, "slo": summary.slo_attainment,
            **{f"ttft_{p}": summary.ttft_s[p] for p in ("p50", "p99")},
            **{f"tpot_{p}": summary.tpot_s[p] for p in ("p50", "p99")}}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x-{c[3]}-{c[4]}")
def test_the_fast_mode_agrees_with_the_exact_mode(case):
    name, servers, rps, scheduler, memory, arrivals, drift, routing = case
    h100 = name.startswith("whatif")
    spec = WorkloadSpec(duration_s=20, rps=rps, seed=3, arrivals=arrivals, drift=drift,
                        lengths=H100_LENGTHS if h100 else CPU_LENGTHS,
                        adapters=Adapters(count=60, ranks=[8, 16, 32], popularity={"mode": "zipf"}))
    trace, profile = generate(spec), load_profile(name)
    overrides = {"scheduler": scheduler, "memory_policy": memory}
    slo = Slo(ttft_s=1.0 if h100 else 0.5, tpot_s=None)
    if servers == 1:
        config = profile.engine_config(**overrides)
        runs = [simulate_server(trace, profile, config, slo, exact=exact) for exact in (True, False)]
    else:
        runs = [simulate_cluster(trace, profile, ClusterConfig(servers, routing=routing, interval_s=10,
                                                               engine_overrides=overrides, exact=exact), slo)
                for exact in (True, False)]
    exact, fast = (metrics(run.summary) for run in runs)
    assert runs[0].summary.finished == runs[1].summary.finished == len(trace.requests)
    for key, value in exact.items():
        assert fast[key] == pytest.approx(value, rel=0.01), key
    # In fact a span's clock is the running sum of the very latencies the steps would have: bit-identical.
    assert runs[0].results == runs[1].results


def engines_at_a_span(profile: Profile, trace: Trace) -> tuple:
    """Two engines given the whole trace at once, stepped alike until the second could run a span."""
    engines = [make_sim_engine(profile) for _ in range(2)]
    for core, _ in engines:
        ids = register_adapters(core, trace.adapters())
        for r in trace.requests:
            core.add_request(make_request(r, 0.0, ids[r.adapter], sim_prompt))
    (slow, _), (fast, _) = engines
    while (span := fast.scheduler.decode_span(DUMMY_TOKEN.token_id)) is None:
        fast.step()
        slow.step()
    return (*engines, span)


def test_a_span_leaves_the_engine_as_its_steps_would():
    profile = load_profile("cpu-tiny")
    spec = WorkloadSpec(duration_s=1, rps=20, seed=1, lengths=CPU_LENGTHS, adapters=Adapters(count=4, ranks=[8, 16]))
    (slow, slow_clock), (fast, fast_clock), span = engines_at_a_span(profile, generate(spec))
    assert span.steps >= 2 and len(span.chunks) == fast.scheduler.num_running
    starts = fast.executor.run_span(span, float("inf"))
    fast.advance_decodes(len(starts), DUMMY_TOKEN, starts)
    for start in starts:
        assert slow_clock.now() == start
        slow.step()
    assert fast_clock.now() == slow_clock.now()
    state = [[(r.request_id, r.num_computed_tokens, len(r.output_token_ids), len(r.block_ids))
              for r in core.scheduler.running] for core in (slow, fast)]
    assert state[0] == state[1]
    assert slow.stats().generation_tokens_total == fast.stats().generation_tokens_total
    assert slow.num_steps == fast.num_steps


def test_with_nothing_waiting_a_span_runs_through_the_step_that_finishes_a_request():
    profile = load_profile("cpu-tiny")
    spec = WorkloadSpec(duration_s=1, rps=3, seed=1, lengths=CPU_LENGTHS, adapters=Adapters(count=2, ranks=[8]))
    (slow, slow_clock), (fast, fast_clock), span = engines_at_a_span(profile, generate(spec))
    assert fast.scheduler.num_waiting == 0
    first = min(r.sampling.max_tokens - len(r.output_token_ids) for r in fast.scheduler.running)
    assert span.steps == first  # the finishing step is the span's last
    starts = fast.executor.run_span(span, float("inf"))
    finished = fast.advance_decodes(len(starts), DUMMY_TOKEN, starts)
    slow_finished = [o for _ in starts for o in slow.step() if o.finished]
    assert finished and finished == slow_finished
    assert fast_clock.now() == slow_clock.now() and fast.num_steps == slow.num_steps
    assert [r.request_id for r in fast.scheduler.running] == [r.request_id for r in slow.scheduler.running]


def test_a_run_without_rows_streams_the_same_summary():
    spec = WorkloadSpec(duration_s=20, rps=15, seed=2, lengths=CPU_LENGTHS, adapters=Adapters(count=30))
    trace, profile = generate(spec), load_profile("cpu-tiny")
    slo = Slo(ttft_s=0.5)
    kept, streamed = (simulate_cluster(trace, profile, ClusterConfig(3, interval_s=10, keep_results=keep), slo)
                      for keep in (True, False))
    assert streamed.results == [] and len(kept.results) == len(trace.requests)
    a, b = kept.summary, streamed.summary
    assert (a.requests, a.finished, a.starved, a.slo_attainment) == (b.requests, b.finished, b.starved, b.slo_attainment)
    assert b.throughput_tokens_per_s == pytest.approx(a.throughput_tokens_per_s, rel=1e-9)
    assert b.window_throughput_tokens_per_s == pytest.approx(a.window_throughput_tokens_per_s, rel=1e-9)
    for key in ("ttft_s", "tpot_s", "e2e_s"):  # a quantile sketch of 0.1% relative accuracy
        values = [getattr(r, key) for r in kept.results if getattr(r, key)]
        sketched = getattr(b, key)
        assert sketched["mean"] == pytest.approx(getattr(a, key)["mean"], rel=1e-9)
        for p in (50, 90, 99):  # the sketch answers with a value at the rank (numpy would interpolate)
            assert sketched[f"p{p}"] == pytest.approx(np.percentile(values, p, method="lower"), rel=0.002), (key, p)
    assert kept.info["starved_servers"] == streamed.info["starved_servers"]
