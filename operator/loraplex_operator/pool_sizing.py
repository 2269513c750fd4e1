"""`sizing.estimator: planner`: the pool's required servers from the twin's minimum-GPU plan.

At each placement the pool's forecast demand becomes a plan request (pure parts in `sizing`); the
plan runs in the Deps' PlannerRunner and a later tick reads its outcome. `planner_sizing` turns that
outcome and the previous status into what the status says and the autoscaler uses; it is pure."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from loraplex.latency.profile import Profile, load_profile
from loraplex.placement.controller import build_input
from loraplex.sim.planner import plan
from loraplex.spec.crd import AdapterPoolSpec, AdapterPoolStatus, Condition
from loraplex_operator.adapter_status import Event
from loraplex_operator.deps import Deps
from loraplex_operator.planner_runner import PlanOutcome
from loraplex_operator.pool_status import PLANNED
from loraplex_operator.sizing import check_profile, plan_key, planner_oracle, workload_summary

INVALID_SIZING = "InvalidSizing"  # the reason of a sizing spec the operator cannot use
NO_ADAPTERS = "NoAdapters"


@dataclass(frozen=True)
class Sizing:
    required: int | None                # servers for the autoscaler (None: no plan yet)
    slots: tuple[int, ...]              # A_max per planned server, as the status keeps them
    condition: tuple[bool, str, str]    # the Planned condition: (status, reason, message)
    invalid: str = ""                   # why the sizing spec cannot be used (the pool is Failed)
    events: tuple[Event, ...] = ()


@functools.lru_cache(maxsize=8)
def _profile(name_or_path: str) -> Profile:
    """Profiles are files in the image: read once (a failed read raises and is not cached)."""
    return load_profile(name_or_path)


def _previous_condition(previous: AdapterPoolStatus | None) -> Condition | None:
    return next((c for c in previous.conditions if c.type == PLANNED), None) if previous else None


def _last_plan(previous: AdapterPoolStatus | None) -> tuple[int | None, tuple[int, ...]]:
    """The required servers and slots of the last plan the status holds ((None, ()) if none)."""
    if previous is None or not previous.planned_adapter_slots:
        return None, ()
    return previous.required_servers, tuple(previous.planned_adapter_slots)


def _kept(required: int | None) -> str:
    return f"keeping the last plan ({required} servers)" if required is not None else "servers stay as they are"


def planner_sizing(outcome: PlanOutcome | None, previous: AdapterPoolStatus | None, floor: int) -> Sizing:
    """`outcome` of the plan asked for last (None while it runs); `floor`: the largest replicas.min
    of the pool's adapters, which the plan (one server per adapter) does not know about."""
    required, slots = _last_plan(previous)
    before = _previous_condition(previous)
    if outcome is None:
        if before is not None and before.reason not in (INVALID_SIZING, NO_ADAPTERS):
            return Sizing(required, slots, (before.status == "True", before.reason, before.message))
        return Sizing(required, slots, (False, "Planning", "waiting for the first plan"))
    if outcome.servers is None:
        message = f"{outcome.message}; {_kept(required)}"
        events = () if before is not None and before.reason == outcome.reason else (
            Event("Warning", outcome.reason, message),)
        return Sizing(required, slots, (False, outcome.reason, message), events=events)
    message = (f"{outcome.servers} servers for {outcome.adapters} adapters (slots {list(outcome.slots)}), "
               f"planned in {outcome.seconds:.1f} s")
    events = () if len(slots) == outcome.servers else (
        Event("Normal", PLANNED, f"planner: {len(slots) or 'no'} -> {outcome.servers} servers; {message}"),)
    return Sizing(max(outcome.servers, floor), outcome.slots, (True, PLANNED, message), events=events)


def invalid_sizing(message: str) -> Sizing:
    """A sizing spec the operator cannot use: no estimate (the autoscaler holds), the pool is Failed
    (the tick posts the Warning event)."""
    return Sizing(None, (), (False, INVALID_SIZING, message), invalid=message)


def _ask(pool: str, spec: AdapterPoolSpec, profile: Profile, deps: Deps) -> bool:
    """Asks the runner for the plan of the demand the placement forecasts now; False when the pool
    has no adapters to plan for."""
    controller = deps.controller(pool, spec)
    store = deps.store(pool)
    demand = store.demand_windows(deps.clock.now(), controller.windows)
    adapters = build_input([], store.adapters(), demand, controller.operating_points, None,
                           controller.forecaster).adapters
    summary = workload_summary(adapters, spec.sizing)
    if summary is None:
        return False
    oracle, max_slots = planner_oracle(profile, spec), spec.engine.max_loras
    deps.planner.ask(pool, plan_key(summary, spec), lambda: plan(summary, profile, oracle, max_slots=max_slots))
    return True


def size_with_planner(pool: str, spec: AdapterPoolSpec, previous: AdapterPoolStatus | None, floor: int,
                      due: bool, deps: Deps) -> Sizing:
    """Asks for a new plan when placement is due (or none was asked yet), then reads the last one."""
    assert spec.sizing.profile is not None  # the spec's own rule for the planner
    try:
        profile = _profile(spec.sizing.profile)
        check_profile(profile, spec.sizing)
    except (OSError, ValueError) as exc:
        return invalid_sizing(f"sizing.profile: {exc}")
    if (due or not deps.planner.asked(pool)) and not _ask(pool, spec, profile, deps):
        deps.planner.forget(pool)
        return Sizing(None, (), (False, NO_ADAPTERS, "the pool has no adapters to plan for"))
    return planner_sizing(deps.planner.outcome(pool), previous, floor)
