"""Multi-turn chat sessions: a seeded workload, and one driver for the twin and the real engine.

Workload (the conventions of multi-turn chat benchmarks on ShareGPT, LMSYS-Chat and WildChat):
- `num_adapters` adapters (default 100, Chameleon's count), each of a rank drawn uniformly from
  {8, 16, 32, 64, 128}; Zipf popularity (exponent `zipf_s`, default 1.0) over a seeded shuffle of
  them, so popularity does not follow rank (§5, "Chameleon-like point");
- sessions arrive as a Poisson process at `rate` per second, each with one adapter;
- turns per session are geometric with mean `mean_turns` (default 5, capped at `max_turns`):
  between LMSYS-Chat-1M's 2.0 and WildChat's 2.52 turns per conversation (§2.5, §2.6) and our
  count of ShareGPT V3's 7 messages per conversation (§2.7), a count that includes both roles;
- per turn, new user tokens and output tokens are the ShareGPT V3 lognormals (vLLM filter,
  Llama-3 tokens, §2.7): user (3.674, 1.369), output (5.287, 0.971), both clipped to [4, 1024]
  and multiplied by `length_scale` (the CPU engine runs them at about a quarter);
- think time between a reply and the next turn's arrival is exponential, mean `think_mean_s`;
- a session ends early once its next turn would not fit `max_model_len` (a chat UI would
  truncate the history; ending keeps every prompt an extension of the previous one);
- the first `alora_adapters` adapters (default 0) are activated LoRAs: every user message of their
  sessions carries the invocation (`INVOCATION_TOKENS` more tokens), so each turn's adapter applies
  from its own message on and the conversation before it is the base model's (`loraplex.spec.alora`).

Prompts: turn k+1's prompt is turn k's prompt, turn k's actual output tokens and the new user
tokens. Every session of one adapter starts with that adapter's system prompt of
`system_prompt_tokens`, so prefixes are shared within an adapter; a session's own tokens start with
a tag that encodes its index, so no two sessions share more than the system prompt.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from loraplex.engine.core import EngineCore
from loraplex.engine.memory.stats import MemoryStats
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.sim.popularity import Popularity, weights

DEFAULT_RANKS = (8, 16, 32, 64, 128)
WaitUntil = Callable[[float], None]


@dataclass(frozen=True)
class LogNormal:
    """Token counts: round(exp(N(mu, sigma))), clipped to [low, high] before scaling."""

    mu: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, count: int, scale: float) -> np.ndarray:
        raw = np.clip(np.rint(rng.lognormal(self.mu, self.sigma, count)), self.low, self.high)
        return np.maximum(1, np.rint(raw * scale)).astype(np.int64)


USER_TOKENS = LogNormal(3.674, 1.369, 4, 1024)  # ShareGPT V3 prompts, vLLM filter (workloads.md §2.7)
OUTPUT_TOKENS = LogNormal(5.287, 0.971, 4, 1024)  # ShareGPT V3 replies, vLLM filter


@dataclass(frozen=True)
class SessionSpec:
    num_adapters: int = 100
    ranks: tuple[int, ...] = DEFAULT_RANKS
    zipf_s: float = 1.0
    rate: float = 0.5  # sessions per second
    num_sessions: int = 200
    duration_s: float | None = None  # arrival window: sessions that would arrive later are left out
    mean_turns: float = 5.0
    max_turns: int = 20
    think_mean_s: float = 10.0
    length_scale: float = 1.0
    system_prompt_tokens: int = 64
    max_model_len: int = 4096
    alora_adapters: int = 0  # the first this many adapters are activated LoRAs
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {"num_adapters": self.num_adapters >= 1, "ranks": bool(self.ranks) and min(self.ranks) >= 1,
                  "zipf_s": self.zipf_s >= 0, "rate": self.rate > 0, "num_sessions": self.num_sessions >= 1,
                  "duration_s": self.duration_s is None or self.duration_s > 0,
                  "mean_turns": self.mean_turns >= 1, "max_turns": self.max_turns >= 1,
                  "think_mean_s": self.think_mean_s >= 0, "length_scale": self.length_scale > 0,
                  "system_prompt_tokens": self.system_prompt_tokens >= 0,
                  "max_model_len": self.max_model_len > self.system_prompt_tokens + 8,
                  "alora_adapters": 0 <= self.alora_adapters <= self.num_adapters}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid session workload setting(s): {', '.join(bad)} "
                             f"({', '.join(f'{b}={getattr(self, b)!r}' for b in bad)})")


@dataclass(frozen=True)
class Turn:
    user_tokens: int  # new user tokens of this turn
    output_tokens: int  # tokens the reply has (EOS ignored)
    think_s: float  # pause between the previous reply and this turn (0 for the first turn)


@dataclass(frozen=True)
class Session:
    index: int
    adapter: str
    arrival_s: float  # of the first turn, from the workload's start
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class SessionWorkload:
    spec: SessionSpec
    adapters: dict[str, int]  # name -> rank, in index order
    sessions: list[Session]
    alora: frozenset[str] = frozenset()  # the adapters that are activated LoRAs

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def adapter_index(self, name: str) -> int:
        return list(self.adapters).index(name)  # once per adapter: the driver caches system prompts

    def invocations(self, tokens: PromptTokens) -> dict[str, tuple[int, ...]]:
        """The activated LoRAs' invocation (one for all of them) in `tokens`' ids, by adapter."""
        return {name: tuple(tokens.invocation()) for name in self.adapters if name in self.alora}


def make_sessions(spec: SessionSpec) -> SessionWorkload:
    """The seeded session workload of `spec` (the same spec gives the same workload)."""
    rng = np.random.default_rng(spec.seed)
    ranks = rng.choice(np.asarray(spec.ranks), size=spec.num_adapters)
    adapters = {f"chat{i:03d}-r{r}": int(r) for i, r in enumerate(ranks)}
    names = list(adapters)
    share = np.empty(spec.num_adapters)
    share[rng.permutation(spec.num_adapters)] = weights(Popularity(mode="zipf", zipf_s=spec.zipf_s),
                                                         spec.num_adapters)
    arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, spec.num_sessions))
    if spec.duration_s is not None:
        arrivals = arrivals[arrivals < spec.duration_s]
    choices = rng.choice(spec.num_adapters, size=len(arrivals), p=share)
    sessions = [Session(i, names[a], float(t), _turns(spec, rng, a < spec.alora_adapters))
                for i, (t, a) in enumerate(zip(arrivals, choices, strict=True))]
    return SessionWorkload(spec, adapters, sessions, frozenset(names[:spec.alora_adapters]))


def _turns(spec: SessionSpec, rng: np.random.Generator, alora: bool = False) -> tuple[Turn, ...]:
    """A session's turns, cut where the conversation would outgrow max_model_len; an activated LoRA's
    user messages hold the invocation too."""
    count = min(int(rng.geometric(1.0 / spec.mean_turns)), spec.max_turns)
    users = USER_TOKENS.sample(rng, count, spec.length_scale) + (INVOCATION_TOKENS if alora else 0)
    outputs = OUTPUT_TOKENS.sample(rng, count, spec.length_scale)
    thinks = rng.exponential(spec.think_mean_s, count) if spec.think_mean_s > 0 else np.zeros(count)
    room = spec.max_model_len - spec.system_prompt_tokens
    # the first turn always fits (shortened if need be); its message opens with the session's tag
    users[0] = min(max(int(users[0]), TAG_TOKENS + (INVOCATION_TOKENS if alora else 0)), room - 1)
    outputs[0] = min(int(outputs[0]), room - int(users[0]))
    turns, context = [], spec.system_prompt_tokens
    for k in range(count):
        context += int(users[k]) + int(outputs[k])
        if context > spec.max_model_len:
            break
        turns.append(Turn(int(users[k]), int(outputs[k]), 0.0 if k == 0 else float(thinks[k])))
    return tuple(turns)


# ---- token ids ------------------------------------------------------------------------------

TAG_TOKENS = 2  # a session's index in two tokens opens its first user message
INVOCATION_TOKENS = 4  # an activated LoRA's invocation: after the tag in a first message, else first


@dataclass(frozen=True)
class PromptTokens:
    """Deterministic token ids: an adapter's system prompt, and each session's user messages."""

    vocab_size: int
    seed: int = 0
    first_id: int = 3  # ids below are special tokens (<s>, </s>, <unk> in the tiny model)

    def system(self, adapter_index: int, count: int) -> list[int]:
        return self._draw((self.seed, 0, adapter_index), count)

    def user(self, session: int, turn: int, count: int, invoked: bool = False) -> list[int]:
        """`count` tokens of a user message; `invoked`: an activated LoRA's, holding its invocation."""
        tokens = self._draw((self.seed, 1, session, turn), count)
        start = TAG_TOKENS if turn == 0 else 0
        if turn == 0:
            tokens[:TAG_TOKENS] = self._tag(session)[:count]
        if invoked:
            tokens[start:start + INVOCATION_TOKENS] = self.invocation()[:max(0, count - start)]
        return tokens

    def invocation(self) -> list[int]:
        """The activated LoRAs' invocation."""
        return self._draw((self.seed, 2), INVOCATION_TOKENS)

    def _tag(self, session: int) -> list[int]:
        base = self.vocab_size - self.first_id
        if session >= base * base:
            raise ValueError(f"{session + 1} sessions need a vocabulary above {self.first_id + base} ids")
        return [self.first_id + session // base, self.first_id + session % base]

    def _draw(self, key: tuple[int, ...], count: int) -> list[int]:
        return np.random.default_rng(key).integers(self.first_id, self.vocab_size, count).tolist()


# ---- the driver -----------------------------------------------------------------------------

@dataclass
class TurnRecord:
    session: int
    turn: int
    adapter: str
    request: Request
    token_times: list[float] = field(default_factory=list)  # clock reading at each output token

    @property
    def ttft_s(self) -> float | None:
        first = self.request.first_token_time
        return None if first is None else first - self.request.arrival_time

    def gaps(self) -> list[float]:
        """Time between consecutive output tokens (TBT)."""
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]


