"""The key/value cache: preallocated per-row buffers and the writes into them.

`KVCache` holds every layer's keys and values for a batch of rows, in one of two layouts
(stacked [L, B, KVH, S, D], or per layer [B*KVH, S, D] for the decoding layout); `write_kv`
writes a forward pass's new entries at each row's fill length. Row operations (a row as a
one-row cache, a row written over another, a resize) are its methods, so a caller such as
the serving engine never reaches into the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from medusa_jax.model.config import ModelConfig, as_dtype
from medusa_jax.runtime import pytree as struct  # flax.struct without importing Flax
from medusa_jax.runtime import sharding


@struct.dataclass
class KVCache:
    """Preallocated keys/values, one fill length per batch row.

    k, v:    [L, B, KVH, S, D]  slot s of row b holds the token at position s
                                (heads before slots: attention is then a plain batched matmul)
             or tuples of L [B*KVH, S, D] buffers (`per_layer`, for the decoding layout: a
             batch row's KV heads are rows b*KVH .. (b+1)*KVH - 1)
    lengths: [B] int32          slots [0, lengths[b]) are the row's committed context

    `forward` writes the new tokens at slots lengths[b] ... lengths[b] + T - 1 and leaves
    `lengths` alone: the caller decides how many of them to keep (speculative decoding keeps
    a different number per row) and calls `advance`.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1] if isinstance(self.k, tuple) else self.k.shape[3]

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=None, *,
             per_layer: bool = False) -> "KVCache":
        """`per_layer=True`: k and v are tuples of L buffers [B*KVH, S, D], for the
        decoding layout on one device (each layer writes its own buffer in place)."""
        dtype = as_dtype(dtype or cfg.compute_dtype)
        if per_layer:
            shape = (batch * cfg.num_kv_heads, capacity, cfg.head_dim)
            return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                       v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                       lengths=jnp.zeros((batch,), jnp.int32))
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        # under `jax.set_mesh`: rows over the batch axes, KV heads over "model"
        k, v = sharding.constrain_cache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                                        cfg.num_kv_heads)
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))

    def advance(self, n: jax.Array) -> "KVCache":
        return self.replace(lengths=self.lengths + n.astype(jnp.int32))

    def leading(self, rows: int, window: int) -> "KVCache":
        """The first `rows` rows, cut to their first `window` slots (a copy). A loop that
        attends over a window carries this, not the whole cache: a narrower read of a
        loop-carried buffer that the loop also updates makes XLA copy it at every step."""
        if isinstance(self.k, tuple):
            kvh = self.k[0].shape[0] // self.lengths.shape[0]
            k = tuple(a[:rows * kvh, :window] for a in self.k)
            v = tuple(a[:rows * kvh, :window] for a in self.v)
        else:
            k, v = self.k[:, :rows, :, :window], self.v[:, :rows, :, :window]
        return KVCache(k=k, v=v, lengths=self.lengths[:rows])

    def put_leading(self, sub: "KVCache") -> "KVCache":
        """`leading`'s inverse: `sub` written over the first rows and slots (in place when
        this cache is donated or dead afterwards)."""
        at = lambda a, b: jax.lax.dynamic_update_slice(a, b, (0,) * a.ndim)  # noqa: E731
        if isinstance(self.k, tuple):
            k, v = tuple(map(at, self.k, sub.k)), tuple(map(at, self.v, sub.v))
        else:
            k, v = at(self.k, sub.k), at(self.v, sub.v)
        return KVCache(k=k, v=v, lengths=at(self.lengths, sub.lengths))

    def row(self, row: jax.Array) -> "KVCache":
        """Row `row` (int32 scalar) as a one-row cache (a copy)."""
        if isinstance(self.k, tuple):  # per layer [B*KVH, C, D]: row b's heads at b*KVH ..
            kvh = self.k[0].shape[0] // self.lengths.shape[0]
            heads = lambda a: jax.lax.dynamic_slice_in_dim(a, row * kvh, kvh, 0)  # noqa: E731
            k, v = tuple(map(heads, self.k)), tuple(map(heads, self.v))
        else:  # [L, B, KVH, C, D]
            k, v = (jax.lax.dynamic_slice_in_dim(a, row, 1, 1) for a in (self.k, self.v))
        return self.replace(k=k, v=v,
                            lengths=jax.lax.dynamic_slice_in_dim(self.lengths, row, 1, 0))

    def put_row(self, one: "KVCache", row: jax.Array) -> "KVCache":
        """Row `row` (int32 scalar) overwritten by the one-row cache `one`'s keys/values,
        over its first `one.capacity` slots (the row's length is left as it was)."""
        if isinstance(self.k, tuple):  # per layer [B*KVH, C, D]
            at = (row * one.k[0].shape[0], jnp.int32(0), jnp.int32(0))
            k = tuple(jax.lax.dynamic_update_slice(a, b, at) for a, b in zip(self.k, one.k))
            v = tuple(jax.lax.dynamic_update_slice(a, b, at) for a, b in zip(self.v, one.v))
        else:  # [L, B, KVH, C, D]
            z = jnp.int32(0)
            k = jax.lax.dynamic_update_slice(self.k, one.k, (z, row, z, z, z))
            v = jax.lax.dynamic_update_slice(self.v, one.v, (z, row, z, z, z))
        return self.replace(k=k, v=v)

    def copy_row(self, src: jax.Array, dst: jax.Array) -> "KVCache":
        """Row `src`'s keys/values and length copied over row `dst` (int32 scalars)."""
        c = self.put_row(self.row(src), dst)
        return c.replace(lengths=c.lengths.at[dst].set(c.lengths[src]))

    def resized(self, capacity: int) -> "KVCache":
        """Each row `capacity` slots long: cut, or zero-padded at the end (only a row's
        first `lengths` slots hold anything)."""
        def fit(a, axis):
            if capacity <= a.shape[axis]:
                return jax.lax.slice_in_dim(a, 0, capacity, axis=axis)
            pad = [(0, 0)] * a.ndim
            pad[axis] = (0, capacity - a.shape[axis])
            return jnp.pad(a, pad)

        if isinstance(self.k, tuple):  # per layer [B*KVH, C, D]
            return self.replace(k=tuple(fit(a, 1) for a in self.k),
                                v=tuple(fit(a, 1) for a in self.v))
        return self.replace(k=fit(self.k, 3), v=fit(self.v, 3))  # [L, B, KVH, C, D]


