"""Merged drafts: any drafter's tree with the n-gram continuation added as one more branch,
so one verification pass checks both and acceptance keeps the longest accepted path.

`merge_tree(tree, extra)` adds a chain of `extra` nodes under the root at a rank of its own
(the tree's top_k; the merged tree has top_k + 1). A static tree verifies its nodes and the
chain's: the budget is the drafter's tree plus `extra` tokens a step. A dynamic tree chooses
its `size` nodes from its pool as before and verifies the chain's nodes besides (`size +
extra` in all); the chain is never traded against the drafter's nodes. The drafter
(`MergedDrafter`) runs the inner drafter on the tree without the chain, the n-gram drafter
for the chain, and lays both on the merged tree.

Rejection sampling: the inner drafter draws its drafts as it does alone (`DraftSampler`),
and the chain's tokens are marked fixed (`Proposal.fixed`): acceptance offers the chain's
first token at the root before the drawn ones, as a deterministic draft (accepted with the
target's probability), then the drawn ones with their own q; lossless either way.

`merged(heads, extra)`: heads of any kind bound to their merged drafter; decode them with
`MergedDrafter.tree_for(tree)`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.drafter import BoundParams, Context, Drafter
from medusa_jax.decoding.step import Proposal, tree_proposal
from medusa_jax.decoding.tree import DynamicTree, Tree
from medusa_jax.drafters import shipped
from medusa_jax.drafters.registry import drafter_for
from medusa_jax.drafters.ngram.drafter import NgramCarry, NgramDrafter
from medusa_jax.model.backbone import Params

DEFAULT_EXTRA = shipped.NGRAM_MERGED_DEFAULT  # the chain's length, chosen by measurement


@dataclasses.dataclass(frozen=True)
class MergedDynamicTree(DynamicTree):
    """A dynamic tree that takes its pool as it is: a merged pool was cut to what its inner
    tree can choose before the chain was added, and a second cut could drop chain nodes,
    which are always verified. The inner tree of a merged one is such a tree too (its pool
    may hold nodes it never chooses, where the merged tree went through a `DynamicTree`)."""

    def __post_init__(self):
        if not 1 <= self.size <= self.pool.num_nodes - 1:
            raise ValueError(f"tree {self.name!r}: a dynamic tree chooses 1 .. "
                             f"{self.pool.num_nodes - 1} nodes, got {self.size}")


def merge_tree(tree: Tree | DynamicTree, extra: int) -> Tree | DynamicTree:
    """`tree` with a chain of `extra` n-gram nodes under the root (rank `top_k`)."""
    if not isinstance(extra, int) or isinstance(extra, bool) or extra < 1:
        raise ValueError(f"ngram extra nodes must be an integer >= 1, got {extra!r}")
    static = tree.pool if isinstance(tree, DynamicTree) else tree
    k = static.top_k
    paths = static.to_json() + [[k] + [0] * d for d in range(extra)]
    merged = Tree.from_paths(paths, top_k=k + 1, name=f"{static.name}+ngram{extra}")
    if isinstance(tree, DynamicTree):
        return MergedDynamicTree(merged, tree.size + extra, name=f"{tree.name}+ngram{extra}")
    return merged


def split_tree(tree: Tree | DynamicTree) -> tuple[Tree | DynamicTree, int]:
    """A merged tree -> (the inner tree, the chain's length)."""
    static = tree.pool if isinstance(tree, DynamicTree) else tree
    k = static.top_k - 1
    inner = [list(p) for p in static.paths_ranks if p[0] != k]
    extra = len(static.paths_ranks) - len(inner)
    if extra == 0 or not inner or not all(
            p == (k,) + (0,) * (len(p) - 1) for p in static.paths_ranks if p[0] == k):
        raise ValueError(f"tree {static.name!r} holds no n-gram chain: build it with "
                         f"merge_tree(tree, extra)")
    inner_static = Tree.from_paths(inner, top_k=k, name=static.name)
    if not isinstance(tree, DynamicTree):
        return inner_static, extra
    return MergedDynamicTree(inner_static, tree.size - extra, name=tree.name), extra


@functools.cache
def _layout(paths_ranks: tuple, top_k: int) -> np.ndarray:
    """Each merged node's index in [inner tree's nodes (root first), chain nodes]."""
    k = top_k - 1
    inner = sorted((p for p in paths_ranks if p[0] != k), key=lambda p: (len(p), p))
    index = {(): 0, **{p: i + 1 for i, p in enumerate(inner)}}
    n_in = len(inner) + 1
    return np.array([0] + [n_in + len(p) - 1 if p[0] == k else index[p] for p in paths_ranks],
                    np.int32)


def _rows_first(carry: NgramCarry, axis: int) -> NgramCarry:
    """An n-gram carry kept with its rows on `axis` (0 or 1) -> rows first."""
    if axis == 0:
        return carry
    return NgramCarry(tokens=jnp.moveaxis(carry.tokens, axis, 0),
                      length=carry.length.reshape(-1))


def _rows_at(carry: NgramCarry, axis: int) -> NgramCarry:
    """The inverse of `_rows_first`: tokens [S, B] and length [1, B] for axis 1."""
    if axis == 0:
        return carry
    if axis != 1:
        raise ValueError(f"a merged drafter's inner carry has its rows on axis 0 or 1, "
                         f"got {axis}")
    return NgramCarry(tokens=jnp.moveaxis(carry.tokens, 0, 1), length=carry.length[None])


@dataclasses.dataclass(frozen=True)
class MergedDrafter(Drafter):
    """`inner`: any drafter; `ngram`: the n-gram drafter of the chain; `extra`: its length
    (what `tree_for` adds). The carry is (the inner's, the n-gram history with its rows on
    the inner's batch axis)."""

    inner: object
    ngram: NgramDrafter = NgramDrafter()
    extra: int = DEFAULT_EXTRA

    def __post_init__(self):
        merge_tree(Tree.from_paths([[0]]), self.extra)  # the same check, before any work

    @property
    def kind(self) -> str:
        return self.inner.kind  # the parameters are the inner drafter's

    @property
    def name(self) -> str:
        return f"{self.inner.kind}+ngram"

    @property
    def batch_axis(self) -> int:
        return self.inner.batch_axis

    @property
    def context(self) -> Context:
        # the n-gram history follows plain steps and rebuilds from tokens; so does the
        # pair, unless the inner drafter keeps hidden states of every position
        inner = self.inner.context
        return inner if inner is Context.HIDDEN_STATES else self.ngram.context

    @property
    def aux_layers(self) -> tuple:
        return tuple(self.inner.aux_layers)

    def matches(self, heads: Params) -> bool:
        return self.inner.matches(heads)

    def axes(self, heads: Params) -> dict:
        return self.inner.axes(heads)

    def tree_for(self, tree: Tree | DynamicTree) -> Tree | DynamicTree:
        return merge_tree(tree, self.extra)

    def depth(self, heads) -> None:
        return None  # the inner tree is checked against the inner drafter in `prepare`

    def num_heads(self, heads, carry) -> int:
        return 1 << 30

    def prepare(self, heads: Params, tree, cpu_kernels: bool = False) -> Params:
        inner_tree, _ = split_tree(tree)
        have = self.inner.depth(heads)
        if have is not None and have < inner_tree.depth:
            raise ValueError(f"tree {inner_tree.name!r} has depth {inner_tree.depth} but "
                             f"there are only {have} {self.inner.kind.title()} heads")
        return BoundParams(dict(self.inner.prepare(heads, inner_tree, cpu_kernels)), self)

    def _ngram_carry(self, carry):
        return _rows_first(carry, self.batch_axis)

    def begin(self, params, heads, hidden, aux, tokens, lengths, root, capacity: int):
        inner = self.inner.begin(params, heads, hidden, aux, tokens, lengths, root, capacity)
        ngram = self.ngram.begin(params, heads, hidden, aux, tokens, lengths, root, capacity)
        return inner, _rows_at(ngram, self.batch_axis)

    def advance(self, params, heads, carry, hidden, aux, tokens, acc_len, next_root, lengths,
                live):
        inner, ngram = carry
        inner = self.inner.advance(params, heads, inner, hidden, aux, tokens, acc_len,
                                   next_root, lengths, live)
        ngram = self.ngram.advance(params, heads, self._ngram_carry(ngram), hidden, aux,
                                   tokens, acc_len, next_root, lengths, live)
        return inner, _rows_at(ngram, self.batch_axis)

    def append(self, carry, tokens, live):
        inner, ngram = carry
        if self.inner.follows_plain_steps:
            inner = self.inner.append(inner, tokens, live)
        ngram = self.ngram.append(self._ngram_carry(ngram), tokens, live)
        return inner, _rows_at(ngram, self.batch_axis)

    def propose(self, params, heads, carry, root, tree, draw=None) -> Proposal:
        inner_tree, extra = split_tree(tree)
        static = tree.pool if isinstance(tree, DynamicTree) else tree
        inner_carry, ngram = carry
        prop = self.inner.propose(params, heads, inner_carry, root, inner_tree, draw)
        chain, _ = self.ngram.drafts(self._ngram_carry(ngram), root, 1, extra)
        chain = chain[:, 0].astype(jnp.int32)  # [B, extra]
        at = jnp.asarray(_layout(static.paths_ranks, static.top_k))
        tokens = jnp.concatenate([prop.tokens, chain], axis=1)[:, at]
        drafts = _merged_drafts(prop, chain, at)
        if not isinstance(tree, DynamicTree):
            return tree_proposal(tokens, None, tree).replace(**drafts)
        b, t = prop.fed.shape
        j = jnp.arange(extra)
        fed_mask = jnp.zeros((b, t + extra, t + extra), bool)
        fed_mask = fed_mask.at[:, :t, :t].set(prop.fed_mask)
        fed_mask = fed_mask.at[:, t:, 0].set(True)  # the chain attends the root ...
        fed_mask = fed_mask.at[:, t:, t:].set(j[:, None] >= j[None, :])  # ... and itself
        depth = jnp.broadcast_to(1 + j, (b, extra)).astype(prop.fed_depth.dtype)
        return Proposal(
            fed=jnp.concatenate([prop.fed, chain], axis=1),
            fed_depth=jnp.concatenate([prop.fed_depth, depth], axis=1),
            fed_mask=fed_mask, tokens=tokens,
            valid=jnp.concatenate([prop.valid, jnp.ones((b, extra), bool)], axis=1)[:, at],
            slot=jnp.concatenate([prop.slot, jnp.broadcast_to(t + j, (b, extra))
                                  .astype(prop.slot.dtype)], axis=1)[:, at], **drafts)


def _merged_drafts(prop: Proposal, chain: jax.Array, at: jax.Array) -> dict:
    """The inner drafter's drawn drafts (draws [B, N_in, k], draft_logq [B, N_in, V]) and the
    chain [B, extra] laid on the merged tree's nodes (`at`): each node's drafts [B, N, k + 1]
    (the root's rank k: the chain's first token; a chain node's rank 0: the next one) and
    which of them are fixed [B, N, k + 1]; a chain node draws nothing (q of no mass)."""
    if prop.draws is None:
        return {}
    b, n_in, k = prop.draws.shape
    extra = chain.shape[1]
    draws = jnp.zeros((b, n_in + extra, k + 1), prop.draws.dtype)
    draws = draws.at[:, :n_in, :k].set(prop.draws).at[:, 0, k].set(chain[:, 0])
    draws = draws.at[:, n_in:n_in + extra - 1, 0].set(chain[:, 1:])
    fixed = jnp.zeros(draws.shape, bool)
    if prop.fixed is not None:
        fixed = fixed.at[:, :n_in, :k].set(prop.fixed)
    fixed = fixed.at[:, 0, k].set(True).at[:, n_in:n_in + extra - 1, 0].set(True)
    none = jnp.full((b, extra, prop.draft_logq.shape[-1]), -jnp.inf, prop.draft_logq.dtype)
    logq = jnp.concatenate([prop.draft_logq, none], axis=1)
    return dict(draws=draws[:, at], draft_logq=logq[:, at], fixed=fixed[:, at])


def merged(heads: Params, extra: int = DEFAULT_EXTRA, ngram: NgramDrafter | None = None,
           head_fn=None) -> BoundParams:
    """Heads of any kind bound to a `MergedDrafter` over their own drafter: decode them with
    `drafter.tree_for(tree)` (`heads.drafter`)."""
    inner = drafter_for(heads, head_fn)
    return BoundParams(dict(heads), MergedDrafter(inner, ngram or NgramDrafter(), extra))