@dataclass
class SessionRun:
    records: list[TurnRecord]  # every submitted turn, in submission order
    origin: float  # clock reading at workload time 0
    end: float  # clock reading when the last turn finished (or the horizon was hit)
    memory: MemoryStats


def run_sessions(core: EngineCore, workload: SessionWorkload, wait_until: WaitUntil,
                 prompt_token_source: PromptTokens, horizon_s: float | None = None) -> SessionRun:
    """Play `workload` on `core` (its adapters already added under the workload's names): each
    session's first turn at its arrival, every later turn its think time after the previous reply.
    `wait_until(t)` idles until clock reading t (a virtual jump, or a sleep on a wall clock)."""
    driver = _Driver(core, workload, prompt_token_source)
    clock = core.clock
    while driver.due or core.has_unfinished():
        now = clock.now()
        if horizon_s is not None and now - driver.origin >= horizon_s:
            break
        driver.submit_due(now)
        if core.has_unfinished():
            driver.step()
        elif driver.due:
            wait_until(driver.due[0][0])
    return SessionRun(driver.records, driver.origin, clock.now(), core.memory_stats())


class _Driver:
    def __init__(self, core: EngineCore, workload: SessionWorkload, tokens: PromptTokens) -> None:
        self.core = core
        self.workload = workload
        self.tokens = tokens
        self.origin = core.clock.now()
        self.records: list[TurnRecord] = []
        self.live: dict[str, TurnRecord] = {}
        self.due = [(self.origin + s.arrival_s, s.index, 0) for s in workload.sessions]  # (time, session, turn)
        heapq.heapify(self.due)
        self.last: dict[int, Request] = {}  # session -> its latest turn's request
        self.system: dict[str, list[int]] = {}
        self.stalled = 0

    def submit_due(self, now: float) -> None:
        due = self.due
        while due and due[0][0] <= now:
            at, session, turn = heapq.heappop(due)
            self._submit(self.workload.sessions[session], turn, at)

    def _submit(self, session: Session, turn: int, at: float) -> None:
        spec = session.turns[turn]
        new = self.tokens.user(session.index, turn, spec.user_tokens, session.adapter in self.workload.alora)
        previous = self.last.get(session.index)
        prompt = (self._system(session.adapter) + new if previous is None
                  else previous.prompt_token_ids + previous.output_token_ids + new)
        adapter = self.core.adapters.serving(session.adapter).id
        request = Request(f"s{session.index}-t{turn}", prompt, turn_sampling(spec.output_tokens), adapter=adapter,
                          arrival_time=at)
        self.core.add_request(request)
        record = TurnRecord(session.index, turn, session.adapter, request)
        self.records.append(record)
        self.live[request.request_id] = record
        self.last[session.index] = request

    def _system(self, adapter: str) -> list[int]:
        if adapter not in self.system:
            self.system[adapter] = self.tokens.system(self.workload.adapter_index(adapter),
                                                      self.workload.spec.system_prompt_tokens)
        return self.system[adapter]

    def step(self) -> None:
        core = self.core
        idle = core.scheduler.num_running == 0
        steps = core.stats().steps_total if idle else 0  # the stall check below runs only when idle
        outputs = core.step()
        now = core.clock.now()
        for out in outputs:
            record = self.live.get(out.request_id)
            if record is None:
                continue
            record.token_times.extend([now] * len(out.new_token_ids))
            if out.finished:
                del self.live[out.request_id]
                self._next_turn(record, now)
        if idle and not outputs:
            self._check_progress(steps)

    def _next_turn(self, record: TurnRecord, now: float) -> None:
        turns = self.workload.sessions[record.session].turns
        if record.turn + 1 < len(turns):
            heapq.heappush(self.due, (now + turns[record.turn + 1].think_s, record.session, record.turn + 1))

    def _check_progress(self, steps_before: int) -> None:
        """An idle engine that executes no step, with no copy under way, will never move again."""
        core = self.core
        if core.stats().steps_total != steps_before or core.memory.copies_in_flight:
            self.stalled = 0
            return
        self.stalled += 1
        if self.stalled > 1000:
            raise RuntimeError("the engine admits none of its waiting requests while idle")


