"""Demand under a prefix-aware profile, over a real Redis and real HTTP: a conversation's later turn
adds to its adapter's demand only the prompt tokens the router's index did not predict cached on the
server it chose, plus its output (`loraplex.routing.demand.demand_tokens`)."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from loraplex_bench.echo_server import EchoServer
from loraplex_router.app import RouterSettings, create_app
from loraplex_router.auth import KeyRing
from threaded_server import ThreadedServer

from loraplex.routing.pipeline import make_profile
from loraplex.routing.prefix import PrefixConfig, chunk_tokens
from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.redis_store import RedisRoutingStore
from loraplex.routing.table import RoutingTable, make_entry

DIGEST = "sha256:" + "0" * 64
OUTPUT = 4


class Stack:
    def __init__(self, redis_url: str, free_port, wait, profile: str) -> None:
        self.wait = wait
        self.store = RedisRoutingStore.from_url(redis_url, f"demand-{profile}", window_s=1.0)
        self.echo = ThreadedServer(EchoServer("s0"), free_port()).start()
        self.store.register_server(ServerRecord("s0", self.echo.url, max_rank=64, base_model="base"), ttl_s=600)
        self.store.put_adapter(AdapterRecord("a", DIGEST, 8, 1000, "file:///adapters/a"))
        settings = RouterSettings(profile=make_profile(profile, rng=random.Random(0)), profile_name=profile,
                                  keys=KeyRing(), poll_interval_s=0.05)
        self.router = ThreadedServer(create_app(self.store, settings), free_port()).start()
        self.store.publish_table(RoutingTable(1, time.time(), {"a": make_entry("a", DIGEST, 8, [("s0", 1.0)])}))
        wait(lambda: httpx.get(self.router.url + "/health").json()["routing_version"] == 1)

    def chat(self, messages: list[dict]) -> int:
        """Sends one turn; its prompt tokens as the server counted them."""
        answer = httpx.post(self.router.url + "/v1/chat/completions",
                            json={"model": "a", "messages": messages, "max_tokens": OUTPUT})
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens"]

    def matched_blocks(self) -> float:
        text = httpx.get(self.router.url + "/metrics").text
        match = re.search(r'^loraplex_router_prefix_blocks_total{kind="matched"} (\S+)$', text, re.M)
        return float(match.group(1)) if match else 0.0

    def demand(self) -> float:
        windows = self.store.demand_windows(time.time() + 2.0, 5)
        return sum(windows.rates.get("a", ()))  # window_s = 1, so tokens/s sums to tokens

    def stop(self) -> None:
        self.router.stop()
        self.echo.stop()
        self.store.close()


@pytest.fixture
def stack(redis_url: str, free_port, wait, request) -> Iterator[Stack]:
    stack = Stack(redis_url, free_port, wait, request.param)
    yield stack
    stack.stop()


def two_turns(stack: Stack) -> tuple[int, int]:
    """A conversation's two turns, the second re-sending the first and its answer."""
    messages = [{"role": "system", "content": "be brief " * 40 + "a " * 200},
                {"role": "user", "content": "why is the sky blue? " * 10}]
    first = stack.chat(messages)
    messages += [{"role": "assistant", "content": "x " * OUTPUT}, {"role": "user", "content": "and at night?"}]
    return first, stack.chat(messages)


@pytest.mark.parametrize("stack", ["prefix-aware"], indirect=True)
def test_a_later_turn_counts_only_what_the_index_did_not_predict_cached(stack: Stack) -> None:
    first, second = two_turns(stack)
    cached = stack.matched_blocks() * chunk_tokens(PrefixConfig().chunk_chars)
    assert 0 < cached < second  # the first turn's prompt, as the index saw it, and not capped
    expected = first + OUTPUT + second - cached + OUTPUT
    stack.wait(lambda: stack.demand() == pytest.approx(expected))


@pytest.mark.parametrize("stack", ["loraserve"], indirect=True)
def test_other_profiles_count_every_prompt_token(stack: Stack) -> None:
    first, second = two_turns(stack)
    stack.wait(lambda: stack.demand() == pytest.approx(first + second + 2 * OUTPUT))
