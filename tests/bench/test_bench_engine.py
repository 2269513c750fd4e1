"""`loraplex bench engine` runs end to end on a small workload and writes its JSON report."""

from __future__ import annotations

import json

import pytest
from loraplex_bench.engine import PassResult, make_workload, parse_counts, ratios, summarise

from loraplex.cli import main


def test_workload_assigns_adapters_round_robin() -> None:
    workload = make_workload(5, 4, 2, vocab_size=100, adapter_names=["a", "b", "c"], num_adapters=2)
    assert workload.adapters == ["a", "b", "a", "b", "a"] and workload.num_adapters == 2
    assert all(len(p) == 4 and all(3 <= t < 100 for t in p) for p in workload.prompts)
    assert make_workload(5, 4, 2, 100, ["a"], 1).prompts == workload.prompts  # same prompts for every K


def test_summary_and_ratios() -> None:
    def result(system: str, k: int, wall: float) -> PassResult:
        return PassResult(system, k, output_tokens=100, wall_s=wall, ttft_s=[0.1, 0.2, 0.3], outputs=[[1], [2]])

    hf = [summarise([result("hf", k, 1.0)], None) for k in (1, 4)]
    ours = [summarise([result("ours", 1, 0.25)], [result("hf", 1, 1.0)]),
            summarise([result("ours", 4, 0.5), result("ours", 4, 0.4), result("ours", 4, 0.3)],
                      [result("hf", 4, 1.0)])]
    assert ours[1].tokens_per_s == pytest.approx(250.0) and ours[1].ttft_p50_ms == pytest.approx(200.0)
    assert ours[0].greedy_match_with_hf == 2
    ratio = ratios(hf + ours, [1, 4])
    assert ratio["ours_over_hf_tokens_per_s"] == {"1": pytest.approx(4.0), "4": pytest.approx(2.5)}
    assert ratio["ours_drop_1_to_4"] == pytest.approx(0.375)
    with pytest.raises(Exception, match="--num-adapters"):
        parse_counts("1,x")


def test_bench_command_end_to_end(tiny_model, tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--model", str(tiny_model.base_dir), "--requests", "4", "--prompt-len", "8",
                 "--output-len", "3", "--num-adapters", "1,2", "--out", str(out), "--plots", str(tmp_path)]) == 0
    for name in ("engine-tokens-per-s-vs-adapters.png", "engine-ttft-p50-vs-adapters.png"):
        assert (tmp_path / name).stat().st_size > 0
    report = json.loads(out.read_text())
    assert report["parameters"]["requests"] == 4 and report["parameters"]["max_loras"] == 2
    systems = {(r["system"], r["num_adapters"]) for r in report["results"]}
    assert systems == {("ours", 1), ("ours", 2), ("hf", 1), ("hf", 2)}
    ours = [r for r in report["results"] if r["system"] == "ours"]
    assert all(r["greedy_match_with_hf"] == 4 for r in ours)  # same greedy tokens as HF+peft in fp32
    assert set(report["ratios"]) == {"ours_over_hf_tokens_per_s", "ours_drop_1_to_2"}
    assert "ours / HF tokens/s" in capsys.readouterr().out
