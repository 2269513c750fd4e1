"""Chameleon's scheduler step by step: admission phases, quotas, bypass and squash, refreshes.

Before anything finishes, the predictor says min(max_tokens, 128) tokens, so `max_tokens` sets a
request's predicted output here. Base-model requests count as rank 8 of max_lora_rank 64:
prompt 4 + output 4 is WRS 0.002 and needs 8 tokens, 8 + 8 is 0.004 and 16, 40 + 40 is 0.02 and 80.
"""

from __future__ import annotations

import pytest
from sched_harness import drain, is_running, make_core, req, running_ids

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.memory.gate import PageGate
from loraplex.engine.request import RequestStatus
from loraplex.engine.scheduling.chameleon import IDLE, SPARE, ChameleonOptions

STATIC = {"refresh_s": 1e9}  # no timer refresh during a test
QUOTAS = {**STATIC, "work_conserving": False}  # the paper's quotas alone: what they admit, nothing more


def small(i: int):
    return req(f"s{i}", 4, 4)


def medium(i: int):
    return req(f"m{i}", 8, 8)


def large(i: int):
    return req(f"L{i}", 40, 40)


def add(core: EngineCore, *requests):
    for r in requests:
        core.add_request(r)
    return requests


def test_phase_one_admits_each_queue_within_its_quota_and_a_blocked_queue_lends_nothing():
    core, _, _ = make_core(options=QUOTAS)
    sched = core.scheduler
    sched.configure([0.01], quota_tokens=[16, 100])
    s0, s1, s2, l0, l1 = add(core, small(0), small(1), small(2), large(0), large(1))
    core.step()
    assert running_ids(core) == {"s0", "s1", "L0"}  # queue 0 fits two; queue 1 fits one of 80
    assert sched.held_tokens == [16, 80]
    assert [e.request.request_id for e in sched.queues[0]] == ["s2"]  # no spare: queue 1 is not empty
    drain(core, core.clock)
    assert sched.held_tokens == [0, 0] and sched.held_seats == [0, 0] and sched._held_total == 0


def test_phase_two_lends_the_spare_of_emptied_queues_and_a_large_head_can_stay_blocked():
    core, _, _ = make_core(options=QUOTAS)
    sched = core.scheduler
    sched.configure([0.003, 0.01], quota_tokens=[40, 16, 150])
    add(core, large(0))
    core.step()
    assert sched.held_tokens == [0, 0, 80]
    add(core, small(0), medium(0), medium(1), large(1))
    core.step()
    # phase 1: s0 (queue 0 then empty: 32 spare), m0 (queue 1 full), L1 does not fit 150 - 80
    # phase 2: the 32 spare takes m1 (16); 16 left cannot take L1 (80)
    assert running_ids(core) == {"L0", "s0", "m0", "m1"}
    assert sched._entries["m1"].charged_to == SPARE
    assert sched.stats().spare_held_tokens == 16
    assert [e.request.request_id for e in sched.queues[2]] == ["L1"]
    drain(core, core.clock)
    assert sched.stats().spare_held_tokens == 0 and sched._held_total == 0


def test_capacity_the_quotas_leave_idle_goes_to_a_fitting_request_of_a_quota_bound_queue():
    """Queue 1's quota holds one large request and queue 0 never empties, so nothing is lent: with the
    quotas alone L1 waits while seats and budget sit idle (counted); work-conserving, it starts on them."""
    for work_conserving in (False, True):
        core, _, _ = make_core(options={**STATIC, "work_conserving": work_conserving})
        sched = core.scheduler
        sched.configure([0.01], quota_tokens=[16, 100])
        _, _, s2, l0, l1 = add(core, small(0), small(1), small(2), large(0), large(1))
        core.step()
        idle = sched.stats().idle
        assert is_running(l0)
        assert is_running(l1) == is_running(s2) == work_conserving
        if work_conserving:
            assert sched._entries["L1"].charged_to == IDLE and sched.held_tokens == [16, 80]  # it borrows no quota
            assert idle.steps == 0 and sched.stats().num_idle_admissions == 2
        else:
            assert (idle.steps, idle.reasons) == (1, {"quota": 1})
            assert idle.seats == core.config.max_num_seqs - 3 and idle.tokens > 0
        drain(core, core.clock)
        assert sched._held_total == 0 and sum(sched.held_seats) == 0


