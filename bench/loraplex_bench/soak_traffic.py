"""The traffic of `loraplex bench soak`: steady mixed requests through the router with the openai client,
a share of them bad on purpose, so that the error paths are soaked as well as the answers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai

from loraplex_bench.closed_loop import ClosedLoop

GOOD_KINDS = ("completion", "completion-stream", "chat", "chat-stream")
BAD_KINDS = ("unknown-adapter", "too-long", "bad-json")
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "hello"}]
UNKNOWN_MODEL = "no-such-adapter"
TOO_LONG_PROMPT = "hello " * 5000  # about 5,000 tokens: over the tiny model's 2,048
BAD_JSON = b'{"model": "x", "messages": ['
TIMEOUT_S = 120.0
Session = tuple[openai.OpenAI, httpx.Client]


class StreamCut(Exception):
    """A stream that ended without a finish_reason."""


class Traffic(ClosedLoop):
    """Request i is a bad one when i % bad_every == bad_every - 1 (the bad kinds in turn); the good ones,
    numbered g = 0, 1, 2, ... among themselves, are kind g % 4 for model g // 4 (so every kind meets every
    one of `models`, whatever bad_every is). Outcomes are counted: answered (per kind), refused as they
    should be (a bad request answered 4xx; per kind and status) and unexpected (5xx, a transport error, a
    4xx to a good request, a bad one answered; per kind, status and message)."""

    def __init__(self, url: str, models: list[str], clients: int, rate: float | None, max_tokens: int,
                 bad_every: int) -> None:
        super().__init__(clients, rate)
        self.url = url
        self.models = models
        self.max_tokens = max_tokens
        self.bad_every = bad_every
        self.ok: Counter[str] = Counter()
        self.expected: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()

    def summary(self) -> dict:
        with self.lock:
            ok, expected, unexpected = sum(self.ok.values()), sum(self.expected.values()), sum(self.unexpected.values())
            return {"sent": ok + expected + unexpected, "ok": ok, "expected_4xx": expected,
                    "unexpected": unexpected, "ok_by_kind": dict(self.ok), "expected_4xx_by_kind": dict(self.expected),
                    "unexpected_by_error": dict(self.unexpected.most_common(10))}

    @contextmanager
    def session(self) -> Iterator[Session]:
        with openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as api, \
                httpx.Client(base_url=self.url, timeout=TIMEOUT_S) as http:
            yield api, http

    def send(self, session: Session, i: int) -> None:
        kind, model = self._kind(i)
        try:
            self._request(session, kind, model)
            status, detail = 200, "answered"
        except openai.APIStatusError as exc:
            status, detail = exc.status_code, exc.message
        except httpx.HTTPStatusError as exc:
            status, detail = exc.response.status_code, exc.response.text
        except (openai.OpenAIError, httpx.HTTPError, StreamCut) as exc:
            status, detail = None, f"{type(exc).__name__}: {exc}"
        self._record(kind, status, detail)

    def _kind(self, i: int) -> tuple[str, str]:
        """Request i's kind and model."""
        if self.bad_every and i % self.bad_every == self.bad_every - 1:
            bad = i // self.bad_every
            return BAD_KINDS[bad % len(BAD_KINDS)], self.models[bad % len(self.models)]
        good = i - i // self.bad_every if self.bad_every else i  # the bad requests leave no gap in the good ones
        return GOOD_KINDS[good % len(GOOD_KINDS)], self.models[good // len(GOOD_KINDS) % len(self.models)]

    def _request(self, session: Session, kind: str, model: str) -> None:
        api, http = session
        if kind == "unknown-adapter":  # streamed: the refusal comes before the stream would begin
            _drain(api.chat.completions.create(model=UNKNOWN_MODEL, messages=MESSAGES, max_tokens=self.max_tokens,
                                               stream=True))
        elif kind == "too-long":
            api.completions.create(model=model, prompt=TOO_LONG_PROMPT, max_tokens=self.max_tokens)
        elif kind == "bad-json":
            http.post("/v1/chat/completions", content=BAD_JSON,
                      headers={"content-type": "application/json"}).raise_for_status()
        elif kind.startswith("chat"):
            _check(api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=self.max_tokens,
                                               stream=kind.endswith("-stream")))
        else:
            _check(api.completions.create(model=model, prompt=PROMPT, max_tokens=self.max_tokens,
                                          stream=kind.endswith("-stream")))

    def _record(self, kind: str, status: int | None, detail: str) -> None:
        with self.lock:
            if kind in GOOD_KINDS and status == 200:
                self.ok[kind] += 1
            elif kind in BAD_KINDS and status is not None and 400 <= status < 500:
                self.expected[f"{kind} {status}"] += 1
            else:
                self.unexpected[f"{kind} {status or 'no answer'}: {detail[:160]}"] += 1


def _check(answer: object) -> None:
    """A streamed answer is read to its end, and must say why it ended."""
    if isinstance(answer, openai.Stream) and not _drain(answer):
        raise StreamCut("the stream ended without a finish_reason")


def _drain(stream: openai.Stream) -> bool:
    """Read the stream to its end; whether a chunk carried a finish_reason."""
    finished = False
    for chunk in stream:
        finished = finished or any(choice.finish_reason for choice in chunk.choices)
    return finished
