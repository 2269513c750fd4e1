"""`loraplex bench table-deltas` on a tiny pool (the 10,000-adapter run: docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json

import pytest
from loraplex_bench.table_deltas import run

from loraplex.spec.errors import CommandError


def _args(tmp_path, **change) -> argparse.Namespace:
    args = argparse.Namespace(adapters=40, servers=4, routes=2, routers=1, agents=1, repeats=1, before="",
                              out=str(tmp_path / "deltas.json"))
    for key, value in change.items():
        setattr(args, key, value)
    return args


def test_a_tiny_run_reports_every_reader_and_both_kinds_of_change(tmp_path):
    assert run(_args(tmp_path)) == 0
    after = json.loads((tmp_path / "deltas.json").read_text())["after"]
    for kind in ("one_change", "ten_percent"):
        assert after[kind]["spread_s_median"] > 0 and after[kind]["redis_in_KiB_median"] > 0
    assert len(after["reader_rss_MiB"]) == 2 and after["table_keys_MiB"] > 0


@pytest.mark.parametrize("change", [{"adapters": 5}, {"routes": 5}])
def test_bad_arguments_are_refused_before_anything_starts(tmp_path, change):
    with pytest.raises(CommandError, match="--adapters"):
        run(_args(tmp_path, **change))