def test_the_fill_goes_past_a_request_refused_for_kv_to_a_smaller_one():
    core, _, _ = make_core(options=STATIC, num_blocks=24, max_model_len=96, max_num_batched_tokens=64)
    sched = core.scheduler
    sched.configure([0.01], quota_tokens=[1, 1])  # the quotas admit nothing: only the fill does
    running = add(core, req("big0", 40, 40))[0]
    core.step()
    big, tiny = add(core, req("big1", 60, 4), req("tiny", 4, 4))  # 15 pages for big1's chunk, 14 are free
    core.step()
    assert is_running(running) and is_running(tiny) and not is_running(big)
    assert sched.stats().idle.steps == 0
    drain(core, core.clock)


def test_an_aged_request_refused_for_kv_keeps_the_pages_that_free_as_fifo_does():
    core, _, clock = make_core(options={**STATIC, "max_wait_s": 1.0}, num_blocks=24, max_model_len=96,
                               max_num_batched_tokens=64)
    core.scheduler.configure([0.01], quota_tokens=[1, 1])
    running = add(core, req("big0", 40, 40))[0]
    core.step()
    big = add(core, req("big1", 60, 4))[0]  # 15 pages for its chunk, 14 are free
    core.step()
    clock.advance(1.5)  # big1 is past the aging limit; tiny has just arrived
    tiny = add(core, req("tiny", 4, 4))[0]
    core.step()
    assert is_running(running) and not is_running(big) and not is_running(tiny)
    assert core.scheduler.stats().idle.reasons == {"aged": 1}
    drain(core, clock)
    assert big.first_scheduled_time <= tiny.first_scheduled_time


def test_fifo_counts_the_idle_capacity_behind_a_head_refused_for_kv():
    core, _, _ = make_core("fifo", num_blocks=24, max_model_len=96, max_num_batched_tokens=64)
    add(core, req("big0", 40, 40))
    core.step()
    add(core, req("big1", 60, 4), req("tiny", 4, 4))
    core.step()
    idle = core.scheduler.stats().idle
    assert idle.steps == 1 and idle.reasons == {"order": 1} and idle.seats == core.config.max_num_seqs - 1


def test_a_request_larger_than_its_quota_runs_alone_in_its_queue():
    core, _, _ = make_core(options=QUOTAS)
    sched = core.scheduler
    sched.configure([0.01], quota_tokens=[8, 50])  # queue 0 will have no spare to lend
    s0, l0, l1 = add(core, small(0), large(0), large(1))
    core.step()
    assert is_running(s0) and is_running(l0) and not is_running(l1)
    assert sched.held_tokens[1] == 50  # it borrows the whole quota, never more
    drain(core, core.clock)
    assert l1.status is RequestStatus.FINISHED


@pytest.mark.parametrize("max_wait_s", [0.0, 1.0])
def test_a_head_waiting_longer_than_max_wait_borrows_what_nobody_holds(max_wait_s):
    core, _, clock = make_core(options={**QUOTAS, "max_wait_s": max_wait_s})
    sched = core.scheduler
    sched.configure([0.01], quota_tokens=[16, 100])
    _, l0, l1 = add(core, small(0), large(0), large(1))
    core.step()
    assert is_running(l0) and not is_running(l1)  # 80 of queue 1's 100 held: L1 does not fit
    clock.advance(1.5)
    add(core, small(1))  # queue 0 never empties: it lends nothing
    core.step()
    if max_wait_s:
        assert is_running(l1) and sched._entries["L1"].charged_to == SPARE
        assert sched._held_total <= sched.token_pool  # borrowed from what nobody holds, never over-lent
    else:
        assert not is_running(l1)
    drain(core, clock)
    assert sched._held_total == 0


