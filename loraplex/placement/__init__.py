"""Adapter placement (pure): which servers serve each adapter and with what traffic fraction φ.
`make_policy(name)` picks LoRAServe's Algorithm 1, Dynamo's min-cost flow or a baseline; `PlacementController` runs a policy
over a RoutingStore every interval."""

from loraplex.placement.controller import ControllerReport, PlacementController, build_input
from loraplex.placement.forecast import FORECASTERS, ewma, last_window, make_forecaster
from loraplex.placement.loraserve import DEFAULT_HYSTERESIS
from loraplex.placement.max_replicas import cap_placement, cap_routes
from loraplex.placement.operating_points import (
    DEFAULT_CPU,
    DEFAULT_GPU,
    OperatingPoints,
    OperatingPointsError,
    default_operating_points,
)
from loraplex.placement.policy import POLICY_NAMES, PlacementPolicy, make_policy
from loraplex.placement.slots import cap_slots
from loraplex.placement.snapshot import (
    Placement,
    PlacementAdapter,
    PlacementError,
    PlacementInput,
    PlacementServer,
)

__all__ = [
    "DEFAULT_CPU", "DEFAULT_GPU", "DEFAULT_HYSTERESIS", "FORECASTERS", "POLICY_NAMES", "ControllerReport", "OperatingPoints",
    "OperatingPointsError", "Placement", "PlacementAdapter", "PlacementController", "PlacementError",
    "PlacementInput", "PlacementPolicy", "PlacementServer", "build_input",
    "default_operating_points", "ewma", "last_window", "make_forecaster", "make_policy",
    "cap_placement", "cap_routes", "cap_slots",
]
