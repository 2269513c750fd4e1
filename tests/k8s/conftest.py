"""Fixtures of the Kubernetes tests.

`api_server_errors(obj, old=None)`: validate a custom resource the way the API server would, without
an API server:

1. The generated openAPIV3Schema with jsonschema's Draft 4 validator (OpenAPI 3.0 schemas use Draft 4
   semantics, e.g. boolean `exclusiveMinimum`). `kubectl apply` validates strictly (unknown fields are
   errors), which we mirror by closing every object that lists its properties.
2. Defaults applied as the API server does (parents defaulted to {} get their children's defaults).
3. Every `x-kubernetes-validations` rule evaluated with a real CEL interpreter (`cel` package), with
   `self` bound to the value at that node; rules on `oldSelf` only run for updates.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_FILES = {"AdapterPool": "adapterpools.yaml", "LoRADeployment": "loradeployments.yaml"}


def load_crd(kind: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "crds" / CRD_FILES[kind]).read_text())


def schema_of(kind: str) -> dict[str, Any]:
    return load_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes")}
    if "properties" in schema:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(schema["additionalProperties"])
    if "items" in schema:
        out["items"] = _strict(schema["items"])
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def cel_errors(schema: dict[str, Any], value: Any, old: Any = None) -> list[str]:
    import cel

    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        uses_old = "oldSelf" in rule["rule"]
        if uses_old and old is None:
            continue  # transition rules apply to updates only
        context = {"self": value, "oldSelf": old} if uses_old else {"self": value}
        if cel.evaluate(rule["rule"], context) is not True:
            errors.append(rule["message"])
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += cel_errors(sub, value[name], old.get(name) if isinstance(old, dict) else None)
    elif isinstance(value, list) and "items" in schema:
        errors += [e for v in value for e in cel_errors(schema["items"], v)]
    return errors


def api_server_errors(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Messages the API server would answer with; [] when it accepts (and defaults) the object."""
    schema = schema_of(obj.get("kind", ""))
    obj = apply_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft4Validator(_strict(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    return errors or cel_errors(schema, obj, old)


@pytest.fixture(name="api_server_errors")
def _api_server_errors():  # noqa: ANN202
    return api_server_errors


@pytest.fixture(name="examples")
def _examples() -> dict[str, dict[str, Any]]:
    """The example resources of examples/ (the ones the docs show), by file name."""
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))}


@pytest.fixture(name="api_server_defaults")
def _api_server_defaults():  # noqa: ANN202
    """The object with the defaults of its CRD schema applied."""
    return lambda obj: apply_defaults(schema_of(obj["kind"]), obj)