@pytest.mark.parametrize("max_wait_s", [0.0, 1.0])
def test_past_the_aging_limit_requests_go_in_arrival_order_whatever_their_queue(max_wait_s):
    core, _, clock = make_core(options={**STATIC, "max_wait_s": max_wait_s}, max_num_seqs=1)
    core.scheduler.configure([0.01], quota_tokens=[500, 500], quota_seats=[1, 1])
    s0, l0 = add(core, small(0), large(0))
    core.step()
    assert is_running(s0) and not is_running(l0)  # smallest queue first: the one seat
    clock.advance(1.5)
    s1 = add(core, small(1))[0]  # not aged: it has just arrived
    while not s0.is_finished:
        core.step()
    core.step()
    assert is_running(l0) == bool(max_wait_s) and is_running(s1) == (not max_wait_s)
    drain(core, clock)


def test_without_max_wait_a_head_ages_at_aging_factor_times_the_recent_mean_wait():
    core, _, clock = make_core(options={**STATIC, "aging_factor": 3.0, "slo_s": 10.0})
    sched = core.scheduler
    assert sched.max_wait_s() == 5.0  # nothing admitted yet: half of slo_s
    sched.configure([0.01], quota_tokens=[16, 100])
    r = add(core, small(0))[0]
    clock.advance(0.5)
    core.step()
    assert is_running(r) and sched.max_wait_s() == pytest.approx(1.5)  # 3 x the one wait seen
    clock.advance(100.0)
    add(core, large(0))
    clock.advance(30.0)
    core.step()
    assert sched.max_wait_s() == 5.0  # never beyond half of slo_s


def test_seats_are_split_so_no_queue_takes_them_all():
    core, _, _ = make_core(options=QUOTAS, max_num_seqs=4)
    sched = core.scheduler
    sched.configure([0.01], quota_tokens=[500, 500], quota_seats=[3, 1])
    add(core, *(small(i) for i in range(6)), large(0))
    core.step()
    assert running_ids(core) == {"s0", "s1", "s2", "L0"}


def bypass_setup(**options):
    """Two slots: a's running request ends in ~40 steps, c's in ~60. r1 (adapter b) cannot get a slot."""
    core, _, clock = make_core(options={**QUOTAS, **options}, max_loras=2)
    core.scheduler.configure([], quota_tokens=[1024])
    la, lc = add(core, req("la", 4, 40, "a"), req("lc", 4, 60, "c"))
    core.step()
    clock.advance(0.01)
    rest = add(core, req("r1", 4, 4, "b"), req("r2", 4, 4, "c"), req("r3", 4, 100, "c"), req("r4", 4, 4, "a"),
               req("r5", 4, 4, "d"))
    core.step()
    clock.advance(0.01)
    return core, clock, (la, lc, *rest)


class SharedMemoryGate(PageGate):
    """As if adapters and KV shared one pool (issue 10): every admission takes memory the head needs."""

    def competes(self, adapter):
        return True


def test_younger_requests_of_resident_adapters_bypass_a_head_without_adapter_memory():
    core, _, (la, lc, r1, r2, r3, r4, r5) = bypass_setup()
    sched = core.scheduler
    assert not is_running(r1)
    assert is_running(r2) and is_running(r3) and is_running(r4)  # they join resident adapters' slots
    assert not is_running(r5)  # d needs a slot too
    assert sched.stats().num_bypasses == 3
    assert sched._blocked[0].entry.request is r1
    drain(core, core.clock)
    assert all(r.status is RequestStatus.FINISHED for r in (la, lc, r1, r2, r3, r4, r5))


def test_with_shared_memory_only_requests_ending_before_the_heads_memory_frees_bypass():
    core, _, clock = make_core(options=QUOTAS, max_loras=2)
    sched = core.scheduler
    sched.gate = SharedMemoryGate(core.memory)
    sched.configure([], quota_tokens=[1024])
    add(core, req("la", 4, 40, "a"), req("lc", 4, 60, "c"))
    core.step()
    r1, r2, r3 = add(core, req("r1", 4, 4, "b"), req("r2", 4, 4, "c"), req("r3", 4, 100, "c"))
    core.step()
    assert not is_running(r1)
    assert is_running(r2)  # 5 predicted steps < ~39 until a's slot frees
    assert not is_running(r3)  # 101 predicted steps: it would outlast the head's wait
    assert sched.stats().num_bypasses == 1


