"""`loraplex up` and routing: --profile, --routing-option and --router-arg reach the router's command
line (every `loraplex router` flag is reachable) and bad ones are refused with one line before
anything starts; the AdapterPool's spec.routing in the -f folder is published in the routing table,
an edit of it too, and one the router could not build is refused like any bad manifest."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from loraplex_local.manifests import ManifestError
from loraplex_local.stack import LocalStack, StackConfig, config_from_args, running_stack
from loraplex_router.cli import add_router_args
from waiting import wait_until

from loraplex.cli import build_registry
from loraplex.routing.choice import RoutingChoice
from loraplex.routing.memory_store import InMemoryRoutingStore
from loraplex.routing.records import ServerRecord
from loraplex.spec.errors import CommandError
from loraplex.util.clock import ManualClock

LORAPLEX = str(Path(sys.executable).parent / "loraplex")


def _up(*argv: str) -> StackConfig:
    return config_from_args(build_registry().parser.parse_args(["up", *argv]))


def _router_flags(config: StackConfig, tmp_path: Path) -> argparse.Namespace:
    """The arguments the stack's router process gets, parsed as `loraplex router` parses them."""
    argv = LocalStack(StackConfig(workdir=tmp_path, router_args=config.router_args))._router_argv()
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return parser.parse_args(argv[argv.index("router") + 1:])


def test_routing_flags_and_router_args_reach_the_router(tmp_path: Path) -> None:
    config = _up("--profile", "rank-aware", "--routing-option", "slo_tpot_s=0.05",
                 "--router-arg=--ttfb-deadline=30", "--router-arg=--eject-after=5",
                 "--router-arg=--ejection-time=2", "--router-arg=--max-ejected-fraction=0.25",
                 "--router-arg=--max-request-bytes=1024", "--router-arg=--poll-interval=0.2")
    flags = _router_flags(config, tmp_path)
    assert flags.profile == "rank-aware" and flags.routing_option == ["slo_tpot_s=0.05"]
    assert (flags.ttfb_deadline, flags.eject_after, flags.ejection_time) == (30.0, 5, 2.0)
    assert (flags.max_ejected_fraction, flags.max_request_bytes) == (0.25, 1024)
    assert flags.poll_interval == 0.2  # a router arg wins over the stack's own choice


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--router-arg=--bogus"], "router arguments: unrecognized arguments: --bogus"),
    (["--router-arg=--ttfb-deadline=-1"], "argument --ttfb-deadline: invalid non-negative float"),
    (["--router-arg=--max-ejected-fraction=2"], "--max-ejected-fraction must be between 0 and 1"),
    (["--routing-option", "slo=1"], "unknown rank-aware options ['slo']"),
    (["--profile", "fastest"], "unknown routing profile 'fastest'"),
    (["--router-arg=--port=9000"], "--router-arg=--port=9000: `loraplex up` sets it itself"),
    (["--router-arg=--por=9000"], "router arguments: unrecognized arguments: --por=9000"),  # no abbreviations
    (["--router-arg=-h"], "router arguments: unrecognized arguments: -h"),
])
def test_bad_router_arguments_are_refused_before_anything_starts(argv: list[str], fragment: str) -> None:
    with pytest.raises(CommandError) as refused:
        _up(*argv)
    assert fragment in str(refused.value)


