"""The online output-length predictor: per adapter, by prompt length, bounded, with its error."""

from __future__ import annotations

import pytest

from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import FinishReason, Request
from loraplex.engine.scheduling.output_predictor import OutputLengthPredictor, PredictorOptions
from loraplex.engine.scheduling.sjf import learn_output, predict_output
from loraplex.spec.adapter import AdapterId

A, B, C = (AdapterId(n, f"sha256:{n}") for n in "abc")


def test_before_any_data_it_predicts_the_prior_within_the_bounds():
    p = OutputLengthPredictor(PredictorOptions(prior_tokens=100))
    assert p.predict(A, 10, max_out=500) == 100
    assert p.predict(A, 10, max_out=16) == 16
    assert p.predict(A, 10, max_out=500, min_out=300) == 300
    assert p.predict(None, 10, max_out=1) == 1


def test_it_learns_each_adapter_from_finished_requests():
    p = OutputLengthPredictor()
    for _ in range(50):
        p.observe(A, 20, 10)
        p.observe(B, 20, 300)
    assert p.predict(A, 20, 1000) == pytest.approx(10, abs=3)
    assert p.predict(B, 20, 1000) == pytest.approx(300, abs=10)
    assert 10 < p.predict(C, 20, 1000) < 300  # a new adapter starts from everyone's mean


def test_it_is_conditioned_on_prompt_length():
    p = OutputLengthPredictor()
    for _ in range(200):
        p.observe(A, 8, 20)  # short prompts, short answers
        p.observe(A, 1000, 400)
    assert p.predict(A, 9, 2000) == pytest.approx(20, abs=5)
    assert p.predict(A, 900, 2000) == pytest.approx(400, abs=15)
    assert OutputLengthPredictor.bucket(9) == OutputLengthPredictor.bucket(15) != OutputLengthPredictor.bucket(16)


def test_it_follows_a_changed_workload():
    p = OutputLengthPredictor(PredictorOptions(predictor_window=20))
    for _ in range(100):
        p.observe(A, 20, 50)
    for _ in range(100):
        p.observe(A, 20, 200)
    assert p.predict(A, 20, 1000) == pytest.approx(200, abs=5)


def test_it_reports_its_running_error():
    p = OutputLengthPredictor()
    p.observe(A, 20, 100, predicted=80)
    p.observe(A, 20, 50, predicted=60)
    stats = p.stats()
    assert stats.observations == 2
    assert stats.mean_abs_error == pytest.approx(15)
    assert stats.mean_rel_error == pytest.approx((0.2 + 0.2) / 2)
    assert stats.bias == pytest.approx((-20 + 10) / 2)


def test_the_scheduler_helpers_bound_by_context_and_skip_aborts():
    p = OutputLengthPredictor(PredictorOptions(prior_tokens=500))
    r = Request("r", [1] * 90, SamplingParams(max_tokens=1000), adapter=A)
    assert predict_output(p, r, max_model_len=100) == 10  # the context left
    r.output_token_ids = [1] * 7
    r.finish_reason = FinishReason.ABORT
    learn_output(p, r, 10)
    assert p.stats().observations == 0
    r.finish_reason = FinishReason.STOP
    learn_output(p, r, 10)
    assert p.stats().observations == 1 and p.stats().mean_abs_error == 3


def test_options_are_checked():
    with pytest.raises(ValueError):
        PredictorOptions(prior_tokens=0)
