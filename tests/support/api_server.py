"""The API server's handling of our CRDs and custom resources, without an API server (used by
tests/k8s through its conftest). Each step mirrors k8s.io/apiextensions-apiserver (pkg/apiserver/schema):

- `api_server_errors(obj, old=None)`, a create (or an update from `old`) as `kubectl apply` sends it:
  pruning of unknown fields (pruning/algorithm.go; kubectl's strict field validation makes each one an
  error), removal of non-nullable nulls (defaulting/prunenulls.go), defaulting (defaulting/algorithm.go:
  a missing field gets its default, then the defaults below it), metadata.name as a DNS-1123 subdomain
  (registry/customresource/validator.go), the openAPIV3Schema (jsonschema Draft 4: OpenAPI 3.0 has its
  boolean `exclusiveMinimum`), then, when the schema passes, every `x-kubernetes-validations` rule with
  a real CEL interpreter (`cel` package), `self` typed by the schema (a `number` is a double) and bound
  to the value at the rule's node, the root rules seeing the whole object. A missing key is an error, as
  on the server; rules on `oldSelf` run for updates only.
- `default_errors(schema)`, what the server checks on each `default` when the CRD is created
  (defaulting/validation.go): the literal as it is, nested defaults NOT applied, must be pruned, must
  match the schema of its node, and must pass every rule of that node and below.
- `structural_errors(schema)`: the structural-schema rules the server enforces on a CRD (schema/
  validation.go, apis/apiextensions/validation/validation.go) that our generator could break, and that
  every rule reads only fields its node declares (the server compiles rules against the schema).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_META_FIELDS = ("apiVersion", "kind", "metadata")
# What a root rule may read of the object's metadata (cel/model/schemas.go WithTypeAndObjectMeta).
_ROOT_METADATA = ("name", "generateName")


def crd_documents(directory: Path = ROOT / "crds") -> list[dict[str, Any]]:
    """Every CRD in the YAML files of `directory` (a file may hold several)."""
    return [doc for path in sorted(directory.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
            if doc is not None]


@functools.lru_cache
def _crd_text(kind: str) -> str:
    return json.dumps(next(d for d in crd_documents() if d["spec"]["names"]["kind"] == kind))


def load_crd(kind: str) -> dict[str, Any]:
    """The CRD of `kind` in crds/ (a fresh copy: callers may change it)."""
    return json.loads(_crd_text(kind))


def schema_of(kind: str) -> dict[str, Any]:
    return load_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _join(path: str, key: object) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)


# ---------------------------------------------------------------------------------------------------
# Pruning, null removal, defaulting


def prune(value: Any, schema: dict[str, Any] | None, root: bool = False, path: str = "") -> list[str]:
    """Drop the fields the schema does not know (in place); their paths. At the root, apiVersion, kind
    and metadata are the server's own."""
    if schema is not None and schema.get("x-kubernetes-preserve-unknown-fields"):
        return _skip_prune(value, schema, root, path)
    unknown: list[str] = []
    if isinstance(value, dict):
        for key in list(value):
            if root and key in _META_FIELDS:
                continue
            sub = None if schema is None else schema.get("properties", {}).get(key)
            if sub is None and isinstance((schema or {}).get("additionalProperties"), dict):
                sub = schema["additionalProperties"]  # type: ignore[index]
            if sub is not None:
                unknown += prune(value[key], sub, path=_join(path, key))
            else:
                unknown.append(_join(path, key))
                del value[key]
    elif isinstance(value, list):
        for i, item in enumerate(value):
            unknown += prune(item, None if schema is None else schema.get("items"), path=_join(path, i))
    return unknown


def _skip_prune(value: Any, schema: dict[str, Any], root: bool, path: str) -> list[str]:
    unknown: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if root and key in _META_FIELDS:
                continue
            sub = schema.get("properties", {}).get(key)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is not None:
                unknown += prune(item, sub, path=_join(path, key))
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            unknown += _skip_prune(item, schema["items"], False, _join(path, i))
    return unknown


