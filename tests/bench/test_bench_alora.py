"""`loraplex bench alora`: checker pipelines as activated LoRA vs standard LoRA; the twin side gives a
table and JSON, an aLoRA checker finds its conversation cached; bad input is one line."""

from __future__ import annotations

import json

import pytest

from loraplex.cli import main


def test_twin_side_reports_alora_checkers_reusing_the_conversation(tmp_path, capsys) -> None:
    out = tmp_path / "alora.json"
    argv = ["bench", "alora", "--side", "twin", "--ks", "2", "--sessions", "2", "--turns", "2",
            "--system-tokens", "200", "--json", str(out)]
    assert main(argv) == 0
    assert "| twin | 2 | alora |" in capsys.readouterr().out
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    alora, lora = rows["alora"], rows["lora"]
    assert alora["pipelines"] == lora["pipelines"] == 8  # the engine side's two rounds, pooled
    assert alora["checker_cached"] > 0.9 * alora["checker_prompt"]  # every checker on the base's KV
    assert lora["checker_cached"] < 0.6 * lora["checker_prompt"]  # only its own earlier turn
    assert alora["checker_ttft_s"] < lora["checker_ttft_s"]


def test_the_twin_routes_a_fan_out_as_the_router_does(tmp_path) -> None:
    """The twin's requests go through the router's prefix-aware profile: with no load slack, checkers
    that find their conversation's server busy go elsewhere and find less of it cached."""
    def cached_share(*options: str) -> float:
        out = tmp_path / f"{len(options)}.json"
        assert main(["bench", "alora", "--side", "twin", "--ks", "6", "--sessions", "2", "--turns", "2",
                     "--system-tokens", "200", "--agents", "2", "--json", str(out), *options]) == 0
        [alora] = [r for r in json.loads(out.read_text())["rows"] if r["mode"] == "alora"]
        return alora["checker_cached"] / alora["checker_prompt"]

    strict = [f"--routing-option={o}"
              for o in ("load_slack=0", "alora_slack=0", "alora_slack_tokens=0", "load_factor=1")]
    assert cached_share(*strict) < cached_share()


def test_the_twins_router_sees_an_agents_load_as_of_its_last_heartbeat_it_has_read() -> None:
    """As the stack's router: the load an agent wrote at its last heartbeat, once a registry read
    has passed it; the agent's load since then is not seen."""
    from types import SimpleNamespace

    from loraplex_bench.alora import _TwinServer

    scheduler = SimpleNamespace(num_running=3, num_waiting=2)
    server = _TwinServer("a", SimpleNamespace(scheduler=scheduler), None, phase=0.3)
    server.heartbeat(0.2, 1.0)
    assert server.load_seen(0.2, 0.5) == 0  # no heartbeat yet
    server.heartbeat(0.4, 1.0)
    assert server.load_seen(0.4, 0.5) == 0  # written at 0.3, read at 0.5
    scheduler.num_running = 0
    assert server.load_seen(0.5, 0.5) == 5 and server.load_seen(1.2, 0.5) == 5
    server.heartbeat(1.4, 1.0)
    assert server.load_seen(1.4, 0.5) == 5 and server.load_seen(1.5, 0.5) == 2


@pytest.mark.parametrize(("flags", "message"), [(["--ks", "7"], "--ks takes 1 to 6"),
                                                 (["--ks", "x"], "comma-separated integers"),
                                                 (["--sessions", "0"], "must be >= 1"),
                                                 (["--twin-serving-cpu-ms", "5"], "only with a --twin-serving-ms")])
def test_bad_arguments_are_one_line(flags, message, capsys) -> None:
    assert main(["bench", "alora", "--side", "twin", *flags]) != 0
    assert message in capsys.readouterr().err


def test_the_twin_against_a_recorded_engine_side_takes_its_serving_path_and_load(tmp_path, capsys) -> None:
    """--engine-json: the engine side's rows join the table, and what it measured of its host (the
    serving path per request, its CPU, the load beyond its own processes) is the twin's; a recording of
    another workload is refused in one line."""
    argv = ["bench", "alora", "--side", "twin", "--ks", "2", "--sessions", "2", "--turns", "2",
            "--system-tokens", "200"]
    main([*argv, "--json", str(tmp_path / "twin.json")])
    recorded = json.loads((tmp_path / "twin.json").read_text())
    engine = [{**r, "side": "engine", "engine_hits": r["cached"], "serving_s": 0.05, "load": 6.0,
               "serving_cpu_s": 0.02} for r in recorded["rows"]]  # what an engine side records, in its shape
    (tmp_path / "engine.json").write_text(json.dumps({**recorded, "rows": engine}))
    capsys.readouterr()
    assert main([*argv, "--engine-json", str(tmp_path / "engine.json")]) == 0
    out = capsys.readouterr()
    assert "| engine | 2 | alora |" in out.out and "| twin | 2 | alora |" in out.out
    assert "serving path 50 ms" in out.out and "background load 2.0" in out.out  # 6 - 3 agents - 1
    assert "its CPU 20.0 ms per request" in out.out
    assert main([*argv[:-1], "300", "--engine-json", str(tmp_path / "engine.json")]) != 0
    assert "ran another workload: --system-tokens 200" in capsys.readouterr().err


def test_the_serving_paths_cpu_slows_the_engines_it_shares_cores_with(tmp_path) -> None:
    """EMULATION: a request's serving CPU takes cores from the engines' steps while its path lasts, so
    the same serving path with CPU finishes fewer pipelines per second than without."""
    def speed(cpu_ms: str) -> float:
        out = tmp_path / f"{cpu_ms}.json"
        assert main(["bench", "alora", "--side", "twin", "--ks", "2", "--sessions", "3", "--turns", "2",
                     "--system-tokens", "200", "--twin-host-cores", "1", "--twin-serving-ms", "50",
                     "--twin-serving-cpu-ms", cpu_ms, "--json", str(out)]) == 0
        [alora] = [r for r in json.loads(out.read_text())["rows"] if r["mode"] == "alora"]
        return alora["pipelines_per_s"]

    assert speed("40") < speed("0")
