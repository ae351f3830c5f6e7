"""The one place the decoders learn how to find the drafter of parameters that carry none
(plain heads, a plain head function): the drafters layer, above this one, installs its
lookup here when its package is imported (`medusa_jax.drafters`). Stdlib only, so the
drafters package can install it without starting JAX; decoding never imports drafters."""

from __future__ import annotations

_lookup = None


def install(fn) -> None:
    """`fn(heads, head_fn) -> drafter`: the lookup of parameters that carry no drafter."""
    global _lookup
    _lookup = fn


def lookup(heads, head_fn=None):
    """The installed lookup's drafter of `heads` (one-line error when none is installed)."""
    if _lookup is None:
        raise ValueError("these heads carry no drafter and no drafter kind is registered: "
                         "import medusa_jax.drafters, or pass the drafter (head_fn=)")
    return _lookup(heads, head_fn)
