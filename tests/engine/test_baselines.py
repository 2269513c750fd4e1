"""The sjf and vtc baselines, and the schedulers' common face."""

from __future__ import annotations

import pytest
from sched_harness import SCHEDULER_NAMES, assert_no_running_kv, drain, is_running, make_core, req

from loraplex.engine.request import RequestStatus


def admission_order(core, clock) -> list[str]:
    order: list[str] = []
    while core.has_unfinished():
        core.step()
        clock.advance(0.01)
        order += [r.request_id for r in core.scheduler.running if r.request_id not in order]
    return order


def test_sjf_admits_by_predicted_output():
    core, _, clock = make_core("sjf", max_num_seqs=1)
    for rid, max_tokens in (("long", 30), ("short", 5), ("mid", 15)):
        core.add_request(req(rid, 4, max_tokens))
    assert admission_order(core, clock) == ["short", "mid", "long"]
    assert core.scheduler.stats().predictor.observations == 3


def test_sjf_by_prompt_admits_the_shortest_prompt_first():
    core, _, clock = make_core("sjf", options={"order_by": "prompt"}, max_num_seqs=1)
    for rid, prompt_len, max_tokens in (("long", 30, 2), ("short", 3, 40), ("mid", 12, 20)):
        core.add_request(req(rid, prompt_len, max_tokens))
    assert admission_order(core, clock) == ["short", "mid", "long"]
    with pytest.raises(ValueError, match="order_by"):
        make_core("sjf", options={"order_by": "rank"})


def test_sjf_starves_a_long_request_under_a_stream_of_short_ones():
    core, _, clock = make_core("sjf", max_num_seqs=1)
    long = req("long", 4, 50)
    core.add_request(long)
    for i in range(200):
        core.add_request(req(f"s{i}", 2, 2))
        core.step()
        clock.advance(0.01)
    assert long.first_scheduled_time is None  # the flaw chameleon's queues fix


def test_vtc_counts_input_at_admission_and_output_per_token():
    core, _, clock = make_core("vtc", options={"input_weight": 1.0, "output_weight": 2.0})
    core.add_request(req("r", 10, 5, "a"))
    core.step()
    assert core.scheduler.counters[req("x", 1, 1, "a").adapter] == 10 + 2  # prompt + its first token
    drain(core, clock)
    stats = core.scheduler.stats()
    assert stats.adapter_counters == {"a": 10 + 2 * 5}
    assert stats.adapter_service == {"a": 15}


def test_vtc_lifts_a_newly_backlogged_adapter_to_the_least_served_backlogged_one():
    core, _, clock = make_core("vtc", max_num_seqs=1)
    sched = core.scheduler
    for i in range(3):
        core.add_request(req(f"a{i}", 10, 10, "a"))
    for _ in range(15):  # a0 has finished, a1 runs, a2 waits
        core.step()
    a, b = req("x", 1, 1, "a").adapter, req("y", 1, 1, "b").adapter
    assert sched.counters[a] > 0
    core.add_request(req("b0", 10, 10, "b"))
    assert sched.counters[b] == sched.counters[a]  # no credit for having been idle
    drain(core, clock)
    c = req("z", 1, 1, "c").adapter
    core.add_request(req("c0", 10, 10, "c"))  # nothing backlogged: lifted to the adapter served last
    assert sched.counters[c] == sched.counters[sched._last_served] > 0


def test_vtc_serves_a_light_adapter_between_a_heavy_ones_requests():
    core, _, clock = make_core("vtc", max_num_seqs=1)
    for i in range(8):
        core.add_request(req(f"heavy{i}", 8, 8, "a"))
    core.step()
    for i in range(2):
        core.add_request(req(f"light{i}", 8, 8, "b"))
    order = admission_order(core, clock)
    assert order.index("light0") <= 2 and order.index("light1") <= 4
    fifo, _, fifo_clock = make_core("fifo", max_num_seqs=1)
    for i in range(8):
        fifo.add_request(req(f"heavy{i}", 8, 8, "a"))
    fifo.step()
    for i in range(2):
        fifo.add_request(req(f"light{i}", 8, 8, "b"))
    assert admission_order(fifo, fifo_clock).index("light0") == 8


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_every_scheduler_aborts_waiting_and_running_requests_cleanly(name):
    core, _, clock = make_core(name, max_num_seqs=2, max_loras=1)
    requests = [req(f"r{i}", 6, 20, "abcde"[i % 5]) for i in range(8)]
    for r in requests:
        core.add_request(r)
    core.step()
    core.step()
    assert any(is_running(r) for r in requests)
    for r in requests[::2]:
        core.abort_request(r.request_id)
    assert core.scheduler.num_waiting + core.scheduler.num_running == 4
    drain(core, clock)
    assert_no_running_kv(core)
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    stats = core.scheduler_stats()
    assert stats.policy == name and stats.queues[0].length == 0


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_every_scheduler_counts_what_ended_admission_while_requests_wait(name):
    core, _, clock = make_core(name, max_num_seqs=1, max_num_batched_tokens=64, max_loras=1)
    core.add_request(req("first", 4, 3, "a"))
    core.step()  # it takes the only seat
    core.add_request(req("second", 4, 3, "a"))
    core.step()
    assert core.scheduler.stats().admission_limits == {"seats": 1}
    drain(core, clock)
    core.add_request(req("big", 100, 2))  # 100 prompt tokens: the budget of 64 ends the step
    core.add_request(req("after", 4, 2))
    core.step()
    assert core.scheduler.stats().admission_limits["budget"] == 1
    drain(core, clock)
    limits = core.scheduler.stats().admission_limits
    assert set(limits) <= {"budget", "seats", "kv", "adapter", "policy"}
