"""opefo_trl.runs as a package: its modules import one another without a circle (imports inside functions too)."""

import ast
from pathlib import Path

import opefo_trl.runs

PACKAGE = Path(opefo_trl.runs.__file__).parent


def _imports_within_runs(path: Path) -> set[str]:
    """The modules of opefo_trl.runs that ``path`` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {name.split(".")[2] for name in names if name.startswith("opefo_trl.runs.")}


def test_the_modules_of_runs_import_one_another_without_a_circle():
    graph = {path.stem: _imports_within_runs(path) for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    assert "options" in graph["checkpoint"]  # checkpoint.py <-> options.py was a circle once (inside a function)

    def circle_from(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        for imported in sorted(graph.get(module, ())):
            if (found := circle_from(imported, [*path, module])) is not None:
                return found
        return None

    circles = [found for module in sorted(graph) if (found := circle_from(module, [])) is not None]
    assert not circles, f"opefo_trl.runs imports in a circle: {' -> '.join(circles[0])}"