@pytest.mark.parametrize(("quota", "bypasses"), [(159, False), (160, True)])
def test_a_bypass_leaves_room_in_the_quota_for_the_head(quota, bypasses):
    core, _, _ = make_core(options=QUOTAS, max_loras=2)
    sched = core.scheduler
    sched.configure([], quota_tokens=[quota])
    add(core, req("la", 4, 4, "a"), req("lc", 4, 4, "c"))  # 40 + 72 tokens (rank 8 and 16 at 4 a rank)
    core.step()
    assert sched.held_tokens == [112]
    # r1 needs 40; r2 8: c's weights (64 tokens) are on the device already, paid for by lc
    r1, r2 = add(core, req("r1", 4, 4, "b"), req("r2", 4, 4, "c"))
    core.step()
    assert not is_running(r1)
    assert is_running(r2) == bypasses  # only if r1's 40 still fit after r2's 8
    if bypasses:
        assert sched._entries["r2"].charge == 8 and sched.held_tokens == [120]


def test_a_bypasser_is_squashed_when_its_memory_would_let_the_head_start_first():
    core, _, (la, lc, r1, r2, r3, r4, r5) = bypass_setup()
    sched = core.scheduler
    core.abort_request("lc")  # c's slot is now held by the bypassers r2 and r3 alone
    core.step()
    assert is_running(r1)
    assert r2.status is RequestStatus.PREEMPTED and r3.status is RequestStatus.PREEMPTED
    assert r2.num_preemptions == 1 and sched.stats().num_squashes == 2
    assert all(b.entry.request is not r1 for b in sched._blocked.values())
    assert [e.request.request_id for e in sched.queues[0]][:2] == ["r2", "r3"]  # back in arrival order
    drain(core, core.clock)
    assert r2.status is RequestStatus.FINISHED and len(r2.output_token_ids) == 4


def test_a_head_whose_adapter_is_being_copied_in_is_passed_over_not_blocked():
    """Its memory is granted and the copy is in flight (unified pool): the requests behind it start, as
    under FIFO, and nothing counts as a bypass; it starts when the copy lands."""
    core, _, clock = make_core(options={**STATIC, "max_bypasses": 0}, memory_policy="unified", num_blocks=2048)
    core.scheduler.configure([], quota_tokens=[4096])
    warm = add(core, req("w", 4, 1, "a"))[0]
    drain(core, clock)
    assert warm.is_finished
    cold, ready = add(core, req("cold", 4, 4, "e"), req("ready", 4, 4, "a"))
    core.step()
    assert core.memory.loading(cold.adapter) and not is_running(cold)
    assert is_running(ready)
    assert core.scheduler.stats().num_bypasses == 0 and not core.scheduler._blocked
    drain(core, clock)
    assert cold.is_finished


def test_a_head_blocked_long_enough_gets_the_memory_that_frees_first():
    core, clock, (la, lc, r1, r2, r3, r4, r5) = bypass_setup(reserve_after_s=0.05)
    sched = core.scheduler
    clock.advance(0.05)
    core.step()
    assert sched._holder.entry.request is r1 and sched._holder.reserved == la.adapter  # a ends before c
    late_a, late_c = add(core, req("late_a", 4, 4, "a"), req("late_c", 4, 4, "c"))
    for _ in range(200):
        if is_running(r1) or r1.is_finished:
            break
        core.step()
        clock.advance(0.01)
        assert not is_running(late_a)  # a's slot is promised to r1
        assert not is_running(r5)  # nobody else takes a slot that frees
    assert r1.first_scheduled_time is not None
    assert la.is_finished and not lc.is_finished  # r1 got a's slot, not c's
    assert late_c.first_scheduled_time is not None  # c stayed open meanwhile
    drain(core, clock)


def test_the_first_refresh_waits_for_enough_arrivals_then_splits_by_size():
    core, _, clock = make_core(options={"min_samples": 8})
    sched = core.scheduler
    add(core, *(small(i) for i in range(4)))
    core.step()
    assert sched.num_refreshes == 0 and len(sched.queues) == 1
    add(core, *(small(i) for i in range(4, 8)), *(large(i) for i in range(4)))
    core.step()
    assert sched.num_refreshes == 1 and len(sched.queues) == 2
    assert 0.002 < sched.bounds[0] < 0.02
    stats = sched.stats()
    assert sum(q.quota_tokens for q in stats.queues) == sched.token_pool
    assert sum(q.quota_seats for q in stats.queues) == core.config.max_num_seqs
    assert stats.queues[1].upper_boundary is None and stats.queues[0].arrival_rate == pytest.approx(8.0)


