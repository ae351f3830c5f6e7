"""Nothing outside `medusa_jax/serving/` touches a private name of the serving package: the
server, the commands and the tests use the engine's public surface only, so the engine's
inside can change without them (a static check over the source, no import)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVING = ROOT / "medusa_jax" / "serving"
OUTSIDE = ("medusa_jax", "infer", "train", "tests", "tools")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def serving_private_names() -> set[str]:
    """Every underscore name the serving modules define: module-level names, class
    members, and attributes they assign on `self`."""
    names = set()
    for path in SERVING.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def uses(path: Path, private: set[str], root: Path = ROOT) -> list[str]:
    """`path`'s uses of those names: `x._name` (but `self` / `cls`'s own) and imports of an
    underscore name from a serving module."""
    out, where = [], path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            out.append(f"{where}:{node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "medusa_jax.serving")):
            out += [f"{where}:{node.lineno}: import {a.name}"
                    for a in node.names if _private(a.name)]
    return out


def test_nothing_outside_serving_uses_its_private_names():
    private = serving_private_names()
    assert {"_loop", "_deliver"} <= private  # the check sees the engine's own
    bad = []
    for top in OUTSIDE:
        for path in sorted((ROOT / top).rglob("*.py")):
            if SERVING not in path.parents and path != Path(__file__):
                bad += uses(path, private)
    assert not bad, "private names of medusa_jax.serving used outside it:\n" + "\n".join(bad)


def test_the_check_catches_a_private_use(tmp_path):
    src = tmp_path / "user.py"
    src.write_text("from medusa_jax.serving.engine import _hidden\n"
                   "def f(engine):\n    return engine._deliver, self._deliver\n")
    found = sorted(line.split(": ", 1)[1] for line in uses(src, {"_deliver", "_hidden"},
                                                            tmp_path))
    assert found == ["._deliver", "import _hidden"]
