"""The Gateway API Inference Extension's InferencePool CRD on a real API server (KUBECONFIG set), for
the tests that create InferencePools there: the tests' CRD (tests/k8s/fixtures, written from GIE's
published v1 fields) is installed unless one is there already. A CRD the tests did not install (GIE's
own, on a cluster that has it) is used as it is, never replaced."""

from __future__ import annotations

from pathlib import Path

from kube import get_json, kubectl

CRD = "inferencepools.inference.networking.k8s.io"
FIXTURE = Path(__file__).resolve().parents[1] / "k8s" / "fixtures" / f"{CRD}.yaml"
FIXTURE_LABEL = "loraplex.io/test-fixture"


def ensure_inference_pool_crd() -> str:
    """Makes the InferencePool kind known to the API server; returns whose CRD serves it: "fixture"
    (the tests' own, applied again so that it follows the file) or "installed" (one found there)."""
    existing = get_json("crd", CRD)
    if existing and FIXTURE_LABEL not in existing["metadata"].get("labels", {}):
        return "installed"
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=loraplex-tests", "-f", str(FIXTURE))
    kubectl("label", "--overwrite", "crd", CRD, f"{FIXTURE_LABEL}=true")
    kubectl("wait", "--for=condition=Established", f"crd/{CRD}", "--timeout=60s")
    return "fixture"
