"""CopyEngine and HostKVPool: ordered background jobs on a real thread, the emulated transfer
cost, failure reporting, and exact KV round trips device -> host -> device."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from loraplex_agent.runtime.copy_engine import CopyEngine, CopyJobError
from loraplex_agent.runtime.host_kv import HostKVPool, coalesce

from loraplex.engine.messages import KVCopy

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MB = 1_000_000


@pytest.fixture
def engine() -> Iterator[CopyEngine]:
    copies = CopyEngine(CPU)
    yield copies
    copies.close()


def copy_job(dst: torch.Tensor, src: torch.Tensor, log: list[int] | None = None,
             job: int = 0) -> Callable[[], int]:
    def run() -> int:
        dst.copy_(src)
        if log is not None:
            log.append(job)
        return src.numel() * src.element_size()
    return run


def held_until(gate: threading.Event) -> Callable[[], int]:
    """A job that moves nothing and lasts until the test opens the gate."""
    def run() -> int:
        gate.wait(30)
        return 0
    return run


def test_jobs_run_in_order_and_each_is_reported_exactly_once(engine: CopyEngine):
    dst, ran = torch.zeros(20, 64), []
    for job in range(20):
        engine.submit(job, copy_job(dst[job], torch.full((64,), float(job)), ran, job))
    assert engine.wait_all(timeout=30)
    assert ran == list(range(20))
    assert engine.poll() == list(range(20))
    assert engine.poll() == []
    assert torch.equal(dst[:, 0], torch.arange(20.0))
    stats = engine.stats()
    assert (stats.jobs, stats.failed, stats.bytes) == (20, 0, 20 * 64 * 4)
    assert engine.pending == 0


def test_the_emulation_charges_each_job_its_bytes_over_the_bandwidth():
    with CopyEngine(CPU, emulate_h2d_gbps=0.1) as copies:
        start = time.perf_counter()
        copies.submit(0, lambda: 2 * MB)  # 20 ms at 0.1 GB/s
        copies.submit(1, lambda: 2 * MB)
        assert copies.wait_all(timeout=30)
        wall = time.perf_counter() - start
        results = copies.poll_results()
    assert [r.job_id for r in results] == [0, 1]
    assert all(r.seconds >= 0.018 for r in results)
    assert wall >= 0.036  # serialised like one link: the second waits for the first
    assert results[1].queued_s >= 0.015
    assert copies.stats().emulated_s >= 0.036
    assert copies.drain_job_seconds() == [r.seconds for r in results]
    assert copies.drain_job_seconds() == []


def test_no_emulation_by_default_and_charge_sync_sleeps_on_the_caller():
    with CopyEngine(CPU) as free:
        assert free.charge_sync(100 * MB) == 0.0
    with CopyEngine(CPU, emulate_h2d_gbps=0.1) as copies:
        start = time.perf_counter()
        assert copies.charge_sync(2 * MB) >= 0.018
        assert time.perf_counter() - start >= 0.018
        assert copies.charge_sync(2 * MB, elapsed_s=1.0) == 0.0  # the real copy already took longer
        dst = torch.zeros(1000)
        assert copies.run_sync(copy_job(dst, torch.ones(1000))) == 4000
        assert dst.sum() == 1000
        stats = copies.stats()
    assert (stats.sync_copies, stats.sync_bytes, stats.jobs) == (3, 4 * MB + 4000, 0)


def test_compute_on_the_engine_thread_proceeds_while_a_slow_job_copies():
    with CopyEngine(CPU, emulate_h2d_gbps=0.1) as copies:
        copies.submit(7, lambda: 50 * MB)  # 0.5 s of emulated transfer
        assert copies.poll() == []  # returns at once: the job is still on the link
        x = torch.randn(64, 64)
        for _ in range(10):
            x = torch.tanh(x @ x)
        computed_at = time.perf_counter()
        assert copies.pending == 1
        assert copies.wait_all(timeout=30)
        (result,) = copies.poll_results()
    assert result.job_id == 7 and result.seconds >= 0.45
    assert computed_at < time.perf_counter() - 0.1  # the compute finished well before the job


def test_a_failed_job_is_reported_with_its_id_and_later_jobs_still_run(engine: CopyEngine):
    def fail() -> int:
        raise ValueError("host page gone")

    dst = torch.zeros(3)
    engine.submit(0, copy_job(dst[0:1], torch.ones(1)))
    engine.submit(1, fail)
    engine.submit(2, copy_job(dst[2:3], torch.ones(1)))
    engine.submit(3, lambda: "not bytes")  # type: ignore[arg-type, return-value]
    assert engine.wait_all(timeout=30)
    assert engine.poll() == [0]  # what finished before the failure comes first
    with pytest.raises(CopyJobError) as failed:
        engine.poll()
    assert failed.value.job_id == 1 and isinstance(failed.value.__cause__, ValueError)
    assert engine.poll() == [2]
    with pytest.raises(CopyJobError) as bad_return:
        engine.poll()
    assert bad_return.value.job_id == 3 and isinstance(bad_return.value.__cause__, TypeError)
    assert engine.poll() == []
    assert dst.tolist() == [1.0, 0.0, 1.0]
    assert engine.stats().failed == 2


def test_poll_results_reports_failures_without_raising(engine: CopyEngine):
    engine.submit(5, lambda: 1 // 0)
    engine.submit(6, lambda: 8)
    assert engine.wait_all(timeout=30)
    results = engine.poll_results()
    assert [(r.job_id, r.ok, r.nbytes) for r in results] == [(5, False, 0), (6, True, 8)]
    assert isinstance(results[0].error, ZeroDivisionError)


def test_close_runs_queued_jobs_joins_and_is_idempotent():
    copies = CopyEngine(CPU, emulate_h2d_gbps=1.0)
    gate = threading.Event()
    copies.submit(0, held_until(gate))
    copies.submit(1, lambda: 10 * MB)
    gate.set()
    copies.close()
    copies.close()
    assert not copies._thread.is_alive()
    assert copies.poll() == [0, 1]
    with pytest.raises(RuntimeError, match="closed"):
        copies.submit(2, lambda: 0)


def test_wait_all_times_out_while_a_job_is_held(engine: CopyEngine):
    gate = threading.Event()
    engine.submit(0, held_until(gate))
    assert not engine.wait_all(timeout=0.05)
    gate.set()
    assert engine.wait_all(timeout=30)


def test_a_bandwidth_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="positive"):
        CopyEngine(CPU, emulate_h2d_gbps=0.0)


def device_caches(device: torch.device, dtype: torch.dtype, layers: int = 3,
                  pages: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (pages, 4, 2, 16)  # [pages, block_size, kv_heads, head_dim]
    return [(torch.randn(shape).to(device, dtype), torch.randn(shape).to(device, dtype)) for _ in range(layers)]


def round_trip(device: torch.device, dtype: torch.dtype, copies: CopyEngine | None = None) -> None:
    caches = device_caches(device, dtype)
    original = [(k.clone(), v.clone()) for k, v in caches]
    pool = HostKVPool.like(caches, num_pages=6)
    assert pool.pinned == (device.type == "cuda")
    out = [KVCopy(3, 1), KVCopy(4, 2), KVCopy(6, 0)]
    assert pool.swap_out(caches, out) == 3 * pool.page_bytes
    for k, v in caches:  # the device pages go to other requests right after
        k[[3, 4, 6]] = 0
        v[[3, 4, 6]] = 0
    back = [KVCopy(0, 1), KVCopy(1, 2), KVCopy(7, 0)]
    if copies is None:
        assert pool.swap_in(caches, back) == 3 * pool.page_bytes
    else:
        copies.submit(9, lambda: pool.swap_in(caches, back))
        assert copies.wait_all(timeout=30) and copies.poll() == [9]
    for (k, v), (k0, v0) in zip(caches, original, strict=True):
        for now, then in ((k, k0), (v, v0)):
            assert torch.equal(now[[0, 1, 7]].view(torch.uint8), then[[3, 4, 6]].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_pool_round_trip_keeps_bytes_exact(dtype: torch.dtype):
    round_trip(CPU, dtype)


def test_host_pool_swap_in_as_a_background_job(engine: CopyEngine):
    round_trip(CPU, torch.bfloat16, engine)


def test_host_pool_sizes_and_page_checks():
    caches = device_caches(CPU, torch.bfloat16, layers=2)
    pool = HostKVPool.like(caches, num_pages=4)
    assert pool.num_pages == 4
    assert pool.page_bytes == 2 * 2 * 4 * 2 * 16 * 2
    with pytest.raises(IndexError, match="host page 4"):
        pool.swap_out(caches, [KVCopy(0, 4)])
    with pytest.raises(IndexError, match="device page 8"):
        pool.swap_in(caches, [KVCopy(8, 0)])
    with pytest.raises(ValueError, match="layers"):
        pool.swap_in(caches[:1], [KVCopy(0, 0)])


def test_consecutive_pages_coalesce_into_runs():
    copies = [KVCopy(2, 5), KVCopy(3, 6), KVCopy(4, 7), KVCopy(9, 8), KVCopy(1, 0), KVCopy(2, 2)]
    assert coalesce(copies) == [(2, 5, 3), (9, 8, 1), (1, 0, 1), (2, 2, 1)]
    assert coalesce([]) == []


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_host_pool_round_trip_through_pinned_memory(dtype: torch.dtype):
    device = torch.device("cuda")
    with CopyEngine(device) as copies:
        round_trip(device, dtype, copies)
    assert HostKVPool.like(device_caches(device, dtype), 2).layers[0][0].is_pinned()


@needs_cuda
def test_cuda_job_follows_the_compute_work_queued_before_it():
    device = torch.device("cuda")
    src, dst = torch.zeros(1 << 20, device=device), torch.zeros(1 << 20, device=device)
    with CopyEngine(device) as copies:
        torch.cuda._sleep(200_000_000)  # holds the compute stream: the fill below lands late
        src.fill_(7.0)
        copies.submit(0, copy_job(dst, src))
        assert copies.wait_all(timeout=60)
        assert copies.poll() == [0]
        # completed on the device: read on another stream with no synchronisation of ours
        with torch.cuda.stream(torch.cuda.Stream(device)):
            assert dst.min().item() == 7.0


@needs_cuda
def test_cuda_compute_stream_is_not_blocked_by_a_slow_job():
    device = torch.device("cuda")
    host = torch.ones(64 << 20, pin_memory=True)  # 256 MB
    dst = torch.empty_like(host, device=device)
    with CopyEngine(device, emulate_h2d_gbps=0.5) as copies:
        copies.submit(0, copy_job(dst, host))
        assert copies.poll() == []
        x = torch.randn(256, 256, device=device)
        assert torch.isfinite(x @ x).all().item()
        assert copies.wait_all(timeout=60)
        (result,) = copies.poll_results()
    assert result.ok and result.seconds >= 0.45
    assert dst.min().item() == dst.max().item() == 1.0
