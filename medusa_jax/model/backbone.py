"""The Llama-family decoder (Llama 2/3, Vicuna, Mistral, Qwen2, Qwen3, Gemma 1/2/3) as pure
functions.

Parameters are a plain dict pytree with the layers stacked on a leading axis, so the forward
pass is one `lax.scan` over layers (one compiled layer, whatever the depth):

    embed        [V, H]
    layers/
      attn_norm  [L, H]          wq [L, H, NH*D]   wk, wv [L, H, KVH*D]   wo [L, NH*D, H]
      bq         [L, NH*D]       bk, bv [L, KVH*D]        (only with attention_bias)
      q_norm, k_norm [L, D]                               (only with qk_norm)
      mlp_norm   [L, H]          w_gate, w_up [L, H, F]   w_down [L, F, H]
      post_attn_norm, post_mlp_norm [L, H]                (only with sandwich_norms)
    final_norm   [H]
    lm_head      [H, V]                                   (absent with tied embeddings)

Decoding on one device uses `decoding_layout` (a tuple of per-layer dicts run as a straight
line, fused q/k/v and gate/up); `forward` takes either layout. The forward functions can
also return the residual stream entering chosen layers (`aux_layers`, for drafters that read
the backbone's intermediate features).

The caller passes explicit positions and an explicit boolean attention mask over the cache
slots, so causal prefill, one-token decoding and Medusa's tree verification all use the same
attention code: a tree mask is just another mask.

Gemma's differences are static choices read from the config (no runtime branch on the hot
path): GeGLU, RMSNorm by (1 + weight), scaled embeddings, soft-capping, sandwich norms. Its
sliding-window layers keep the one KV-cache layout of every layer (all slots, as global
layers): a local layer ANDs the caller's mask with p_query - p_key < window, from the
positions the forward pass already has (`window_masks`), so in a Medusa step the tree mask
combines with each layer's own window.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from medusa_jax import kernels
from medusa_jax.model.cache import (  # noqa: F401 (re-exported: callers import them from here)
    MAX_UNROLLED_ROWS,
    KVCache,
    write_kv,
)
from medusa_jax.model.cache import write_layer as _write_layer
from medusa_jax.model.config import ModelConfig, as_dtype
from medusa_jax.model.layout import (  # noqa: F401 (re-exported: callers import them from here)
    CPU_OUTPUT,
    FUSED,
    ParamSpec,
    decoding_layout,
    fuse_layer,
    head_units,
    init_params,
    is_decoding_layout,
    on_cpu,
    param_axes,
    param_shapes,
    param_specs,
    standard_layout,
    with_cpu_output,
    without_cpu_output,
)

from medusa_jax.model.rope import (  # noqa: F401 (re-exported: callers import them from here)
    apply_rope,
    rope_frequencies,
    rope_rows,
    rope_table,
    rotate,
)

Params = dict


# ----------------------------------------------------------------------------- masks


def causal_mask(lengths: jax.Array, num_new: int, capacity: int) -> jax.Array:
    """[B, T, S] mask for T new tokens appended after `lengths[b]` committed ones."""
    query = lengths[:, None] + jnp.arange(num_new)[None, :]  # [B, T] slot of each query
    return jnp.arange(capacity)[None, None, :] <= query[:, :, None]


def tree_mask_after_prefix(lengths: jax.Array, tree_mask: jax.Array, capacity: int) -> jax.Array:
    """[B, T, S]: every tree node sees the whole prefix, and the tree nodes it `tree_mask`s.

    tree_mask: [T, T] (one tree) or [B, T, T] (a tree per row) boolean, node i may attend
    node j (its ancestors and itself).
    """
    t = tree_mask.shape[-1]
    rel = jnp.arange(capacity)[None, :] - lengths[:, None]  # [B, S] slot relative to prefix end
    in_tree = (rel >= 0) & (rel < t)
    if tree_mask.ndim == 2:
        tree_part = jnp.transpose(tree_mask[:, jnp.clip(rel, 0, t - 1)], (1, 0, 2))  # [B, T, S]
    else:
        tree_part = jnp.take_along_axis(tree_mask, jnp.clip(rel, 0, t - 1)[:, None, :], axis=2)
    return (rel < 0)[:, None, :] | (tree_part & in_tree[:, None, :])


# ----------------------------------------------------------------------------- layers


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32, scaled by (offset + weight): Gemma stores weight - 1 (offset 1)."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    if offset:  # static: the Llama family never adds
        w = w + offset
    return (x * w).astype(dtype)


def _norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_offset)


def layer_kinds(cfg: ModelConfig) -> tuple:
    """Each layer's sliding window (None: global attention), from `cfg.layer_windows`."""
    return cfg.layer_windows or (None,) * cfg.num_layers


