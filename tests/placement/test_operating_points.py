import json

import pytest

from loraplex.placement import (
    OperatingPoints,
    OperatingPointsError,
    default_operating_points,
    ewma,
    make_forecaster,
)
from loraplex.placement.forecast import last_window


def test_interpolates_in_log_rank_and_clamps():
    op = OperatingPoints({8: 4000.0, 32: 3000.0})
    assert op.tps(8) == 4000.0
    assert op.tps(16) == pytest.approx(3500.0)
    assert op.tps(4) == 4000.0 and op.tps(256) == 3000.0


def test_loads_a_json_profile(tmp_path):
    path = tmp_path / "op.json"
    path.write_text(json.dumps({"tokens_per_second": {"8": 100, "64": 50}, "device": "cpu"}))
    op = OperatingPoints.load(path)
    assert op.tokens_per_second == {8: 100.0, 64: 50.0} and op.source == str(path)
    assert OperatingPoints.from_dict(op.to_dict()).tokens_per_second == op.tokens_per_second


@pytest.mark.parametrize("doc", [{}, {"tokens_per_second": {"x": 1}}, {"tokens_per_second": {"8": -1}},
                                 {"tokens_per_second": {}}])
def test_bad_profiles_are_rejected(doc):
    with pytest.raises(OperatingPointsError):
        OperatingPoints.from_dict(doc)


def test_missing_file_and_unknown_device(tmp_path):
    with pytest.raises(OperatingPointsError, match="cannot read"):
        OperatingPoints.load(tmp_path / "nope.json")
    with pytest.raises(OperatingPointsError, match="device"):
        default_operating_points("tpu")
    assert default_operating_points("cpu").tps(8) > default_operating_points("cpu").tps(128)


def test_forecasters():
    assert ewma([10.0, 10.0, 10.0]) == pytest.approx(10.0)
    assert ewma([0.0, 0.0, 8.0], alpha=0.5) == pytest.approx(4.0)
    assert ewma([]) == 0.0 and last_window([1.0, 2.0]) == 2.0
    with pytest.raises(ValueError, match="alpha"):
        ewma([1.0], alpha=0)
    with pytest.raises(ValueError, match="forecaster"):
        make_forecaster("arima")
