"""A drafter's own KV cache over the committed context (`ContextCache`, rows on axis 0): the
carry of a kind that runs a decoder layer of its own over every committed position (EAGLE-3;
a DeepSeek-style MTP module), declared `Context.HIDDEN_STATES`.

Entry p of such a cache is the drafter's layer run at position p on (features of token p,
the embedding of token p+1): `next_tokens` gives each entry's token p+1 (the root after a
row's last one), so the carry is complete once the root is chosen. The kind appends entries
with its layer (`write_rows` puts each row's new keys/values after its `length`), keeps the
layer's output at the last entry in `out` (what predicts the tokens after the root), and
cuts the cache to the backbone's attention window with `fit` (its `Drafter.window`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from medusa_jax.model.cache import MAX_UNROLLED_ROWS
from medusa_jax.runtime import pytree as struct


@struct.dataclass
class ContextCache:
    # heads first, the layout the attention reads in place (no per-call transposed copy)
    k: jax.Array  # [B, KVH, S, D] the drafter's keys (rotated) of the committed entries
    v: jax.Array  # [B, KVH, S, D]
    out: jax.Array  # [B, H] the layer's output at entry length-1 (predicts the depth-1 nodes)
    length: jax.Array  # [B] int32 entries committed (= the backbone's cache length)


def init(batch: int, kv_heads: int, capacity: int, head_dim: int, hidden: int,
         dtype=jnp.float32) -> ContextCache:
    """An empty cache with room for `capacity` entries per row."""
    kv = jnp.zeros((batch, kv_heads, capacity, head_dim), dtype)
    return ContextCache(k=kv, v=kv, out=jnp.zeros((batch, hidden), dtype),
                        length=jnp.zeros((batch,), jnp.int32))


def fit(carry: ContextCache, slots: int) -> ContextCache:
    """The cache with room for `slots` entries: its keys/values cut, or zero-padded at the
    end (only a row's first `length` entries hold anything, the rest are masked)."""
    s = carry.k.shape[2]
    if slots == s:
        return carry
    if slots < s:
        cut = lambda a: jax.lax.slice_in_dim(a, 0, slots, axis=2)  # noqa: E731
    else:
        cut = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, slots - s), (0, 0)))  # noqa: E731
    return carry.replace(k=cut(carry.k), v=cut(carry.v))


def write_rows(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """cache [B, KVH, S, D], new [B, KVH, T, D]: row b's T entries go to slots starts[b] ...
    (the caller keeps starts[b] + T <= S for the rows it reads). One in-place update per row,
    as the backbone writes its cache (`MAX_UNROLLED_ROWS`). Under a mesh a scatter here is
    partitioned into all-gathers over parts of `model`, which run beside the backbone's
    collectives; on XLA:CPU's simulated devices such concurrent collectives can hold every
    thread of the shared pool while they wait for each other."""
    if cache.shape[0] > MAX_UNROLLED_ROWS:
        return jax.vmap(lambda c, n, st: jax.lax.dynamic_update_slice_in_dim(c, n, st, 1))(
            cache, new, starts)
    zero = jnp.zeros((), jnp.int32)
    for b in range(cache.shape[0]):
        at = (jnp.int32(b), zero, starts[b].astype(jnp.int32), zero)
        cache = jax.lax.dynamic_update_slice(cache, new[b:b + 1], at)
    return cache


def next_tokens(tokens: jax.Array, last: jax.Array, root: jax.Array) -> jax.Array:
    """tokens [B, T] (a prompt, or a step's accepted path root first), last [B] the index of
    each row's last committed one, root [B] the token chosen after it -> [B, T] the token
    after each (entry j's other input): tokens[:, j+1], the root at `last`."""
    j = jnp.arange(tokens.shape[1])[None]
    after = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    return jnp.where(j == last[:, None], root[:, None], after)
