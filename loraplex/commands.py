"""Subcommands that live in the torch-free core: workloads and the digital twin. Benchmarks register
from `loraplex_bench` (bench/), the components from their own packages."""

from __future__ import annotations

from loraplex.cli import CommandRegistry


def register(registry: CommandRegistry) -> None:
    """Each command imports its module lazily (`loraplex.sim.commands` is argparse-only)."""
    from loraplex.sim import commands as sim

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
