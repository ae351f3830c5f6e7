"""An n-gram (prompt-lookup) drafter (`decoding.drafter.Drafter`): no parameters, no training.

The carry (`NgramCarry`, rows on axis 0) is each row's token history: the prompt, then every
committed token. To propose, the root is put after the history and the context's last n
tokens are looked up in it: the tokens that followed their most recent earlier occurrence
are the drafts, the longest n first (from `max_n` down to `min_n`). One vectorised match
over the whole buffer per step, static shapes, nothing read back to the host.

The tree's branches get distinct continuations: candidate 0 is the best occurrence (longest
n, then most recent); candidate r the best one whose next token differs from those of
candidates 0 .. r-1. A node whose path's deepest nonzero rank is r (0 when all its ranks are
0) takes candidate r's token at its depth: the chain of rank-0 nodes is the best
continuation, a depth-1 node of rank r and its rank-0 chain the r-th alternative. A
continuation that runs into the root repeats with the occurrence's period (a match n tokens
long ending p tokens before the root says the text repeats every p tokens). Rows with no
match draft the root over and over: verification rejects what is wrong.

Rejection sampling verifies these drafts as deterministic ones (the step's `draw` is not
used): each is accepted with the target's probability, which is lossless.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.drafter import BoundParams, Context, refuse_head_fn
from medusa_jax.decoding.step import Proposal, tree_proposal
from medusa_jax.decoding.tree import DynamicTree, Tree, chain_tree
from medusa_jax.drafters import shipped
from medusa_jax.drafters.kind import Kind
from medusa_jax.drafters.ngram import pool
from medusa_jax.model.backbone import Params
from medusa_jax.runtime import pytree as struct

DEFAULT_MAX_N = shipped.NGRAM_DEFAULT_MAX
DEFAULT_MIN_N = shipped.NGRAM_DEFAULT_MIN
MAX_N_LIMIT = shipped.NGRAM_SIZE_LIMIT  # one comparison pass over the history per n

# a dynamic tree ranks nodes by these stand-in log-probabilities (the drafter has none):
# the best continuation first, then the alternatives in order, unmatched ones last
_MATCHED_LOGP = -0.05
_PER_CANDIDATE_LOGP = -0.05
_UNMATCHED_LOGP = -20.0


@struct.dataclass
class NgramCarry:
    tokens: jax.Array  # [B, S + 1] int32: the committed tokens (S: the capacity), then room
    length: jax.Array  # [B] int32: committed tokens in `tokens`


def match_lengths(hist: jax.Array, last: jax.Array, max_n: int, min_n: int) -> jax.Array:
    """hist [B, S] int32 with each row's context ending at index last [B] -> [B, S] int32:
    for each end position j < last, the longest n <= max_n such that hist[j-n+1 .. j] equals
    hist[last-n+1 .. last] (the n-gram ending at j is the context's last n tokens), or 0 where
    that is below min_n."""
    b, s = hist.shape
    j = jnp.arange(s)[None]  # [1, S]
    run = jnp.ones((b, s), bool)
    n = jnp.zeros((b, s), jnp.int32)
    for t in range(max_n):  # compare hist[j - t] with hist[last - t]
        shifted = jnp.pad(hist, ((0, 0), (t, 0)))[:, :s]
        target = jnp.take_along_axis(hist, jnp.maximum(last - t, 0)[:, None], axis=1)
        run = run & (shifted == target) & (j >= t) & ((last - t) >= 0)[:, None]
        n = n + run
    n = jnp.where(j < last[:, None], n, 0)
    return jnp.where(n >= min_n, n, 0)


def continuations(hist: jax.Array, last: jax.Array, num: int, depth: int, max_n: int,
                  min_n: int) -> tuple[jax.Array, jax.Array]:
    """hist [B, S] int32 (each row's context ends at index last [B]) -> (drafts [B, num,
    depth] int32, found [B, num] bool): `num` continuations of the context, each `depth`
    tokens, best first (the module docstring says which); where none is found, the last
    token repeated."""
    b, s = hist.shape
    n = match_lengths(hist, last, max_n, min_n)
    j = jnp.arange(s, dtype=jnp.int32)[None]
    score = jnp.where(n > 0, n * s + j, -1)  # longest n, then most recent
    nxt = jnp.concatenate([hist[:, 1:], hist[:, -1:]], axis=1)  # [B, S] the token after j
    ends, found = [], []
    for _ in range(num):
        end = jnp.argmax(score, axis=1).astype(jnp.int32)  # [B]
        ok = jnp.take_along_axis(score, end[:, None], axis=1)[:, 0] >= 0
        ends.append(end)
        found.append(ok)
        first = jnp.take_along_axis(nxt, end[:, None], axis=1)  # [B, 1]
        score = jnp.where(nxt == first, -1, score)  # the next candidate starts differently
    ends = jnp.stack(ends, axis=1)  # [B, num]
    found = jnp.stack(found, axis=1)
    period = jnp.maximum(last[:, None] - ends, 1)  # [B, num]
    d = jnp.arange(depth, dtype=jnp.int32)[None, None]  # [1, 1, D]
    at = ends[..., None] + 1 + d % period[..., None]  # [B, num, D]
    drafts = jnp.take_along_axis(hist, at.reshape(b, -1), axis=1).reshape(b, num, depth)
    fallback = jnp.take_along_axis(hist, last[:, None], axis=1)[:, :, None]  # [B, 1, 1]
    return jnp.where(found[..., None], drafts, fallback), found


@functools.cache
def node_plan(paths_ranks: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Each node's (candidate [N], depth [N]) of a tree's paths (node i+1 = paths_ranks[i];
    the root: candidate 0 at depth 0): the candidate is the path's deepest nonzero rank."""
    cand = [0] + [next((r for r in reversed(p) if r), 0) for p in paths_ranks]
    depth = [0] + [len(p) for p in paths_ranks]
    return np.array(cand, np.int32), np.array(depth, np.int32)


