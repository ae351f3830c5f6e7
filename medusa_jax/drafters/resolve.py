"""What a command decodes with, resolved in one place for the API, the serving engine and
the benchmark (`resolve`): the loaded drafter, with n-gram drafts merged into its tree when
asked (`merge_ngram`; `drafters.ngram.merged`), and a pool shared across requests."""

from __future__ import annotations

import dataclasses

from medusa_jax.decoding.drafter import BoundParams
from medusa_jax.drafters import registry
from medusa_jax.drafters.ngram import merged

Params = object  # a parameter pytree


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What to decode with: `heads` (bound to their drafter when merged), `drafter`, `tree`
    (with the n-gram chain when merged), `pool` (a shared pool, or None); all None but the
    tree for plain decoding."""

    heads: Params
    drafter: object
    tree: object
    pool: object = None


def resolve(heads: Params, tree, ngram: int | None = None,
            ngram_sizes: tuple = (None, None), shared_pool: int | None = None) -> Resolved:
    """`heads` (None: plain decoding) and `tree` -> what to decode with: `ngram` chain
    nodes merged into the tree (None: not merged; `ngram_sizes`: max_n, min_n), and the
    drafter reading a pool of `shared_pool` entries shared across requests (None: none)."""
    if heads is None:
        if shared_pool is not None:
            raise ValueError("ngram_shared: plain decoding drafts nothing (the n-gram drafter "
                             "does: --heads ngram)")
        return Resolved(None, None, tree)
    if ngram is not None:
        heads = merge_ngram(heads, ngram, *ngram_sizes)
    drafter = registry.drafter_for(heads)
    pool = None
    if shared_pool is not None:
        shared = drafter.shared_pool(shared_pool)
        if shared is None:
            raise ValueError(f"ngram_shared: a {drafter.kind} drafter keeps no shared n-gram "
                             f"pool (the n-gram drafter does: --heads ngram)")
        drafter, pool = shared
    if ngram is not None:
        tree = drafter.tree_for(tree)
    return Resolved(heads, drafter, tree, pool)


def merge_ngram(heads: Params, extra: int | None = None, max_n: int | None = None,
                min_n: int | None = None):
    """`heads` of any kind bound to a drafter that adds the n-gram continuation (`extra`
    chain nodes; None: the measured default) to their tree: decode with
    `heads.drafter.tree_for(tree)` (`drafters.ngram.merged`)."""
    ngram = registry.without_files("ngram", max_n=max_n, min_n=min_n).drafter
    if isinstance(heads, BoundParams) and isinstance(heads.drafter, type(ngram)):
        raise ValueError("n-gram drafts merge into another drafter's tree, not the n-gram "
                         "drafter's own")
    return merged.merged(heads, merged.DEFAULT_EXTRA if extra is None else extra, ngram)
