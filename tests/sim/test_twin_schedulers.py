"""The twin runs every engine scheduler unchanged, on its virtual clock."""

from __future__ import annotations

import pytest

from loraplex.latency.profile import Memory, Profile
from loraplex.sim.server import simulate_server
from loraplex.sim.trace import Trace, TraceRequest

ENGINE = dict(max_model_len=2048, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
              max_loras=4, max_lora_rank=64, scheduler="fifo", residency="lru")
PROFILE = Profile(name="test", model="m", hardware="h", engine=ENGINE, memory=Memory(kv_tokens_base=16384),
                  coefficients={"intercept": 0.01, "batch": 0.001, "prefill_tokens": 1e-4, "loads": 0.02})


def trace(n: int = 300) -> Trace:
    requests = []
    for i in range(n):  # ~40 requests/s, ranks 8-64 over 8 adapters, some base-model requests
        adapter = None if i % 9 == 0 else f"a{i % 8}"
        rank = 8 * 2 ** (i % 4) if adapter else 0
        requests.append(TraceRequest(f"r{i}", 0.025 * i, adapter, rank, 20 + (i * 37) % 300, 5 + (i * 13) % 60))
    return Trace(requests)


@pytest.mark.parametrize("scheduler", ["fifo", "sjf", "vtc", "chameleon"])
def test_the_twin_runs_every_scheduler(scheduler):
    options = {"min_samples": 32, "refresh_s": 2.0, "slo_s": 1.0} if scheduler == "chameleon" else {}
    config = PROFILE.engine_config(scheduler=scheduler, scheduler_options=options)
    run = simulate_server(trace(), PROFILE, config)
    assert len(run.results) == 300
    assert all(r.generated == r.output_len for r in run.results)
    assert run.summary.finished == 300
