"""Filling a static tree depth by depth, for any drafter that drafts a node's children from
a call over its parent (Hydra's heads, EAGLE-3's layer, an MTP module): the kind gives one
function, `level(state, d, paths, tokens) -> (state, logits [B, E, Vd])`, the logits of the
E nodes at depth d that have children (`paths` [E, d+1]: their root-to-node paths, host
numpy; `tokens` [B, N] every node's token so far), threading a state of its own (its tree
keys/values, its outputs); `draft_tree` picks each node's children from them (the top-k, or
drawn by a `decoding.step.DraftSampler`), maps draft ids to the target vocabulary
(`Vocab`), and keeps each node's log-probability for a dynamic tree's choice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from medusa_jax.decoding.step import small_top_k
from medusa_jax.decoding.tree import tree_plan


@dataclasses.dataclass(frozen=True)
class Vocab:
    """How a drafter's draft ids map to the target vocabulary: `to_target(ids)` (identity by
    default), `spread(logq [..., Vd]) -> [..., V]` the draft distribution over the target
    vocabulary (identity), `size` V (None: the logits' own), `fill` the log-probability of
    a node that drafts nothing (a leaf)."""

    to_target: object = None
    spread: object = None
    size: int | None = None
    fill: float = 0.0


def draft_tree(level, state, root: jax.Array, paths_ranks, num_nodes: int,
               want_logp: bool = True, draw=None, top_k: int = 0, vocab: Vocab = Vocab(),
               top_k_fn=small_top_k):
    """Fill a static tree (node i+1 = paths_ranks[i]) from `level` (above), starting from
    `state`: root [B] -> (tokens [B, N] target ids, node log-probabilities [B, N]: each
    node's own, under its parent's call; 0 at the root; None unless `want_logp`; sampled
    drafts or None). A node of rank r takes its parent's r-th most likely draft id, or with
    `draw` its r-th draw, and the drafts come back as (each node's `top_k` draws [B, N,
    top_k] and the distribution they were drawn from [B, N, V], over the target
    vocabulary)."""
    to_target = vocab.to_target or (lambda ids: ids)
    spread = vocab.spread or (lambda lq: lq)
    b = root.shape[0]
    tokens = jnp.zeros((b, num_nodes), jnp.int32).at[:, 0].set(root.astype(jnp.int32))
    logp = jnp.zeros((b, num_nodes), jnp.float32)
    draws = logq = None
    for d, (paths, nodes, parent_pos, rank, k) in enumerate(tree_plan(
            tuple(map(tuple, paths_ranks)))):
        state, logits = level(state, d, paths, tokens)  # [B, E, Vd]
        if draw is None:
            top = top_k_fn(logits, k)  # [B, E, k] draft ids
        else:
            top, lq = draw.top_k(logits, k, axis=0, call=d)  # [B, E, k], [B, E, Vd]
            if draws is None:
                draws = jnp.zeros((b, num_nodes, top_k), jnp.int32)
                logq = jnp.full((b, num_nodes, vocab.size or logits.shape[-1]), vocab.fill,
                                jnp.float32)
            parents = paths[:, -1]  # the E nodes whose children this call drafts
            draws = draws.at[:, parents, :k].set(to_target(top).astype(jnp.int32))
            logq = logq.at[:, parents].set(spread(lq))
        tokens = tokens.at[:, nodes].set(to_target(top[:, parent_pos, rank]).astype(jnp.int32))
        if want_logp:
            own = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), top, axis=-1)
            logp = logp.at[:, nodes].set(own[:, parent_pos, rank])
    return tokens, (logp if want_logp else None), (None if draw is None else (draws, logq))
