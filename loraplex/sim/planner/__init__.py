"""The minimum-GPU planner of the digital-twin paper: a surrogate (or the twin itself) answers
"does this GPU starve, and what throughput does it reach?", and a first-fit-decreasing greedy with
testing points packs adapters onto as few GPUs as those answers allow.

    from loraplex.sim.planner import WorkloadSummary, plan
    result = plan(WorkloadSummary.from_trace(trace), load_profile("cpu-tiny"))
    result.num_gpus, result.assignment, result.a_max  # assignment: adapter -> {GPU: share of its requests}
"""

from loraplex.sim.planner.greedy import Plan, PlanError, plan
from loraplex.sim.planner.oracle import GpuLoad, Oracle, TwinOracle
from loraplex.sim.planner.workload import AdapterDemand, WorkloadSummary

__all__ = ["AdapterDemand", "GpuLoad", "Oracle", "Plan", "PlanError", "TwinOracle", "WorkloadSummary", "plan"]
