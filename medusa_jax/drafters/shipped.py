"""The drafters `--heads` / `heads=` takes by name: the ones shipped for the embedded model
(each trained by its command's default run; their folders: `runtime.assets.SHIPPED_HEADS`)
and the kinds built without files (the n-gram drafter: any model). No JAX here: `--help` and
the commands' early checks read it."""

from __future__ import annotations

from pathlib import Path

from medusa_jax.runtime import assets

MEDUSA, HYDRA, EAGLE = "default", "hydra", "eagle"  # train.medusa1, train.hydra, train.eagle
NAMES = tuple(assets.SHIPPED_HEADS)

# kinds a name selects with no files at all (`registry.without_files`); for any model
NGRAM = "ngram"
FILELESS = (NGRAM,)
# the n-gram sizes the commands and the API take (`--ngram-max` / `ngram_max`, ...): one
# comparison pass over the history per n keeps a step cheap
NGRAM_SIZE_LIMIT = 64
NGRAM_DEFAULT_MAX, NGRAM_DEFAULT_MIN = 4, 1
# `--ngram` / `ngram=True`: the chain merged into a drafter's tree, in nodes (measured:
# docs/benchmarks/2026-12-06-ngram.md)
NGRAM_MERGED_DEFAULT = 3
NGRAM_ALONE_CHAIN = 6  # the n-gram drafter's own default tree: a chain of this many nodes


def folder(name: str) -> Path:
    """The folder of the shipped drafter `name` (one of NAMES)."""
    if name not in assets.SHIPPED_HEADS:
        raise ValueError(f"no shipped drafter {name!r}; shipped: {', '.join(NAMES)}")
    return assets.shipped_heads_dir(name)


def fileless(name) -> bool:
    """Whether `--heads name` / `heads=name` selects a kind built without files."""
    return isinstance(name, str) and name in FILELESS


def help_names() -> str:
    """"'default' / 'hydra' / 'eagle'", for the commands' --heads help."""
    return " / ".join(repr(n) for n in NAMES)


FLAGS = ("--heads", "--ngram", "--ngram-max", "--ngram-min")  # as `check_ngram` names them
API_ARGS = ("heads", "ngram", "ngram_max", "ngram_min")  # ... in the notebook API


def check_ngram(heads, ngram, max_n, min_n, context: int | None = None,
                names=FLAGS) -> None:
    """The n-gram settings together, before any work: `heads` (a name or path, None: plain
    decoding), `ngram` (the merged chain's nodes, None: not merged), the sizes (None: the
    defaults), `context` the model's (None: not known yet). ValueError in one line naming
    the flag (or argument: `names`)."""
    h, g, mx, mn = names
    alone = fileless(heads)
    if ngram is not None:
        if heads is None:
            raise ValueError(f"{g} merges n-gram drafts into a drafter's tree: give {h} too "
                             f"(plain decoding drafts nothing)")
        if alone:
            raise ValueError(f"{g} merges n-gram drafts into another drafter's tree; "
                             f"{h} {NGRAM} drafts n-grams already: leave out {g}")
        if not isinstance(ngram, int) or isinstance(ngram, bool) or \
                not 1 <= ngram <= NGRAM_SIZE_LIMIT:
            raise ValueError(f"{g} takes 1..{NGRAM_SIZE_LIMIT} chain nodes, got {ngram!r}")
    if alone and Path(heads).exists():
        raise ValueError(f"{h} {heads} names the n-gram drafter, but there is a file or "
                         f"folder {heads!r} here too: give ./{heads} for that one")
    if (max_n is not None or min_n is not None) and not alone and ngram is None:
        raise ValueError(f"{mx} / {mn} set the n-gram drafts' sizes: use them with "
                         f"{h} {NGRAM} or {g}")
    for flag, v in ((mx, max_n), (mn, min_n)):
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= NGRAM_SIZE_LIMIT:
            raise ValueError(f"{flag} must be an integer in 1..{NGRAM_SIZE_LIMIT}, got {v!r}")
        if context is not None and v > context:
            raise ValueError(f"{flag} {v} is larger than the model's context ({context} "
                             f"tokens)")
    hi = NGRAM_DEFAULT_MAX if max_n is None else max_n
    lo = NGRAM_DEFAULT_MIN if min_n is None else min_n
    if lo > hi:
        raise ValueError(f"{mn} ({lo}) must be at most {mx} ({hi})")
