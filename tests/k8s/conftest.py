"""Fixtures of the Kubernetes tests. The API server's handling of CRDs and custom resources, mirrored
without an API server, is in tests/support/api_server.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from api_server import ROOT, api_server_errors, decode, schema_of


@pytest.fixture(name="api_server_errors")
def _api_server_errors():  # noqa: ANN202
    return api_server_errors


@pytest.fixture(name="examples")
def _examples() -> dict[str, dict[str, Any]]:
    """The example resources of examples/ (the ones the docs show), by file name."""
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))}


@pytest.fixture(name="api_server_defaults")
def _api_server_defaults():  # noqa: ANN202
    """The object as the server stores it: pruned, without nulls, defaulted."""
    return lambda obj: decode(obj, schema_of(obj["kind"]))[0]
