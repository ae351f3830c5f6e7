"""Every backticked path or module the docs and docstrings name exists.

Scans README.md, docs/**/*.md and the docstrings and comments of medusa_jax/, train/, infer/
and tests/ for backticked references that look like repository paths (`decoding/step.py`,
`drafters/eagle3/`, `docs/performance.md:40-42`, `tests/test_layers.py::test_no_import_circles`)
or modules (`medusa_jax.serving.engine`, `infer.bench`, `python -m train.medusa1`,
`decoding.step.DraftSampler`, `heads.apply_heads`), and fails listing each one that names no
file, folder, line, test, module or attribute here, with file:line."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("medusa_jax", "train", "infer", "tests")
MODULE_ROOTS = ("medusa_jax", "infer", "train", "tests")

SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*(```|~~~)")
# a path: ends in one of these extensions or in a slash, with an optional `:line[-line]`
# or `::test_name` after it
PATH = re.compile(r"^(?:\./)?([\w.-]+(?:/[\w.-]+)*(?:\.(?:py|md|json|txt|cc)|/))"
                  r"(?::(\d+)(?:-(\d+))?|::(\w+))?[,.;:)]?$")
MODULE = re.compile(r"^((?:%s)(?:\.\w+)+)(?:\(\))?[,.;:)]?$" % "|".join(MODULE_ROOTS))
PYTHON_M = re.compile(r"python3? -m ([\w.]+)")
# a module by its short name and something in it: `heads.apply_heads`, `decoding.step.run`
# (not `model.layers.`, a prefix of weight names)
SHORT = re.compile(r"^([a-z_][a-z0-9_]*)((?:\.[A-Za-z_]\w*)+)(?:\(\))?[,;:)]?$")
# modules the package's flat layout had, gone since (train_step.py is training/step.py now)
RETIRED = {"heads_formats", "hydra_train", "train_cli", "train_config", "train_step",
           "test_hostile_input"}


def _files() -> tuple[set[str], set[str]]:
    """The repository's files and folders, as paths relative to its root."""
    files, dirs = {"README.md", "pyproject.toml"}, set()
    for top in ("docs", ".ci", *CODE_DIRS):
        for p in (ROOT / top).rglob("*"):
            rel = p.relative_to(ROOT).as_posix()
            if "__pycache__" in rel or ".egg-info" in rel:
                continue
            (dirs if p.is_dir() else files).add(rel)
        dirs.add(top)
    return files, dirs


FILES, DIRS = _files()
# every module here by its dotted name: `medusa_jax.decoding.step`, `infer.bench`
MODULES = {".".join(Path(f).with_suffix("").parts).removesuffix(".__init__"): ROOT / f
           for f in sorted(FILES) if f.endswith(".py")}
EXTENSIONS = {"py", "md", "json", "jsonl", "txt", "cc", "safetensors", "model", "lock"}
# the first folder of a path the check takes for one of ours: top-level folders and the
# folders under medusa_jax/, tests/ and docs/ (`decoding/step.py` means medusa_jax's or the
# tests'); a path starting anywhere else (another project's `medusa/model/...`) is skipped
OUR_FOLDERS = {d.split("/")[-1] for d in DIRS
               if d.count("/") == 0 or (d.count("/") == 1 and d.split("/")[0] in
                                        ("medusa_jax", "tests", "docs"))}


def _is_placeholder(word: str) -> bool:
    return (word.startswith(("runs/", "~", "/", "http:", "https:", "gs:", "s3:", "hf:"))
            or any(c in word for c in "<>{}*$") or "..." in word
            or re.search(r"(^|/)[A-Z][A-Z_]+(/|$)", word) is not None)   # DIR, OUT