# Batch rows written one in-place update each (up to this many; see `write_rows`).
MAX_UNROLLED_ROWS = 16


def write_rows(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """cache [L, B, KVH, S, D], new [L, B, KVH, T, D]: row b's T entries go to slot starts[b].

    One in-place update per row (B is static): a `vmap` over the row axis would move it
    to the front and back, which XLA does by copying the whole cache at every step. Past
    `MAX_UNROLLED_ROWS` rows (sampling tests, big offline batches) the vmap it is: a copy
    per step is cheaper there than thousands of updates to trace and compile."""
    if cache.shape[1] > MAX_UNROLLED_ROWS:
        def one(c, n, s):  # c [L, KVH, S, D]
            return jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=2)

        return jax.vmap(one, in_axes=(1, 1, 0), out_axes=1)(cache, new, starts)
    zero = jnp.zeros((), jnp.int32)
    for b in range(cache.shape[1]):
        start = (zero, jnp.asarray(b, jnp.int32), zero, starts[b].astype(jnp.int32), zero)
        cache = jax.lax.dynamic_update_slice(cache, new[:, b:b + 1], start)
    return cache


def write_layer(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """cache [B*KVH, S, D], new [B, KVH, T, D]: row b's entries go to slot starts[b], one
    in-place update per row."""
    kvh = new.shape[1]
    if new.shape[0] > MAX_UNROLLED_ROWS:  # see `write_rows`
        rows = cache.reshape(new.shape[0], kvh, *cache.shape[1:])
        rows = jax.vmap(lambda c, n, st: jax.lax.dynamic_update_slice_in_dim(c, n, st, axis=1)
                        )(rows, new, starts)
        return rows.reshape(cache.shape)
    zero = jnp.zeros((), jnp.int32)
    for b in range(new.shape[0]):
        cache = jax.lax.dynamic_update_slice(
            cache, new[b], (jnp.asarray(b * kvh, jnp.int32), starts[b], zero))
    return cache


def write_kv(cache: KVCache, k_new: jax.Array, v_new: jax.Array) -> KVCache:
    """Write [L, B, KVH, T, D] keys/values at slots lengths[b] ... (lengths unchanged)."""
    if isinstance(cache.k, tuple):
        return cache.replace(
            k=tuple(write_layer(c, k_new[i], cache.lengths) for i, c in enumerate(cache.k)),
            v=tuple(write_layer(c, v_new[i], cache.lengths) for i, c in enumerate(cache.v)))
    return cache.replace(k=write_rows(cache.k, k_new, cache.lengths),
                         v=write_rows(cache.v, v_new, cache.lengths))
