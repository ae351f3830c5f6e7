"""Outside the drafters, no code names a kind of drafter: not as a string, not by importing a
kind's module, and nothing decides on `aux_layers` (a drafter says what it needs through the
protocol: `keeps_context`, `depth`, `formats`, ...). The step may pass `drafter.aux_layers`
to the backbone; it may not branch on them."""

import ast
from pathlib import Path

import pytest

from medusa_jax.drafters import registry, shipped

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ["medusa_jax/decoding", "medusa_jax/serving", "medusa_jax/api.py",
           "medusa_jax/tools", "medusa_jax/kernels", "infer"]
# the registered kinds and the shipped drafters' names ("default" aside: a plain word)
KINDS = set(registry.kinds()) | set(shipped.NAMES) - {shipped.MEDUSA}
KIND_MODULES = tuple(t.rsplit(".", 1)[0] for t in registry.KINDS.values() if isinstance(t, str))


def files():
    for f in FOLDERS:
        p = ROOT / f
        yield from ([p] if p.is_file() else sorted(p.rglob("*.py")))


def docstrings(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def names_aux_layers(node) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "aux_layers" or
               isinstance(n, ast.Name) and n.id == "aux_layers" for n in ast.walk(node))


def offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = docstrings(tree)
    where = path.relative_to(ROOT)
    bad = []
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in skip and node.value in KINDS:
            bad.append(f"{line}: the kind name {node.value!r}")
        elif isinstance(node, ast.Import):
            bad += [f"{line}: imports {a.name}" for a in node.names
                    if a.name.startswith(KIND_MODULES)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            bad += [f"{line}: imports {m}" for m in mods if m.startswith(KIND_MODULES)][:1]
        elif isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)) and \
                names_aux_layers(node.test):
            bad.append(f"{line}: decides on aux_layers")
        elif isinstance(node, ast.BoolOp) and any(names_aux_layers(v) for v in node.values):
            bad.append(f"{line}: decides on aux_layers")
    return bad


def test_the_walk_sees_the_files():
    seen = {p.relative_to(ROOT).as_posix() for p in files()}
    assert "medusa_jax/decoding/step.py" in seen and "infer/bench.py" in seen


def test_the_check_catches_what_it_must(tmp_path):
    p = ROOT / "tests" / "drafters" / "_kind_probe.py"  # inside ROOT, for relative_to
    p.write_text('from medusa_jax.drafters.hydra import heads\n'
                 'if d.aux_layers:\n    k = "eagle3"\n')
    try:
        assert len(offences(p)) == 3
    finally:
        p.unlink()


@pytest.mark.parametrize("folder", [f for f in FOLDERS if not f.endswith("serving")])
def test_no_kind_is_named_outside_the_drafters(folder):
    bad = [b for p in files() if p.relative_to(ROOT).as_posix().startswith(folder)
           for b in offences(p)]
    assert not bad, "kind-specific code outside medusa_jax/drafters:\n" + "\n".join(bad)


def test_no_kind_is_named_in_serving():
    bad = [b for p in files() if "serving" in p.parts for b in offences(p)]
    assert not bad, "kind-specific code in serving/:\n" + "\n".join(bad)
