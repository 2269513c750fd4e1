"""The chart's router values become `loraplex router` flags: routingOptions, the resilience knobs
(whose defaults are the router's own) and extraArgs, rendered by Helm's engine and parsed by the
router's own parser."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from loraplex_router.cli import add_router_args

from loraplex.cli import build_registry

CHART = Path(__file__).resolve().parents[2] / "helm" / "loraplex"
helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")

SET = {"router": {"profile": "rank-aware", "ttfbDeadline": 2.5, "ejectAfter": 5, "ejectionTime": 1,
                  "maxEjectedFraction": 0.25, "maxRequestBytes": 1 << 30,
                  "routingOptions": {"slo_tpot_s": "0.05", "latency_profile": "whatif-h100-llama8b"},
                  "extraArgs": ["--max-attempts=5", "--poll-interval=0.5"]}}


def _router_args(values: dict[str, Any]) -> list[str]:
    out = helm.Chart.load(str(CHART)).render(values=values, name="lp", namespace="serving")
    router = next(doc for path, text in out.items() if path.endswith("router.yaml")
                  for doc in yaml.safe_load_all(text) if doc and doc["kind"] == "Deployment")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "router"
    return args[1:]


def _parsed(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return parser.parse_args(args)


def test_the_default_values_are_the_routers_defaults() -> None:
    rendered, defaults = vars(_parsed(_router_args({}))), vars(_parsed([]))
    for flag in ("profile", "ttfb_deadline", "eject_after", "ejection_time", "max_ejected_fraction",
                 "max_request_bytes", "routing_option"):
        assert rendered[flag] == defaults[flag], flag


def test_set_values_reach_the_router_and_it_takes_them() -> None:
    args = _router_args(SET)
    flags = _parsed(args)
    assert flags.profile == "rank-aware"
    assert flags.routing_option == ["latency_profile=whatif-h100-llama8b", "slo_tpot_s=0.05"]
    assert (flags.ttfb_deadline, flags.eject_after, flags.ejection_time, flags.max_ejected_fraction) == (2.5, 5, 1, 0.25)
    assert flags.max_request_bytes == 1 << 30  # an integer, not Go's 1.073741824e+09
    assert args[-2:] == ["--max-attempts=5", "--poll-interval=0.5"]  # last: they win over the chart's
    assert (flags.max_attempts, flags.poll_interval) == (5, 0.5)
    build_registry("router").check_args("router", args)  # `loraplex router` would start with them


# What `helm install --set router.ttfbDeadline=2.5 --set router.routingOptions.prompt_tokens=512 ...`
# hands the chart: Helm's --set keeps decimals as strings and turns whole numbers into integers.
SET_ON_THE_COMMAND_LINE = {"router": {"profile": "rank-aware", "ttfbDeadline": "2.5", "ejectionTime": "0.5", "maxEjectedFraction": "0.25",
                                      "routingOptions": {"prompt_tokens": 512, "slo_tpot_s": "0.05"}}}


def _schema_errors(router: dict[str, Any]) -> list:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["router"] |= router
    schema = json.loads((CHART / "values.schema.json").read_text())
    return list(jsonschema.Draft7Validator(schema).iter_errors(values))


def test_values_set_on_the_command_line_pass_the_schema_and_reach_the_router() -> None:
    assert _schema_errors(SET_ON_THE_COMMAND_LINE["router"]) == []
    args = _router_args(SET_ON_THE_COMMAND_LINE)
    flags = _parsed(args)
    assert (flags.ttfb_deadline, flags.ejection_time, flags.max_ejected_fraction) == (2.5, 0.5, 0.25)
    assert flags.routing_option == ["prompt_tokens=512", "slo_tpot_s=0.05"]
    build_registry("router").check_args("router", args)


@pytest.mark.parametrize("bad", [{"maxEjectedFraction": 2}, {"maxEjectedFraction": "1.5"}, {"ejectAfter": -1},
                                 {"ejectionTime": 0}, {"ejectionTime": "0.0"}, {"ttfbDeadline": -1},
                                 {"ttfbDeadline": "soon"}, {"maxRequestBytes": 0},
                                 {"routingOptions": {"slo_tpot_s": [0.05]}}, {"extraArgs": "--max-attempts=5"}])
def test_the_schema_refuses_bad_router_values(bad: dict[str, Any]) -> None:
    assert _schema_errors(bad)


@pytest.mark.parametrize("values", [SET, SET_ON_THE_COMMAND_LINE])
def test_helm_lint_strict_takes_the_set_values(values: dict[str, Any]) -> None:
    report = helm.lint(str(CHART), values, strict=True, kube_version="v1.36.0")
    assert report["errors"] == [], report
    assert [m["error"] for m in report["messages"]] == ["icon is recommended"], report


def test_helm_lint_refuses_a_bad_string_value() -> None:
    report = helm.lint(str(CHART), {"router": {"maxEjectedFraction": "1.5"}}, strict=True, kube_version="v1.36.0")
    assert report["errors"], report
