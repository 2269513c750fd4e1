"""Outlier detection (loraplex.routing.outliers) and heartbeat lateness (Snapshot), on a fake clock."""

from __future__ import annotations

import math

import pytest
from loraplex_router.snapshot import Heartbeat, Snapshot, track_heartbeats

from loraplex.routing.outliers import Failure, Outcome, OutlierConfig, OutlierDetector, TtfbDeadline
from loraplex.routing.records import ServerRecord


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool(*names: str, heartbeat_at: float = 0.0) -> dict[str, ServerRecord]:
    return {n: ServerRecord(n, f"http://{n}", max_rank=64, heartbeat_at=heartbeat_at) for n in names}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def detector(clock: FakeClock, **config) -> OutlierDetector:
    return OutlierDetector(OutlierConfig(**config), clock)


def test_consecutive_failures_eject_and_an_answer_starts_the_count_again(clock):
    d, live = detector(clock, consecutive=3), pool("a", "b", "c")
    assert d.record_failure("a", Failure.DEADLINE, live) is Outcome.COUNTED
    assert d.record_failure("a", Failure.TRANSPORT, live) is Outcome.COUNTED
    d.record_success("a")
    assert d.record_failure("a", Failure.DEADLINE, live) is Outcome.COUNTED
    assert d.record_failure("a", Failure.DEADLINE, live) is Outcome.COUNTED
    assert d.ejected(live) == frozenset()
    assert d.record_failure("a", Failure.DEADLINE, live) is Outcome.EJECTED
    assert d.ejected(live) == {"a"}
    assert d.record_failure("a", Failure.DEADLINE, live) is Outcome.COUNTED  # already out


def test_a_refused_connection_ejects_at_once(clock):
    d, live = detector(clock, consecutive=3), pool("a", "b")
    assert d.record_failure("a", Failure.CONNECT, live) is Outcome.EJECTED
    assert d.ejected(live) == {"a"}


def test_ejections_in_a_row_grow_up_to_the_maximum_and_are_forgotten_later(clock):
    d, live = detector(clock, consecutive=1, base_ejection_s=5, max_ejection_s=12), pool("a", "b")
    lengths = []
    for _ in range(4):
        d.record_failure("a", Failure.DEADLINE, live)
        lengths.append(d.ejection_ends_in("a"))
        clock.now += lengths[-1]
        assert d.ejected(live) == frozenset()  # its time is up
    assert lengths == [5, 10, 12, 12]
    clock.now += 12.5  # longer than the maximum without an ejection: the next one is the first again
    d.record_failure("a", Failure.DEADLINE, live)
    assert d.ejection_ends_in("a") == 5


@pytest.mark.parametrize(("live", "fraction", "limit"), [(1, 0.5, 0), (2, 0.5, 1), (3, 0.5, 1), (4, 0.5, 2),
                                                        (10, 0.5, 5), (10, 0.05, 1), (3, 1.0, 2), (3, 0.0, 0)])
def test_the_ejected_fraction_leaves_at_least_one_server(live, fraction, limit):
    assert OutlierConfig(max_ejected_fraction=fraction).limit(live) == limit


def test_an_ejection_beyond_the_fraction_overflows(clock):
    d, live = detector(clock, consecutive=1, max_ejected_fraction=0.5, base_ejection_s=5), pool("a", "b", "c")
    assert d.record_failure("a", Failure.CONNECT, live) is Outcome.EJECTED
    assert d.record_failure("b", Failure.CONNECT, live) is Outcome.OVERFLOW
    assert d.ejected(live) == {"a"}
    # An ejected server that left the registry (the router drops silent ones) still counts: the pool
    # must not lose server after server while it re-places.
    assert d.record_failure("b", Failure.CONNECT, pool("b", "c")) is Outcome.OVERFLOW
    clock.now += 5  # a's ejection is over
    assert d.record_failure("b", Failure.CONNECT, pool("b", "c")) is Outcome.EJECTED


def test_a_single_server_is_never_ejected(clock):
    d, live = detector(clock, consecutive=1), pool("a")
    assert d.record_failure("a", Failure.CONNECT, live) is Outcome.OVERFLOW
    assert d.ejected(live) == frozenset()


def test_a_silent_server_is_back_at_its_next_heartbeat(clock):
    d = detector(clock, consecutive=3, base_ejection_s=5, max_ejection_s=60)
    assert d.record_failure("a", Failure.SILENT, pool("a", "b", heartbeat_at=50.0)) is Outcome.EJECTED
    assert d.ejection_ends_in("a") == 60  # by time, at most: its heartbeat is what ends it
    clock.now += 30
    assert d.ejected(pool("a", "b", heartbeat_at=50.0)) == {"a"}  # still the heartbeat seen before
    assert d.ejected(pool("a", "b", heartbeat_at=81.0)) == frozenset()  # it heartbeat again: back


def test_a_server_ejected_while_heartbeating_waits_out_its_time(clock):
    """A fresh heartbeat says nothing about a server that fails while heartbeating (a stuck GPU)."""
    d = detector(clock, consecutive=1, base_ejection_s=30)
    d.record_failure("a", Failure.DEADLINE, pool("a", "b", heartbeat_at=50.0))
    clock.now += 29
    assert d.ejected(pool("a", "b", heartbeat_at=79.0)) == {"a"}
    clock.now += 1
    assert d.ejected(pool("a", "b", heartbeat_at=80.0)) == frozenset()


