"""The kinds of drafter: kind -> its class (`decoding.drafter.Drafter`), each written here as
"module:class" and imported on first use, so a command pays only for the kinds it decodes.
This module is the one door to them: which kind parameters are (`kind_of`), their drafter
(`drafter_for`, what the decoders reach through `decoding.kinds`), their class
(`drafter_class`), their logical axes (`axes_of`) and weight dtype (`with_weight_dtype`).

A new kind is a folder under `medusa_jax.drafters` and one line in `_ENTRIES` (or, from a
test or a plugin, one `register(kind, "module:class")` call, or `register(kind, TheClass)`).
Everything else (decoders, the engine, file formats, enlarging, benchmarks, tree search)
reaches the kind through the protocol: nothing outside this package names one. The order
of `KINDS` (kind -> target, built from `_ENTRIES`) is the order in which `matches` is asked (and file layouts are detected).
"""

from __future__ import annotations

import importlib

from medusa_jax.constants import HEADS_DTYPES
from medusa_jax.drafters import shipped

Params = object  # a parameter pytree

# (kind, "module:class", how the commands' help names its drafters), one line a kind; tried
# in this order
_ENTRIES = (
    ("eagle3", "medusa_jax.drafters.eagle3.drafter:Eagle3Drafter", "EAGLE-3 drafters"),
    ("hydra", "medusa_jax.drafters.hydra.drafter:HydraDrafter", "Hydra heads"),
    ("medusa", "medusa_jax.drafters.medusa.drafter:MedusaDrafter", "Medusa heads"),
    ("ngram", "medusa_jax.drafters.ngram.drafter:NgramDrafter", "n-gram drafts"),
    ("mtp", "medusa_jax.drafters.mtp.drafter:MtpDrafter", "MTP modules"),
)
KINDS: dict[str, object] = {kind: target for kind, target, _ in _ENTRIES}
WHAT: dict[str, str] = {kind: what for kind, _, what in _ENTRIES}

# the kind of heads decoded with a plain head function (`drafter_for(heads, head_fn)`), and
# of our artifacts written before the artifact recorded its kind
HEAD_FN_KIND = "medusa"


def register(kind: str, target, what: str | None = None) -> None:
    """Make `kind` known: `target` is "module:class" or the class itself, `what` how help
    names its drafters (default: "KIND drafters"). A kind registered again is replaced
    (tests register toy kinds and `unregister` them)."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"a drafter kind is a non-empty str, got {kind!r}")
    if not (isinstance(target, type) or (isinstance(target, str) and target.count(":") == 1)):
        raise ValueError(f"register({kind!r}, ...): give 'module:class' or a class, "
                         f"got {target!r}")
    KINDS[kind] = target
    WHAT[kind] = what or f"{kind} drafters"


def unregister(kind: str) -> None:
    """Forget `kind` (a toy kind a test registered)."""
    KINDS.pop(kind, None)
    WHAT.pop(kind, None)


def help_kinds(files_only: bool = False) -> str:
    """"EAGLE-3 drafters, Hydra heads, Medusa heads, ...": the registered kinds, as the
    commands' help names them (no kind is imported: `--help` starts no JAX). `files_only`:
    the kinds read from files (`shipped.FILELESS` left out)."""
    return ", ".join(WHAT[k] for k in KINDS if not (files_only and shipped.fileless(k)))


def _protocol():
    """`decoding.drafter` (imported on first use: this module stays JAX-free for --help)."""
    from medusa_jax.decoding import drafter

    return drafter


def kinds() -> tuple[str, ...]:
    return tuple(KINDS)


def drafter_class(kind: str) -> type:
    """The drafter class registered for `kind`."""
    if kind not in KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; known: {', '.join(KINDS)}")
    target = KINDS[kind]
    if isinstance(target, type):
        return target
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def classes():
    """(kind, class) of every registered kind, in order."""
    return [(kind, drafter_class(kind)) for kind in KINDS]


def kind_of(heads: Params) -> str:
    """The kind of drafter `heads` are the parameters of: the one bound to them, else the
    first whose `matches` says yes."""
    if isinstance(heads, _protocol().BoundParams):
        return heads.drafter.kind
    for kind, cls in classes():
        if cls.matches(heads):
            return kind
    names = ", ".join(sorted(heads)) if isinstance(heads, dict) else type(heads).__name__
    raise ValueError(f"these heads are of no known drafter kind ({', '.join(KINDS)}); "
                     f"their tensors: {names}")


def drafter_for(heads: Params, head_fn=None):
    """The drafter of `heads`: `head_fn` when it is a drafter already, else the one bound to
    `heads` (`BoundParams`), else the registered kind's, built from `head_fn` (a plain head
    function `(heads, hidden [B, H], lengths [B]) -> logits [K, B, V]`, tests' oracles)."""
    if isinstance(head_fn, _protocol().Drafter):
        return head_fn
    if head_fn is None and isinstance(heads, _protocol().BoundParams):
        return heads.drafter
    if head_fn is not None and not any(cls.matches(heads) for _, cls in classes()):
        # a head function takes whatever parameters it likes (tests' oracle heads)
        return drafter_class(HEAD_FN_KIND).from_head_fn(head_fn)
    return drafter_class(kind_of(heads)).from_head_fn(head_fn)


