"""The real openai client against a local stack's router, and load through it, for the end-to-end tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import openai
from loraplex_bench.closed_loop import ClosedLoop

HELLO = [{"role": "user", "content": "hello"}]


def client(stack) -> openai.OpenAI:
    """A client of the stack's router that never retries: every failure is the router's."""
    return openai.OpenAI(base_url=stack.router_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(c: openai.OpenAI, model: str, max_tokens: int = 3) -> str:
    return c.completions.create(model=model, prompt="def add(a, b):", max_tokens=max_tokens,
                                temperature=0).choices[0].text


def stream_chat(c: openai.OpenAI, model: str, started: list[bool] | None = None, max_tokens: int = 3,
                **sampling: float) -> str:
    """The streamed answer's text; `started[0]` is set once its first chunk has come."""
    text = ""
    for chunk in c.chat.completions.create(model=model, messages=HELLO, max_tokens=max_tokens, stream=True,
                                           **sampling):
        if started is not None:
            started[0] = True
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    return text


class OpenAILoad(ClosedLoop):
    """Clients sending requests through the router until the block ends: a streamed chat and a plain
    completion in turn, over `adapters` (`complete` and `stream_chat` send them). Answers are counted, in
    all and by adapter; failures are recorded as (adapter, whether the stream had begun, error): a stream
    that had begun is committed to its server. `state()` says what it waits for (a failure's message)."""

    def __init__(self, stack, adapters: list[str], clients: int = 4,
                 complete: Callable[[openai.OpenAI, str], object] = complete,
                 stream_chat: Callable[..., object] = stream_chat) -> None:
        super().__init__(clients)
        self.stack = stack
        self.adapters = adapters
        self.complete = complete
        self.stream_chat = stream_chat
        self.ok = 0
        self.served: Counter[str] = Counter()  # answers by adapter
        self.failures: list[tuple[str, bool, str]] = []
        self.open: dict[int, tuple[str, float]] = {}  # request number -> (adapter, when it was sent)

    def session(self) -> openai.OpenAI:
        return client(self.stack)

    def send(self, c: openai.OpenAI, i: int) -> None:
        adapter, started = self.adapters[i % len(self.adapters)], [False]
        with self.lock:
            self.open[i] = (adapter, self.now())
        try:
            if i % 2 == 0:
                self.stream_chat(c, adapter, started)
            else:
                self.complete(c, adapter)
            with self.lock:
                self.ok += 1
                self.served[adapter] += 1
        except openai.OpenAIError as exc:
            with self.lock:
                self.failures.append((adapter, started[0], repr(exc)))
        finally:
            with self.lock:
                del self.open[i]

    def state(self) -> str:
        """What the load has done and what it waits for, for a failure's message."""
        with self.lock:
            waiting = ", ".join(f"{adapter} for {self.now() - sent:.0f} s" for adapter, sent in self.open.values())
            return (f"{self.ok} answered; open: {waiting or 'none'}; {len(self.failures)} failed, the last: "
                    f"{self.failures[-3:]}")
