"""Reading a folder of AdapterPool / LoRADeployment YAML for the local stack, the same files
`kubectl apply -f` takes, validated by the same models (loraplex.spec.crd).

Local mode resolves what the operator resolves in a cluster: the digest, rank and size of each
adapter, read from its files. It can do that for `file://` sources; a remote source must declare
`adapter.sha256` and `adapter.rank` (the agents still verify the digest when they fetch it). A
`file://` path without a leading '/' (file://adapters/sql) is relative to the YAML file's folder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from loraplex.routing.records import AdapterRecord
from loraplex.spec.crd import AdapterPool, LoRADeployment, parse_resource

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


class ManifestError(ValueError):
    """A manifest that cannot be applied; the message names the file and the reason."""


@dataclass
class Manifests:
    pool: AdapterPool | None = None
    deployments: dict[str, tuple[LoRADeployment, Path]] = field(default_factory=dict)  # name -> (obj, file)


def read_folder(folder: Path) -> Manifests:
    """Every *.yaml / *.yml / *.json file in `folder` (not recursive), in name order."""
    if not folder.is_dir():
        raise ManifestError(f"{folder} is not a folder")
    found = Manifests()
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml", ".json")):
        for obj in _documents(path):
            _add(found, parse_or_explain(obj, path), path)
    return found


def folder_fingerprint(folder: Path) -> tuple:
    """Changes whenever a manifest file is added, removed or modified (polled by the local stack)."""
    return tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir()
                        if p.suffix in (".yaml", ".yml", ".json")))


def parse_or_explain(obj: object, path: Path) -> AdapterPool | LoRADeployment:
    if not isinstance(obj, dict):
        raise ManifestError(f"{path}: every document must be a mapping")
    try:
        return parse_resource(obj)
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}") from exc


def _documents(path: Path) -> list[object]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise ManifestError(f"{path}: {exc}") from exc


def _add(found: Manifests, resource: AdapterPool | LoRADeployment, path: Path) -> None:
    name = resource.metadata.get("name")
    if not name:
        raise ManifestError(f"{path}: {resource.kind} has no metadata.name")
    if isinstance(resource, AdapterPool):
        if found.pool is not None and found.pool.metadata["name"] != name:
            raise ManifestError(f"{path}: a second AdapterPool {name!r}; the local stack runs one pool")
        found.pool = resource
        return
    if name in found.deployments:
        raise ManifestError(f"{path}: LoRADeployment {name!r} is defined twice")
    found.deployments[name] = (resource, path)


def adapter_record(deployment: LoRADeployment, path: Path) -> AdapterRecord:
    """The registry record of a deployment (the adapter is named by the deployment's name)."""
    name, spec = deployment.metadata["name"], deployment.spec.adapter
    source = resolve_source(spec.source, path.parent)
    if source.startswith("file://"):
        digest, rank, size = _inspect(Path(source.removeprefix("file://")), path)
        if spec.sha256 and f"sha256:{spec.sha256}" != digest:
            raise ManifestError(f"{path}: adapter {name!r} has digest {digest}, not the declared sha256")
        if spec.rank and spec.rank != rank:
            raise ManifestError(f"{path}: adapter {name!r} has rank {rank}, not the declared {spec.rank}")
    elif spec.sha256 and spec.rank:
        digest, rank, size = f"sha256:{spec.sha256}", spec.rank, 0
    else:
        raise ManifestError(f"{path}: local mode reads digests of file:// adapters only; give adapter.sha256 "
                            f"and adapter.rank for {spec.source}")
    return AdapterRecord(name=name, digest=digest, rank=rank, size_bytes=size, source=source,
                         expected_tps=deployment.spec.traffic.expected_tokens_per_second).validate()


def resolve_source(source: str, base: Path) -> str:
    if source.startswith("file://") and not source.startswith("file:///"):
        return "file://" + str((base / source.removeprefix("file://")).resolve())
    return source


def _inspect(folder: Path, manifest: Path) -> tuple[str, int, int]:
    weights, config = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    if not weights.is_file() or not config.is_file():
        raise ManifestError(f"{manifest}: {folder} is not a PEFT adapter folder ({CONFIG_FILE} and "
                            f"{WEIGHTS_FILE} are needed)")
    try:
        rank = int(json.loads(config.read_text())["r"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"{manifest}: {config} has no valid rank 'r': {exc}") from exc
    digest = hashlib.sha256()
    with weights.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest(), rank, weights.stat().st_size
