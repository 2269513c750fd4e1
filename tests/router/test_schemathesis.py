"""Schemathesis against the router's own /openapi.json (tests/support/schemathesis_run.py), with the
router in front of a real agent (`loraplex up` with one agent on the tiny model, its own redis-server):
the schema's examples, boundary cases and a bounded number of generated requests, valid and invalid,
must never get a 5xx, and the router must still route afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from schemathesis_run import run_schemathesis, schemathesis_command

POOL, BASE = "fuzz", "tiny-llama"
ADAPTERS = ("fz0", "fz1")


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, free_port) -> Iterator[Any]:
    from loraplex_local.stack import StackConfig, running_stack

    folder = tmp_path_factory.mktemp("fuzz-manifests")
    (folder / "pool.yaml").write_text(
        f"apiVersion: loraplex.io/v1alpha1\nkind: AdapterPool\nmetadata: {{name: {POOL}}}\nspec:\n"
        f"  baseModel: {{name: {BASE}, source: \"file://{tiny_model.base_dir}\", dtype: float32}}\n"
        "  engine: {maxLoraRank: 64, maxLoras: 2, maxNumSeqs: 4, maxModelLen: 256}\n")
    for name, source in zip(ADAPTERS, tiny_model.adapters.values(), strict=False):
        (folder / f"{name}.yaml").write_text(
            f"apiVersion: loraplex.io/v1alpha1\nkind: LoRADeployment\nmetadata: {{name: {name}}}\n"
            f"spec:\n  pool: {POOL}\n  adapter: {{source: \"file://{source}\"}}\n")
    config = StackConfig(agents=1, manifests=folder, router_port=free_port(), agent_base_port=free_port(),
                         redis_port=free_port(), heartbeat_interval_s=0.5, heartbeat_ttl_s=5.0,
                         workdir=tmp_path_factory.mktemp("fuzz-stack"), agent_args=["--num-blocks", "200"])
    with running_stack(config) as stack:
        yield stack


def test_no_operation_answers_a_server_error(stack, tmp_path):
    url = stack.router_url
    output = run_schemathesis(schemathesis_command(f"{url}/openapi.json", url), tmp_path, models=(BASE, *ADAPTERS))
    assert "No issues found" in output, output[-4000:]


def test_the_router_still_routes_afterwards(stack):
    assert httpx.get(stack.router_url + "/ready", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for model in (BASE, *ADAPTERS):
        reply = client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")
    assert all(child.alive for child in [stack.router, *stack.agents.values()])
