"""The test tree's own rules, read from the source with `ast`: test modules import shared helpers
from `tests/support/` only (never another test module), and the tests and the benchmarks do not
import each other (a test may run a benchmark script as a subprocess, as tests/bench/ does).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
BENCH = ROOT / "bench"
HELPERS = "support"  # the one package of the test tree that modules may import


def imported_names(source: str) -> set[str]:
    """Top-level names of the absolute imports in `source` (`a` for `import a.b`, `from a.b`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def sys_path_edits(source: str) -> list[str]:
    """The source of every `sys.path.<method>(...)` call in `source`."""
    edits = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and ast.unparse(node.func.value) == "sys.path"
        ):
            edits.append(ast.unparse(node))
    return edits


def module_names(folder: Path) -> set[str]:
    """What an import of `folder`'s files or folders would be called at top level."""
    return {p.stem for p in folder.rglob("*.py")} | {
        p.name for p in folder.rglob("*") if p.is_dir() and p.name != "__pycache__"
    }


def sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_modules_under_tests_import_no_test_module() -> None:
    local = module_names(TESTS) - {HELPERS}
    wrong = {
        str(path.relative_to(ROOT)): sorted(imported_names(path.read_text()) & local)
        for path in sources(TESTS)
    }
    wrong = {path: names for path, names in wrong.items() if names}
    assert not wrong, f"import these from tests/{HELPERS}/ instead: {wrong}"


def test_tests_do_not_import_the_benchmarks() -> None:
    bench = module_names(BENCH) | {"bench"}
    wrong = {}
    for path in sources(TESTS):
        source = path.read_text()
        found = sorted(imported_names(source) & bench) + sys_path_edits(source)
        if found:
            wrong[str(path.relative_to(ROOT))] = found
    assert not wrong, f"tests importing bench/ modules or editing sys.path: {wrong}"


def test_benchmarks_do_not_import_the_tests() -> None:
    tests = {p.stem for p in TESTS.rglob("*.py")} | {"tests", HELPERS}
    wrong = {}
    for path in sources(BENCH):
        source = path.read_text()
        found = sorted(imported_names(source) & tests)
        found += [edit for edit in sys_path_edits(source) if "tests" in edit]
        if found:
            wrong[str(path.relative_to(ROOT))] = found
    assert not wrong, f"bench/ modules importing the tests: {wrong}"


def test_test_module_names_are_unique_across_folders() -> None:
    """pytest imports a test file of a folder without `__init__.py` by its bare name (the default
    `prepend` import mode): two files of one name in two folders would collide."""
    seen: dict[str, list[str]] = {}
    for path in sources(TESTS):
        if path.name != "conftest.py" and path.parent.name != HELPERS:
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    duplicates = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not duplicates, f"rename one of each: {duplicates}"


@pytest.mark.parametrize(
    ("source", "names"),
    [
        ("import test_engine", {"test_engine"}),
        ("import test_engine_faults as faults", {"test_engine_faults"}),
        ("from test_server_support import send", {"test_server_support"}),
        ("from support.engine import options\nfrom . import sibling", {"support"}),
        ("def f():\n    from common import PROMPTS", {"common"}),
    ],
    ids=["import", "import-as", "from-import", "relative-import-skipped", "inside-a-function"],
)
def test_imported_names_finds_every_absolute_import(source: str, names: set[str]) -> None:
    assert imported_names(source) == names


def test_sys_path_edits_are_found() -> None:
    source = 'import sys\nsys.path.insert(0, str(ROOT / "bench"))\nprint(sys.path)'
    assert sys_path_edits(source) == ["sys.path.insert(0, str(ROOT / 'bench'))"]


def test_bench_scripts_import_each_other_without_a_circle() -> None:
    """The benchmark scripts are a flat folder of modules (not a package, so import-linter does
    not see them): no chain of their imports leads back to where it started."""
    scripts = {path.stem: path for path in BENCH.glob("*.py")}
    graph = {
        name: sorted(imported_names(path.read_text()) & set(scripts) - {name})
        for name, path in scripts.items()
    }

    def circle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            name, path = stack.pop()
            for imported in graph[name]:
                if imported == start:
                    return [*path, start]
                if imported not in path:
                    stack.append((imported, [*path, imported]))
        return None

    circles = [circle for name in graph if (circle := circle_from(name))]
    assert not circles, f"bench/ modules that import each other in a circle: {circles}"