def window_masks(kinds: tuple, q_pos: jax.Array, k_pos: jax.Array, mask: jax.Array) -> dict:
    """{window: mask}: the caller's mask [B, T, S] for a global layer (window None), and that
    mask restricted to keys whose position is within `window` of the query's (p_q - p_k <
    window, transformers' sliding window) for each local window in `kinds`. q_pos [B, T],
    k_pos [B or 1, S] (the position each key slot holds). A tree mask stays a tree mask."""
    out = {None: mask}
    for w in set(kinds) - {None}:
        out[w] = mask & (q_pos[:, :, None] - k_pos[:, None, :] < w)
    return out


def _scale_q(cfg: ModelConfig, q: jax.Array) -> jax.Array:
    if cfg.query_scale is None:
        return q / math.sqrt(q.shape[-1])
    return q * cfg.query_scale  # Gemma 2/3: query_pre_attn_scalar ** -0.5


def _softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); x unchanged when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def embed_tokens(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> [B, T, H] in the compute dtype. Gemma scales by sqrt(H), the factor
    rounded to the weights' dtype first (as transformers does: 55.4256 is 55.5 in bfloat16)."""
    x = params["embed"][tokens]
    if cfg.embed_scale:
        x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
    return x.astype(as_dtype(cfg.compute_dtype))


def cached_attention(cfg: ModelConfig, q, k_new, v_new, k_cache, v_cache, prefix_mask,
                     new_mask, extra=None):
    """Attention over the committed cache plus the T new tokens: the scores of the two are
    concatenated, never the keys, so the cache is only read. The backbone's layers and a
    drafter's own decoder layer over its own cache both attend with it.

    q [B, T, NH, D]; k_new, v_new [B, KVH, T, D]; k_cache, v_cache [B, KVH, S, D] (read
    only: the new tokens are written once after all layers); prefix_mask [B, T, S];
    new_mask [B, T, T]. k_cache None: an empty cache. `extra`: None, or (k, v [B, KVH, N,
    D], mask [B, T, N]) a third block of N keys read between the cache and the new tokens
    (a drafter's tree nodes drafted so far), so neither block is copied into the
    other. Returns [B, T, NH*D].
    """
    b, t, _, d = q.shape
    kvh, g = cfg.num_kv_heads, cfg.q_per_kv
    neg = jnp.finfo(jnp.float32).min
    # [B, KVH, G*T, D]: the query heads sharing a KV head form one batched matmul
    q = q.reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
    q = _scale_q(cfg, q)

    def scores(keys, mask):
        s = jnp.einsum("bkqd,bksd->bkqs", q, keys, preferred_element_type=jnp.float32)
        s = _softcap(s, cfg.attn_softcap).reshape(b, kvh, g, t, -1)
        return jnp.where(mask[:, None, None], s, neg)

    blocks = ([] if k_cache is None else [(k_cache, v_cache, prefix_mask)]) \
        + ([] if extra is None else [extra]) + [(k_new, v_new, new_mask)]
    if len(blocks) == 1:  # empty cache (prefill, training): the new tokens only
        probs = jax.nn.softmax(scores(k_new, new_mask), axis=-1)
        probs = probs.astype(v_new.dtype).reshape(b, kvh, g * t, -1)
        out = jnp.einsum("bkqs,bksd->bkqd", probs, v_new)
    else:
        s = jnp.concatenate([scores(k, m) for k, _, m in blocks], axis=-1)
        probs = jax.nn.softmax(s, axis=-1).astype(v_new.dtype).reshape(b, kvh, g * t, -1)
        out, at = None, 0
        for k, v, _ in blocks:  # each block's values by its own slice of the probabilities
            n = k.shape[2]
            part = jnp.einsum("bkqs,bksd->bkqd", probs[..., at:at + n], v)
            out, at = (part if out is None else out + part), at + n  # [B, KVH, G*T, D]
    return out.reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.num_heads * d)


