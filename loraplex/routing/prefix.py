"""Prefix-aware routing: send a request where its adapter's prompt prefix already has KV.

An approximate index in each router (the approach of llm-d's approximate prefix-cache scorer and
SGLang's cache-aware router), pure and torch-free so the router and the twin run the same code:

- a prompt is cut into block-aligned chunks, each named by a hash chained over the chunks before
  it and seeded with the adapter's identity (name and digest), so a key stands for a whole prefix
  of one adapter's prompt: two adapters never share one, nor two versions of one adapter;
- the router cuts what it has without a tokenizer: the chat messages or the prompt text in chunks
  of `chunk_chars` characters (about one KV block of tokens), token-id prompts in blocks of
  `chunk_chars // 4` ids; the twin cuts token ids in the engine's own blocks;
- an activated LoRA's request (its record carries `invocation_tokens`) is keyed as the base
  model's: by causality its KV before the invocation is the base model's, which the engine caches
  under the base model for the base and every aLoRA adapter, so a checker goes where its
  conversation is. A token-id prompt is keyed up to the invocation's last occurrence; text, which
  the router cannot tokenize, is keyed whole (its chunks past the invocation are a guess that only a
  prompt repeating the checker's own text could hit);
- a server's match counts only when it covers at least one of the KV blocks its agent reports
  (`cached_match`): on an engine with 32-token blocks a one-chunk match is worth nothing;
- after each pick the router records the request's keys for the chosen server (it will compute
  and cache them); a server's keys are an LRU of `blocks_per_server` entries (the agents' prefix
  caches evict least recently used leaves first: keys are recorded deepest first, so a prefix's
  root is evicted last), and a key not seen for `ttl_s` no longer counts;
- nothing is shared between routers: a restarted or second router starts empty and routes by φ
  until it has seen traffic. Only the hit rate suffers, never correctness: a wrong guess costs a
  prefill, as φ-random routing does every time.

The `prefix` filter (`loraplex.routing.pipeline.PrefixFilter`) keeps, of the servers under the load ceiling, those with the longest match
(ties and requests with no match anywhere are left to the profile's scorers: φ for `prefix-aware`,
Algorithm 1 for `prefix-rank-aware`). The ceiling, `load_factor` × the least queue + `load_slack`,
bounds how far a hot prefix can pile requests onto one server: past it, the request goes to a
lighter server, which then holds the prefix too. An activated LoRA's request gets `alora_slack` more,
and one more per `alora_slack_tokens` of its prompt cached on the server: a pipeline fans several
checkers out at once onto one conversation, and each one sent elsewhere recomputes the whole
conversation there, so the longer the conversation, the longer it is worth queueing behind it.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from loraplex.spec.alora import invocation_start
from loraplex.util.args import typed_options

TOKENS_PER_CHAR = 0.25  # English text and code: about four characters a token
MAX_CHUNKS = 4096  # a prompt's keys stop here (256 KiB of text): hashing stays under ~5 ms a request


@dataclass(frozen=True)
class PrefixConfig:
    """The prefix-aware profiles' knobs (their `--routing-option` / spec.routing.options keys)."""

    chunk_chars: int = 64            # characters per chunk of a prompt's text (about a 16-token block)
    blocks_per_server: int = 16384   # keys kept per server (an LRU); about a server's prefix cache in blocks
    ttl_s: float = 600.0             # a key not seen for this long no longer counts
    load_factor: float = 1.5         # load ceiling: load_factor × the least queue + load_slack
    load_slack: int = 2
    alora_slack: int = 4             # more slack for an activated LoRA's request: a checker fan-out stays
                                     # with its conversation (the base model's prefix), ordinary traffic does not
    alora_slack_tokens: int = 128    # and one more request of slack on a server per this many of its prompt
                                     # tokens cached there (the prefill it saves there); 0: none
    min_match: int = 1               # chunks a match needs to count

    def __post_init__(self) -> None:
        if self.chunk_chars < 4 or self.blocks_per_server < 1 or self.min_match < 1:
            raise ValueError("chunk_chars must be >= 4, blocks_per_server and min_match >= 1")
        if not (self.ttl_s > 0 and self.load_factor >= 1
                and min(self.load_slack, self.alora_slack, self.alora_slack_tokens) >= 0):
            raise ValueError("ttl_s must be positive, load_factor >= 1, load_slack, alora_slack and "
                             "alora_slack_tokens >= 0")

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> PrefixConfig:
        """From KEY=VALUE options; unknown keys are the caller's business (`OPTIONS` names ours)."""
        return cls(**typed_options(options, OPTIONS, "prefix"))


OPTIONS = {"chunk_chars": int, "blocks_per_server": int, "ttl_s": float, "load_factor": float,
           "load_slack": int, "alora_slack": int, "alora_slack_tokens": int, "min_match": int}


# ---- keys -----------------------------------------------------------------------------------


def chain(seed: str, chunks: Iterable[bytes]) -> list[int]:
    """One key per chunk: a 64-bit hash of the seed and every chunk up to and including it."""
    keys: list[int] = []
    state = hashlib.blake2b(seed.encode(), digest_size=8).digest()
    for chunk in chunks:
        state = hashlib.blake2b(state + chunk, digest_size=8).digest()
        keys.append(int.from_bytes(state, "little"))
    return keys


