"""The house stays one-way: every import in ``src/autopar`` (at module top or inside a function alike) runs down the
layers below or stays inside its own package, and no set of modules imports itself in a circle.

The layer order is data (``LAYERS``): change it here, deliberately, when the architecture changes."""
import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# lowest first. A module may import its own package, any package of a lower layer, and the base. Packages of one
# layer do not import each other, except as listed in SAME_LAYER (one way only, the circle test keeps it so).
LAYERS = [
    ["autopar.context", "autopar.context_values", "autopar.errors", "autopar.labels", "autopar.dtype", "autopar.layout"],  # the base
    ["autopar.cluster"],
    ["autopar.comm", "autopar.communication"],
    ["autopar.common", "autopar.dataset", "autopar.models"],
    ["autopar.ops", "autopar.nn"],
    ["autopar.perf", "autopar.planner"],  # speed levers; the AUTO planner (reads layouts and ops, never the runtime)
    ["autopar.parallel"],
    ["autopar.checkpoint"],
    ["autopar.train"],
    ["autopar.dryrun"],  # a job simulated on fake tensors: runs scripts that use every layer below
    ["autopar.cli"],
    ["autopar"],  # the package itself: the public facade, importing everything, imported by nothing inside
]
SAME_LAYER = {("autopar.nn", "autopar.ops"), ("autopar.communication", "autopar.comm")}  # (importer, imported)


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in (SRC / "autopar").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    """The autopar modules ``name`` imports; ``from pkg import sub`` counts as importing ``pkg.sub`` alone."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            subs = [f"{base}.{alias.name}" for alias in node.names]
            targets = [s for s in subs if s in mods] + ([base] if any(s not in mods for s in subs) else [])
        else:
            continue
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target.startswith("autopar") and target != name:
                found.add(target)
    return found


def _unit(module: str) -> str:
    """The layer entry a module belongs to: the longest listed prefix."""
    listed = [u for layer in LAYERS for u in layer if module == u or module.startswith(u + ".")]
    assert listed, f"{module} is in no layer: add it to LAYERS"
    return max(listed, key=len)


def _level(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def test_every_import_runs_down_the_layers():
    upward = []
    for importer, imported in sorted(GRAPH.items()):
        for target in sorted(imported):
            a, b = _unit(importer), _unit(target)
            if a == b or _level(b) == 0:
                continue
            if _level(b) > _level(a) or (_level(b) == _level(a) and (a, b) not in SAME_LAYER):
                upward.append(f"{importer} ({a}) imports {target} ({b})")
    assert not upward, "imports running up or across the layers:\n" + "\n".join(upward)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` re-exporting its own modules is not a circle: drop edges from a package to what it
    contains (the modules still may not import each other in a circle)."""
    return {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in graph.items()}


def test_no_import_circles():
    circles = _circles(_package_edges(GRAPH))
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize("graph,expected", [({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
                                            ({"a": {"b"}, "b": {"c"}, "c": set()}, [])])
def test_the_circle_finder_finds_circles(graph, expected):
    assert _circles(graph) == expected