def _sub_schema(schema: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    if schema is None:
        return None
    sub = schema.get("properties", {}).get(key)
    if sub is None and isinstance(schema.get("additionalProperties"), dict):
        return schema["additionalProperties"]
    return sub


def prune_nulls(value: Any, schema: dict[str, Any] | None) -> None:
    """Remove nulls of non-nullable fields that have no default (those get the default)."""
    if isinstance(value, dict):
        for key in list(value):
            sub = _sub_schema(schema, key)
            if value[key] is None and sub is not None and not sub.get("nullable") and "default" not in sub:
                del value[key]
            else:
                prune_nulls(value[key], sub)
    elif isinstance(value, list):
        for item in value:
            prune_nulls(item, None if schema is None else schema.get("items"))


def _non_nullable_null(value: Any, schema: dict[str, Any] | None) -> bool:
    return value is None and schema is not None and not schema.get("nullable")


def default(value: Any, schema: dict[str, Any] | None) -> Any:
    """defaulting/algorithm.go: a missing (or non-nullable null) field gets a copy of its default, then
    every field present, defaulted or not, gets the defaults below it. In place; returns `value`."""
    if schema is None:
        return value
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if "default" in sub and (key not in value or _non_nullable_null(value[key], sub)):
                value[key] = copy.deepcopy(sub["default"])
        extra = schema.get("additionalProperties")
        for key in value:
            if key in schema.get("properties", {}):
                default(value[key], schema["properties"][key])
            elif isinstance(extra, dict):
                if _non_nullable_null(value[key], extra) and "default" in extra:
                    value[key] = copy.deepcopy(extra["default"])
                default(value[key], extra)
    elif isinstance(value, list):
        items = schema.get("items")
        for i in range(len(value)):
            if items is not None and _non_nullable_null(value[i], items) and "default" in items:
                value[i] = copy.deepcopy(items["default"])
            default(value[i], items)
    return value


# ---------------------------------------------------------------------------------------------------
# Validation: openAPIV3Schema, CEL


def openapi_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)  # x-kubernetes-* and `default` are not Draft 4 keywords
    return [f"{'.'.join(map(str, e.absolute_path)) or '<value>'}: {e.message}" for e in validator.iter_errors(value)]


