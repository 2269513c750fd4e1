"""The prefix index, its keys and the prefix filter (pure: the router and the twin run this code)."""

from __future__ import annotations

import random

import pytest
from loraplex_router.snapshot import Snapshot

from loraplex.routing.choice import RoutingChoice, build_profile
from loraplex.routing.pipeline import Candidate, PrefixFilter, RouteRequest, make_profile, prefix_config
from loraplex.routing.prefix import (
    PrefixConfig,
    PrefixIndex,
    adapter_seed,
    alora_body_keys,
    body_keys,
    cached_match,
    chunk_tokens,
    token_keys,
)
from loraplex.routing.records import AdapterRecord

SEED = adapter_seed("a", "sha256:0")


def chat(*contents: str) -> dict:
    roles = ["system", "user", "assistant"]
    return {"messages": [{"role": roles[min(i, 1) if i < 2 else 2 - i % 2], "content": c}
                         for i, c in enumerate(contents)]}


def test_a_later_turn_extends_the_keys_of_the_turn_before() -> None:
    first = body_keys(SEED, chat("you help " * 20, "question one " * 10), 64)
    second = body_keys(SEED, chat("you help " * 20, "question one " * 10, "answer " * 30, "and two"), 64)
    assert first and second[:len(first)] == first and len(second) > len(first)


def test_keys_differ_by_adapter_and_digest() -> None:
    body = chat("same system prompt " * 10)
    keys = {tuple(body_keys(adapter_seed(a, d), body, 64)) for a, d in (("a", "1"), ("a", "2"), ("b", "1"))}
    assert len(keys) == 3


def test_an_activated_loras_request_is_keyed_as_the_base_models_before_its_invocation() -> None:
    base = adapter_seed(None)
    conversation = chat("you help " * 20, "question one " * 10, "answer " * 30)
    checker = chat("you help " * 20, "question one " * 10, "answer " * 30, "<|check|> supported?")
    base_keys = body_keys(base, conversation, 64)
    assert alora_body_keys([7, 8], checker, 64)[:len(base_keys)] == base_keys  # text: keyed whole as the base's
    tokens = list(range(100, 150)) + [7, 8] + list(range(20))
    assert alora_body_keys([7, 8], {"prompt": tokens}, 64) == token_keys(base, tokens[:50], 16)
    absent = list(range(100, 180))  # no invocation: the base model runs throughout
    assert alora_body_keys([7, 8], {"prompt": absent}, 64) == token_keys(base, absent, 16)


def test_only_full_chunks_get_keys() -> None:
    assert body_keys(SEED, {"prompt": "x" * 63}, 64) == []
    assert len(body_keys(SEED, {"prompt": "x" * 130}, 64)) == 2
    assert len(body_keys(SEED, {"prompt": list(range(40))}, 64)) == 2  # blocks of 16 ids
    assert body_keys(SEED, {"prompt": ["a", "b"]}, 64) == []  # a batch: routed by φ


def test_match_stops_at_the_first_missing_or_stale_key() -> None:
    index = PrefixIndex(PrefixConfig(ttl_s=10))
    keys = token_keys(SEED, list(range(64)), 16)
    index.record("s0", keys[:2], now=0.0)
    assert index.match("s0", keys, now=1.0) == 2
    assert index.match("s1", keys, now=1.0) == 0
    assert index.match("s0", keys, now=11.0) == 0  # not seen for ttl_s
    assert index.matches(["s0", "s1"], keys, now=1.0) == {"s0": 2}


def test_each_server_keeps_an_lru_that_evicts_leaves_before_roots() -> None:
    index = PrefixIndex(PrefixConfig(blocks_per_server=4))
    old = token_keys(SEED, list(range(48)), 16)
    new = token_keys(adapter_seed("b"), list(range(32)), 16)
    index.record("s0", old, now=0.0)
    index.record("s0", new, now=1.0)
    assert index.size == 4
    assert index.match("s0", new, now=1.0) == 2
    assert index.match("s0", old, now=1.0) == 2  # its deepest key went first
    index.retain(["s1"])
    assert index.size == 0


def test_a_match_counts_only_when_it_covers_one_of_the_servers_kv_blocks() -> None:
    assert chunk_tokens(64) == 16 and chunk_tokens(2) == 1  # four characters a token, at least one
    assert cached_match(1, 64, 16) == 1  # one 16-token chunk fills a 16-token block
    assert cached_match(1, 64, 32) == 0  # half a 32-token block: cached nowhere, worth nothing
    assert cached_match(2, 64, 32) == 2 and cached_match(3, 64, 32) == 3  # what min_match=2 did by hand
    assert cached_match(1, 64, 0) == 1  # block size unknown (an older agent): any match counts
    assert cached_match(0, 64, 0) == 0


def cands(*pairs: tuple[int, int]) -> list[Candidate]:
    return [Candidate(f"s{i}", phi=1.0, queue_depth=q, prefix_blocks=m) for i, (m, q) in enumerate(pairs)]


def ids(candidates: list[Candidate]) -> list[str]:
    return [c.server_id for c in candidates]


