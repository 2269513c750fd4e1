"""The commands end to end: workload generate -> sim run -> bench report, and bench serve against
a real agent (tiny model) over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from processes import wait_healthy

from loraplex.cli import main
from loraplex.sim.results import read_results
from loraplex.sim.trace import read_trace


def test_generate_simulate_report(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["workload", "generate", "--rps", "2", "--duration", "30", "--adapters", "8",
                 "--out", str(trace)]) == 0
    spec = tmp_path / "spec.yaml"
    spec.write_text("lengths: {profile: fixed, prompt_len: 32, output_len: 8}\nadapters: {count: 4}\n")
    assert main(["workload", "generate", "--spec", str(spec), "--rps", "3", "--duration", "20",
                 "--out", str(trace)]) == 0
    assert read_trace(trace).workload["lengths"]["prompt_len"] == 32
    capsys.readouterr()
    out = tmp_path / "sim.jsonl"
    assert main(["sim", "run", "--trace", str(trace), "--profile", "cpu-tiny", "--slo-ttft", "2",
                 "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["finished"] == doc["summary"]["requests"] > 30
    header, results = read_results(out)
    assert header["workload"]["rps"] == 3 and len(results) == doc["summary"]["requests"]
    assert main(["bench", "report", str(out), "--plots", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "ttft.png").is_file()


def test_cluster_mode_runs_the_router_and_placement(tmp_path, capsys):
    trace, spec = tmp_path / "t.jsonl", tmp_path / "spec.yaml"
    spec.write_text("lengths: {scale: 0.125, max_model_len: 2048}\n")
    main(["workload", "generate", "--spec", str(spec), "--rps", "6", "--duration", "40", "--adapters", "16",
          "--out", str(trace)])
    capsys.readouterr()
    assert main(["sim", "run", "--trace", str(trace), "--servers", "3", "--interval", "15", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["placements"] == 3 and doc["servers"] == 3
    assert sum(doc["requests_per_server"]) == doc["summary"]["requests"]


def test_the_default_workload_is_fitted_to_a_profile_by_the_flag_sim_run_names(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["workload", "generate", "--duration", "60", "--out", str(trace)]) == 0
    capsys.readouterr()
    assert main(["sim", "run", "--trace", str(trace), "--profile", "whatif-h100-llama8b"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "--max-rank 32" in error
    assert main(["workload", "generate", "--duration", "60", "--max-rank", "32", "--max-model-len", "2048",
                 "--out", str(trace)]) == 0
    fitted = read_trace(trace)
    assert max(r.rank for r in fitted.requests) <= 32
    assert max(r.prompt_len + r.output_len for r in fitted.requests) <= 2048
    capsys.readouterr()
    docs = []
    for profile, mode in (("whatif-h100-llama8b", []), ("cpu-tiny", []), ("cpu-tiny", ["--exact"])):
        assert main(["sim", "run", "--trace", str(trace), "--profile", profile, "--json", *mode]) == 0
        docs.append(json.loads(capsys.readouterr().out)["summary"])
    assert docs[1] == docs[2]  # the fast mode is the exact one, step for step
    assert main(["workload", "generate", "--max-rank", "4", "--out", str(trace)]) == 2
    assert "--max-rank 4" in capsys.readouterr().err


def test_bad_input_gets_a_clear_error(tmp_path, capsys):
    assert main(["sim", "run", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["workload", "generate", "--rps", "-1", "--out", str(tmp_path / "x")]) == 2
    assert "argument --rps" in capsys.readouterr().err
    long = tmp_path / "long.jsonl"
    long.write_text('{"trace_version": 1, "workload": {}}\n'
                    '{"request_id": "r", "arrival_s": 0, "adapter": null, "rank": 0, "prompt_len": 3000, "output_len": 9}\n')
    assert main(["sim", "run", "--trace", str(long)]) == 2
    assert "max_model_len is 2048" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_serve_against_a_real_agent(tiny_model, free_port, tmp_path, capsys):
    pytest.importorskip("torch")
    port = free_port()
    name, path = next(iter(tiny_model.adapters.items()))
    agent = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "agent", "--model", str(tiny_model.base_dir),
                              "--port", str(port), "--adapter", f"{name}={path}", "--max-model-len", "512"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", agent)
        trace = tmp_path / "t.jsonl"
        trace.write_text('{"trace_version": 1, "workload": {"duration_s": 1.0}}\n' + "".join(
            json.dumps({"request_id": f"r{i}", "arrival_s": i * 0.2, "adapter": name, "rank": 8,
                        "prompt_len": 20, "output_len": 5}) + "\n" for i in range(5)))
        out = tmp_path / "res.jsonl"
        assert main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--trace", str(trace),
                     "--max-requests", "4", "--out", str(out), "--quiet"]) == 0
        _, results = read_results(out)
        assert len(results) == 4 and all(r.generated == 5 and 0 < r.ttft_s <= r.e2e_s for r in results)
    finally:
        agent.terminate()
        agent.wait(timeout=30)



def test_people_get_a_summary_table_and_no_slo_means_no_attainment(tmp_path, capsys):
    trace, spec = tmp_path / "t.jsonl", tmp_path / "spec.yaml"
    spec.write_text("lengths: {profile: fixed, prompt_len: 32, output_len: 8}\nadapters: {count: 4}\n")
    assert main(["workload", "generate", "--spec", str(spec), "--rps", "2", "--duration", "20", "--out", str(trace)]) == 0
    capsys.readouterr()
    assert main(["sim", "run", "--trace", str(trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["slo_attainment"] is None  # no SLO given
    assert main(["sim", "run", "--trace", str(trace), "--slo-ttft", "2"]) == 0
    table = capsys.readouterr().out
    assert "SLO attainment" in table and "TTFT (s)" in table and not table.lstrip().startswith("{")
    assert main(["workload", "stats", str(trace)]) == 0
    table = capsys.readouterr().out
    assert "requests" in table and "prompt tokens" in table and not table.lstrip().startswith("{")
    assert main(["workload", "stats", str(trace), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] > 10


def test_the_plan_table_puts_the_answer_first(capsys):
    from loraplex.sim.console import show_plan

    show_plan({"slo_ttft_s": 2.0, "oracle": "twin", "max_loras": 8, "assignment": {},
               "planner": {"gpus": 3, "a_max": [8, 8, 4], "s_max": [64, 32, 16], "starved_in_twin": False,
                           "slo_attainment": 0.97, "plan_s": 70.1, "adapters_per_gpu": [8, 8, 4]},
               "baselines": {"random": {"gpus": 4, "slo_attainment": [0.96, 0.95]}}})
    lines = [line for line in capsys.readouterr().out.splitlines() if "│" in line]
    assert "GPUs" in lines[0] and "3" in lines[0]
    assert any("97.0%" in line for line in lines) and any("4 GPUs" in line and "95.0%" in line for line in lines)
