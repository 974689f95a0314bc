"""The direction of imports: each top-level package imports only the ones below it, and no two
modules import each other, directly or round a longer circle. Every import counts, the ones inside
functions and under TYPE_CHECKING too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Bottom to top. core: the ScoredGroup contract, the --set grammar, validation messages; storage:
# shards and checkpoints; inference: the policy server and its client; environments: the API and
# the bundled ones (they call the policy); trainer; tasks: single steps for Prefect; flows: the
# pipelines; clotho: the command line; soak: the fault campaign, above everything it drives.
LAYERS = ["core", "storage", "inference", "environments", "trainer", "tasks", "flows", "clotho", "soak"]


def module_files() -> dict[str, Path]:
    modules = {}
    for package in LAYERS:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(path: Path) -> set[str]:
    """Every absolute module name the file imports (for `from a import b`, both a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the clotho modules it imports."""
    modules = module_files()
    return {
        module: {name for name in imported_names(path) if name in modules and name != module}
        for module, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module."""
    import networkx

    found = networkx.strongly_connected_components(networkx.DiGraph([(a, b) for a, bs in graph.items() for b in bs]))
    return sorted(sorted(component) for component in found if len(component) > 1)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    layer = {package: position for position, package in enumerate(LAYERS)}
    return [
        f"{module} imports {name}, a package above it"
        for module, names in sorted(graph.items())
        for name in sorted(names)
        if layer[name.split(".")[0]] > layer[module.split(".")[0]]
    ]


def test_no_package_imports_one_above_it():
    upward = upward_imports(import_graph())
    assert not upward, "imports must point down " + " < ".join(LAYERS) + ":\n" + "\n".join(upward)


def test_no_modules_import_each_other():
    assert circles(import_graph()) == []


def test_the_checks_see_an_upward_import_and_a_circle():
    graph = {
        "core.a": {"storage.b"},
        "storage.b": {"storage.c", "core.a"},
        "storage.c": {"storage.b"},
        "flows.d": {"core.a"},
    }
    assert upward_imports(graph) == ["core.a imports storage.b, a package above it"]
    assert circles(graph) == [["core.a", "storage.b", "storage.c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_shipped_code_and_the_tools_import_no_tests():
    """The packages, the benches, the soak and the cluster's helpers are run without tests/ (a wheel
    has none): what they share with the tests lives in clotho.testing."""
    files = [path for package in [*LAYERS, "bench", "cluster"] for path in (REPO / package).rglob("*.py")]
    found = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in files
        for name in sorted(imported_names(path))
        if name == "tests" or name.startswith("tests.")
    ]
    assert not found, "\n".join(found)
