"""`loraplex bench prefix-routing`: prefix-aware vs loraserve routing on multi-turn sessions in the
cluster twin, one table with ratios against loraserve, a JSON report; bad input is one line."""

from __future__ import annotations

import json

import pytest
from loraplex_bench.prefix_routing import workload_spec
from loraplex_bench.prefix_routing_engine import VLLM_BLOCK_SIZE, write_manifests
from loraplex_local.stack import LocalStack, StackConfig

from loraplex.cli import build_registry, main
from loraplex.sim.sessions import make_sessions

TINY_TWIN = ["bench", "prefix-routing", "--side", "twin", "--sessions", "12", "--adapters", "4", "--ranks", "8",
             "--servers", "4", "--rate", "2", "--think", "1", "--length-scale", "0.5"]


def test_twin_side_prints_a_table_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "prefix.json"
    assert main([*TINY_TWIN, "--precise", "--json", str(out)]) == 0
    assert "later/base" in capsys.readouterr().out
    [twin] = json.loads(out.read_text())["sides"]
    rows = {(r["workload"], r["routing"]): r for r in twin["rows"]}
    assert set(rows) == {(w, r) for w in ("chat", "unique") for r in ("loraserve", "prefix-aware", "prefix-aware+events")}
    assert rows["chat", "prefix-aware"]["prefix_hit_rate"] > rows["chat", "loraserve"]["prefix_hit_rate"]
    assert rows["unique", "prefix-aware"]["predicted_hit_rate"] == 0.0
    assert rows["chat", "loraserve"]["predicted_hit_rate"] is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--routings", "prefix-aware"], "no loraserve to compare with"),
    (["--workloads", "chat,other"], "unknown routing profiles or workloads ['other']"),
    (["--routing-option", "load_slack=x"], "not a number"),
    (["--servers", "0"], "--servers"),
    (["--engine-repeats", "0"], "--engine-repeats"),
    (["--routing-option", "slo=1"], "unknown prefix options ['slo']"),
    (["--engine-backend", "sglang"], "invalid choice: 'sglang'"),
])
def test_bad_input_is_one_line(flags, message, capsys) -> None:
    assert main([*TINY_TWIN, *flags]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_index_side_measures_the_bounded_index(capsys) -> None:
    assert main(["bench", "prefix-routing", "--side", "index", "--index-adapters", "50", "--index-servers", "4",
                 "--index-conversations", "60", "--routing-option", "blocks_per_server=100"]) == 0
    printed = capsys.readouterr().out
    assert "keys=400," in printed and "bound=400," in printed


def test_engine_side_on_vllm_gives_every_server_a_slot_per_adapter_and_finer_blocks(tmp_path, tiny_model) -> None:
    """--engine-backend vllm: the pool the bench writes is valid, and its agents start vLLM with a slot
    for every adapter (each is on every server) and the bench's block size."""
    args = build_registry().parser.parse_args(["bench", "prefix-routing", "--engine-backend", "vllm",
                                               "--engine-adapters", "10"])
    workload = make_sessions(workload_spec(args, "engine", "chat", args.engine_max_len))
    folder = write_manifests(tmp_path / "manifests", tiny_model.base_dir, workload, args)
    stack = LocalStack(StackConfig(manifests=folder, workdir=tmp_path / "work"))
    argv = stack._agent_argv(tiny_model.base_dir, "prefix-0", 0)
    assert stack.backend == "vllm" and f"--vllm-arg=--block-size={VLLM_BLOCK_SIZE}" in argv
    assert argv[argv.index("--max-cpu-loras") + 1] == str(len(workload.adapters))