def _resolve(path: str, base: Path) -> str | None:
    """The repository file or folder `path` names: relative to the referring file's folder,
    the root, or any folder it ends (`decoding/step.py`, `step.py`)."""
    is_dir = path.endswith("/")
    path = path.rstrip("/")
    pool = DIRS if is_dir else FILES
    try:
        local = (base / path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        local = None
    if local in pool:
        return local
    if path in pool:
        return path
    hits = sorted(f for f in pool if f.endswith("/" + path))
    return hits[0] if hits else None


def _check_path(m: re.Match, base: Path) -> str | None:
    path, first, last, test = m.groups()
    if _is_placeholder(path):
        return None
    head = path.lstrip("./").split("/")[0]
    if "/" in path.rstrip("/"):
        if head not in OUR_FOLDERS:
            return None
    elif not re.match(r"test_\w+\.py$", path):
        return None          # a bare `config.json` is the user's, `cnets.py` another project's
    found = _resolve(path, base)
    if found is None:
        return "no such file or folder"
    if first or test:
        text = (ROOT / found).read_text()
        if first and int(last or first) > len(text.splitlines()):
            return f"{found} has {len(text.splitlines())} lines"
        if test and not re.search(rf"\b(def|class) {test}\b", text):
            return f"{found} has no {test}"
    return None


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _check_module(dotted: str) -> str | None:
    """None when a prefix of `dotted` is a module here and the rest names something in it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        mod = _module_file(".".join(parts[:n]))
        if mod is None:
            continue
        if n == len(parts):
            return None
        attr = parts[n]
        if n + 1 < len(parts) and ROOT.joinpath(*parts[:n + 1]).is_dir():
            break        # a missing submodule of a package
        if re.search(rf"\b{attr}\b", mod.read_text()):
            return None  # an attribute the module defines or imports
        return f"{'.'.join(parts[:n])} has no {attr}"
    return "no such module"


def _check_short(dotted: str) -> str | None:
    """`heads.apply_heads`, `decoding.step.DraftSampler`: a module by the end of its dotted
    name, then what is in it. A first name no module here ends with is a variable's
    (`cfg.hidden_size`) and is left alone."""
    parts = dotted.split(".")
    if parts[0] in RETIRED:
        return "a module that no longer exists"
    if parts[-1] in EXTENSIONS:
        return None                  # a file's name: `model.safetensors`
    for n in range(len(parts), 0, -1):
        tail = "." + ".".join(parts[:n])
        found = [f for name, f in MODULES.items() if ("." + name).endswith(tail)]
        if not found:
            continue
        if n == len(parts):
            return None
        attr = parts[n]
        # a package's names: in any of its files (`kernels.wants` is kernels/fewrow.py's)
        texts = [g.read_text() for f in found
                 for g in (f.parent.rglob("*.py") if f.name == "__init__.py" else [f])]
        if any(re.search(rf"\b{attr}\b", text) for text in texts):
            return None
        return f"no module {parts[:n][-1]} here has {attr}"
    return None


def _check_span(span: str, base: Path, code: bool = False) -> list[str]:
    """What is wrong with each reference in one backticked span (`code`: of a docstring or
    comment, where a retired module's bare name is ours; a guide may name another project's
    variable of the same name)."""
    bad = []
    for m in PYTHON_M.finditer(span):
        if m.group(1).split(".")[0] in MODULE_ROOTS and (err := _check_module(m.group(1))):
            bad.append(f"{m.group(1)}: {err}")
    if PYTHON_M.search(span):
        span = PYTHON_M.sub("", span)
    for word in span.split():
        if (m := PATH.match(word)) and (err := _check_path(m, base)):
            bad.append(f"{word}: {err}")
        elif m := MODULE.match(word):
            if not _is_placeholder(word) and m.group(1).split(".")[-1] not in EXTENSIONS \
                    and (err := _check_module(m.group(1))):
                bad.append(f"{m.group(1)}: {err}")
        elif (m := SHORT.match(word)) and (err := _check_short(m.group(1) + m.group(2))):
            bad.append(f"{word}: {err}")
        elif code and word.strip(",.;:()") in RETIRED:
            bad.append(f"{word}: a module that no longer exists")
    return bad


def _markdown_spans(path: Path):
    fenced = False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:                                    # a command block: its `python -m`s
            for m in PYTHON_M.finditer(line):
                yield i, m.group(0)
        else:
            for m in SPAN.finditer(line):
                yield i, m.group(1)


def _python_spans(path: Path):
    source = path.read_text()
    texts = []        # (first line, text) of each docstring and comment
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            texts.append((node.lineno, source.splitlines()[node.lineno - 1:node.end_lineno]))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            texts.append((tok.start[0], [tok.string]))
    for first, lines in texts:
        for k, line in enumerate(lines):
            for m in SPAN.finditer(line):
                yield first + k, m.group(1)


def stale_references() -> list[str]:
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    sources += sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")
                      if "__pycache__" not in p.parts)
    bad = []
    for src in sources:
        spans = _markdown_spans(src) if src.suffix == ".md" else _python_spans(src)
        for line, span in spans:
            for err in _check_span(span, src.parent, src.suffix == ".py"):
                bad.append(f"{src.relative_to(ROOT)}:{line}: `{err}`")
    return bad


def test_backticked_paths_and_modules_exist():
    bad = stale_references()
    assert not bad, f"{len(bad)} references to nothing here:\n" + "\n".join(bad)


def test_the_check_catches_what_it_should():
    base = ROOT / "docs"
    assert _check_span("medusa_jax/decoding/step.py", base) == []
    assert _check_span("decoding/step.py", base) == []
    assert _check_span("drafters/eagle3/", base) == []
    assert _check_span("medusa_jax.serving.engine.auto_plain_above", base) == []
    assert _check_span("python -m infer.bench --help", base) == []
    assert _check_span("runs/<run>/heads/config.json", base) == []
    assert _check_span("medusa/model/medusa_model.py", base) == []   # another project's
    assert _check_span("decoding/nowhere.py", base)
    assert _check_span("medusa_jax.serving.nowhere", base)
    assert _check_span("medusa_jax.serving.engine.no_such_name", base)
    assert _check_span("python -m infer.nowhere", base)
    assert _check_span("docs/performance.md:100000", base)
    assert _check_span("medusa_jax/decoding/step.py:100000", base)
    assert _check_span("tests/decoding/test_decode.py::test_no_such_test", base)
    assert _check_span("drafters/nowhere/", base)
    assert _check_span("test_engine.py", base) == []
    assert _check_span("test_nowhere.py", base)
    assert _check_span("heads.apply_heads", base) == []
    assert _check_span("heads.no_such_name", base)
    assert _check_span("train_step.make_train_step", base)
    assert _check_span("train_config", base, code=True)
    assert _check_span("cfg.hidden_size", base) == []
    assert _check_span("decoding.step.DraftSampler", base) == []
    assert _check_span("decoding.nowhere.DraftSampler", base)


# a measured figure: a ratio (`2.19x`, `0.46x-0.49x`) or a time in ms; the guides and the
# README describe behaviour and link to docs/results.md and the dated logs for these
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+x(?:-\d+(?:\.\d+)?x)?(?!\w)|\b\d+(?:\.\d+)? ms\b")


def test_measured_figures_live_in_the_results_page_and_the_logs():
    """A figure written in two places goes stale in one of them: outside docs/results.md and
    docs/benchmarks/, the README and the guides hold no measured ratio or time."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name == "results.md":
            continue
        fenced = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if FENCE.match(line):
                fenced = not fenced
            if not fenced and FIGURE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {FIGURE.search(line).group(0)}")
    assert not found, "measured figures outside docs/results.md and docs/benchmarks/:\n" + \
        "\n".join(found)


def undocumented_kinds() -> list[str]:
    """The registered drafter kinds the README's feature list (by the name the commands'
    help gives them, `registry.WHAT`) or architecture.md's Drafters section (by their folder,
    `drafters/KIND/`) leave out."""
    from medusa_jax.drafters import registry

    readme = (ROOT / "README.md").read_text().lower()
    section = (ROOT / "docs" / "architecture.md").read_text().split("\n## Drafters\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    return [f"README.md: {registry.WHAT[k]!r}" for k in registry.kinds()
            if registry.WHAT[k].lower() not in readme] + \
        [f"docs/architecture.md#drafters: `drafters/{k}/`" for k in registry.kinds()
         if f"`drafters/{k}/`" not in section]


def test_the_docs_name_every_registered_kind():
    """A new kind in the registry leaves no kind list in the docs stale."""
    from medusa_jax.drafters import registry

    assert undocumented_kinds() == []
    registry.register("probe", "medusa_jax.nowhere:Probe", "probe drafters")
    try:
        assert undocumented_kinds() == ["README.md: 'probe drafters'",
                                        "docs/architecture.md#drafters: `drafters/probe/`"]
    finally:
        registry.unregister("probe")
