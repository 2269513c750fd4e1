"""The what-if GPU profile (built from published constants), slot search for the baselines, and the
greedy's retry of a failed testing point with fewer adapters."""

from __future__ import annotations

import json

import pytest

from loraplex.cli import main
from loraplex.latency.profile import load_profile
from loraplex.sim.planner import AdapterDemand, GpuLoad, WorkloadSummary, plan
from loraplex.sim.planner.compare import slot_choices
from loraplex.sim.whatif import (
    ADAPTER_PERCENT,
    DECODE_MS,
    NAME,
    PREFILL_MS_PER_TOKEN,
    memory_fit,
    whatif_profile,
)


def test_decode_terms_expand_the_published_product_exactly():
    profile = whatif_profile()
    (c1, c2), (d1, d2) = DECODE_MS, ADAPTER_PERCENT
    k = profile.coefficients
    for batch, adapters in ((1, 1), (100, 10), (256, 64)):
        ours = k["intercept"] + k["batch"] * batch + k["adapters"] * adapters + k["batch_x_adapters"] * batch * adapters
        assert ours == pytest.approx((c1 * batch + c2) * (d1 * adapters + d2) / 100 * 1e-3, rel=1e-12)
    assert k["prefill_tokens"] == pytest.approx(PREFILL_MS_PER_TOKEN * 1e-3)
    assert 6.3e-3 < k["loads"] < 8.1e-3 and k["load_rank_sum"] == 0.0  # the table does not grow with rank


def test_memory_is_the_least_squares_line_of_the_published_table():
    memory = memory_fit()
    assert memory.kv_tokens_base == pytest.approx(307158, abs=1)
    assert memory.kv_tokens_per_slot_rank == pytest.approx(48.0, abs=0.05)
    assert memory.kv_tokens(32, 32) == pytest.approx(258176, rel=0.03)  # a published point


def test_the_shipped_profile_is_the_builders_output_and_says_what_it_is(tmp_path):
    shipped = load_profile(NAME)
    assert shipped == whatif_profile()
    assert "not measured by Loraplex" in shipped.hardware and "what-if" in shipped.model
    assert {k: shipped.engine[k] for k in ("max_model_len", "block_size", "max_num_batched_tokens", "max_num_seqs")} \
        == {"max_model_len": 4096, "block_size": 16, "max_num_batched_tokens": 2048, "max_num_seqs": 256}
    out = tmp_path / "w.json"
    assert main(["sim", "whatif-profile", "--out", str(out), "--max-loras", "16", "--max-lora-rank", "16"]) == 0
    written = json.loads(out.read_text())
    assert written["engine"]["max_loras"] == 16 and written["memory"] == shipped.memory.model_dump()
    with pytest.raises(ValueError, match="leave less KV cache"):
        whatif_profile(max_loras=1000, max_lora_rank=32)


def test_baselines_try_only_slot_counts_that_fit_memory():
    profile = load_profile(NAME)
    assert slot_choices(profile, 32) == [32, 16, 64, 8, 128]  # the profile's 32 first; 256 x 32 leaves < 4096 tokens
    assert max(slot_choices(profile, 8)) == 512


class RateCapOracle:
    """A GPU starves when its adapters' rates sum past `cap`; throughput grows with A_max."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def throughput(self, gpu: GpuLoad) -> float:
        return sum(a.rate_rps for a in gpu.adapters) + gpu.a_max * 1e-3

    def starves(self, gpu: GpuLoad) -> bool:
        return sum(a.rate_rps for a in gpu.adapters) > self.cap


def test_a_failed_testing_point_is_retried_with_fewer_adapters_before_the_gpu_closes():
    summary = WorkloadSummary(tuple(AdapterDemand(f"a{i:02d}", 8, 1.0) for i in range(40)), 100, 20)
    result = plan(summary, whatif_profile(), RateCapOracle(20.0))
    # the paper's rule would close each GPU at 16 adapters (the batch to 32 starves): 3 GPUs
    assert [len(result.gpu_adapters(g)) for g in range(result.num_gpus)] == [20, 20]


def test_an_adapter_that_does_not_fit_is_passed_over_for_smaller_ones_behind_it():
    rates = [8.0] * 3 + [2.0] * 6  # the zigzag order is 8, 2, 8, 2, 8, 2, 2, 2, 2
    summary = WorkloadSummary(tuple(AdapterDemand(f"a{i}", 8, r) for i, r in enumerate(rates)), 100, 20)
    result = plan(summary, whatif_profile(), RateCapOracle(12.0))
    # closing a GPU at the first 8 that does not fit leaves each at 8 + 2 and needs a fourth GPU
    assert [sum(rates[int(a[1:])] for a in result.gpu_adapters(g)) for g in range(result.num_gpus)] == [12.0] * 3


def test_the_last_gpus_adapters_move_to_earlier_gpus_when_all_of_them_fit():
    rates = [5.0] * 5 + [1.0] * 5
    summary = WorkloadSummary(tuple(AdapterDemand(f"a{i}", 8, r) for i, r in enumerate(rates)), 100, 20)
    result = plan(summary, whatif_profile(), RateCapOracle(10.0))
    # first fit leaves a fourth GPU with what remained; the first three can take it
    assert result.num_gpus == 3 and sorted(result.assignment) == [f"a{i}" for i in range(10)]
    assert all(sum(rates[int(a[1:])] for a in result.gpu_adapters(g)) <= 10.0 for g in range(3))
