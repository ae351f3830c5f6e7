"""Moving a sequence's positions: what a training-time test, a chain of modules and their
losses do to pair each position with the token (or label) some positions ahead."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def shift(x: jax.Array, n: int) -> jax.Array:
    """x [B, T, ...] moved n positions left along T, zeros shifted in at the end (the EAGLE-3
    reference's `padding(x, left=False)`, applied n times)."""
    if n == 0:
        return x
    pad = jnp.zeros((x.shape[0], min(n, x.shape[1])) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)