def _cel_value(value: Any, schema: dict[str, Any] | None) -> Any:
    """The value as CEL sees it: typed by the schema (a `number` is a double even when written 2)."""
    if schema is None:
        return value
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        return {k: _cel_value(v, _sub_schema(schema, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_cel_value(v, schema.get("items")) for v in value]
    return value


def cel_errors(schema: dict[str, Any], value: Any, old: Any = None, path: str = "") -> list[str]:
    """Every rule at this node and below, on `value` as it is. A failing rule gives its message; a rule
    that cannot be evaluated (a missing key, a type error) gives the interpreter's error."""
    import cel

    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        uses_old = "oldSelf" in rule["rule"]
        if uses_old and old is None:
            continue  # transition rules apply to updates only
        context = {"self": _cel_value(value, schema)}
        if uses_old:
            context["oldSelf"] = _cel_value(old, schema)
        try:
            result = cel.evaluate(rule["rule"], context)
        except Exception as exc:  # noqa: BLE001 - the interpreter's own error types
            where = f"{path}: " if path else ""
            errors.append(f"{where}{type(exc).__name__}: {exc} evaluating rule: {rule['rule']}")
            continue
        if result is not True:
            errors.append(rule["message"])
    if isinstance(value, dict):
        for key, item in value.items():
            sub = _sub_schema(schema, key)
            if sub is not None:
                errors += cel_errors(sub, item, old.get(key) if isinstance(old, dict) else None, _join(path, key))
    elif isinstance(value, list) and "items" in schema:
        errors += [e for i, v in enumerate(value) for e in cel_errors(schema["items"], v, path=_join(path, i))]
    return errors


def _metadata_errors(obj: dict[str, Any]) -> list[str]:
    name = (obj.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        return ["metadata.name: Required value"]
    if len(name) > 253 or not _SUBDOMAIN.fullmatch(name):
        return [f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain"]
    return []


def api_server_errors(obj: dict[str, Any], old: dict[str, Any] | None = None,
                      schema: dict[str, Any] | None = None) -> list[str]:
    """Messages the API server would answer with; [] when it accepts (and defaults) the object.
    `schema`: the openAPIV3Schema to check against; default: our CRD of the object's kind."""
    schema = schema or schema_of(obj.get("kind", ""))
    obj, unknown = decode(obj, schema)
    errors = [f"unknown field {path!r}" for path in unknown]
    errors += _metadata_errors(obj) + openapi_errors(obj, schema)
    if errors:
        return errors
    return cel_errors(schema, obj, None if old is None else decode(old, schema)[0])


def decode(obj: dict[str, Any], schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of `obj` as the server decodes a request: pruned, without nulls, defaulted; and the paths
    of the unknown fields it pruned."""
    obj = copy.deepcopy(obj)
    unknown = prune(obj, schema, root=True)
    prune_nulls(obj, schema)
    return default(obj, schema), unknown


# ---------------------------------------------------------------------------------------------------
# The CRD itself: defaults and structural rules


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node with its path (properties, items, additionalProperties)."""
    out = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        out += walk(sub, _join(path, name))
    if isinstance(schema.get("items"), dict):
        out += walk(schema["items"], f"{path}[*]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += walk(schema["additionalProperties"], f"{path}[key]")
    return out


def default_errors(schema: dict[str, Any]) -> list[str]:
    """defaulting/validation.go ValidateDefaults: each default as it stands, pruned, valid against its
    node's schema and passing every rule of the node and below. (No default lies inside metadata.)"""
    errors = []
    for path, node in walk(schema):
        if "default" not in node:
            continue
        literal = node["default"]
        pruned = copy.deepcopy(literal)
        prune(pruned, node)
        if pruned != literal:
            errors.append(f"{path}.default: must not have unknown fields")
            continue
        found = openapi_errors(literal, node) or cel_errors(node, literal)
        errors += [f"{path}.default: {e}" for e in found]
    return errors


_INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
_TYPES = {"array", "boolean", "integer", "number", "object", "string"}
_FORBIDDEN = ("$ref", "const", "title", "definitions", "patternProperties", "additionalItems", "id", "dependencies")
_RULE_PATH = re.compile(r"\b(?:self|oldSelf)((?:\.[A-Za-z_][A-Za-z0-9_]*)+)(\s*\()?")


def structural_errors(schema: dict[str, Any]) -> list[str]:
    errors = []
    if schema.get("type") != "object":
        errors.append("<root>.type: must be object at the root")
    if "additionalProperties" in schema:
        errors.append("<root>.additionalProperties: must not be used at the root")
    metadata = schema.get("properties", {}).get("metadata", {"type": "object"})
    if metadata.get("type") != "object" or set(metadata) - {"type", "properties"} or \
            set(metadata.get("properties", {})) - set(_ROOT_METADATA):
        errors.append("metadata: must not specify anything other than name and generateName")
    for path, node in walk(schema):
        where = path or "<root>"
        errors += [f"{where}: {key} is not allowed" for key in _FORBIDDEN if key in node]
        if node.get("type") is not None and node["type"] not in _TYPES:
            errors.append(f"{where}.type: {node['type']} is not supported")
        if "type" not in node and not node.get("x-kubernetes-int-or-string") \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            errors.append(f"{where}.type: must not be empty")
        if node.get("type") == "array" and "items" not in node:
            errors.append(f"{where}.items: must be specified")
        extra = node.get("additionalProperties")
        if extra is not None and (extra is False or (node.get("properties") and isinstance(extra, dict))):
            errors.append(f"{where}.additionalProperties: additionalProperties and properties are mutual exclusive")
        if "anyOf" in node and (node["anyOf"] != _INT_OR_STRING or not node.get("x-kubernetes-int-or-string")):
            errors.append(f"{where}.anyOf: only the int-or-string pattern is structural")
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node and (node[key] is not True or key.replace("exclusiveM", "m") not in node):
                errors.append(f"{where}.{key}: must be true next to {key.replace('exclusiveM', 'm')}")
        if node.get("uniqueItems"):
            errors.append(f"{where}.uniqueItems: cannot be set to true")
        if node.get("x-kubernetes-list-type") == "map":
            items = node.get("items", {})
            for key in node.get("x-kubernetes-list-map-keys", []):
                if key not in items.get("required", []) and "default" not in items.get("properties", {}).get(key, {}):
                    errors.append(f"{where}: list-map key {key} must be required or have a default")
        for rule in node.get("x-kubernetes-validations", []):
            errors += _undeclared_fields(rule["rule"], node, root=not path, where=where)
    return errors


def _undeclared_fields(rule: str, node: dict[str, Any], root: bool, where: str) -> list[str]:
    """Fields a rule reads that its node does not declare: the server's CEL compiler refuses them."""
    errors = []
    for match in _RULE_PATH.finditer(rule):
        names = match.group(1).split(".")[1:]
        if match.group(2):  # `self.source.startsWith(...)`: the last name is a method
            names = names[:-1]
        current: dict[str, Any] | None = node
        for i, name in enumerate(names):
            if root and i == 1 and names[0] == "metadata":
                if name not in _ROOT_METADATA:
                    errors.append(f"{where}: rule {rule!r} reads metadata.{name}; only name and generateName exist")
                break
            properties = (current or {}).get("properties")
            if properties is None:
                break  # a map or free-form object: not checked here
            if name not in properties and not (root and name in _META_FIELDS):
                errors.append(f"{where}: rule {rule!r} reads {name!r}, which is not declared")
                break
            current = properties.get(name)
    return errors


# ---------------------------------------------------------------------------------------------------
# The resources the docs show


def _has_placeholder(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_placeholder(k) or _has_placeholder(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_placeholder(v) for v in value)
    return isinstance(value, str) and value.strip() in ("...", "…")


def documented_resources() -> dict[str, dict[str, Any]]:
    """Every whole AdapterPool and LoRADeployment in examples/**/*.yaml and in the fenced YAML blocks of
    README.md and docs/*.md, by "file#n". Fragments (no apiVersion/kind/metadata.name/spec), blocks
    that are not YAML, and objects with `{...}` / `[...]` placeholders are left out."""
    found: dict[str, dict[str, Any]] = {}
    sources = [(p, p.read_text()) for p in sorted((ROOT / "examples").rglob("*.yaml"))]
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"^[ \t]*```ya?ml[^\n]*\n(.*?)^[ \t]*```", doc.read_text(), re.S | re.M)
        sources += [(doc, block) for block in blocks]
    for path, text in sources:
        try:
            objects = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError:
            continue
        for obj in objects:
            if not isinstance(obj, dict) or obj.get("kind") not in ("AdapterPool", "LoRADeployment") \
                    or not {"apiVersion", "metadata", "spec"} <= set(obj) or _has_placeholder(obj):
                continue
            key = str(path.relative_to(ROOT))
            found[f"{key}#{sum(k.startswith(key + '#') for k in found) + 1}"] = obj
    return found
