"""`loraplex crds generate` and `loraplex operator` as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from loraplex_operator.inspect_source import InspectionError, SourceInspector, file_url
from loraplex_operator.main import peering_objects

from loraplex.cli import main
from loraplex.spec.crd import AdapterSource


def test_crds_generate_then_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crds", "generate", "--check", "--out", str(tmp_path)]) == 2  # nothing there yet
    assert "out of date" in capsys.readouterr().err
    assert main(["crds", "generate", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapterpools.yaml", "kopf-peerings.yaml",
                                                          "loradeployments.yaml"]
    assert main(["crds", "generate", "--check", "--out", str(tmp_path)]) == 0


def test_operator_help_lists_its_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "loraplex.cli", "operator", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in ("--namespace", "--redis-url", "--peering", "--standalone"):
        assert flag in out


def test_peering_objects() -> None:
    assert peering_objects("lp", []) == [{"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                           "metadata": {"name": "lp"}}]
    assert [o["metadata"]["namespace"] for o in peering_objects("lp", ["a", "b"])] == ["a", "b"]


def test_source_urls() -> None:
    assert file_url("hf://org/name@v1", "adapter_config.json") == \
        "https://huggingface.co/org/name/resolve/v1/adapter_config.json"
    assert file_url("https://host/x/", "w") == "https://host/x/w"
    with pytest.raises(InspectionError, match="sha256 and spec.adapter.rank"):
        file_url("file:///adapters/a", "w")


def test_unreachable_source_is_retryable() -> None:
    inspector = SourceInspector(timeout_s=2, hf_endpoint="http://127.0.0.1:9")  # discard port: refused
    with pytest.raises(InspectionError) as info:
        inspector.inspect(AdapterSource(source="hf://org/a"), {})
    assert info.value.retryable and info.value.reason == "SourceUnreachable"
