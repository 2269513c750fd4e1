"""Schemathesis against the running agent's own /openapi.json (tests/support/schemathesis_run.py):
the schema's examples, boundary cases and a bounded number of generated requests, valid and
invalid, to every operation must never get a 5xx, and the agent must still serve afterwards."""

from __future__ import annotations

import re

from schemathesis_run import run_schemathesis, schemathesis_command

API_KEY = "test-admin-key"  # the agent fixture's admin key: the adapter endpoints get past auth


def finished_requests(agent) -> float:
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", agent.metrics(), re.M))


def test_no_operation_answers_a_server_error(agent, tmp_path):
    before = finished_requests(agent)
    command = schemathesis_command(f"{agent.url}/openapi.json", agent.url,
                                   headers={"Authorization": f"Bearer {API_KEY}"})
    output = run_schemathesis(command, tmp_path, models=(agent.base, *agent.adapters))
    assert "No issues found" in output, output[-4000:]
    assert finished_requests(agent) - before >= 5  # some generated requests got as far as generation


def test_the_agent_still_serves_afterwards(agent):
    with agent.http() as http:
        assert http.get("/health").status_code == 200
        models = {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert {agent.base, *agent.adapters} <= models  # nothing it started with was unloaded
    reply = agent.client().completions.create(model=agent.adapters[0], prompt="hi", max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop")
