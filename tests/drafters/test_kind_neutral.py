"""Outside the drafters (and the training recipes), no code names a kind of drafter: not as a
string, not as an identifier, not by importing a kind's module, and nothing that talks to
drafters decides on `aux_layers` (a drafter says what it needs through the protocol:
`context`, `depth`, `formats`, ...). The step may pass `drafter.aux_layers` to the backbone;
it may not branch on them.

"medusa" is also the project's name, so identifiers may hold it; "ngram" identifiers name
the n-gram merge, a decoding option of the API, the flags and the engine whose drafter is
resolved in `drafters.resolve`. What is still named elsewhere is listed in `KNOWN`, each
with its reason: the test fails on anything new, and on a listed entry that is gone (strike
it from the list)."""

import ast
import re
from pathlib import Path

import pytest

from medusa_jax.drafters import registry, shipped

ROOT = Path(__file__).resolve().parents[2]
TOP = ["medusa_jax", "infer", "train"]
OUTSIDE = ("medusa_jax/drafters/", "medusa_jax/training/recipes/")
# the layers that talk to drafters: there, nothing may decide on `aux_layers` (the model
# computes the features a drafter names; the trainer's config is listed in KNOWN)
DRAFTER_USERS = ("medusa_jax/decoding/", "medusa_jax/serving/", "medusa_jax/api.py",
                 "medusa_jax/tools/", "medusa_jax/kernels/", "medusa_jax/training/", "infer/")
# the registered kinds and the shipped drafters' names ("default" aside: a plain word)
KINDS = set(registry.kinds()) | set(shipped.NAMES) - {shipped.MEDUSA}
KIND_MODULES = tuple(t.rsplit(".", 1)[0] for t in registry.KINDS.values() if isinstance(t, str))
IDENTIFIER = re.compile(r"(?:^|_)(%s)(?:_|$|\d)" % "|".join(
    sorted(KINDS - {registry.HEAD_FN_KIND, "ngram"}, key=len, reverse=True)), re.I)

# file -> offences still there (without line numbers), and why
KNOWN = {
    # the trainer's generic recipe defaults to Medusa heads; its config branches on
    # aux_layers, names the recipes' defaults and takes --aux-layers' default from the
    # drafter's own rule (issue 61: the training helper's files; EagleConfig belongs with
    # its recipe)
    "medusa_jax/training/trainer.py": {"the kind name 'medusa'",
                                       "imports medusa_jax.drafters.medusa"},
    "medusa_jax/training/config.py": {"the kind name 'medusa'", "the kind name 'hydra'",
                                      "the kind name 'eagle'", "decides on aux_layers",
                                      "identifier EAGLE_LR", "identifier EAGLE_SELF_DISTILL_LR",
                                      "identifier EAGLE_DRAFT_VOCAB",
                                      "imports medusa_jax.drafters.eagle3.layers"},
    # the export command names the layouts each kind is written in
    "train/export_heads.py": {"the kind name 'eagle3'", "the kind name 'hydra'"},
}


def files():
    for top in TOP:
        for p in sorted((ROOT / top).rglob("*.py")):
            if not p.relative_to(ROOT).as_posix().startswith(OUTSIDE):
                yield p


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


def identifiers(node) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.alias):
        return [node.asname or node.name.rsplit(".", 1)[-1]]
    return []


def offences(path: Path) -> list[tuple[int, str]]:
    """(line, what) of each place `path` names a kind or decides on aux_layers."""
    tree = ast.parse(path.read_text())
    skip = docstrings(tree)
    where = path.relative_to(ROOT).as_posix()
    users = where.startswith(DRAFTER_USERS) or where.startswith("tests/")
    bad = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        bad += [(line, f"identifier {n}") for n in identifiers(node) if IDENTIFIER.search(n)]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in skip and node.value in KINDS:
            bad.append((line, f"the kind name {node.value!r}"))
        elif isinstance(node, ast.Import):
            bad += [(line, f"imports {a.name}") for a in node.names
                    if a.name.startswith(KIND_MODULES)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            bad += [(line, f"imports {m}") for m in mods if m.startswith(KIND_MODULES)][:1]
        elif users and isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)) and \
                names_aux_layers(node.test):
            bad.append((line, "decides on aux_layers"))
        elif users and isinstance(node, ast.BoolOp) and \
                any(names_aux_layers(v) for v in node.values):
            bad.append((line, "decides on aux_layers"))
    return bad


def test_the_walk_sees_the_files():
    seen = {p.relative_to(ROOT).as_posix() for p in files()}
    assert {"medusa_jax/decoding/step.py", "infer/bench.py", "medusa_jax/model/backbone.py",
            "medusa_jax/training/trainer.py", "train/export_heads.py"} <= seen
    assert not any(s.startswith(OUTSIDE) for s in seen)


def test_the_check_catches_what_it_must():
    p = ROOT / "tests" / "drafters" / "_kind_probe.py"  # inside ROOT, for relative_to
    p.write_text('from medusa_jax.drafters.hydra import heads\n'
                 'if d.aux_layers:\n    k = "eagle3"\n'
                 'def hydra_depth(eagle3_cfg):\n    return EAGLE_X\n'
                 'medusa_step = ngram_size = 1\n')
    try:
        got = [what for _, what in offences(p)]
        assert sorted(got) == sorted([
            "imports medusa_jax.drafters.hydra", "decides on aux_layers",
            "the kind name 'eagle3'", "identifier hydra_depth", "identifier eagle3_cfg",
            "identifier EAGLE_X"])
    finally:
        p.unlink()


@pytest.mark.parametrize("top", TOP)
def test_no_kind_is_named_outside_the_drafters(top):
    found = {}
    for p in files():
        where = p.relative_to(ROOT).as_posix()
        if where.startswith(top + "/"):
            for line, what in offences(p):
                found.setdefault(where, {}).setdefault(what, line)
    new = [f"{f}:{line}: {what}" for f, whats in sorted(found.items())
           for what, line in whats.items() if what not in KNOWN.get(f, set())]
    assert not new, "kind-specific code outside medusa_jax/drafters:\n" + "\n".join(new)
    gone = [f"{f}: {what}" for f, whats in KNOWN.items() if f.startswith(top + "/")
            for what in whats if what not in found.get(f, {})]
    assert not gone, "no longer there (strike them from KNOWN):\n" + "\n".join(gone)


@pytest.mark.parametrize("command", ["infer.generate", "infer.bench", "infer.serve",
                                     "infer.search_tree", "train.enlarge"])
def test_every_commands_heads_help_names_every_kind(command):
    """The --heads help is written from the registry: a kind registered before the parser
    is built shows up in it, with every kind read from files."""
    import importlib

    module = importlib.import_module(command)
    registry.register("probe", "medusa_jax.nowhere:Probe", "probe drafters")
    try:
        parser = module.build_parser()
    finally:
        registry.unregister("probe")
    text = " ".join(next(a.help for a in parser._actions if "--heads" in a.option_strings)
                    .split())
    wanted = [registry.WHAT[k] for k in registry.kinds() if not shipped.fileless(k)]
    assert all(w in text for w in wanted + ["probe drafters"]), text
    assert all(repr(n) in text for n in shipped.NAMES), text
