"""Rotary position embeddings of the Llama family (Hugging Face's half-split layout): the
inverse frequencies with 'linear' or 'llama3' scaling (`rope_frequencies`), the (cos, sin)
table of positions (`rope_table`, `rope_rows`) and the rotation (`rotate`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from medusa_jax.model.config import ModelConfig


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> jax.Array:
    """[D/2] inverse frequencies, with 'linear' or 'llama3' scaling applied. `local`: those
    of the sliding-window layers (Gemma 3's `rope_local_base_freq`, when the config has one)."""
    d = cfg.head_dim
    theta, scaling = cfg.rope_theta, cfg.rope_scaling
    if local and cfg.local_rope_theta is not None:
        theta, scaling = cfg.local_rope_theta, cfg.local_rope_scaling
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    kind = scaling[0]
    if kind == "linear":
        inv_freq = inv_freq / scaling[1]
    elif kind == "llama3":
        _, factor, low_ff, high_ff, old_ctx = scaling
        low_wavelen = old_ctx / low_ff
        high_wavelen = old_ctx / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = jnp.where(medium, smoothed, scaled)
    return inv_freq


def rope_table(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> (cos, sin) [B, T, 1, D/2] float32: the rotation `rotate` applies."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rope_rows(positions: jax.Array, inv_freq: jax.Array, size: int
              ) -> tuple[jax.Array, jax.Array]:
    """`rope_table(positions, inv_freq)` for positions [B, T] in [0, size), read from the
    table of positions 0 .. size-1. Sines and cosines computed from the positions would be
    fused by XLA into each layer's rotation and computed again for every element it
    rotates; the table depends on no input, so it is computed once, outside a decoding
    loop, and a pass only reads its T rows."""
    cos, sin = rope_table(jnp.arange(size, dtype=jnp.int32)[None], inv_freq)  # [1, S, 1, D/2]
    at = jnp.clip(positions, 0, size - 1)
    return cos[0][at], sin[0][at]


def rotate(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Half-split (Hugging Face layout) rotary embedding of x [B, T, N, D] by a
    `rope_table`."""
    cos, sin = rope
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Half-split (Hugging Face layout) rotary embedding. x: [B, T, N, D], positions: [B, T]."""
    return rotate(x, rope_table(positions, inv_freq))
