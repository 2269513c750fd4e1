"""One real agent (engine thread + FastAPI + uvicorn on 127.0.0.1) on the tiny model, per session.

Tests talk to it over HTTP with the real `openai` client and httpx. Tests that load adapters at
runtime use their own adapter names, so they do not disturb each other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from openai import OpenAI
from waiting import wait_for

API_KEY = "test-admin-key"
SERVED_MODEL = "tiny-base"
START_ADAPTERS = ("lora00-r8", "lora01-r16", "lora02-r32", "lora03-r64")
MAX_MODEL_LEN = 512


@dataclass
class Agent:
    url: str
    tiny_model: object  # loraplex_agent.tools.tiny_model.TinyModel
    engine: object  # loraplex_agent.runtime.async_engine.AsyncEngine (read-only from tests)
    base: str = SERVED_MODEL
    adapters: tuple[str, ...] = START_ADAPTERS
    max_model_len: int = MAX_MODEL_LEN

    def client(self) -> OpenAI:
        # The OpenAI client needs some key; the chat/completions endpoints do not check it.
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    @staticmethod
    def wait_for(condition, what: str, timeout_s: float = 60.0, interval_s: float = 0.05):
        """Poll `condition` until it returns something truthy; the bound only guards against a hang."""
        return wait_for(what, condition, timeout_s, interval_s)


@pytest.fixture(scope="session")
def agent(tiny_model, free_port) -> Iterator[Agent]:
    from loraplex_agent.api.server import AgentConfig, build_app
    from loraplex_agent.cli import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_STALL_TIMEOUT_S
    from loraplex_agent.runtime.async_engine import AsyncEngine
    from loraplex_agent.runtime.llm import LLM

    llm = LLM(tiny_model.base_dir, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
              num_blocks=256, max_num_seqs=16, max_num_batched_tokens=256, max_loras=3,
              max_lora_rank=64, served_model_name=SERVED_MODEL)
    engine = AsyncEngine(llm, DEFAULT_STALL_TIMEOUT_S)
    adapters = tuple((name, str(tiny_model.adapters[name])) for name in START_ADAPTERS)
    app = build_app(engine, AgentConfig(DEFAULT_MAX_REQUEST_BYTES, admin_api_key=API_KEY, adapters=adapters))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="agent-under-test", daemon=True)
    thread.start()
    _wait_until_started(server, thread)
    try:
        yield Agent(f"http://127.0.0.1:{port}", tiny_model, engine)
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _wait_until_started(server: uvicorn.Server, thread: threading.Thread, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the agent exited during start-up (see the log above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agent did not start within {timeout_s} s")
        time.sleep(0.05)

