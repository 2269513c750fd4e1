"""Properties every scheduler keeps: the schedule changes timing, never tokens; chameleon never
over-lends a quota; no request waits forever under a sustained stream of short ones."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_harness import SCHEDULER_NAMES, assert_no_running_kv, make_core, req

from loraplex.engine.request import RequestStatus
from loraplex.engine.scheduling.chameleon import IDLE, SPARE, ChameleonScheduler

# chameleon reconfigures often here: refreshes, load shifts and re-bucketing all get exercised
BUSY_CHAMELEON = {"min_samples": 4, "refresh_s": 0.5, "shift_window_s": 0.4, "max_bypasses": 2}
ADAPTER_NAMES = [None, "a", "b", "c", "d", "e"]

arrivals = st.lists(
    st.tuples(st.integers(0, 30), st.integers(1, 40), st.integers(1, 16), st.sampled_from(ADAPTER_NAMES)),
    min_size=1, max_size=24)
engine_configs = st.fixed_dictionaries({
    "num_blocks": st.sampled_from([64, 256]), "max_num_batched_tokens": st.sampled_from([7, 16, 64]),
    "max_num_seqs": st.integers(1, 6), "max_loras": st.integers(1, 3)})


def replay(name: str, workload, config: dict, options: dict | None = None, check=None) -> dict[str, list[int]]:
    core, _, clock = make_core(name, options=options if name == "chameleon" else None, **config)
    requests = [(step, req(f"r{i}", prompt, max_tokens, adapter))
                for i, (step, prompt, max_tokens, adapter) in enumerate(workload)]
    step = 0
    while step < 20_000:
        for at, request in requests:
            if at == step:
                core.add_request(request)
        if step > max(at for at, _ in requests) and not core.has_unfinished():
            break
        core.step()
        if check:
            check(core)
        clock.advance(0.05)
        step += 1
    assert not core.has_unfinished(), f"{name} left requests unfinished"
    assert_no_running_kv(core)
    return {r.request_id: r.output_token_ids for _, r in requests}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals, engine_configs)
def test_outputs_are_the_same_under_every_scheduler(workload, config):
    expected = replay("fifo", workload, config)
    assert all(len(tokens) == max_tokens for (_, _, max_tokens, _), tokens in zip(workload, expected.values(), strict=True))
    for name in SCHEDULER_NAMES[1:]:
        assert replay(name, workload, config, BUSY_CHAMELEON) == expected, name


def check_quotas(core) -> None:
    sched: ChameleonScheduler = core.scheduler
    running = [sched._entries[r.request_id] for r in sched.running]
    assert all(e.charged_to != -2 for e in running), "a running request holds no quota"
    assert sched._held_total == sum(e.charge for e in running) == sum(sched.held_tokens) + sched._spare_tokens
    assert sum(sched.held_seats) + sched._spare_seats + sum(e.charged_to == IDLE for e in running) == len(running)
    assert all(e.charge == 0 for e in running if e.charged_to == IDLE), "work-conserving admissions hold no quota"
    assert sched._held_total <= sched.token_pool
    assert sched._spare_tokens == sum(e.charge for e in running if e.charged_to == SPARE)


def lending_checked(core) -> None:
    """Wrap `_borrow` so every loan is checked against what its lender has at that moment."""
    sched: ChameleonScheduler = core.scheduler
    borrow = sched._borrow

    def checked(entry, where, charge):
        assert sched._held_total + charge <= sched.token_pool, "the pool is over-lent"
        if where >= 0:
            assert sched.held_tokens[where] + charge <= sched.quota_tokens[where], "a token quota is over-lent"
            assert sched.held_seats[where] + 1 <= sched.quota_seats[where], "a seat quota is over-lent"
        assert charge <= entry.need
        borrow(entry, where, charge)

    sched._borrow = checked


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals, engine_configs, st.sampled_from(["min", "equal"]), st.sampled_from([0.05, 1.0, 5.0]))
def test_chameleon_never_over_lends_a_quota(workload, config, split, slo_s):
    options = {**BUSY_CHAMELEON, "quota_split": split, "slo_s": slo_s}
    seen = []

    def check(core):
        if not seen:
            lending_checked(core)
            seen.append(core)
        check_quotas(core)

    replay("chameleon", workload, config, options, check)
    sched = seen[0].scheduler
    assert sched._held_total == 0 and sum(sched.held_seats) == 0 and sched._spare_seats == 0


def run_stream(name: str, options: dict | None, long_at: int, per_step: list[int], short_adapters: list[str],
               long_adapter: str, **config) -> tuple[int | None, int]:
    """Short requests arrive every step for `len(per_step) * 10` steps; one long request at `long_at`.
    Returns the step the long request finished (None: never) and the number of steps run."""
    core, _, clock = make_core(name, options=options, **config)
    long = req("long", 60, 40, long_adapter)
    steps = len(per_step) * 10
    n = 0
    for step in range(steps):
        if step == long_at:
            core.add_request(long)
        for _ in range(per_step[step % len(per_step)]):
            core.add_request(req(f"s{n}", 2 + n % 7, 1 + n % 3, short_adapters[n % len(short_adapters)]))
            n += 1
        core.step()
        clock.advance(0.02)
        if long.status is RequestStatus.FINISHED:
            return step, steps
    return None, steps


stream_shapes = st.lists(st.integers(0, 3), min_size=4, max_size=12).filter(lambda xs: sum(xs) >= len(xs))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["fifo", "vtc", "chameleon"]), st.integers(0, 40), stream_shapes,
       st.lists(st.sampled_from(["a", "b", "c", None]), min_size=1, max_size=3), st.integers(3, 8))
def test_no_request_waits_forever_under_a_stream_of_short_ones(name, long_at, per_step, short_adapters, seqs):
    options = {"min_samples": 16, "refresh_s": 2.0} if name == "chameleon" else None
    finished_at, steps = run_stream(name, options, long_at, per_step * 4, short_adapters, "e",
                                    max_num_seqs=seqs, max_loras=5, num_blocks=512)
    assert finished_at is not None, f"{name}: the long request never finished in {steps} steps"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 40), stream_shapes, st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3),
       st.integers(1, 2), st.integers(2, 8))
def test_chameleon_starves_no_adapter_when_slots_are_scarce(long_at, per_step, short_adapters, slots, seqs):
    """With fewer slots than adapters FIFO can pass over a cold adapter forever (a hot adapter
    always holds the slot); chameleon's blocked head reserves the memory that frees first. The
    streams here can outrun the engine: past the aging limit the requests that arrived before the
    long one go first (arrival order), so it may finish only after that backlog (up to ~170 steps)."""
    finished_at, steps = run_stream("chameleon", {"min_samples": 16, "refresh_s": 2.0}, long_at, per_step * 8,
                                    short_adapters, "e", max_num_seqs=seqs, max_loras=slots, num_blocks=512)
    assert finished_at is not None, f"the long request never finished in {steps} steps"
