"""The operator's subcommands: `loraplex operator` and `loraplex crds generate`. Arguments are
declared here; kopf and the Kubernetes client are imported only when the operator runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from loraplex.cli import CommandRegistry
from loraplex.spec.errors import CommandError

DEFAULT_CRD_DIRS = ("crds", "helm/loraplex/files/crds")


def register(registry: CommandRegistry) -> None:
    registry.add("operator", "Run the Kubernetes operator (AdapterPool and LoRADeployment)", _operator_args,
                 _run_operator)
    registry.add("crds generate", "Write the CustomResourceDefinitions generated from loraplex.spec.crd",
                 _crds_args, _run_crds)


def _operator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", action="append", default=None, metavar="NS",
                   help="watch this namespace (repeatable); default: all namespaces")
    p.add_argument("--redis-url", default=None, help="routing store; default: $LORAPLEX_REDIS_URL")
    p.add_argument("--peering", default=None, help="kopf peering object used for leader election "
                   "(default: $LORAPLEX_PEERING or 'loraplex')")
    p.add_argument("--priority", type=int, default=None, help="peering priority; default: random")
    p.add_argument("--standalone", action="store_true", help="no peering (a single replica only)")
    p.add_argument("--liveness", default="http://127.0.0.1:8080/healthz",
                   help="liveness endpoint URL (the Helm chart binds 0.0.0.0 in the pod)")
    p.add_argument("--log-level", default="info")


def _run_operator(args: argparse.Namespace) -> int:
    from loraplex_operator import main

    return main.run(args)


def _crds_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", action="append", default=None, metavar="DIR",
                   help=f"output folder (repeatable); default: {' and '.join(DEFAULT_CRD_DIRS)}")
    p.add_argument("--check", action="store_true", help="write nothing; fail if a file is out of date")


def _run_crds(args: argparse.Namespace) -> int:
    from loraplex.spec.crd_schema import stale_crds, write_crds

    dirs = [Path(d) for d in (args.out or DEFAULT_CRD_DIRS)]
    if args.check:
        stale = [p for d in dirs for p in stale_crds(d)]
        if stale:
            raise CommandError("out of date: " + ", ".join(map(str, stale)) + " (run `loraplex crds generate`)")
        print("CRDs are up to date")
        return 0
    for d in dirs:
        for path in write_crds(d):
            print(f"wrote {path}")
    return 0
