"""Reading a folder of AdapterPool / LoRADeployment YAML for the local stack, the same files
`kubectl apply -f` takes, validated by the same models (loraplex.spec.crd).

Local mode learns what the operator learns in a cluster: the digest, rank, size and target modules
of each adapter, read from its files, and writes the record the operator writes
(loraplex.pool.records). It can read `file://` sources; a remote source must declare
`adapter.sha256` and `adapter.rank` (the agents still verify the digest when they fetch it). A
`file://` path without a leading '/' (file://adapters/sql) is relative to the YAML file's folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from loraplex.pool.records import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterFacts,
    AdapterFactsError,
    adapter_record,
    check_declared,
    config_facts,
    declared_facts,
)
from loraplex.routing.choice import pool_routing, routing_error
from loraplex.routing.records import AdapterRecord
from loraplex.spec.crd import AdapterPool, AdapterPoolSpec, LoRADeployment, parse_resource
from loraplex.spec.errors import one_line, validation_line

log = logging.getLogger("loraplex.up")


class ManifestError(ValueError):
    """A manifest that cannot be applied; the message names the file and the reason."""


@dataclass
class Manifests:
    pool: AdapterPool | None = None
    deployments: dict[str, tuple[LoRADeployment, Path]] = field(default_factory=dict)  # name -> (obj, file)
    pool_path: Path | None = None  # the file the AdapterPool came from


Resource = AdapterPool | LoRADeployment


class Reporter:
    """Says a file's trouble in one line naming the file, once per change of that file (its size and
    time of change) or of what is wrong with it: a file left as it is never fills the log, and an edit
    that still fails is said again."""

    def __init__(self) -> None:
        self._said: dict[Path, tuple[tuple[int, int] | None, str]] = {}

    def say(self, path: Path, message: str) -> None:
        said = (_stamp_or_none(path), message)
        if self._said.get(path) != said:
            self._said[path] = said
            log.error("not applied: %s", message if str(path) in message else f"{path}: {message}")

    def forget(self, keep: set[Path]) -> None:
        """Forget the files not in `keep` (fixed or removed): a new trouble of theirs is said again."""
        for path in set(self._said) - keep:
            del self._said[path]


def manifest_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml", ".json"))


def folder_fingerprint(folder: Path) -> tuple:
    """Changes whenever a manifest file is added, removed or modified (polled by the local stack)."""
    return tuple(sorted((p.name, *_stamp(p)) for p in manifest_files(folder)))


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


def _stamp_or_none(path: Path) -> tuple[int, int] | None:
    try:
        return _stamp(path)
    except OSError:
        return None


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
        candidate = Manifests(found.pool, dict(found.deployments), found.pool_path)
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
            stamp = _stamp_or_none(path)
            if self._stamps.get(path) == stamp:
                continue
            self._stamps[path] = stamp
            try:
                self._good[path] = parse_file(path)
                self._bad.pop(path, None)
            except Exception as exc:  # noqa: BLE001 - any trouble of one file is that file's, said in one line
                self._bad[path] = file_error(path, exc)
        for gone in set(self._stamps) - set(present):
            for table in (self._stamps, self._good, self._bad):
                table.pop(gone, None)
        manifests, clashes = merge({path: self._good[path] for path in present if path in self._good})
        return manifests, {**self._bad, **clashes}


def file_error(path: Path, exc: BaseException) -> str:
    """One line naming the file: a ManifestError's own line, else the exception's type and first line."""
    if isinstance(exc, ManifestError):
        return str(exc)
    if isinstance(exc, AdapterFactsError):
        return f"{path}: {exc.message}"
    return f"{path}: {type(exc).__name__}: {one_line(exc)}"


def parse_or_explain(obj: object, path: Path) -> AdapterPool | LoRADeployment:
    if not isinstance(obj, dict):
        raise ManifestError(f"{path}: every document must be a mapping")
    try:
        return parse_resource(obj)
    except ValidationError as exc:
        raise ManifestError(f"{path}: {_what(obj)}: {validation_line(exc)}") from None
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}") from None


def _what(obj: dict) -> str:
    name = (obj.get("metadata") or {}).get("name") if isinstance(obj.get("metadata"), dict) else None
    return f"{obj.get('kind')} {name!r}" if name else str(obj.get("kind"))


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
        found.pool, found.pool_path = resource, path
        return
    if name in found.deployments:
        raise ManifestError(f"{path}: LoRADeployment {name!r} is defined twice")
    found.deployments[name] = (resource, path)


def deployment_record(deployment: LoRADeployment, path: Path, pool: AdapterPoolSpec | None) -> AdapterRecord:
    """The registry record of a deployment (the adapter is named by the deployment's name), as the
    operator writes it; ManifestError naming the file when it cannot be made."""
    name, spec = deployment.metadata["name"], deployment.spec.adapter
    source = resolve_source(spec.source, path.parent)
    try:
        if source.startswith("file://"):
            facts = _inspect(Path(source.removeprefix("file://")), path)
            check_declared(spec, facts.rank, facts.digest)
        else:
            facts = declared_facts(spec)
            if facts is None:
                raise ManifestError(f"{path}: local mode reads digests of file:// adapters only; give "
                                    f"adapter.sha256 and adapter.rank for {spec.source}")
        return adapter_record(name, facts, deployment.spec, pool, source)
    except AdapterFactsError as exc:
        raise ManifestError(f"{path}: adapter {name!r}: {exc.message}") from None


def resolve_source(source: str, base: Path) -> str:
    if source.startswith("file://") and not source.startswith("file:///"):
        return "file://" + str((base / source.removeprefix("file://")).resolve())
    return source


def _inspect(folder: Path, manifest: Path) -> AdapterFacts:
    weights, config = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    if not weights.is_file() or not config.is_file():
        raise ManifestError(f"{manifest}: {folder} is not a PEFT adapter folder ({CONFIG_FILE} and "
                            f"{WEIGHTS_FILE} are needed)")
    try:
        facts = config_facts(json.loads(config.read_text()))
    except ValueError as exc:
        raise ManifestError(f"{manifest}: {config}: {one_line(exc)}") from None
    digest = hashlib.sha256()
    with weights.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return facts.with_weights("sha256:" + digest.hexdigest(), weights.stat().st_size)