def depth_of(heads: Params) -> int | None:
    """How many tree levels the drafter of `heads` can fill (None: any)."""
    return drafter_for(heads).depth(heads)


def without_files(kind: str, **options):
    """The heads of a kind that needs no files (`shipped.FILELESS`: `--heads ngram`), bound
    to their drafter (`BoundParams`); `options` are the kind's (the n-gram sizes)."""
    return drafter_class(kind).without_files(**options)


def default_tree_of(heads: Params):
    """The tree the drafter bound to `heads` decodes with unless told (None: the model's)."""
    bound = isinstance(heads, _protocol().BoundParams)
    return heads.drafter.default_tree if bound else None


def check_heads_dtype(dtype, name: str = "heads dtype") -> None:
    """A one-line ValueError naming `name` unless `dtype` is one of `HEADS_DTYPES`."""
    if dtype not in HEADS_DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(HEADS_DTYPES)}, got {dtype!r}")


# Logical axes that stack copies of a tensor (one per head, one per block) rather than
# being one of its matrix dimensions.
_STACKING_AXES = ("medusa_heads", "medusa_layers")


def with_weight_dtype(heads: Params, dtype: str) -> Params:
    """Heads of any kind with their weight matrices (floating tensors with two logical axes
    or more besides the per-head and per-block stacking, `axes_of`) in `dtype`, one of
    `HEADS_DTYPES`; biases and norms keep theirs. The heads compute in the backbone's dtype
    whatever their weights are stored in: bfloat16 weights halve what a step reads of them,
    and change only what they propose (verification decides what is emitted)."""
    import jax.numpy as jnp

    check_heads_dtype(dtype)
    BoundParams = _protocol().BoundParams
    axes = axes_of(heads)
    out = dict(heads)
    for name, x in heads.items():
        matrix = len([a for a in axes.get(name, ()) if a not in _STACKING_AXES]) >= 2
        if matrix and jnp.issubdtype(x.dtype, jnp.floating):
            out[name] = x.astype(getattr(jnp, dtype))
    return BoundParams(out, heads.drafter) if isinstance(heads, BoundParams) else out


def axes_of(heads: Params) -> dict:
    """{name: logical axes} of heads of any kind (`BoundParams` like `heads`, to map with it)."""
    BoundParams = _protocol().BoundParams
    axes = drafter_class(kind_of(heads)).axes(heads)
    return BoundParams(axes, heads.drafter) if isinstance(heads, BoundParams) else axes