def _attention_flat(cfg: ModelConfig, q, k_cache, v_cache, mask, kernel: bool = False):
    """Attention over a per-layer cache that already holds the new tokens.

    q [B, T, NH, D]; k_cache, v_cache [B*KVH, W, D]; mask [B, T, W]. Returns [B, T, NH*D].
    The cache's own [B*KVH, W, D] shape is the products' batch layout, so XLA reads the
    buffer as it is (a reshape would make it fuse the cache update into each reader).
    `kernel`: the CPU kernel's attention (`kernels.attention`; no softcap)."""
    b, t, _, d = q.shape
    kvh, g = cfg.num_kv_heads, cfg.q_per_kv
    q = q.reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b * kvh, g * t, d)
    if kernel and cfg.attn_softcap is None and kernels.attention_wants(d):
        out = kernels.attention(_scale_q(cfg, q), k_cache, v_cache, mask)
        return (out.astype(q.dtype).reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4)
                .reshape(b, t, cfg.num_heads * d))
    s = jnp.einsum("kqd,ksd->kqs", _scale_q(cfg, q), k_cache,
                   preferred_element_type=jnp.float32)
    s = _softcap(s, cfg.attn_softcap).reshape(b, kvh, g, t, -1)
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(s, axis=-1).astype(v_cache.dtype).reshape(b * kvh, g * t, -1)
    out = jnp.einsum("kqs,ksd->kqd", probs, v_cache)  # [B*KVH, G*T, D]
    return out.reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.num_heads * d)


def attention_inputs(cfg: ModelConfig, h, layer, rope, kv_dtype):
    """The attention block's input half over its normalised input h [B, T, I] (I = H: a
    backbone layer's `attn_norm` of the residual stream; wider: a drafter's normalised
    inputs side by side), rope a `rope_table` -> (q [B, T, NH, D] after rope,
    k, v [B, KVH, T, D] in `kv_dtype`, k after rope)."""
    b, t, _ = h.shape
    dt = h.dtype
    if "wqkv" in layer:  # `decoding_layout`: one product for q, k and v
        qkv = kernels.matmul(h, layer["wqkv"])
        if cfg.attention_bias:
            qkv = qkv + layer["bqkv"].astype(dt)
        qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = jnp.split(qkv, [qd, qd + kvd], axis=-1)
    else:
        q = kernels.matmul(h, layer["wq"])
        k = kernels.matmul(h, layer["wk"])
        v = kernels.matmul(h, layer["wv"])
        if cfg.attention_bias:
            q = q + layer["bq"].astype(dt)
            k = k + layer["bk"].astype(dt)
            v = v + layer["bv"].astype(dt)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = _norm(cfg, q, layer["q_norm"])
        k = _norm(cfg, k, layer["k_norm"])
    q = rotate(q, rope)
    k = rotate(k, rope).transpose(0, 2, 1, 3).astype(kv_dtype)
    v = v.transpose(0, 2, 1, 3).astype(kv_dtype)
    return q, k, v


