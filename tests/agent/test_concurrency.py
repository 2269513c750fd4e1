"""Many requests at once, over several adapters, give the same greedy text as one at a time."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
from openai import AsyncOpenAI

PROMPTS = ["def parse(self, text):\n", "import sys\nimport os\n", "class Stack:\n    def push(", "for i in range("]


async def _run_all(agent, jobs: list[tuple[str, str]], concurrent: bool) -> list[str]:
    client = AsyncOpenAI(base_url=f"{agent.url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(model: str, prompt: str) -> str:
        response = await client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                                   extra_body={"ignore_eos": True})
        return response.choices[0].text

    async with client:
        if concurrent:
            return list(await asyncio.gather(*(one(m, p) for m, p in jobs)))
        return [await one(m, p) for m, p in jobs]


def test_concurrent_requests_over_adapters_match_sequential(agent):
    models = [agent.base, *agent.adapters]  # more adapters than device slots: residency churns
    jobs = [(models[i % len(models)], PROMPTS[i % len(PROMPTS)]) for i in range(20)]
    sequential = asyncio.run(_run_all(agent, jobs, concurrent=False))
    concurrent = asyncio.run(_run_all(agent, jobs, concurrent=True))
    assert concurrent == sequential


def test_a_disconnected_client_aborts_its_request(agent):
    def aborted() -> float:
        return _sample(agent.metrics(), 'vllm:request_success_total{finished_reason="abort"')

    before = aborted()
    body = {"model": agent.adapters[0], "prompt": PROMPTS[0], "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=agent.url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the request runs; now hang up
    agent.wait_for(lambda: aborted() == before + 1, "the request to be aborted")
    agent.wait_for(lambda: _sample(agent.metrics(), "vllm:num_requests_running{") == 0,
                   "the running batch to empty")


def test_a_client_hanging_up_on_a_plain_request_aborts_it(agent):
    def aborted() -> float:
        return _sample(agent.metrics(), 'vllm:request_success_total{finished_reason="abort"')

    def running() -> float:
        return _sample(agent.metrics(), "vllm:num_requests_running{")

    agent.wait_for(lambda: running() == 0, "an idle engine")
    before = aborted()
    body = json.dumps({"model": agent.base, "prompt": PROMPTS[1], "max_tokens": 480, "ignore_eos": True}).encode()
    host, port = agent.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        agent.wait_for(lambda: running() == 1, "the request to run")
    agent.wait_for(lambda: aborted() == before + 1, "the request to be aborted")
    agent.wait_for(lambda: running() == 0, "the running batch to empty")


def _sample(text: str, prefix: str) -> float:
    """The value of the first sample line starting with `prefix` (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