def adapter_seed(adapter: str | None, digest: str = "") -> str:
    """The identity keys are seeded with: the adapter's name and digest, or the base model."""
    return f"{adapter}@{digest}" if adapter is not None else "(base)"


def token_keys(seed: str, tokens: Sequence[int], block: int) -> list[int]:
    """Keys of the full `block`-token blocks of a token-id prompt."""
    full = min(len(tokens) // block, MAX_CHUNKS)
    return chain(seed, (",".join(map(str, tokens[i * block:(i + 1) * block])).encode() for i in range(full)))


def text_keys(seed: str, text: str, chunk_chars: int) -> list[int]:
    """Keys of the full `chunk_chars`-character chunks of a text."""
    full = min(len(text) // chunk_chars, MAX_CHUNKS)
    return chain(seed, (text[i * chunk_chars:(i + 1) * chunk_chars].encode() for i in range(full)))


def body_keys(seed: str, body: Mapping, chunk_chars: int) -> list[int]:
    """Keys of an OpenAI request body as the router sees it: chat messages serialised one by one
    (a client that re-sends a conversation re-sends its messages as they were), a completion's prompt
    text, or its token ids. Batched prompts and anything else: no keys (routed by φ)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        tools = body.get("tools")
        if tools:  # chat templates put the tools ahead of the conversation
            seed += json.dumps(tools, sort_keys=True, ensure_ascii=False)
        text = "".join(json.dumps(m, sort_keys=True, ensure_ascii=False) + "\n" for m in messages)
        return text_keys(seed, text, chunk_chars)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return text_keys(seed, prompt, chunk_chars)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return token_keys(seed, prompt, chunk_tokens(chunk_chars))
    return []


def alora_body_keys(invocation: Sequence[int], body: Mapping, chunk_chars: int) -> list[int]:
    """Keys of an activated LoRA's request: the base model's keys of what precedes the invocation."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return alora_token_keys(invocation, prompt, chunk_tokens(chunk_chars))
    return body_keys(adapter_seed(None), body, chunk_chars)


def alora_token_keys(invocation: Sequence[int], prompt: Sequence[int], block: int) -> list[int]:
    """Keys of an activated LoRA's token-id prompt: the base model's keys of the blocks before the
    last occurrence of its invocation (all of it when the invocation is absent: the base model runs)."""
    start = invocation_start(prompt, invocation)
    return token_keys(adapter_seed(None), prompt[:start] if start is not None else prompt, block)


def chunk_tokens(chunk_chars: int) -> int:
    """The tokens the router takes a chunk of `chunk_chars` characters to hold (it has no tokenizer);
    also the block of a token-id prompt."""
    return max(1, round(chunk_chars * TOKENS_PER_CHAR))


def cached_match(chunks: int, chunk_chars: int, block_size: int) -> int:
    """A server's match as it counts: its `chunks` matched chunks when they cover at least one of its
    KV blocks of `block_size` tokens (0: unknown, any match counts), else 0. An engine caches whole
    blocks only: a shorter match saves no prefill, yet would draw the request there."""
    return chunks if chunks * chunk_tokens(chunk_chars) >= block_size else 0


# ---- the index ------------------------------------------------------------------------------


@dataclass
class PrefixIndex:
    """Which server has seen which prefix keys, LRU-bounded per server. Times come from the caller's
    clock (the router's monotonic one, the twin's virtual one)."""

    config: PrefixConfig = field(default_factory=PrefixConfig)
    servers: dict[str, OrderedDict[int, float]] = field(default_factory=dict)

    def match(self, server: str, keys: Sequence[int], now: float) -> int:
        """How many leading keys the server holds, fresh."""
        held = self.servers.get(server)
        if not held:
            return 0
        oldest = now - self.config.ttl_s
        for depth, key in enumerate(keys):
            seen = held.get(key)
            if seen is None or seen < oldest:
                return depth
        return len(keys)

    def matches(self, servers: Iterable[str], keys: Sequence[int], now: float) -> dict[str, int]:
        """Matched depth of every server with a match."""
        if not keys:
            return {}
        depths = {s: self.match(s, keys, now) for s in servers}
        return {s: d for s, d in depths.items() if d}

    def record(self, server: str, keys: Sequence[int], now: float) -> None:
        """The server now holds `keys` (it will have computed them)."""
        held = self.servers.setdefault(server, OrderedDict())
        for key in reversed(keys):  # the root last: most recently used, evicted last
            held[key] = now
            held.move_to_end(key)
        while len(held) > self.config.blocks_per_server:
            held.popitem(last=False)

    def retain(self, servers: Iterable[str]) -> None:
        """Forget servers that left the pool."""
        keep = set(servers)
        for gone in [s for s in self.servers if s not in keep]:
            del self.servers[gone]

    @property
    def size(self) -> int:
        """Keys held, all servers together."""
        return sum(len(held) for held in self.servers.values())
