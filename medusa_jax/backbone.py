"""The Llama-family decoder (Llama 2/3, Vicuna, Mistral, Qwen2, Qwen3) as pure functions.

Parameters are a plain dict pytree with the layers stacked on a leading axis, so the forward
pass is one `lax.scan` over layers (one compiled layer, whatever the depth):

    embed        [V, H]
    layers/
      attn_norm  [L, H]          wq [L, H, NH*D]   wk, wv [L, H, KVH*D]   wo [L, NH*D, H]
      bq         [L, NH*D]       bk, bv [L, KVH*D]        (only with attention_bias)
      q_norm, k_norm [L, D]                               (only with qk_norm)
      mlp_norm   [L, H]          w_gate, w_up [L, H, F]   w_down [L, F, H]
    final_norm   [H]
    lm_head      [H, V]                                   (absent with tied embeddings)

The caller passes explicit positions and an explicit boolean attention mask over the cache
slots, so causal prefill, one-token decoding and Medusa's tree verification all use the same
attention code: a tree mask is just another mask.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from medusa_jax.config import ModelConfig, as_dtype

Params = dict


@struct.dataclass
class KVCache:
    """Preallocated keys/values, one fill length per batch row.

    k, v:    [L, B, S, KVH, D]  slot s of row b holds the token at position s
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
        return self.k.shape[2]

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=None) -> "KVCache":
        dtype = as_dtype(dtype or cfg.compute_dtype)
        shape = (cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    def advance(self, n: jax.Array) -> "KVCache":
        return self.replace(lengths=self.lengths + n.astype(jnp.int32))


# ----------------------------------------------------------------------------- masks


def causal_mask(lengths: jax.Array, num_new: int, capacity: int) -> jax.Array:
    """[B, T, S] mask for T new tokens appended after `lengths[b]` committed ones."""
    query = lengths[:, None] + jnp.arange(num_new)[None, :]  # [B, T] slot of each query
    return jnp.arange(capacity)[None, None, :] <= query[:, :, None]


def tree_mask_after_prefix(lengths: jax.Array, tree_mask: jax.Array, capacity: int) -> jax.Array:
    """[B, T, S]: every tree node sees the whole prefix, and the tree nodes it `tree_mask`s.

    tree_mask: [T, T] boolean, node i may attend node j (ancestors and itself).
    """
    t = tree_mask.shape[0]
    rel = jnp.arange(capacity)[None, :] - lengths[:, None]  # [B, S] slot relative to prefix end
    in_tree = (rel >= 0) & (rel < t)
    tree_part = tree_mask[:, jnp.clip(rel, 0, t - 1)]  # [T, B, S]
    tree_part = jnp.transpose(tree_part, (1, 0, 2)) & in_tree[:, None, :]
    return (rel < 0)[:, None, :] | tree_part


# ----------------------------------------------------------------------------- layers


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * weight.astype(jnp.float32)).astype(dtype)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """[D/2] inverse frequencies, with 'linear' or 'llama3' scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    kind = cfg.rope_scaling[0]
    if kind == "linear":
        inv_freq = inv_freq / cfg.rope_scaling[1]
    elif kind == "llama3":
        _, factor, low_ff, high_ff, old_ctx = cfg.rope_scaling
        low_wavelen = old_ctx / low_ff
        high_wavelen = old_ctx / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = jnp.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Half-split (Hugging Face layout) rotary embedding. x: [B, T, N, D], positions: [B, T]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _write_rows(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """cache [B, S, ...], new [B, T, ...]: write row b's T entries at slot starts[b]."""

    def one(c, n, s):
        return jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=0)

    return jax.vmap(one)(cache, new, starts)


def _attention(cfg: ModelConfig, q, k, v, mask):
    """q [B, T, NH, D]; k, v [B, S, KVH, D]; mask [B, T, S] -> [B, T, NH*D]."""
    b, t, _, d = q.shape
    q = q.reshape(b, t, cfg.num_kv_heads, cfg.q_per_kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, cfg.num_heads * d)