def test_the_command_says_it_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run([LORAPLEX, "up", "--workdir", str(tmp_path), "--router-arg=--eject-after=-1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["error: router arguments: argument --eject-after: invalid non-negative int "
                                                  "value: '-1'"]


def _write(folder: Path, routing: str) -> None:
    (folder / "pool.yaml").write_text(
        "apiVersion: loraplex.io/v1alpha1\nkind: AdapterPool\nmetadata: {name: tiny}\nspec:\n"
        "  baseModel: {name: tiny-llama, source: \"file:///unused\"}\n"
        "  placement: {intervalSeconds: 30}\n" + routing)
    (folder / "a.yaml").write_text(
        "apiVersion: loraplex.io/v1alpha1\nkind: LoRADeployment\nmetadata: {name: a}\n"
        f"spec:\n  pool: tiny\n  adapter: {{source: hf://org/a, sha256: {'e' * 64}, rank: 8}}\n")


def _stack(folder: Path) -> LocalStack:
    """The stack's control loop over the in-process store, with two registered servers, no processes."""
    stack = LocalStack(StackConfig(manifests=folder, workdir=folder / "work"))
    stack.store = InMemoryRoutingStore("tiny", ManualClock())
    for sid in ("s0", "s1"):
        stack.store.register_server(ServerRecord(sid, f"http://127.0.0.1/{sid}", max_rank=64), ttl_s=600)
    stack.controller = stack.build_controller()
    return stack


def test_the_pools_routing_is_published_and_an_edit_too(tmp_path: Path) -> None:
    _write(tmp_path, "  routing: {profile: rank-aware, options: {slo_tpot_s: '0.05'}}\n")
    stack = _stack(tmp_path)
    stack.tick()
    assert stack.store.read_table().routing == RoutingChoice("rank-aware", {"slo_tpot_s": "0.05"})
    _write(tmp_path, "  routing: {profile: least-loaded}\n")
    stack.tick()  # the placement is not due: the changed choice alone publishes a version
    table = stack.store.read_table()
    assert table.version == 2 and table.routing == RoutingChoice("least-loaded")
    _write(tmp_path, "  routing: {profile: rank-aware, options: {slo_tpot_s: fast}}\n")
    stack.tick()  # not applied: logged, the last good manifests stay
    assert stack.store.read_table().routing == RoutingChoice("least-loaded")
    _write(tmp_path, "")
    stack.tick()
    assert stack.store.read_table().routing is None  # no spec.routing: the router's flags decide


def test_a_pool_routing_the_router_would_refuse_is_a_manifest_error(tmp_path: Path) -> None:
    _write(tmp_path, "  routing: {profile: fastest}\n")
    with pytest.raises(ManifestError, match="AdapterPool 'tiny': routing: unknown routing profile 'fastest'"):
        LocalStack(StackConfig(manifests=tmp_path, workdir=tmp_path / "work"))


def test_up_runs_its_router_with_the_pools_routing_and_the_router_args(tiny_model, tmp_path: Path,
                                                                      free_port) -> None:
    """Real processes: redis-server, one agent on the tiny model, the router."""
    folder = tmp_path / "manifests"
    folder.mkdir()

    def write_pool(routing: str) -> None:
        (folder / "pool.yaml").write_text(
            "apiVersion: loraplex.io/v1alpha1\nkind: AdapterPool\nmetadata: {name: tiny}\nspec:\n"
            f"  baseModel: {{name: tiny-llama, source: \"file://{tiny_model.base_dir}\", dtype: float32}}\n"
            "  engine: {maxLoraRank: 64, maxLoras: 4, maxNumSeqs: 8, maxModelLen: 256}\n" + routing)

    write_pool("  routing: {profile: least-loaded}\n")
    source = next(iter(tiny_model.adapters.values()))
    (folder / "a.yaml").write_text("apiVersion: loraplex.io/v1alpha1\nkind: LoRADeployment\nmetadata: {name: a}\n"
                                   f"spec:\n  pool: tiny\n  adapter: {{source: \"file://{source}\"}}\n")
    up = _up("--router-arg=--ttfb-deadline=30")
    config = StackConfig(agents=1, manifests=folder, router_port=free_port(), agent_base_port=free_port(),
                         redis_port=free_port(), workdir=tmp_path / "work", router_args=up.router_args)
    with running_stack(config) as stack:
        metrics = lambda: httpx.get(stack.router_url + "/metrics").text  # noqa: E731
        wait_until(lambda: 'routing_profile_info{profile="least-loaded",source="table"} 1.0' in metrics())
        assert "loraplex_router_ttfb_deadline_seconds 30.0" in metrics()
        answer = httpx.post(stack.router_url + "/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        write_pool("  routing: {profile: rank-aware, options: {latency_profile: cpu-tiny}}\n")
        wait_until(lambda: 'routing_profile_info{profile="rank-aware",source="table"} 1.0' in metrics())
