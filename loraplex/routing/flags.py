"""The routing flags `loraplex router` and `loraplex up` share (declared once)."""

from __future__ import annotations

import argparse


def add_routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="loraserve", help="routing profile: loraserve (φ-weighted random), "
                   "load-aware (φ + queue depth + residency), least-loaded (shortest queue), rank-aware "
                   "(Toppings: the least extra per-token latency, SLO filter), prefix-aware or prefix-rank-aware "
                   "(first the servers holding the request's longest cached prefix, under a load ceiling). An AdapterPool's spec.routing, "
                   "which the routing table carries, replaces this and the three flags below while it is set; "
                   "docs/router.md")
    p.add_argument("--routing-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a knob of the rank-aware or prefix profiles (repeatable), e.g. slo_tpot_s=0.05, "
                        "latency_profile=whatif-h100-llama8b or load_slack=4")
    p.add_argument("--scorers", default=None, metavar="NAME=W,...",
                   help="override the profile's scorer weights, e.g. phi=1,queue=1,residency=0.5")
    p.add_argument("--picker", default=None, help="override the profile's picker: weighted-random or max-score")
