"""`loraplex bench reliability`'s bookkeeping (the runs themselves take minutes: docs/reliability.md)."""

from __future__ import annotations

import argparse

import pytest
from loraplex_bench.reliability import Sent, _summary, run

from loraplex.spec.errors import CommandError


def test_lost_requests_and_cut_streams_are_told_apart():
    sent = [Sent(1.0, 0.2, True, "a"), Sent(2.0, 0.3, True, "b"),
            Sent(10.5, 2.5, True, "b"), Sent(11.0, 0.2, True, "b"),
            Sent(10.2, 0.1, False, "a", "RemoteProtocolError('peer closed connection without sending complete "
                                        "message body (incomplete chunked read)')"),
            Sent(12.0, 0.1, False, "", "502 b'{\"error\": ...}'"),
            Sent(9.0, 16.0, True, "a", first=0.5)]  # its first bytes came before the event: committed
    summary = _summary(sent, event=10.0, end=20.0)
    assert (summary["requests"], summary["lost"], summary["cut_streams"]) == (7, 1, 1)
    assert summary["committed"] == {"requests": 1, "p50_s": 16.0, "p99_s": 16.0, "max_s": 16.0}
    assert summary["before"] == {"requests": 2, "rps": 0.2, "p50_s": 0.2, "p99_s": 0.3, "max_s": 0.3}
    assert summary["window"]["requests"] == 4 and summary["window"]["max_s"] == 2.5
    assert summary["worst_second_in_window_rps"] == 0  # nothing finished in most seconds of the window


@pytest.mark.parametrize(("change", "fragment"), [({"scenarios": "stop,nap"}, "nap"), ({"agents": 1}, "--agents"),
                                                  ({"replicas": 4}, "--replicas")])
def test_bad_arguments_are_refused_before_anything_starts(change, fragment):
    args = argparse.Namespace(scenarios="stop", clients=8, agents=3, warmup=10.0, stop_seconds=15.0, after=10.0,
                              max_tokens=8, replicas=None, model=None, out=None, raw=None, workdir=None)
    for key, value in change.items():
        setattr(args, key, value)
    with pytest.raises(CommandError, match=fragment):
        run(args)
