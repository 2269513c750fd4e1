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
from pydantic import ValidationError

from loraplex.routing.choice import pool_routing, routing_error
from loraplex.routing.records import AdapterRecord
from loraplex.spec.crd import AdapterPool, LoRADeployment, parse_resource
from loraplex.spec.errors import one_line

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


class ManifestError(ValueError):
    """A manifest that cannot be applied; the message names the file and the reason."""


@dataclass
class Manifests:
    pool: AdapterPool | None = None
    deployments: dict[str, tuple[LoRADeployment, Path]] = field(default_factory=dict)  # name -> (obj, file)


Resource = AdapterPool | LoRADeployment


def read_folder(folder: Path) -> Manifests:
    """Every *.yaml / *.yml / *.json file in `folder` (not recursive), in name order; ManifestError
    for the first bad file (the local stack reads a folder file by file instead: ManifestFolder)."""
    if not folder.is_dir():
        raise ManifestError(f"{folder} is not a folder")
    manifests, errors = merge({path: parse_file(path) for path in manifest_files(folder)})
    if errors:
        raise ManifestError(next(iter(errors.values())))
    return manifests


def manifest_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml", ".json"))


def folder_fingerprint(folder: Path) -> tuple:
    """Changes whenever a manifest file is added, removed or modified (polled by the local stack)."""
    return tuple(sorted((p.name, *_stamp(p)) for p in manifest_files(folder)))


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


def parse_file(path: Path) -> list[Resource]:
    """The resources of one file; ManifestError, one line naming the file and the field, if any is bad."""
    resources = [parse_or_explain(obj, path) for obj in _documents(path)]
    for resource in resources:
        name = resource.metadata.get("name")
        if not name:
            raise ManifestError(f"{path}: {resource.kind} has no metadata.name")
        error = routing_error(pool_routing(resource.spec)) if isinstance(resource, AdapterPool) else ""
        if error:  # the router would refuse it: say so here
            raise ManifestError(f"{path}: AdapterPool {name!r}: routing: {error}")
    return resources


def merge(files: dict[Path, list[Resource]]) -> tuple[Manifests, dict[Path, str]]:
    """The resources of every file, in the files' order. A file that clashes with an earlier one (a
    second AdapterPool, a LoRADeployment defined twice) is left out whole: {file: why}."""
    found, errors = Manifests(), {}
    for path, resources in files.items():
        candidate = Manifests(found.pool, dict(found.deployments))
        try:
            for resource in resources:
                _add(candidate, resource, path)
        except ManifestError as exc:
            errors[path] = str(exc)
            continue
        found = candidate
    return found, errors


class ManifestFolder:
    """The -f folder read file by file, so that one bad file holds up no other: a file that fails to
    parse is left out (its last good version stays applied) and listed in `errors`, one line each."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._stamps: dict[Path, tuple[int, int]] = {}
        self._good: dict[Path, list[Resource]] = {}
        self._bad: dict[Path, str] = {}

    def read(self) -> tuple[Manifests, dict[Path, str]]:
        """The manifests of the good files, and {file: one-line error} for the others (re-reading only changed files)."""
        present = manifest_files(self.folder)
        for path in present:
            stamp = _stamp(path)
            if self._stamps.get(path) == stamp:
                continue
            self._stamps[path] = stamp
            try:
                self._good[path] = parse_file(path)
                self._bad.pop(path, None)
            except ManifestError as exc:
                self._bad[path] = str(exc)
        for gone in set(self._stamps) - set(present):
            for table in (self._stamps, self._good, self._bad):
                table.pop(gone, None)
        manifests, clashes = merge({path: self._good[path] for path in present if path in self._good})
        return manifests, {**self._bad, **clashes}


def parse_or_explain(obj: object, path: Path) -> AdapterPool | LoRADeployment:
    if not isinstance(obj, dict):
        raise ManifestError(f"{path}: every document must be a mapping")
    try:
        return parse_resource(obj)
    except ValidationError as exc:
        raise ManifestError(f"{path}: {_what(obj)}: {_first_error(exc)}") from None
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}") from None


def _what(obj: dict) -> str:
    name = (obj.get("metadata") or {}).get("name") if isinstance(obj.get("metadata"), dict) else None
    return f"{obj.get('kind')} {name!r}" if name else str(obj.get("kind"))


def _first_error(exc: ValidationError) -> str:
    """pydantic's block as one line: the field's path, what is wrong, and how many more there are."""
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "the document"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}"


def _documents(path: Path) -> list[object]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise ManifestError(f"{path}: {one_line(exc)}") from exc


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
    invocation: tuple[int, ...] = ()
    if source.startswith("file://"):
        digest, rank, size, invocation = _inspect(Path(source.removeprefix("file://")), path)
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
                         expected_tps=deployment.spec.traffic.expected_tokens_per_second,
                         invocation_tokens=invocation).validate()


def resolve_source(source: str, base: Path) -> str:
    if source.startswith("file://") and not source.startswith("file:///"):
        return "file://" + str((base / source.removeprefix("file://")).resolve())
    return source


def _inspect(folder: Path, manifest: Path) -> tuple[str, int, int, tuple[int, ...]]:
    """Digest, rank, size and activated-LoRA invocation (empty for a standard LoRA) of a folder."""
    weights, config = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    if not weights.is_file() or not config.is_file():
        raise ManifestError(f"{manifest}: {folder} is not a PEFT adapter folder ({CONFIG_FILE} and "
                            f"{WEIGHTS_FILE} are needed)")
    try:
        doc = json.loads(config.read_text())
        rank = int(doc["r"])
        invocation = tuple(int(t) for t in doc.get("alora_invocation_tokens") or ())
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"{manifest}: {config} has no valid rank 'r' or alora_invocation_tokens: {exc}") from exc
    digest = hashlib.sha256()
    with weights.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest(), rank, weights.stat().st_size, invocation
