"""The package's import graph has no cycle.

The graph, read from the source with `ast`: a module imports another where it says so, at module level or inside a
function or class (a function's import runs when it is called), but not in an ``if TYPE_CHECKING:`` block (never run).
Importing ``a.b.c`` also runs the module-level code of the packages ``a`` and ``a.b`` (their ``__init__.py``), so a
module depends on the module-level imports of the packages above what it imports, other than its own (a package's
lazy ``__getattr__`` runs only when its attribute is asked for: only a module that imports the package itself depends
on it). A cycle is a set of modules each of which, through these edges, needs all the others.
"""

import ast
from pathlib import Path

import opefo_trl

PACKAGE = Path(opefo_trl.__file__).parent


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) of every import of the package's modules in ``path``, outside
    ``if TYPE_CHECKING:`` blocks; ``from x import y`` imports the module ``x.y`` where there is one, else ``x``."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                for statement in child.orelse:
                    visit(ast.Module(body=[statement], type_ignores=[]), module_level)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, module_level) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from this package, up level - 1
                    above = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*above, base] if base else above)
                for alias in child.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    found.append((target, child.lineno, module_level))
            in_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, module_level and not in_function)

    visit(ast.parse(path.read_text()), True)
    return [(target, line, level) for target, line, level in found if target in modules and target != name]


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, str]]:
    """{node: {node it needs: where}}; a node is a module, or ``"<package> (init)"``, a package's module-level code."""
    root = package.parent
    paths = {module_name(path, root): path for path in package.rglob("*.py")}
    found = {name: imports(path, name, set(paths)) for name, path in paths.items()}
    graph: dict[str, dict[str, str]] = {}
    for name, edges in found.items():
        graph[name] = {}
        if paths[name].name == "__init__.py":
            graph[f"{name} (init)"] = {}
        for target, line, module_level in edges:
            where = f"{paths[name].relative_to(root)}:{line}"
            needs = [(name, target, where)]
            parts = target.split(".")
            for depth in range(1, len(parts)):  # the packages above the target, other than the importer's own
                above = ".".join(parts[:depth])
                if above in paths and not f"{name}.".startswith(f"{above}."):
                    needs.append((name, f"{above} (init)", f"{where}, which runs {above}'s __init__.py"))
            for source, needed, why in needs:
                graph[source].setdefault(needed, why)
                if module_level and paths[name].name == "__init__.py":
                    graph[f"{name} (init)"].setdefault(needed, why)
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """A shortest cycle through each strongly connected component of more than one node, as its nodes in order."""
    reach = {node: set(edges) for node, edges in graph.items()}
    changed = True
    while changed:  # transitive closure (the package has ~150 nodes)
        changed = False
        for reached in reach.values():
            more = set().union(*(reach[other] for other in reached)) - reached
            if more:
                reached |= more
                changed = True
    found, seen = [], set()
    for start in sorted(graph):
        if start in seen or start not in reach[start]:
            continue
        component = {node for node in reach[start] if start in reach[node]}
        seen |= component
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:  # breadth first, back to the start
            frontier = [
                came_from.setdefault(after, node) and after
                for node in frontier
                for after in sorted(graph[node])
                if after in component and after not in came_from
            ]
        cycle, node = [], came_from[start]
        while node != start:
            cycle.append(node)
            node = came_from[node]
        found.append([start, *reversed(cycle)])
    return found


def describe(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    pairs = zip(cycle, [*cycle[1:], cycle[0]], strict=True)
    return "\n".join(f"  {node} -> {after}  ({graph[node][after]})" for node, after in pairs)


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n\n".join(describe(graph, cycle) for cycle in found)


def test_the_graph_reads_imports_in_functions_and_packages_but_not_type_checking_blocks(tmp_path):
    """On a small package: an import inside a function counts, one in an ``if TYPE_CHECKING:`` block does not, and
    importing a module runs its package's module-level code (its imports), not its functions."""
    files = {
        "__init__.py": "def __getattr__(name):\n    from pkg.b import B\n\n    return B\n",
        "a.py": "import typing\n\nfrom pkg.sub.c import C\n\nif typing.TYPE_CHECKING:\n    from pkg.b import B\n",
        "b.py": "def make():\n    from pkg import a\n",
        "sub/__init__.py": "from pkg import b\n",
        "sub/c.py": "C = 1\n",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg.a"] == {
        "pkg.sub.c": "pkg/a.py:3",
        "pkg.sub (init)": "pkg/a.py:3, which runs pkg.sub's __init__.py",
    }
    assert graph["pkg"] == {"pkg.b": "pkg/__init__.py:2"} and graph["pkg (init)"] == {}
    assert graph["pkg.sub (init)"] == {"pkg.b": "pkg/sub/__init__.py:1"}
    assert cycles(graph) == [["pkg.a", "pkg.sub (init)", "pkg.b"]]
    assert describe(graph, cycles(graph)[0]).splitlines() == [
        "  pkg.a -> pkg.sub (init)  (pkg/a.py:3, which runs pkg.sub's __init__.py)",
        "  pkg.sub (init) -> pkg.b  (pkg/sub/__init__.py:1)",
        "  pkg.b -> pkg.a  (pkg/b.py:2)",
    ]