def test_the_filter_keeps_the_longest_match_under_the_load_ceiling() -> None:
    f = PrefixFilter(PrefixConfig(load_factor=1.5, load_slack=2))
    request = RouteRequest("a", prefix_blocks=8)
    assert ids(f.filter(request, cands((8, 0), (3, 0), (0, 0)))) == ["s0"]
    assert ids(f.filter(request, cands((8, 3), (3, 0), (0, 0)))) == ["s1"]  # s0 over 0 * 1.5 + 2
    assert ids(f.filter(request, cands((8, 3), (0, 2), (0, 1)))) == ["s0"]  # 3 <= 1 * 1.5 + 2
    assert ids(f.filter(request, cands((8, 9), (0, 2), (0, 4)))) == ["s1", "s2"]  # no match under it: the light
    assert ids(f.filter(request, cands((0, 0), (0, 5)))) == ["s0", "s1"]  # no match anywhere: φ decides
    assert ids(f.filter(RouteRequest("a"), cands((8, 0), (0, 0)))) == ["s0", "s1"]


def test_an_activated_loras_request_may_queue_longer_behind_its_conversation() -> None:
    """A checker fan-out stays on the server holding its conversation up to `alora_slack` more requests
    than ordinary traffic would, one more per `alora_slack_tokens` of its prompt cached there, and no further."""
    f = PrefixFilter(PrefixConfig(load_factor=1.5, load_slack=2, alora_slack=4, alora_slack_tokens=0))
    checker, ordinary = RouteRequest("c", prefix_blocks=8, alora=True), RouteRequest("a", prefix_blocks=8)
    assert ids(f.filter(checker, cands((8, 6), (0, 0)))) == ["s0"]  # 6 <= 0 * 1.5 + 2 + 4
    assert ids(f.filter(ordinary, cands((8, 6), (0, 0)))) == ["s1"]
    assert ids(f.filter(checker, cands((8, 7), (0, 0)))) == ["s1"]  # still bounded by load
    scaled = PrefixFilter(PrefixConfig(load_factor=1.5, load_slack=2, alora_slack=4, alora_slack_tokens=32))
    long = RouteRequest("c", prefix_blocks=96, alora=True)  # 96 chunks of 16 tokens: 1,536 cached, 48 more
    assert ids(scaled.filter(long, cands((96, 54), (0, 0)))) == ["s0"]  # 54 <= 0 * 1.5 + 2 + 4 + 48
    assert ids(scaled.filter(long, cands((96, 55), (0, 0)))) == ["s1"]  # still bounded by load
    assert ids(scaled.filter(checker, cands((8, 10), (0, 0)))) == ["s0"]  # a short match buys little: 2 + 4 + 4
    assert ids(scaled.filter(checker, cands((8, 11), (0, 0)))) == ["s1"]
    assert ids(scaled.filter(ordinary, cands((96, 3), (0, 0)))) == ["s1"]  # ordinary traffic: load_slack only
    records = {"chk": AdapterRecord("chk", "sha256:0", 8, 1, "file:///chk", invocation_tokens=(7, 8)),
               "a": AdapterRecord("a", "sha256:1", 8, 1, "file:///a")}
    snapshot = Snapshot(None, {}, records)  # the router's: the record says which adapter is activated
    assert snapshot.route_request("chk", prefix_blocks=8).alora and not snapshot.route_request("a").alora


def test_prefix_profiles_read_their_options() -> None:
    profile = build_profile(RoutingChoice("prefix-aware", {"load_slack": "5", "chunk_chars": "32"}))
    assert prefix_config(profile) == PrefixConfig(chunk_chars=32, load_slack=5)
    ranked = build_profile(RoutingChoice("prefix-rank-aware", {"slo_tpot_s": "0.05", "min_match": "2"}))
    assert prefix_config(ranked).min_match == 2 and prefix_config(ranked.fallback).min_match == 2
    assert prefix_config(make_profile("loraserve")) is None
    with pytest.raises(ValueError, match="takes no prefix options"):
        build_profile(RoutingChoice("loraserve", {"load_slack": "1"}))
    with pytest.raises(ValueError, match="not a number"):
        build_profile(RoutingChoice("prefix-aware", {"ttl_s": "long"}))
    with pytest.raises(ValueError, match="load_factor >= 1"):
        build_profile(RoutingChoice("prefix-aware", {"load_factor": "0.5"}))
    with pytest.raises(ValueError, match="alora_slack_tokens >= 0"):
        build_profile(RoutingChoice("prefix-aware", {"alora_slack_tokens": "-1"}))


def test_phi_still_governs_requests_without_prefix_history() -> None:
    profile = make_profile("prefix-aware", rng=random.Random(0))
    candidates = [Candidate("s0", phi=0.9), Candidate("s1", phi=0.1)]
    picks = [profile.pick(RouteRequest("a", prefix_blocks=4), candidates).server_id for _ in range(2000)]
    assert 0.85 < picks.count("s0") / len(picks) < 0.95
    held = [Candidate("s0", phi=0.9), Candidate("s1", phi=0.1, prefix_blocks=4)]
    assert {profile.pick(RouteRequest("a", prefix_blocks=4), held).server_id for _ in range(50)} == {"s1"}


def test_a_huge_prompt_gets_a_bounded_number_of_keys() -> None:
    from loraplex.routing.prefix import MAX_CHUNKS

    assert len(body_keys(SEED, {"prompt": "x" * 64 * (MAX_CHUNKS + 10)}, 64)) == MAX_CHUNKS
