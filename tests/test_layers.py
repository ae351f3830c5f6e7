"""The package's folders are its layers: every import points down, and none closes a circle.

Walks every `import` in medusa_jax (those inside functions too: a deferred import still
ties two modules together) and fails on an import from a higher layer, between two
sibling folders of one layer, or on any cycle among modules."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "medusa_jax"

# lowest first; a folder imports only from folders of lower rank (and from itself)
LAYERS = {
    "constants": 0, "kernels": 0, "runtime": 1, "text": 2, "model": 3, "decoding": 4, "drafters": 5,
    "api": 6, "tools": 7, "training": 8, "serving": 8, "cli": 9, "__init__": 10,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The medusa_jax modules `path` imports (a name imported from a package counts as its
    submodule when there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("medusa_jax"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("medusa_jax"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if modules.get(sub) else node.module)
    return found


modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
graph = {name: imports_of(path) - {name} for name, path in modules.items()}


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_is_in_a_layer():
    assert {layer(m) for m in modules} <= set(LAYERS), \
        f"folders without a layer: {sorted({layer(m) for m in modules} - set(LAYERS))}"


def test_imports_point_down():
    bad = []
    for name, deps in graph.items():
        for dep in deps:
            if dep == "medusa_jax" or layer(dep) == layer(name):
                continue
            if LAYERS[layer(dep)] >= LAYERS[layer(name)]:
                bad.append(f"{name} -> {dep}")
    assert not bad, "imports that do not point down:\n" + "\n".join(sorted(bad))


def test_no_import_circles():
    """Tarjan's strongly connected components: any component of two or more modules is a
    circle (the package's root, which only forwards names lazily, aside)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w == "medusa_jax" or w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_walk_sees_the_package():
    """The checks above are only as good as the graph: it holds the modules and edges it
    must (a decoder imports the backbone)."""
    assert "medusa_jax.decoding.decode" in graph
    assert "medusa_jax.model.backbone" in graph["medusa_jax.decoding.decode"]