def _layer(cfg: ModelConfig, x, layer, k_cache, v_cache, positions, mask, starts, inv_freq):
    """One decoder layer. x [B, T, H]; k_cache, v_cache [B, S, KVH, D]."""
    b, t, _ = x.shape
    dt = x.dtype
    h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    q = h @ layer["wq"].astype(dt)
    k = h @ layer["wk"].astype(dt)
    v = h @ layer["wv"].astype(dt)
    if cfg.attention_bias:
        q = q + layer["bq"].astype(dt)
        k = k + layer["bk"].astype(dt)
        v = v + layer["bv"].astype(dt)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    k_cache = _write_rows(k_cache, k.astype(k_cache.dtype), starts)
    v_cache = _write_rows(v_cache, v.astype(v_cache.dtype), starts)
    attn = _attention(cfg, q, k_cache.astype(dt), v_cache.astype(dt), mask)
    x = x + attn @ layer["wo"].astype(dt)

    h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    gate = jax.nn.silu(h @ layer["w_gate"].astype(dt))
    x = x + (gate * (h @ layer["w_up"].astype(dt))) @ layer["w_down"].astype(dt)
    return x, k_cache, v_cache


def output_projection(cfg: ModelConfig, params: Params) -> jax.Array:
    """[H, V]: the lm_head, or the transposed embedding when tied."""
    if cfg.tie_word_embeddings:
        return params["embed"].T
    return params["lm_head"]


def logits_from_hidden(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
    """Final-norm hidden states [..., H] -> float32 logits [..., V]."""
    w = output_projection(cfg, params)
    return jnp.einsum("...h,hv->...v", hidden, w.astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,  # [B, T] int32
    positions: jax.Array,  # [B, T] int32
    mask: jax.Array,  # [B, T, S] bool: query t may attend cache slot s
    cache: KVCache,
    *,
    return_logits: bool = True,
) -> tuple[jax.Array | None, jax.Array, KVCache]:
    """Run the decoder on T new tokens per row.

    Returns (logits [B, T, V] float32 or None, hidden [B, T, H] after the final norm, cache
    with the new keys/values written at slots lengths[b] ... lengths[b] + T - 1).
    """
    dt = as_dtype(cfg.compute_dtype)
    x = params["embed"][tokens].astype(dt)
    inv_freq = rope_frequencies(cfg)
    starts = cache.lengths

    def body(x, xs):
        layer, kc, vc = xs
        x, kc, vc = _layer(cfg, x, layer, kc, vc, positions, mask, starts, inv_freq)
        return x, (kc, vc)

    x, (k, v) = jax.lax.scan(body, x, (params["layers"], cache.k, cache.v))
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = logits_from_hidden(cfg, params, hidden) if return_logits else None
    return logits, hidden, cache.replace(k=k, v=v)


def param_shapes(cfg: ModelConfig) -> dict:
    """The backbone's parameter tree as {name: shape}; the single source of truth for
    initialisation, loading and sharding."""
    h, f, lyr = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = {
        "attn_norm": (lyr, h),
        "wq": (lyr, h, qd),
        "wk": (lyr, h, kvd),
        "wv": (lyr, h, kvd),
        "wo": (lyr, qd, h),
        "mlp_norm": (lyr, h),
        "w_gate": (lyr, h, f),
        "w_up": (lyr, h, f),
        "w_down": (lyr, f, h),
    }
    if cfg.attention_bias:
        layers.update(bq=(lyr, qd), bk=(lyr, kvd), bv=(lyr, kvd))
    if cfg.qk_norm:
        layers.update(q_norm=(lyr, cfg.head_dim), k_norm=(lyr, cfg.head_dim))
    shapes = {"embed": (cfg.vocab_size, h), "layers": layers, "final_norm": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, cfg.vocab_size)
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> Params:
    """Random backbone (norms at one), for tests and random-weight benchmarks."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    dtype = as_dtype(cfg.param_dtype)
    out = []
    for path, shape, k in zip(paths, leaves, keys):
        if "norm" in path:
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((std * jax.random.normal(k, shape)).astype(dtype))
    return jax.tree.unflatten(treedef, out)