def test_ejected_lists_live_servers_only(clock):
    d = detector(clock, consecutive=1, base_ejection_s=30)
    d.record_failure("a", Failure.CONNECT, pool("a", "b", "c"))
    assert d.ejected(pool("b", "c")) == frozenset()  # gone from the registry
    assert d.ejected(pool("a", "b", "c")) == {"a"}  # back within its ejection: still out


def test_disabled_never_ejects(clock):
    for config in ({"consecutive": 0}, {"max_ejected_fraction": 0.0}):
        d, live = detector(clock, **config), pool("a", "b", "c")
        for failure in Failure:
            assert d.record_failure("a", failure, live) is Outcome.COUNTED
        assert d.ejected(live) == frozenset()


@pytest.mark.parametrize("config", [{"consecutive": -1}, {"base_ejection_s": 0}, {"max_ejection_s": -1},
                                    {"max_ejected_fraction": 1.5}, {"base_ejection_s": math.nan}])
def test_bad_configs_are_refused(config):
    with pytest.raises(ValueError):
        OutlierConfig(**config).validate()


def test_the_deadline_grows_with_slow_first_bytes_and_never_drops_below_its_floor():
    deadline = TtfbDeadline(10.0, factor=4.0, min_samples=20, every=1)
    assert deadline.current() == 10.0
    for _ in range(100):
        deadline.observe(0.2)  # a healthy pool: 4 × 0.2 s < 10 s
    assert deadline.current() == 10.0
    for _ in range(100):
        deadline.observe(5.0)  # every prefill got slow
    assert deadline.current() == pytest.approx(20.0)
    assert TtfbDeadline(0.0).current() == math.inf
    off = TtfbDeadline(0.0, min_samples=1, every=1)
    off.observe(1.0)
    assert off.current() == math.inf


# ---- heartbeat lateness (Snapshot) ------------------------------------------------------------


def test_the_interval_is_the_shortest_gap_between_heartbeats():
    beat = Heartbeat(100.0, 5.0)
    assert beat.interval_s is None
    assert beat.next(100.0, 6.0) is beat  # the same heartbeat read again
    beat = beat.next(102.0, 7.0).next(106.0, 11.0)  # one poll missed a heartbeat: the gap is 4
    assert (beat.sent_at, beat.seen_at, beat.interval_s) == (106.0, 11.0, 2.0)
    assert beat.next(105.0, 12.0).interval_s == 2.0  # the agent's clock stepped back: keep the interval


def heartbeat_snapshot(now: float, seen_at: float, read_at: float, interval: float | None = 1.0) -> Snapshot:
    servers = pool("a")
    beats = {"a": Heartbeat(0.0, seen_at, interval)}
    return Snapshot(None, servers, {}, taken_at=read_at, heartbeats=beats, servers_read_at=read_at,
                    poll_interval_s=0.5)


def test_a_heartbeat_is_late_after_two_intervals_and_a_poll():
    assert heartbeat_snapshot(0, 0, 0).late_after_s("a") == 2.5
    assert not heartbeat_snapshot(0, 100.0, 102.4).heartbeat_late("a", 102.4)
    assert heartbeat_snapshot(0, 100.0, 102.6).heartbeat_late("a", 102.6)
    assert not heartbeat_snapshot(0, 100.0, 102.6, interval=None).heartbeat_late("a", 102.6)  # unknown yet
    assert heartbeat_snapshot(0, 100.0, 102.6, interval=None).late_after_s("a") is None
    assert not heartbeat_snapshot(0, 100.0, 102.6).heartbeat_late("b", 102.6)  # not registered


def test_late_heartbeats_are_counted():
    servers = pool("a", "b", "c")
    beats = {"a": Heartbeat(0.0, 100.0, 1.0), "b": Heartbeat(0.0, 99.0, 1.0), "c": Heartbeat(0.0, 103.0, None)}
    snapshot = Snapshot(None, servers, {}, heartbeats=beats, servers_read_at=103.0, poll_interval_s=0.5)
    assert snapshot.late_heartbeats(103.0) == 2  # c's interval is not known yet: never late


def test_no_heartbeat_is_late_while_the_registry_is_not_read():
    """When the store fails, the router's view of every heartbeat stops: that is not their fault."""
    snapshot = heartbeat_snapshot(0, seen_at=100.0, read_at=101.0)
    assert snapshot.heartbeat_late("a", 103.0)
    assert not snapshot.heartbeat_late("a", 103.1)  # the last read is more than 2 polls + 1 s old


def test_track_heartbeats_follows_each_server():
    first = track_heartbeats({}, pool("a", "b", heartbeat_at=10.0), now=1.0)
    second = track_heartbeats(first, {**pool("a", heartbeat_at=11.0), **pool("c", heartbeat_at=11.0)}, now=2.0)
    assert set(second) == {"a", "c"}
    assert second["a"] == Heartbeat(11.0, 2.0, 1.0)
    assert second["c"] == Heartbeat(11.0, 2.0, None)
