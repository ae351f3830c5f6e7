"""Fixed drafts among drawn ones (`Proposal.fixed`, merged n-gram drafts): acceptance offers
them first, each as a deterministic draft, and leaves the drawn drafts' q as it was."""

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.acceptance import rejection_drafted
from medusa_jax.decoding.tree import Tree


def test_a_fixed_draft_is_offered_before_the_drawn_one():
    """One node, target p = (0.5, 0.3, 0.2); rank 0 drawn (token 1, from q = (0.2, 0.8, 0)),
    rank 1 fixed (token 2). Token 2 first, accepted with p(2) = 0.2; else p' = (0.625, 0.375,
    0) and token 1 is accepted with min(1, 0.375 / 0.8) = 0.46875 (q untouched by the fixed
    draft); else the bonus is token 0. So: token 2 w.p. 0.2, token 1 w.p. 0.375, token 0 w.p.
    0.425. Without `fixed`, token 1 would be offered first (0.375) and token 2 after it."""
    tree = Tree.from_paths([[0], [1]])
    n = 40000
    logp = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]] * 3, jnp.float32))[None].repeat(n, 0)
    logq = jnp.log(jnp.asarray([[0.2, 0.8, 0.0]] * 3, jnp.float32))[None].repeat(n, 0)
    draws = jnp.broadcast_to(jnp.asarray([[1, 2], [0, 0], [0, 0]], jnp.int32), (n, 3, 2))
    fixed = jnp.broadcast_to(jnp.asarray([[False, True], [False] * 2, [False] * 2]),
                             (n, 3, 2))
    keys = jax.random.split(jax.random.key(0), n)
    best, acc, root = rejection_drafted(logp, tree, keys, None, draws, logq, fixed)
    acc, root, best = np.asarray(acc), np.asarray(root), np.asarray(best)
    # an accepted draft is walked into (node 1: token 1, node 2: token 2), else the bonus
    first = np.where(acc == 1, np.asarray([1, 2])[np.minimum(best, 1)], root)
    assert np.all(acc[first == 0] == 0) and np.all(acc[first != 0] == 1)
    np.testing.assert_allclose(np.bincount(first, minlength=3) / n, [0.425, 0.375, 0.2],
                               atol=0.01)
