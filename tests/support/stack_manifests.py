"""AdapterPool and LoRADeployment YAML for the local stacks (`loraplex up -f`) of the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

TINY_ENGINE = "{maxLoraRank: 64, maxLoras: 4, maxNumSeqs: 8, maxModelLen: 256}"
PLACEMENT = "{policy: loraserve, intervalSeconds: 30}"  # long: the tests see placements they cause


def pool_yaml(name: str, base: Path, engine: str = TINY_ENGINE, placement: str = PLACEMENT) -> str:
    """An AdapterPool serving the tiny model in `base` as tiny-llama (float32: the CPU's dtype)."""
    return (f"apiVersion: loraplex.io/v1alpha1\nkind: AdapterPool\nmetadata: {{name: {name}}}\nspec:\n"
            f"  baseModel: {{name: tiny-llama, source: \"file://{base}\", dtype: float32}}\n"
            f"  engine: {engine}\n  placement: {placement}\n")


def deployment_yaml(name: str, source: Path, pool: str, replicas: str = "") -> str:
    """A LoRADeployment of the adapter folder `source`; `replicas` such as "{min: 3}"."""
    return (f"apiVersion: loraplex.io/v1alpha1\nkind: LoRADeployment\nmetadata: {{name: {name}}}\n"
            f"spec:\n  pool: {pool}\n  adapter: {{source: \"file://{source}\"}}\n"
            + (f"  replicas: {replicas}\n" if replicas else ""))
