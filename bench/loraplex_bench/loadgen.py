"""`loraplex bench serve`: replay a trace against an OpenAI-compatible server, open loop.

Each request is sent at its trace arrival time, whatever the server is doing, as a streaming
/v1/completions call whose prompt is `prompt_len` random token ids and whose output is forced to
`output_len` tokens (max_tokens + ignore_eos). TTFT, mean time between tokens and E2E are measured
at the client. HTTP/1.1 over asyncio streams (stdlib only: the core may not import httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from loraplex.sim.metrics import RequestResult, summarize, trace_duration
from loraplex.sim.results import write_results
from loraplex.sim.trace import Trace, TraceRequest, read_trace
from loraplex.spec.errors import CommandError


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    path: str  # e.g. /v1/completions
    api_key: str | None = None

    @classmethod
    def from_url(cls, url: str, api_key: str | None = None) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise CommandError(f"--url must be an http://host[:port] URL (https is not supported), not {url!r}")
        base = parts.path.rstrip("/")
        path = base if base.endswith("/completions") else f"{base.removesuffix('/v1')}/v1/completions"
        return cls(parts.hostname, parts.port or 80, path, api_key)


class HttpError(Exception):
    pass


async def stream_completion(endpoint: Endpoint, body: dict, timeout: float) -> list[float]:
    """POST `body`; returns the arrival time (monotonic) of every streamed event with tokens."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(endpoint.host, endpoint.port), timeout)
    try:
        auth = f"Authorization: Bearer {endpoint.api_key}\r\n" if endpoint.api_key else ""
        writer.write((f"POST {endpoint.path} HTTP/1.1\r\nHost: {endpoint.host}:{endpoint.port}\r\n"
                      f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{auth}"
                      f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload)
        await writer.drain()
        return await asyncio.wait_for(_read_events(reader), timeout)
    finally:
        writer.close()


async def _read_events(reader: asyncio.StreamReader) -> list[float]:
    status = (await reader.readline()).decode("latin-1").split()
    headers = {}
    while (line := (await reader.readline()).decode("latin-1").strip()):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if len(status) < 2 or status[1] != "200":
        raise HttpError(f"HTTP {' '.join(status[1:]) or '?'}: {(await reader.read(2000)).decode(errors='replace')}")
    times: list[float] = []
    buffer = b""
    async for piece in _body(reader, headers.get("transfer-encoding", "").lower() == "chunked"):
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        now = time.monotonic()
        for line in lines:
            if _has_tokens(line.strip()):
                times.append(now)
    return times


async def _body(reader: asyncio.StreamReader, chunked: bool):
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF after each chunk


def _has_tokens(line: bytes) -> bool:
    if not line.startswith(b"data:"):
        return False
    data = line[5:].strip()
    if data == b"[DONE]":
        return False
    event = json.loads(data)
    if "error" in event:
        raise HttpError(f"server error in stream: {event['error']}")
    return any(choice.get("text") or choice.get("finish_reason") for choice in event.get("choices", []))


def _body_for(request: TraceRequest, model: str | None, rng: random.Random, vocab_size: int) -> dict:
    name = request.adapter or model
    if name is None:
        raise CommandError(f"request {request.request_id} has no adapter: pass --model for the base model")
    return {"model": name, "prompt": [rng.randrange(3, vocab_size) for _ in range(request.prompt_len)],
            "max_tokens": request.output_len, "ignore_eos": True, "stream": True, "temperature": 0.0}


async def _one(endpoint: Endpoint, request: TraceRequest, body: dict, start: float, timeout: float,
               errors: list[str]) -> RequestResult:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.monotonic()))
    sent = time.monotonic()
    try:
        times = await stream_completion(endpoint, body, timeout)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, HttpError, ValueError) as exc:
        errors.append(f"{request.request_id}: {type(exc).__name__}: {exc}")
        return RequestResult(request.request_id, request.adapter, sent - start, request.prompt_len,
                             request.output_len, 0, None, None, None)
    ttft = times[0] - sent if times else None
    e2e = times[-1] - sent if times else None
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return RequestResult(request.request_id, request.adapter, sent - start, request.prompt_len,
                         request.output_len, len(times), ttft, e2e, tpot)


async def replay_http(endpoint: Endpoint, trace: Trace, model: str | None, vocab_size: int, seed: int,
                      timeout: float, progress: bool) -> tuple[list[RequestResult], list[str], float]:
    rng = random.Random(seed)
    bodies = [_body_for(r, model, rng, vocab_size) for r in trace.requests]
    errors: list[str] = []
    start = time.monotonic()
    tasks = [asyncio.create_task(_one(endpoint, r, b, start, timeout, errors))
             for r, b in zip(trace.requests, bodies, strict=True)]
    results = []
    for done, task in enumerate(asyncio.as_completed(tasks), start=1):
        results.append(await task)
        if progress:
            _progress(done, len(tasks), time.monotonic() - start, len(errors))
    if progress:
        sys.stderr.write("\n")
    results.sort(key=lambda r: r.arrival_s)
    return results, errors, time.monotonic() - start


def _progress(done: int, total: int, elapsed: float, errors: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, "
                     f"{elapsed:.0f} s, {errors} errors")
    sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    try:
        trace = read_trace(args.trace)
    except (OSError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    if args.max_requests:
        trace = trace.head(args.max_requests)
    endpoint = Endpoint.from_url(args.url, args.api_key)
    results, errors, elapsed = asyncio.run(replay_http(endpoint, trace, args.model, args.vocab_size, args.seed,
                                                       args.timeout, not args.quiet))
    summary = summarize(results, trace_duration(trace), elapsed)
    out = args.out or f"results-{Path(args.trace).stem}.jsonl"
    write_results(out, trace.workload, results, {"url": args.url, "trace": str(args.trace),
                                                 "summary": summary.to_json(), "errors": errors[:100]})
    print(json.dumps({"summary": summary.to_json(), "errors": len(errors), "results": out}, indent=2))
    for line in errors[:5]:
        print(f"error: {line}", file=sys.stderr)
    return 1 if errors else 0
