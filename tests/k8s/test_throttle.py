"""The operator's client side of the API server's priority and fairness: the shared token bucket,
the summary lines that replace kopf's ERROR line per 429 retry, and KubernetesApi's retries."""

from __future__ import annotations

import logging

import pytest
from loraplex_operator.throttle import QuietRetries, Throttle, ThrottleCount, TokenBucket

from loraplex.util.clock import ManualClock


def test_bucket_lets_a_burst_through_then_paces_at_qps() -> None:
    clock = ManualClock(0.0)
    bucket = TokenBucket(qps=10, burst=3, clock=clock.now)
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve() == pytest.approx(0.1)  # the 4th waits for one token
    assert bucket.reserve() == pytest.approx(0.2)  # and the 5th behind it
    clock.advance(10.0)  # idle: the bucket refills up to the burst, no further
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve() > 0


def test_bucket_without_a_rate_never_waits() -> None:
    bucket = TokenBucket(qps=0, burst=1)
    assert all(bucket.reserve() == 0.0 for _ in range(1000))


def test_throttle_count_announces_summarizes_and_ends_a_spell() -> None:
    count = ThrottleCount(every_s=30.0)
    first = count.note(0.0)
    assert first is not None and "throttling" in first
    assert all(count.note(t) is None for t in (1.0, 2.0, 3.0))  # no line per retry
    assert count.summary(10.0) is None  # the window runs
    line = count.summary(30.0)
    assert line is not None and "throttled 4 requests" in line
    assert count.summary(60.0) == "the API server stopped throttling this operator (4 requests answered 429, " \
                                  "each retried)"
    assert count.summary(120.0) is None  # not throttled: nothing to say
    assert count.note(121.0) is not None  # a new spell is announced again


def _record(message: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord("kopf.objects", level, __file__, 1, message, None, None)


def test_quiet_retries_drop_kopfs_429_lines_only(caplog: pytest.LogCaptureFixture) -> None:
    throttle = Throttle(0, 1, every_s=3600)
    quiet = QuietRetries(throttle)
    retry = ("Request attempt #1/9 failed; will retry: PATCH https://api/apis/loraplex.io/v1alpha1/namespaces/a/"
             "loradeployments/x -> APITooManyRequestsError(429, 'Too many requests')")
    with caplog.at_level(logging.WARNING, logger="loraplex_operator.throttle"):
        assert quiet.filter(_record(retry)) is False
        assert quiet.filter(_record(retry)) is False
    assert [r.levelname for r in caplog.records] == ["WARNING"]  # one announcement, no ERROR
    assert quiet.filter(_record("Request attempt #9/9 failed; escalating: PATCH x -> "
                                "APITooManyRequestsError(429)")) is True  # giving up stays an ERROR
    assert quiet.filter(_record("Request attempt #1/9 failed; will retry: GET x -> APIServerError(500)")) is True


def test_a_429_is_retried_after_its_retry_after_and_counted() -> None:
    from loraplex_operator.kube import THROTTLED_BACKOFFS, KubeError, throttled_call

    throttle, slept, answers = Throttle(0, 1, every_s=3600), [], [KubeError(429, "slow down", 3.0),
                                                                  KubeError(429, "slow down"), "ok"]

    def request() -> str:
        answer = answers.pop(0)
        if isinstance(answer, KubeError):
            raise answer
        return answer

    assert throttled_call(request, throttle, slept.append) == "ok"
    assert [s for s in slept if s] == [3.0, THROTTLED_BACKOFFS[1]]  # its Retry-After, then the backoff
    with pytest.raises(KubeError, match="HTTP 404"):  # anything else is the caller's
        throttled_call(lambda: (_ for _ in ()).throw(KubeError(404, "gone")), throttle, slept.append)


def test_a_429_that_never_ends_is_raised_after_the_backoffs() -> None:
    from loraplex_operator.kube import THROTTLED_BACKOFFS, KubeError, throttled_call

    calls = []

    def request() -> None:
        calls.append(1)
        raise KubeError(429, "slow down", 0.0)

    with pytest.raises(KubeError, match="HTTP 429"):
        throttled_call(request, Throttle(0, 1, every_s=3600), lambda _: None)
    assert len(calls) == len(THROTTLED_BACKOFFS) + 1