def history_with_root(carry: NgramCarry, root: jax.Array) -> jax.Array:
    """The carry's buffer [B, S + 1] with each row's root at index `length`."""
    rows = jnp.arange(root.shape[0])
    return carry.tokens.at[rows, carry.length].set(root.astype(jnp.int32), mode="drop")


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Kind):
    """`max_n`, `min_n`: the n-gram lengths looked up, longest first (1 <= min_n <= max_n)."""

    max_n: int = DEFAULT_MAX_N
    min_n: int = DEFAULT_MIN_N
    kind = "ngram"
    # its history holds every committed token's id: plain steps hand it theirs, and after
    # a cached prefix it is begun on the whole prompt
    context = Context.TOKENS
    batch_axis = 0  # of the carry: every leaf has the rows first

    def __post_init__(self):
        for name in ("max_n", "min_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_N_LIMIT:
                raise ValueError(f"ngram {name} must be an integer in 1..{MAX_N_LIMIT}, "
                                 f"got {v!r}")
        if self.min_n > self.max_n:
            raise ValueError(f"ngram min_n ({self.min_n}) must be <= max_n ({self.max_n})")

    @classmethod
    def matches(cls, heads: Params) -> bool:
        # no parameters: every other kind has tensors
        return heads is not None and hasattr(heads, "__len__") and len(heads) == 0

    @classmethod
    def shape_of(cls, heads: Params) -> tuple[int, int]:
        return 0, 0  # no heads, no blocks

    @classmethod
    def axes(cls, heads: Params) -> dict:
        return {}

    @classmethod
    def without_files(cls, max_n: int | None = None, min_n: int | None = None
                      ) -> BoundParams:
        """The drafter as heads (`--heads ngram`): no tensors, bound to its sizes (None:
        the defaults)."""
        return BoundParams({}, cls(DEFAULT_MAX_N if max_n is None else max_n,
                                   DEFAULT_MIN_N if min_n is None else min_n))

    @classmethod
    def init(cls, cfg, backbone: Params, key, depth: int) -> BoundParams:
        """The drafter as heads, with its default sizes (no tensors: nothing to draw)."""
        return cls.without_files()

    @property
    def default_tree(self) -> Tree:
        """What it decodes with unless told: one continuation (a chain does as well as a
        branched tree of the same size, docs/ngram.md)."""
        return chain_tree(shipped.NGRAM_ALONE_CHAIN)

    @classmethod
    def from_head_fn(cls, head_fn) -> "NgramDrafter":
        refuse_head_fn(head_fn, "the n-gram drafter has no heads")
        return cls()

    def prepare(self, heads: Params, tree, cpu_kernels: bool = False) -> Params:
        return heads

    def begin(self, params, heads, hidden, aux, tokens, lengths, root, capacity: int
              ) -> NgramCarry:
        """After prefill: tokens [B, P] right-padded to lengths [B] -> the history, with room
        for `capacity` tokens (and the root after them)."""
        b, p = tokens.shape
        buf = jnp.zeros((b, capacity + 1), jnp.int32)
        keep = min(p, capacity + 1)
        j = jnp.arange(keep)[None]
        prompt = jnp.where(j < lengths[:, None], tokens[:, :keep].astype(jnp.int32), 0)
        return NgramCarry(tokens=buf.at[:, :keep].set(prompt),
                          length=lengths.astype(jnp.int32))

    def advance(self, params, heads, carry, hidden, aux, tokens, acc_len, next_root, lengths,
                live) -> NgramCarry:
        """After commit: tokens [B, W] the accepted path, root first, of which acc_len + 1
        [B] are committed -> the history with them appended (live rows only)."""
        b, w = tokens.shape
        n = jnp.where(live, acc_len + 1, 0).astype(jnp.int32)
        j = jnp.arange(w, dtype=jnp.int32)[None]
        at = jnp.where(j < n[:, None], carry.length[:, None] + j, carry.tokens.shape[1])
        buf = carry.tokens.at[jnp.arange(b)[:, None], at].set(tokens.astype(jnp.int32),
                                                              mode="drop")
        return NgramCarry(tokens=buf, length=carry.length + n)

    def depth(self, heads) -> None:
        return None  # any depth: a continuation is as long as asked

    def num_heads(self, heads, carry) -> int:
        return 1 << 30  # the same, for callers that ask the carry

    def drafts(self, carry: NgramCarry, root: jax.Array, num: int, depth: int):
        """(drafts [B, num, depth], found [B, num]): the root's `num` best continuations."""
        hist = history_with_root(carry, root)
        return continuations(hist, carry.length, num, depth, self.max_n, self.min_n)

    def propose(self, params, heads, carry, root, tree, draw=None) -> Proposal:
        static = tree.pool if isinstance(tree, DynamicTree) else tree
        drafts, found = self.drafts(carry, root, static.top_k, static.depth)
        tokens, logp = tree_tokens(drafts, found, root, static.paths_ranks)
        return tree_proposal(tokens, logp if isinstance(tree, DynamicTree) else None, tree)

    def append(self, carry: NgramCarry, tokens: jax.Array, live: jax.Array) -> NgramCarry:
        """After a plain step: tokens [B] each row's committed token -> the history with it
        (live [B] rows only)."""
        b, cap = carry.tokens.shape
        at = jnp.where(live, carry.length, cap)  # past the buffer: dropped
        buf = carry.tokens.at[jnp.arange(b), at].set(tokens.astype(jnp.int32), mode="drop")
        return NgramCarry(tokens=buf, length=carry.length + live.astype(jnp.int32))

    def shared_pool(self, size: int):
        """(this drafter reading a pool shared across requests of `size` entries, the pool:
        `drafters.ngram.pool`); a one-line ValueError when the table would not fit."""
        table = pool.NgramPool(size, self.max_n)
        return PooledNgramDrafter(self.max_n, self.min_n, size=int(size)), table


def tree_tokens(drafts: jax.Array, found: jax.Array, root: jax.Array, paths_ranks: tuple
                ) -> tuple[jax.Array, jax.Array]:
    """Continuations drafts [B, K, D] (found [B, K]) laid on a tree (`node_plan`) -> (every
    node's token [B, N], its stand-in log-probability [B, N] for a dynamic tree's choice)."""
    cand, depth = node_plan(tuple(map(tuple, paths_ranks)))
    tokens = drafts[:, cand, np.maximum(depth - 1, 0)].astype(jnp.int32)  # [B, N]
    tokens = tokens.at[:, 0].set(root.astype(jnp.int32))
    own = jnp.where(found[:, cand], _MATCHED_LOGP + _PER_CANDIDATE_LOGP * cand[None],
                    _UNMATCHED_LOGP)
    return tokens, own.at[:, 0].set(0.0)


@struct.dataclass
class PooledCarry:
    hist: NgramCarry
    hits: jax.Array  # [B] int32: lookups that found an entry in the pool


@dataclasses.dataclass(frozen=True)
class PooledNgramDrafter(NgramDrafter):
    """The n-gram drafter that also reads a shared pool of `size` entries (its parameters:
    the table, `NgramPool.into`); n-grams of `max_n` tokens are pooled."""

    size: int = 1

    @property
    def name(self) -> str:
        return f"{self.kind} (shared pool of {self.size} entries)"

    def prepare(self, heads, tree, cpu_kernels: bool = False) -> BoundParams:
        """The bare parameters with an empty table (what `NgramPool.into` fills)."""
        empty = {pool.KEYS: jnp.zeros((self.size,), jnp.uint32),
                 pool.LENS: jnp.zeros((self.size,), jnp.int32),
                 pool.NEXT: jnp.zeros((self.size, pool.POOL_WIDTH), jnp.int32)}
        return BoundParams({**dict(heads), **empty}, self)

    def begin(self, params, heads, hidden, aux, tokens, lengths, root, capacity):
        hist = super().begin(params, heads, hidden, aux, tokens, lengths, root, capacity)
        return PooledCarry(hist=hist, hits=jnp.zeros_like(hist.length))

    def advance(self, params, heads, carry, hidden, aux, tokens, acc_len, next_root, lengths,
                live):
        # the lookup the step's proposal made (root tokens[:, 0] after the history), counted
        found, _, _ = pool.lookup(heads, history_with_root(carry.hist, tokens[:, 0]),
                             carry.hist.length, self.max_n)
        hist = super().advance(params, heads, carry.hist, hidden, aux, tokens, acc_len,
                               next_root, lengths, live)
        return PooledCarry(hist=hist, hits=carry.hits + (found & live).astype(jnp.int32))

    def append(self, carry, tokens, live):
        return PooledCarry(hist=super().append(carry.hist, tokens, live), hits=carry.hits)

    def pool_hits(self, carry) -> jax.Array:
        """[B] int32: each row's lookups that found an entry."""
        return carry.hits

    def propose(self, params, heads, carry, root, tree, draw=None):
        static = tree.pool if isinstance(tree, DynamicTree) else tree
        hist = history_with_root(carry.hist, root)
        last = carry.hist.length
        drafts, found = continuations(hist, last, static.top_k, static.depth, self.max_n,
                                      self.min_n)
        # the pool's context is max_n tokens, as long as any match in the row's own history
        # can be: where it hits, its continuation is the best (it also drafts with no
        # second pass over the history)
        use, nxt, count = pool.lookup(heads, hist, last, self.max_n)
        depth = static.depth
        cont = nxt[:, :depth] if depth <= pool.POOL_WIDTH else \
            jnp.pad(nxt, ((0, 0), (0, depth - pool.POOL_WIDTH)))  # [B, D]
        pooled = jnp.where(jnp.arange(depth)[None] < count[:, None], cont, drafts[:, 0])
        drafts = drafts.at[:, 0].set(jnp.where(use[:, None], pooled, drafts[:, 0]))
        found = found.at[:, 0].set(found[:, 0] | use)
        tokens, logp = tree_tokens(drafts, found, root, static.paths_ranks)
        return tree_proposal(tokens, logp if isinstance(tree, DynamicTree) else None, tree)
