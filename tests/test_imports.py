"""jaxgen's import graph, read from the source with `ast` (module-level and in-function imports alike): no
cycle, and the kernels package imports nothing of `jaxgen.model` outside itself. No module is imported."""

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = Path(ROOT) / "jaxgen"


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of jaxgen (a package by its __init__.py)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, modules) -> set[str]:
    """The jaxgen modules `name` imports anywhere in its file: `from a import b` counts as a.b when that
    is a module, else as a; a relative import is resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import jaxgen.x.y` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "jaxgen.model.attention" in graph and "jaxgen.model.kernels.cpu" in graph  # the walk saw them
    assert "jaxgen.model.kernels" in graph["jaxgen.model.attention"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_import_nothing_else_of_the_model():
    """The kernels are told what they need (the logit scale, float views of the cache's arrays), so the
    model imports them and never the other way round."""
    for name, imports in import_graph().items():
        if name == "jaxgen.model.kernels" or name.startswith("jaxgen.model.kernels."):
            model = {m for m in imports if m.startswith("jaxgen.model")}
            outside = {m for m in model if m != "jaxgen.model.kernels" and not m.startswith("jaxgen.model.kernels.")}
            assert not outside, f"{name} imports {sorted(outside)}"
