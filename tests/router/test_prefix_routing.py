"""Prefix-aware routing over real HTTP: a conversation's later turns go where its earlier turns went,
with the `openai` client re-sending the previous answers, and the router counts what it predicted."""

from __future__ import annotations

import re

import httpx
from openai import OpenAI

from loraplex.routing.records import AdapterRecord
from loraplex.routing.redis_store import RedisRoutingStore

BASE, DIGEST = "tiny-base", "sha256:" + "0" * 64  # the router environment's (tests/router/conftest.py)


def converse(client: OpenAI, adapter: str, index: int, turns: int) -> list[str]:
    """The servers that answered each turn of one conversation."""
    messages = [{"role": "system", "content": f"You are assistant number {index}. " * 8}]
    servers = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"conversation {index}, question {turn}: " + "why? " * 20})
        answer = client.chat.completions.with_raw_response.create(model=adapter, messages=messages, max_tokens=8)
        servers.append(answer.headers["x-loraplex-server"])
        messages.append({"role": "assistant", "content": answer.parse().choices[0].message.content})
    return servers


def counter(text: str, kind: str) -> float:
    match = re.search(rf'^loraplex_router_prefix_blocks_total{{kind="{kind}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_later_turns_follow_the_first(make_router_env) -> None:
    env = make_router_env(profile="prefix-aware")
    client = OpenAI(base_url=env.router.url + "/v1", api_key="none")
    conversations = [converse(client, "b", i, 3) for i in range(12)]
    assert all(len(set(servers)) == 1 for servers in conversations), conversations
    assert len({servers[0] for servers in conversations}) > 1  # φ spreads the conversations themselves
    metrics = httpx.get(env.router.url + "/metrics").text
    requested, matched = counter(metrics, "requested"), counter(metrics, "matched")
    assert 0 < matched < requested


def test_a_match_shorter_than_the_servers_kv_block_draws_no_request(make_router_env, redis_url) -> None:
    prompt = "a tag shared by every request: " * 3  # 93 characters: one 64-character chunk (16 tokens)
    for block_size, spread in ((64, True), (16, False)):  # the block size each server's record reports
        store = RedisRoutingStore.from_url(redis_url, f"pool-{block_size}")
        env = make_router_env(profile="prefix-aware", block_size=block_size, store=store)
        client = OpenAI(base_url=env.router.url + "/v1", api_key="none")
        servers = {client.completions.with_raw_response.create(model="b", prompt=prompt, max_tokens=1)
                   .headers["x-loraplex-server"] for _ in range(24)}
        assert (len(servers) > 1) == spread, (block_size, servers)  # 64-token blocks: φ spreads them
        assert (counter(httpx.get(env.router.url + "/metrics").text, "matched") == 0) == spread


def test_loraserve_keeps_no_index(router_env) -> None:
    client = OpenAI(base_url=router_env.router.url + "/v1", api_key="none")
    converse(client, "b", 0, 2)
    assert counter(httpx.get(router_env.router.url + "/metrics").text, "requested") == 0


def test_an_alora_checker_goes_where_its_conversation_is(make_router_env) -> None:
    """The checker's record carries its invocation: its request is keyed as the base model's, so it
    follows the base model's answer to the server that holds the conversation's KV."""
    env = make_router_env(profile="prefix-aware")
    env.store.put_adapter(AdapterRecord("chk", DIGEST, 8, 1000, "file:///adapters/chk", invocation_tokens=(7, 8)))
    env.publish({"chk": {"s0": 0.3, "s1": 0.3, "s2": 0.4}, "b": {"s0": 0.3, "s1": 0.3, "s2": 0.4}})
    client = OpenAI(base_url=env.router.url + "/v1", api_key="none")
    pairs = []
    for index in range(12):
        messages = [{"role": "system", "content": f"You are assistant number {index}. " * 8},
                    {"role": "user", "content": "why? " * 20}]
        answer = client.chat.completions.with_raw_response.create(model=BASE, messages=messages, max_tokens=8)
        messages += [{"role": "assistant", "content": answer.parse().choices[0].message.content},
                     {"role": "user", "content": "<|check|>\nIs the answer supported?"}]
        check = client.chat.completions.with_raw_response.create(model="chk", messages=messages, max_tokens=2)
        pairs.append((answer.headers["x-loraplex-server"], check.headers["x-loraplex-server"]))
    assert all(base == checker for base, checker in pairs), pairs
    assert len({base for base, _ in pairs}) > 1
