"""The import rules of DESIGN §2, enforced by import-linter's contracts in pyproject.toml."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    """lint-imports, run by this interpreter: the packages it sees are the ones under test (a copied
    virtual environment's `lint-imports` script may name another interpreter)."""
    pytest.importorskip("importlinter", reason="import-linter is not installed (scripts/setup.sh --dev)")
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    result = subprocess.run([sys.executable, "-c", command, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_component_folders_are_source_roots():
    for root in ("operator", "router", "local", "node_agent", "kernels", "bench"):
        assert not (ROOT / root / "__init__.py").exists(), f"{root}/ must not be a package"


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert ruff, "ruff is not installed (scripts/setup.sh --dev)"
    result = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# import-linter cannot see a module named in a string: these rules are checked on the source.
RUNTIME = {"loraplex": ROOT / "loraplex", "loraplex_agent": ROOT / "node_agent" / "loraplex_agent",
           "loraplex_router": ROOT / "router" / "loraplex_router",
           "loraplex_operator": ROOT / "operator" / "loraplex_operator",
           "loraplex_local": ROOT / "local" / "loraplex_local",
           "loraplex_kernels": ROOT / "kernels" / "loraplex_kernels"}
SERVICES = {"loraplex_agent", "loraplex_router", "loraplex_operator", "loraplex_local"}
DYNAMIC_IMPORTS = {"import_module", "__import__", "find_spec"}


def forbidden_for(package: str) -> set[str]:
    """The core reaches no component; a component reaches no other service; nothing reaches bench."""
    if package == "loraplex":
        return set(RUNTIME) - {"loraplex"} | {"loraplex_bench"}
    return (SERVICES - {package}) | {"loraplex_bench"}


def dynamic_imports(path: Path) -> list[str]:
    """Module names given as string literals to importlib.import_module, __import__ or find_spec."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        first = node.args[0]
        if isinstance(first, ast.JoinedStr) and first.values:
            first = first.values[0]
        if called in DYNAMIC_IMPORTS and isinstance(first, ast.Constant) and isinstance(first.value, str):
            names.append(first.value)
    return names


def test_no_runtime_package_imports_a_forbidden_package_by_name():
    offences = [f"{path.relative_to(ROOT)}: {name}"
                for package, folder in RUNTIME.items() for path in sorted(folder.rglob("*.py"))
                for name in dynamic_imports(path)
                if name.split(".")[0] in forbidden_for(package)]
    assert offences == []


def test_the_dynamic_import_check_sees_importlib_and_dunder_import(tmp_path):
    source = tmp_path / "sneaky.py"
    source.write_text("import importlib\nimportlib.import_module('loraplex_agent.bench')\n"
                      "__import__(f'loraplex_bench.{1}')\n")
    assert dynamic_imports(source) == ["loraplex_agent.bench", "loraplex_bench."]


def import_circles(graph: grimp.ImportGraph) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[set[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                members: set[str] = set()
                while module not in members:
                    members.add(stack.pop())
                if len(members) > 1:
                    circles.append(members)
    return circles


def test_no_import_circle_spans_more_than_a_file_pair():
    packages = ("loraplex", "loraplex_agent", "loraplex_router", "loraplex_operator", "loraplex_local",
                "loraplex_kernels", "loraplex_bench")
    circles = import_circles(grimp.build_graph(*packages, cache_dir=None))
    assert [sorted(c) for c in circles if len(c) > 2] == []


def test_the_circle_finder_finds_a_circle_of_three():
    graph = grimp.ImportGraph()
    for importer, imported in (("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")):
        graph.add_import(importer=importer, imported=imported)
    assert import_circles(graph) == [{"a", "b", "c"}]