def turn_sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


# ---- summary --------------------------------------------------------------------------------

@dataclass
class SessionSummary:
    turns: int
    finished: int
    elapsed_s: float
    ttft_mean_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    adapter_hit_rate: float
    prefix_hit_rate: float
    copied_bytes: int  # host <-> device, both directions
    invalid_kv_pages: int
    adapter_loads: int
    prefix_hit_tokens: int


def summarize_sessions(run: SessionRun) -> SessionSummary:
    ttfts = [r.ttft_s for r in run.records if r.ttft_s is not None]
    gaps = [g for r in run.records for g in r.gaps()]
    memory = run.memory
    return SessionSummary(
        turns=len(run.records), finished=sum(r.request.is_finished for r in run.records),
        elapsed_s=run.end - run.origin,
        ttft_mean_s=float(np.mean(ttfts)) if ttfts else float("nan"),
        ttft_p99_s=float(np.percentile(ttfts, 99)) if ttfts else float("nan"),
        tbt_p50_s=float(np.percentile(gaps, 50)) if gaps else float("nan"),
        adapter_hit_rate=memory.adapter_hit_rate, prefix_hit_rate=memory.prefix_hit_rate,
        copied_bytes=memory.h2d_bytes + memory.d2h_bytes, invalid_kv_pages=memory.invalid_kv_pages,
        adapter_loads=memory.adapter_loads, prefix_hit_tokens=memory.prefix_hit_tokens)