def test_refreshes_come_every_refresh_period_of_the_injected_clock():
    core, _, clock = make_core(options={"refresh_s": 10.0, "min_samples": 4})
    sched = core.scheduler
    add(core, *(small(i) for i in range(4)))
    core.step()
    assert sched.num_refreshes == 1
    clock.advance(9.0)
    core.step()
    assert sched.num_refreshes == 1
    clock.advance(1.0)
    core.step()
    assert sched.num_refreshes == 2


def test_a_marked_load_shift_refreshes_early():
    options = {"refresh_s": 1000.0, "min_samples": 8, "shift_window_s": 10.0, "shift_factor": 2.0}
    core, _, clock = make_core(options=options, num_blocks=2048)
    sched = core.scheduler
    for i in range(20):  # one request a second
        core.add_request(small(i))
        core.step()
        clock.advance(1.0)
    assert sched.num_refreshes == 1  # the bootstrap
    for i in range(20, 40):  # the same rate: no refresh
        core.add_request(small(i))
        core.step()
        clock.advance(1.0)
    assert sched.num_refreshes == 1
    for i in range(40, 140):  # ten a second
        core.add_request(small(i))
        core.step()
        clock.advance(0.1)
    assert sched.num_refreshes == 2


def test_a_refresh_moves_waiting_requests_to_their_new_queue_in_arrival_order():
    core, _, _ = make_core(options=QUOTAS)
    sched = core.scheduler
    sched.configure([0.01], quota_tokens=[1, 1])  # almost nothing runs
    requests = add(core, large(0), small(0), medium(0), large(1), small(1), medium(1))
    core.step()
    waiting = {r.request_id for r in requests if not is_running(r)}
    sched.configure([0.003], quota_tokens=[1, 1])
    queues = [[e.request.request_id for e in q] for q in sched.queues]
    assert queues[0] == [r for r in ("s0", "s1") if r in waiting]
    assert queues[1] == [r for r in ("L0", "m0", "L1", "m1") if r in waiting]
    assert sum(sched.held_tokens) + sched._spare_tokens == sched._held_total  # running ones re-charged


def test_overload_is_flagged_when_the_floors_exceed_the_pool():
    core, _, _ = make_core(options={"min_samples": 8, "slo_s": 0.1}, num_blocks=64)
    add(core, *(large(i) for i in range(10)))
    core.step()
    stats = core.scheduler.stats()
    assert stats.overloaded and stats.token_pool == 256
    assert sum(q.min_quota_tokens for q in stats.queues) > 256
    assert sum(q.quota_tokens for q in stats.queues) == 256


def test_stats_report_queues_waits_and_the_predictor():
    core, _, clock = make_core(options=STATIC)
    add(core, *(small(i) for i in range(3)))
    clock.advance(0.5)
    drain(core, clock)
    stats = core.scheduler.stats()
    assert stats.policy == "chameleon" and stats.predictor.observations == 3
    assert stats.queues[0].mean_wait_s == pytest.approx(0.5)
    assert stats.adapter_service[""] == 3 * 8
    assert core.scheduler_stats() == stats


def test_options_are_validated_and_strings_converted():
    core, _, _ = make_core(options={"refresh_s": "60", "max_queues": "3", "prior_tokens": "64"})
    assert core.scheduler.options.refresh_s == 60.0 and core.scheduler.options.max_queues == 3
    assert core.scheduler.predictor.options.prior_tokens == 64.0
    with pytest.raises(ValueError, match="unknown scheduler option"):
        make_core(options={"nope": 1})
    with pytest.raises(ValueError, match="unknown scheduler option"):
        make_core("fifo", options={"refresh_s": 1})
    with pytest.raises(ValueError, match="quota_split"):
        ChameleonOptions(quota_split="fair")
    with pytest.raises(ValueError, match=r"\['chameleon', 'fifo', 'sjf', 'vtc'\]"):
        make_core("lottery")
    assert EngineConfig().scheduler == "fifo"
