"""The house has no circles: the file-level import graph of streamserver/ and engines/, read with
`ast`, has no cycle, and engines/ (the speech engine) never imports streamserver/ (the server).

Every import statement counts, wherever it is: module level, inside functions and methods (lazy
imports), under `if TYPE_CHECKING:` (a cycle hidden from the interpreter is still one in the
design). Edges go from a file to the file it names:
  * `import a.b.c` and `from a.b import c` (c a submodule) -> a/b/c.py (or a/b/c/__init__.py);
  * `from a.b import name` (name not a submodule) and `from a.b import *` -> a/b.py or a/b/__init__.py;
  * relative imports are resolved against the importing file's package.
Importing a.b.c also runs a/__init__.py and a/b/__init__.py, but those are not edges: an edge
to a package's __init__.py exists only where names are taken from the package itself, so that a
package's __init__ re-exporting its submodules does not make every submodule a cycle. Dynamic
imports (importlib.import_module with a computed name) are not seen.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("streamserver", "engines")

Graph = dict[str, set[str]]  # file (relative to ROOT, "/"-separated) -> the files it imports


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, str]:
    """Dotted module name -> its file, for every .py file under the packages."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.relative_to(root).as_posix()
    return found


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(base module, names taken from it) for one import statement; names empty for `import a.b`."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the package of this file, up level - 1 packages
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return [(base, [alias.name for alias in node.names])]


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> tuple[Graph, list[str]]:
    """The file-level import graph, and the imports of the packages' own modules that name no file."""
    modules = _modules(root, packages)
    graph: Graph = {path: set() for path in modules.values()}
    unresolved = []
    for module, path in modules.items():
        tree = ast.parse((root / path).read_text(encoding="utf-8"), filename=path)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for base, names in _imported(node, module, path.endswith("__init__.py")):
                if base.split(".")[0] not in packages:
                    continue  # the standard library and third parties
                if base not in modules:
                    unresolved.append(f"{path}:{node.lineno}: {base}")
                    continue
                submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
                if len(submodules) < len(names) or not names:  # some names come from `base` itself
                    submodules.append(base)
                graph[path].update(modules[m] for m in submodules if modules[m] != path)
    return graph, unresolved


def _strongly_connected(graph: Graph) -> list[set[str]]:
    """Tarjan's components with more than one file (self-imports are not edges)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
            if component:
                components.append(component | {v})

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def find_cycles(graph: Graph) -> list[list[str]]:
    """Cycles covering every edge that lies on one: for each such edge u -> v not yet shown, the
    shortest way back v -> ... -> u. Each cycle is a chain of files, first == last."""
    cycles: list[list[str]] = []
    for component in _strongly_connected(graph):
        covered: set[tuple[str, str]] = set()
        for u in sorted(component):
            for v in sorted(graph[u] & component):
                if (u, v) in covered:
                    continue
                came_from: dict[str, str] = {v: v}
                queue = deque([v])
                while u not in came_from:
                    x = queue.popleft()
                    for y in sorted(graph[x] & component):
                        if y not in came_from:
                            came_from[y] = x
                            queue.append(y)
                back = [u]
                while back[-1] != v:
                    back.append(came_from[back[-1]])
                chain = [u] + back[::-1]
                covered.update(zip(chain, chain[1:]))
                cycles.append(chain)
    return cycles


def test_no_import_cycles_between_files():
    graph, _ = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_imports_of_our_own_modules_name_files():
    """A stale name (a module that moved) would drop its edge and could hide a cycle."""
    _, unresolved = import_graph()
    assert not unresolved, "imports naming no file:\n" + "\n".join("  " + u for u in unresolved)


def test_engines_never_import_the_server():
    graph, _ = import_graph()
    wrong = [f"{a} -> {b}" for a, targets in graph.items() if a.startswith("engines/")
             for b in sorted(targets) if b.startswith("streamserver/")]
    assert not wrong, "engines/ imports streamserver/:\n" + "\n".join("  " + w for w in wrong)


def test_the_graph_reader_sees_every_kind_of_import(tmp_path):
    """The reader itself, on a small package: lazy, relative, submodule-as-name, dotted, cycles."""
    files = {
        "p/__init__.py": "X = 1\n",
        "p/a.py": "from p import X\nfrom . import b\n",  # a name of the package, and a submodule
        "p/b.py": "def f():\n    import p.c.d\n",  # lazy and dotted
        "p/c/__init__.py": "",
        "p/c/d.py": "from ..a import something\nimport json\n",  # relative, two levels; stdlib ignored
        "p/e.py": "from p.c import d, missing\nimport p.nothere\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph, unresolved = import_graph(tmp_path, ("p",))
    assert graph["p/a.py"] == {"p/__init__.py", "p/b.py"} and graph["p/b.py"] == {"p/c/d.py"}
    assert graph["p/c/d.py"] == {"p/a.py"} and graph["p/e.py"] == {"p/c/d.py", "p/c/__init__.py"}
    assert unresolved == ["p/e.py:2: p.nothere"]
    assert find_cycles(graph) == [["p/a.py", "p/b.py", "p/c/d.py", "p/a.py"]]
