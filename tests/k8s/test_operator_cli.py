"""`loraplex crds generate` and `loraplex operator` as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from loraplex_operator.inspect_source import InspectionError, SourceInspector, file_url
from loraplex_operator.kube import KubeError
from loraplex_operator.main import peering_objects
from loraplex_operator.throttle import Throttle

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


class _NoPeeringCrds:
    def apply(self, obj: dict[str, Any]) -> None:
        raise KubeError(404, "the server could not find the requested resource")


def _run_operator(monkeypatch: pytest.MonkeyPatch, kube: Any, *args: str) -> dict[str, Any]:
    """`loraplex operator ARGS` up to kopf.run, whose arguments are returned; only the Kubernetes
    API and kopf's loop are replaced (no cluster here; the e2e tests run the real thing)."""
    import kopf
    from loraplex_operator import main as operator_main

    seen: dict[str, Any] = {}
    monkeypatch.setattr(operator_main, "build_deps", lambda config: SimpleNamespace(kube=kube, throttle=Throttle(0, 1)))
    monkeypatch.setattr(kopf, "run", lambda **kwargs: seen.update(kwargs))
    assert main(["operator", "--redis-url", "redis://127.0.0.1:1/0", *args]) == 0
    return seen


def test_standalone_gives_kopf_no_peering_name(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _run_operator(monkeypatch, _NoPeeringCrds(), "--standalone")  # and creates no peering object
    assert seen["standalone"] is True and seen["peering_name"] is None
    assert seen["liveness_endpoint"].startswith("http://127.0.0.1:")


def test_missing_peering_crds_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex_operator import main as operator_main

    monkeypatch.setattr(operator_main, "build_deps", lambda config: SimpleNamespace(kube=_NoPeeringCrds(), throttle=Throttle(0, 1)))
    assert main(["operator", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert "kopf's peering CRDs are not installed" in err and "Traceback" not in err and err.count("\n") == 1


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
