"""What a command decodes with, resolved once for the API, the serving engine and the
benchmark: the loaded drafter, with n-gram drafts merged into its tree when asked
(`merge_ngram`; `drafters.ngram.merged`)."""

from __future__ import annotations

from medusa_jax.drafters import registry
from medusa_jax.drafters.ngram import merged

Params = object  # a parameter pytree


def merge_ngram(heads: Params, extra: int | None = None, max_n: int | None = None,
                min_n: int | None = None):
    """`heads` of any kind bound to a drafter that adds the n-gram continuation (`extra`
    chain nodes; None: the measured default) to their tree: decode with
    `heads.drafter.tree_for(tree)` (`drafters.ngram.merged`)."""
    ngram = registry.without_files("ngram", max_n=max_n, min_n=min_n).drafter
    if isinstance(getattr(heads, "drafter", None), type(ngram)):
        raise ValueError("n-gram drafts merge into another drafter's tree, not the n-gram "
                         "drafter's own")
    return merged.merged(heads, merged.DEFAULT_EXTRA if extra is None else extra, ngram)