_ACTIVATIONS = {"silu": jax.nn.silu,
                "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # gelu_pytorch_tanh
                "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


def residual_and_mlp(cfg: ModelConfig, x, attn, layer):
    """The output projection of attention [B, T, NH*D] into the residual stream, then the
    MLP block (gated: silu for Llama, GeGLU for Gemma). Gemma 2/3 also normalise each
    block's output before adding it (`sandwich_norms`)."""
    a = kernels.matmul(attn, layer["wo"])
    if cfg.sandwich_norms:
        a = _norm(cfg, a, layer["post_attn_norm"])
    x = x + a
    h = _norm(cfg, x, layer["mlp_norm"])
    if "w_gate_up" in layer:  # `decoding_layout`
        gate, up = jnp.split(kernels.matmul(h, layer["w_gate_up"]), 2, axis=-1)
    else:
        gate, up = kernels.matmul(h, layer["w_gate"]), kernels.matmul(h, layer["w_up"])
    m = kernels.matmul(_ACTIVATIONS[cfg.hidden_act](gate) * up, layer["w_down"])
    if cfg.sandwich_norms:
        m = _norm(cfg, m, layer["post_mlp_norm"])
    return x + m


def decoder_layer(cfg: ModelConfig, x, layer, k_cache, v_cache, rope, prefix_mask, new_mask,
                  extra=None, attn_input=None):
    """One decoder layer over a cache it only reads: the backbone's layers, and a drafter's
    own layer (its weights in this layout), are this function.

    x [B, T, H] the residual stream; layer the weights (`attn_norm`, `wq`/`wk`/`wv` or
    `wqkv`, `wo`, `mlp_norm`, the MLP's); k_cache, v_cache [B, KVH, S, D] or None (empty);
    rope a `rope_table` of the new tokens' positions; prefix_mask [B, T, S], new_mask
    [B, T, T] and `extra` as `cached_attention`'s. `attn_input` [B, T, I]: what q, k and v
    are projected from instead of `attn_norm(x)` (a drafter's normalised embedding and
    feature side by side); x stays the residual. Returns (x, this layer's new keys
    and values [B, KVH, T, D])."""
    dt = x.dtype
    kv_dtype = dt if k_cache is None else k_cache.dtype
    h = _norm(cfg, x, layer["attn_norm"]) if attn_input is None else attn_input.astype(dt)
    q, k, v = attention_inputs(cfg, h, layer, rope, kv_dtype)
    if k_cache is not None:
        k_cache, v_cache = k_cache.astype(dt), v_cache.astype(dt)
    if extra is not None:
        extra = (extra[0].astype(dt), extra[1].astype(dt), extra[2])
    attn = cached_attention(cfg, q, k.astype(dt), v.astype(dt), k_cache, v_cache, prefix_mask,
                            new_mask, extra)
    return residual_and_mlp(cfg, x, attn, layer), k, v


def _forward_per_layer_cache(params, cfg, x, positions, mask, cache, empty_cache, inv_freq,
                             aux_layers=()):
    """The decoding layout over a per-layer cache (`KVCache.init(..., per_layer=True)`):
    each layer first writes its new keys/values into its own cache buffer, at slots
    lengths .. lengths + T - 1, then attends over the first W slots of that buffer with
    the caller's mask [B, T, W]. Writing before reading lets XLA update the buffers in
    place (no copy of the cache per step). Returns (x, new keys, new values, cache, aux):
    aux [B, T, len(aux_layers) * H] the inputs of the `aux_layers`, None without any."""
    if not is_decoding_layout(params):
        raise ValueError("a per-layer KV cache goes with the decoding layout "
                         "(backbone.decoding_layout)")
    window = mask.shape[-1]
    t = positions.shape[1]
    kinds = layer_kinds(cfg)  # static per layer: a sliding window or None
    if empty_cache:  # [B, T, T]: how the new tokens see each other
        new_slots = jnp.minimum(cache.lengths[:, None] + jnp.arange(t)[None], window - 1)
        new_mask = jnp.take_along_axis(mask, new_slots[:, None, :], axis=2)
        masks = window_masks(kinds, positions, positions, new_mask)
    elif any(w is not None for w in kinds):
        # the position each slot holds: its index in the committed part, the new tokens'
        # positions in theirs (a tree node's depth, not its slot)
        slots = jnp.arange(window)[None, :]
        rel = slots - cache.lengths[:, None]  # [B, W]
        k_pos = jnp.where(rel < 0, slots, jnp.take_along_axis(
            positions, jnp.clip(rel, 0, t - 1), axis=1))
        masks = window_masks(kinds, positions, k_pos, mask)
    else:
        masks = {None: mask}
    freqs = {w: inv_freq if w is None else rope_frequencies(cfg, local=True)
             for w in set(kinds)}
    ropes = {w: rope_rows(positions, f, cache.capacity) for w, f in freqs.items()}
    use_kernel = kernels.attends_with_kernel(params)
    ks, vs, new_k, new_v = [], [], [], []
    captured = {}  # layer -> its input [B, T, H]
    for i, layer in enumerate(params["layers"]):
        if i in aux_layers:
            captured[i] = x
        dt = x.dtype
        kc, vc = cache.k[i], cache.v[i]
        q, k, v = attention_inputs(cfg, _norm(cfg, x, layer["attn_norm"]), layer,
                                   ropes[kinds[i]], kc.dtype)
        kc, vc = _write_layer(kc, k, cache.lengths), _write_layer(vc, v, cache.lengths)
        ks.append(kc), vs.append(vc), new_k.append(k), new_v.append(v)
        if empty_cache:  # prefill: the new tokens attend each other only
            attn = cached_attention(cfg, q, k.astype(dt), v.astype(dt), None, None, None,
                              masks[kinds[i]])
        else:
            kw, vw = (kc, vc) if window == kc.shape[1] else (kc[:, :window], vc[:, :window])
            attn = _attention_flat(cfg, q, kw.astype(dt), vw.astype(dt), masks[kinds[i]],
                                   kernel=use_kernel)
        x = residual_and_mlp(cfg, x, attn, layer)
    aux = _concat_aux(captured, aux_layers) if aux_layers else None
    return (x, jnp.stack(new_k), jnp.stack(new_v), cache.replace(k=tuple(ks), v=tuple(vs)),
            aux)


def output_projection(cfg: ModelConfig, params: Params) -> jax.Array:
    """[H, V]: the lm_head, or the transposed embedding when tied."""
    if cfg.tie_word_embeddings:
        return params["embed"].T
    return kernels.unwrap(params["lm_head"])


def logits_from_hidden(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
    """Final-norm hidden states [..., H] -> float32 logits [..., V]."""
    if kernels.active(params) and hidden.dtype == jnp.float32:  # the CPU kernel's product
        w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
        if cfg.tie_word_embeddings and kernels.wants(w):
            w = kernels.output_weight(w)
        if kernels.is_kernel_weight(w):
            return _softcap(kernels.matmul(hidden, w), cfg.final_softcap)
    w = params[CPU_OUTPUT] if CPU_OUTPUT in params else output_projection(cfg, params)
    logits = jnp.einsum("...h,hv->...v", hidden, w.astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    return _softcap(logits, cfg.final_softcap)


def check_aux_layers(cfg: ModelConfig, aux_layers) -> tuple[int, ...]:
    """`aux_layers` as a tuple of distinct layer indices 0 <= i < L (a static argument of
    the forward functions), or a one-line ValueError naming the bad value."""
    layers = tuple(aux_layers)
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) \
                or not 0 <= i < cfg.num_layers:
            raise ValueError(f"aux_layers: {i!r} is not a layer index of this "
                             f"{cfg.num_layers}-layer backbone (0 <= i < {cfg.num_layers})")
        if layers.count(i) > 1:
            raise ValueError(f"aux_layers: layer {i} appears more than once in {layers}")
    return tuple(int(i) for i in layers)


def _concat_aux(captured: dict, aux_layers: tuple) -> jax.Array:
    """{layer: its input [B, T, H]} -> [B, T, len(aux_layers) * H], in `aux_layers` order."""
    return jnp.concatenate([captured[i] for i in aux_layers], axis=-1)


def forward_uncommitted(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,  # [B, T] int32
    positions: jax.Array,  # [B, T] int32
    mask: jax.Array,  # [B, T, W] bool: query t may attend cache slot s (W <= S)
    cache: KVCache,
    *,
    return_logits: bool = True,
    empty_cache: bool = False,
    unroll: int = 1,
    remat: bool = False,
    aux_layers: tuple[int, ...] = (),
) -> tuple:
    """Like `forward`, but leaves the cache untouched and returns the new tokens' keys and
    values ([L, B, KVH, T, D] each) so the caller can commit only some of them (Medusa keeps
    just the accepted path).

    A mask over the first W < S slots only attends those: the decoding loops pass one just
    wide enough for the filled part of the cache (`decode.cache_phases`), so attention does
    not read the empty slots; the new tokens' slots lengths .. lengths+T-1 must be < W.

    `empty_cache=True` promises every row's cache is empty (prefill, training): attention
    then skips the cache entirely, which is cheaper and avoids XLA constant-folding a
    fully masked block. `unroll`: layers per iteration of the scan over stacked layers (the
    decoding layout has no scan: see `decoding_layout`). `remat=True` (training the
    backbone) wraps each layer in `jax.checkpoint` saving nothing inside it: the backward
    pass keeps only the layers' inputs and recomputes each layer (attention scores included)
    instead of holding every layer's intermediates.

    `aux_layers` (static; `check_aux_layers`): also return the residual stream at the input
    of these layers, concatenated in that order, [B, T, len(aux_layers) * H] in the compute
    dtype, as a fourth element (layer 0's input is the embedding). With none (the default) the result and the program are those of a
    plain forward pass."""
    aux_layers = check_aux_layers(cfg, aux_layers)
    if isinstance(cache.k, tuple):  # a per-layer cache is written as it is read
        logits, hidden, new_kv, _, *aux = forward_scratch(
            params, cfg, tokens, positions, mask, cache, return_logits=return_logits,
            empty_cache=empty_cache, aux_layers=aux_layers)
        return (logits, hidden, new_kv, *aux)
    x = embed_tokens(cfg, params, tokens)
    t = tokens.shape[1]
    # Split the caller's mask: committed slots come from the cache, the T new tokens (which
    # would occupy slots lengths .. lengths+T-1) attend each other directly. The cache is
    # only read inside the layers: no per-layer copies of it.
    window = mask.shape[-1]
    slots = jnp.arange(window)
    prefix_mask = mask & (slots[None, None, :] < cache.lengths[:, None, None])
    new_slots = jnp.minimum(cache.lengths[:, None] + jnp.arange(t)[None], window - 1)
    new_mask = jnp.take_along_axis(mask, new_slots[:, None, :], axis=2)  # [B, T, T]
    # Per-layer attention kinds (Gemma 2/3): each window's masks and rotary frequencies once
    kinds = layer_kinds(cfg)
    prefix_masks = window_masks(kinds, positions, slots[None, :], prefix_mask)
    new_masks = window_masks(kinds, positions, positions, new_mask)
    freqs = {w: rope_frequencies(cfg, local=w is not None) for w in set(kinds)}

    def one_layer(x, layer, kc, vc, pm, nm, inv_freq):
        if kc is not None and window < kc.shape[2]:
            kc, vc = kc[:, :, :window], vc[:, :, :window]
        x, k, v = decoder_layer(cfg, x, layer, kc, vc, rope_table(positions, inv_freq), pm,
                                nm)
        return x, (k, v)

    if remat:
        one_layer = jax.checkpoint(one_layer, policy=jax.checkpoint_policies.nothing_saveable,
                                   prevent_cse=False)
    captured = {}  # layer -> its input [B, T, H]
    if is_decoding_layout(params):  # a straight line, each layer's weights read in place
        outs = []
        for i, layer in enumerate(params["layers"]):
            if i in aux_layers:
                captured[i] = x
            kc, vc = (None, None) if empty_cache else (cache.k[i], cache.v[i])
            w = kinds[i]  # static
            x, kv = one_layer(x, layer, kc, vc, prefix_masks[w], new_masks[w], freqs[w])
            outs.append(kv)
        new_kv = (jnp.stack([k for k, _ in outs]), jnp.stack([v for _, v in outs]))
    else:
        uniq = sorted(set(kinds), key=lambda w: -1 if w is None else w)
        if len(uniq) == 1:  # every layer alike (the Llama family): nothing to select
            def body(x, xs):
                layer, kc, vc = xs if not empty_cache else (xs, None, None)
                w = uniq[0]
                return one_layer(x, layer, kc, vc, prefix_masks[w], new_masks[w], freqs[w])

            xs = params["layers"] if empty_cache else (params["layers"], cache.k, cache.v)
        else:  # the scanned layer picks its kind's masks and frequencies by index
            stack = lambda d: jnp.stack([d[w] for w in uniq])  # noqa: E731
            pms, nms, fs = stack(prefix_masks), stack(new_masks), stack(freqs)
            kind = jnp.asarray([uniq.index(w) for w in kinds], jnp.int32)  # [L]

            def body(x, xs):
                layer, kc, vc, i = xs if not empty_cache else (xs[0], None, None, xs[1])
                return one_layer(x, layer, kc, vc, pms[i], nms[i], fs[i])

            xs = ((params["layers"], kind) if empty_cache
                  else (params["layers"], cache.k, cache.v, kind))
        if aux_layers:
            x, new_kv, captured = _scan_capturing(body, x, xs, aux_layers, cfg.num_layers,
                                                  unroll)
        else:
            x, new_kv = jax.lax.scan(body, x, xs, unroll=unroll)
    hidden = _norm(cfg, x, params["final_norm"])
    logits = logits_from_hidden(cfg, params, hidden) if return_logits else None
    if aux_layers:
        return logits, hidden, new_kv, _concat_aux(captured, aux_layers)
    return logits, hidden, new_kv


def _scan_capturing(body, x, xs, aux_layers: tuple, num_layers: int, unroll: int):
    """`lax.scan(body, x, xs)` over the stacked layers that also keeps the carry entering
    each of `aux_layers`. Returns (x, the scan's outputs, {layer: its input [B, T, H]}).

    One scan still (one compiled layer): a static per-layer slot [L] tells each iteration
    where its input goes, slot n (one past the kept ones) taking the layers not asked for,
    so every iteration does the same single [B, T, H] in-place write and nothing is
    stacked per layer ([L, B, T, H] at 7B and 2,048 tokens: 0.5 GB a row in bfloat16)."""
    n = len(aux_layers)
    slot = jnp.asarray([aux_layers.index(i) if i in aux_layers else n
                        for i in range(num_layers)], jnp.int32)  # [L]

    def step(carry, xs_slot):
        x, kept = carry  # kept [n + 1, B, T, H]
        layer_xs, s = xs_slot
        kept = jax.lax.dynamic_update_index_in_dim(kept, x, s, axis=0)
        x, ys = body(x, layer_xs)
        return (x, kept), ys

    kept = jnp.zeros((n + 1, *x.shape), x.dtype)
    (x, kept), ys = jax.lax.scan(step, (x, kept), (xs, slot), unroll=unroll)
    return x, ys, {i: kept[j] for j, i in enumerate(aux_layers)}


def forward_scratch(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                    mask: jax.Array, cache: KVCache, *, return_logits: bool = True,
                    empty_cache: bool = False, unroll: int = 1, remat: bool = False,
                    aux_layers: tuple[int, ...] = ()):
    """`forward_uncommitted` that also returns the cache with the new tokens' keys/values
    written at slots lengths .. lengths + T - 1 (`lengths` unchanged): scratch slots past
    the committed context, which Medusa overwrites with the accepted path (`write_kv`).
    Returns (logits or None, hidden, (new keys, new values) [L, B, KVH, T, D], cache), and
    with `aux_layers` the inputs of those layers [B, T, len(aux_layers) * H] last (see
    `forward_uncommitted`).

    With a per-layer cache each layer writes before it reads (in place); with a stacked
    one the new entries are written after all layers."""
    aux_layers = check_aux_layers(cfg, aux_layers)
    if isinstance(cache.k, tuple):
        x = embed_tokens(cfg, params, tokens)
        x, k_new, v_new, cache, aux = _forward_per_layer_cache(
            params, cfg, x, positions, mask, cache, empty_cache, rope_frequencies(cfg),
            aux_layers)
        hidden = _norm(cfg, x, params["final_norm"])
        logits = logits_from_hidden(cfg, params, hidden) if return_logits else None
        return (logits, hidden, (k_new, v_new), cache) + ((aux,) if aux_layers else ())
    logits, hidden, (k_new, v_new), *aux = forward_uncommitted(
        params, cfg, tokens, positions, mask, cache, return_logits=return_logits,
        empty_cache=empty_cache, unroll=unroll, remat=remat, aux_layers=aux_layers)
    return (logits, hidden, (k_new, v_new), write_kv(cache, k_new, v_new), *aux)


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            mask: jax.Array, cache: KVCache, *, return_logits: bool = True,
            empty_cache: bool = False, unroll: int = 1, remat: bool = False,
            aux_layers: tuple[int, ...] = ()) -> tuple:
    """Run the decoder on T new tokens per row (tokens, positions [B, T]; mask [B, T, S]).

    Slot s of the mask is cache slot s (the mask may cover only the first W slots: see
    `forward_uncommitted`); the new tokens occupy slots lengths[b] ...
    lengths[b] + T - 1, so a causal mask, a tree mask or any other pattern is just a mask.
    Returns (logits [B, T, V] float32 or None, hidden [B, T, H] after the final norm, cache
    with the new keys/values written at those slots; `lengths` is left to the caller).
    `aux_layers` adds a fourth element, the inputs of those layers [B, T, len * H] (see
    `forward_uncommitted`).
    """
    logits, hidden, _, cache, *aux = forward_scratch(
        params, cfg, tokens, positions, mask, cache, return_logits=return_logits,
        empty_cache=empty_cache, unroll=unroll, remat=remat, aux_layers=aux_layers)
    return (logits, hidden, cache, *aux)
