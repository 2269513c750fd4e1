"""Subcommands that live in the torch-free core (simulator, workloads, load generator)."""

from __future__ import annotations

from types import ModuleType

from loraplex.cli import CommandRegistry


def register(registry: CommandRegistry) -> None:
    """Core commands are added here as the core grows; each imports its module lazily."""
    registry.add("bench placement", "time the placement policies on a synthetic pool",
                 lambda parser: _bench_placement().configure(parser), lambda args: _bench_placement().run(args))
    from loraplex.sim import commands as sim  # argparse-only; each run imports its module lazily

    registry.add("workload generate", "write a synthetic or replayed workload trace (JSONL)",
                 sim.generate_args, sim.run_generate)
    registry.add("workload stats", "rate, burstiness, lengths and adapter skew of a trace",
                 sim.stats_args, sim.run_stats)
    registry.add("sim run", "replay a trace on the digital twin (one server or a cluster)",
                 sim.sim_args, sim.run_sim)
    registry.add("sim plan", "the fewest GPUs (and A_max per GPU) that serve a trace without starving",
                 sim.plan_args, sim.run_plan)
    registry.add("sim whatif-profile", "write the what-if H100 / Llama-3.1-8B profile built from published constants",
                 sim.whatif_args, sim.run_whatif)
    registry.add("bench serve", "replay a trace against an OpenAI-compatible endpoint (open loop)",
                 sim.serve_args, sim.run_serve)
    registry.add("bench report", "percentile table and CDF/over-time plots of results files",
                 sim.report_args, sim.run_report)
    from loraplex.sim import memory_compare  # argparse and the twin; the engine side is imported when run

    registry.add("bench memory", "memory policies (unified, lru-static, no-cache) on multi-turn chat sessions, "
                 "in the twin and on the real engine", memory_compare.configure, memory_compare.run)
    from loraplex.sim import scheduler_compare  # argparse and the twin; the engine side is imported when run

    registry.add("bench schedulers", "chameleon, fifo, sjf and vtc at loads relative to FIFO's saturation, "
                 "in the twin and on the real engine", scheduler_compare.configure, scheduler_compare.run)
    from loraplex.sim import placement_twin_cli as placement_twin  # argparse-only

    registry.add("bench placement-twin", "max rps at the SLO per placement policy under rank skew, in the twin",
                 placement_twin.configure, placement_twin.run)
    from loraplex.sim import backends_compare  # argparse; runs `loraplex up` per backend as a subprocess

    registry.add("bench backends", "the same trace through a pool on our engine and a pool on vLLM (local "
                 "stacks): TTFT, TBT and throughput side by side", backends_compare.configure, backends_compare.run)
    from loraplex.sim import routing_compare  # argparse and the twin

    registry.add("bench routing", "rank-aware vs loraserve vs least-loaded routing under rank skew, in the twin: "
                 "throughput at the SLO and P95 TBT", routing_compare.configure, routing_compare.run)


def _bench_placement() -> ModuleType:
    from loraplex.placement import bench

    return bench
