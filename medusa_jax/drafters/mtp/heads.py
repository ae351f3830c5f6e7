"""Multi-token-prediction (MTP) modules: parameters and forward pass (DeepSeek-V3's MTP,
as vLLM's `deepseek_mtp.py` / `mimo_mtp.py` run it and MaxText's
`layers/multi_token_prediction.py` trains it).

D modules, chained depth by depth. Module k (0-based here; depth k+1) at position i reads
the previous depth's hidden state h_{k-1, i} (h_{-1} = the backbone's final hidden state,
after its final norm, as vLLM hands its drafters the target model's output) and the
backbone's embedding of token t_{i+k+1}:

    x = eh_proj_k([enorm_k(emb); hnorm_k(h)])      2H -> H (MiMo: [hnorm_k(h); enorm_k(emb)])
    h_k = decoder_layer_k(x)                        one layer of the backbone's own kind
    logits = the backbone's output head(final_norm_k(h_k))   (DeepSeek-V3's shared_head)

and predicts t_{i+k+2}. Under MiMo's layout (`STYLES`) the projection reads the hidden
state first, and the state handed to the next depth is the output after its final norm
(vLLM's `mimo_mtp.py` returns `final_layernorm(h)`); DeepSeek-V3's hands on the output
before it (its `shared_head.norm` is applied only for the logits). The embedding is zeroed
at rotary position 0 (vLLM: "masking inputs at position 0, as not needed by MTP"). The
embedding and output head are the backbone's (frozen, shared); each module has its norms,
its projection and its decoder layer.

Parameters (D modules stacked on the leading axis; ours are [in, out]: y = x @ w):

    enorm, hnorm, final_norm   [D, H]
    eh_proj                    [D, 2H, H]
    layer.<name>               [D, ...] the backbone layer's tensors (`model.layout`:
                               attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down,
                               and its biases / q-k norms / sandwich norms where it has them)

Their configuration (the backbone's layer, the concatenation order) is not in the shapes:
they travel bound to their drafter (`drafters.mtp.drafter.bind`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.drafters.io import check_float_tensors
from medusa_jax.drafters.toolkit.sequence import shift
from medusa_jax.model import backbone, layout
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig

KIND = "mtp"
LAYER = "layer."  # the prefix of the decoder layer's tensors
OWN = ("enorm", "hnorm", "eh_proj", "final_norm")
# layout style -> (hidden state first in the projection's input, next depth fed the normed
# output)
STYLES = {"deepseek": (False, False), "mimo": (True, True)}
MODULE_AXIS = "medusa_layers"  # a stacking axis (`registry._STACKING_AXES`): not a matrix dim


def layer_specs(cfg: ModelConfig) -> dict:
    """{name: ParamSpec} of one backbone layer (stacked on a leading "layers" axis)."""
    return layout.param_specs(cfg.replace(num_layers=1))["layers"]


def param_shapes(cfg: ModelConfig, modules: int) -> dict[str, tuple]:
    """{name: shape} of `modules` MTP modules for a backbone of config `cfg`."""
    h = cfg.hidden_size
    out = {"enorm": (modules, h), "hnorm": (modules, h), "eh_proj": (modules, 2 * h, h),
           "final_norm": (modules, h)}
    for n, s in layer_specs(cfg).items():
        out[LAYER + n] = (modules,) + tuple(s.shape[1:])
    return out


def axes(heads: Params) -> dict:
    """{name: logical axes}: the layer's as the backbone's, the module axis a stacking one."""
    named = {"enorm": (MODULE_AXIS, "norm"), "hnorm": (MODULE_AXIS, "norm"),
             "final_norm": (MODULE_AXIS, "norm"), "eh_proj": (MODULE_AXIS, "mtp_in", "embed")}
    out = {}
    for n in heads:
        if n in named:
            out[n] = named[n]
        elif n.startswith(LAYER):
            out[n] = (MODULE_AXIS,) + _LAYER_AXES.get(n[len(LAYER):], ("norm",))
    return out


_LAYER_AXES = {"wq": ("embed", "q_heads"), "wk": ("embed", "kv_heads"),
               "wv": ("embed", "kv_heads"), "wo": ("q_heads", "embed"),
               "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
               "bq": ("q_heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
               "q_norm": ("head_dim",), "k_norm": ("head_dim",)}


def is_mtp(heads) -> bool:
    """Whether a heads tree (arrays, numpy or shapes) holds MTP modules."""
    return heads is not None and "eh_proj" in heads and "enorm" in heads


def num_modules(heads: Params) -> int:
    return int(np.shape(heads["eh_proj"])[0])


def init_mtp(key: jax.Array, cfg: ModelConfig, modules: int, std: float = 0.02) -> Params:
    """`modules` fresh modules: norms at one (Gemma's stored weight - 1: zero), the other
    tensors normal(0, std)."""
    shapes = param_shapes(cfg, modules)
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    out = {}
    for n, s in shapes.items():
        if n.endswith("norm"):
            out[n] = jnp.full(s, 1.0 - cfg.norm_offset, jnp.float32)
        else:
            out[n] = std * jax.random.normal(keys[n], s, jnp.float32)
    return out


def check(heads: Params, cfg: ModelConfig, where: str = "MTP modules") -> None:
    """The tensors of modules for a backbone of config `cfg`: names, shapes (the hidden size
    and the layer's), finite floats. One-line ValueError naming `where` and the tensor."""
    if not is_mtp(heads) or np.ndim(heads["eh_proj"]) != 3:
        raise ValueError(f"{where}: no eh_proj [D, 2H, H] tensor: these are not MTP modules")
    d = num_modules(heads)
    if d < 1:
        raise ValueError(f"{where}: no module (eh_proj holds 0)")
    h2 = np.shape(heads["eh_proj"])[1]
    if h2 != 2 * cfg.hidden_size:
        raise ValueError(f"{where}: eh_proj reads {h2} features, but the backbone's hidden "
                         f"size is {cfg.hidden_size} (2H = {2 * cfg.hidden_size})")
    want = param_shapes(cfg, d)
    names = set(heads)
    if names != set(want):
        raise ValueError(f"{where}: missing tensors {sorted(set(want) - names)}, unexpected "
                         f"{sorted(names - set(want))}")
    for n, s in want.items():
        if tuple(np.shape(heads[n])) != s:
            raise ValueError(f"{where}: tensor {n} has shape {tuple(np.shape(heads[n]))}, "
                             f"expected {s}")
    check_float_tensors(heads, tuple(want), where)


# ----------------------------------------------------------------------------- forward


def layer_weights(heads: Params, m: int, dtype) -> dict:
    """Module m's decoder layer in the backbone layer's layout, cast to `dtype`."""
    return {n[len(LAYER):]: heads[n][m].astype(dtype) for n in heads if n.startswith(LAYER)}


def projected(heads: Params, cfg: ModelConfig, m: int, x_embed: jax.Array, hidden: jax.Array,
              positions: jax.Array, style: str = "deepseek") -> jax.Array:
    """[..., H]: eh_proj of the normalised embedding and hidden state side by side (the
    embedding zeroed at position 0; their order the layout `style`'s), the decoder layer's
    input."""
    hidden_first = STYLES[style][0]
    dt = hidden.dtype
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    e = jnp.where((positions == 0)[..., None], 0, x_embed.astype(dt))
    e = backbone.rms_norm(e, heads["enorm"][m], eps, off)
    h = backbone.rms_norm(hidden, heads["hnorm"][m], eps, off)
    both = [h, e] if hidden_first else [e, h]
    return jnp.einsum("...i,ih->...h", jnp.concatenate(both, axis=-1),
                      heads["eh_proj"][m].astype(dt))


def module(heads: Params, cfg: ModelConfig, m: int, x_embed: jax.Array, hidden: jax.Array,
           positions: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array,
           extra: tuple | None = None, style: str = "deepseek"):
    """Module m over T new positions: x_embed [B, T, H] the backbone's embeddings of the
    tokens read, hidden [B, T, H] the previous depth's states, positions [B, T], k_cache /
    v_cache [B, KVH, S, D] the module's keys/values of S earlier entries (S may be 0),
    `extra` None or (k, v [B, KVH, N, D]) N more (a tree's entries), mask [B or 1, T,
    S + N + T]. Returns (h [B, T, H] before the final norm, k_new, v_new [B, KVH, T, D])."""
    s = k_cache.shape[2]
    n = 0 if extra is None else extra[0].shape[2]
    x = projected(heads, cfg, m, x_embed, hidden, positions, style)
    rope = backbone.rope_table(positions, backbone.rope_frequencies(cfg))
    return backbone.decoder_layer(
        cfg, x, layer_weights(heads, m, hidden.dtype), k_cache if s else None,
        v_cache if s else None, rope, mask[..., :s], mask[..., s + n:],
        (extra[0], extra[1], mask[..., s:s + n]) if n else None)


def normed(heads: Params, cfg: ModelConfig, m: int, h: jax.Array) -> jax.Array:
    """Module m's final norm of its output h [..., H]."""
    return backbone.rms_norm(h, heads["final_norm"][m], cfg.rms_norm_eps, cfg.norm_offset)


def fed_on(heads: Params, cfg: ModelConfig, m: int, h: jax.Array, style: str) -> jax.Array:
    """What the next depth reads of module m's output h: h itself, or (MiMo) normed."""
    return normed(heads, cfg, m, h) if STYLES[style][1] else h


def logits(params: Params, cfg: ModelConfig, heads: Params, m: int, h: jax.Array) -> jax.Array:
    """h [..., H] (a `module` output) -> float32 logits [..., V]: module m's final norm,
    then the backbone's output head."""
    return backbone.logits_from_hidden(cfg, params, normed(heads, cfg, m, h))


# ----------------------------------------------------------------------------- training


def chain_hidden(params: Params, cfg: ModelConfig, heads: Params, hidden: jax.Array,
                 tokens: jax.Array, depths: int | None = None, style: str = "deepseek",
                 valid: jax.Array | None = None, segments: jax.Array | None = None,
                 positions: jax.Array | None = None) -> list[jax.Array]:
    """MaxText's MTP over whole sequences (teacher-forced tokens): hidden [B, T, H] the
    backbone's final hidden states, tokens [B, T]; module k at position i reads module
    k-1's output at i (the backbone's state for k = 0) and the embedding of tokens[i+k+1],
    attending causally over its own sequence (`valid` [B, T]: keys that are real tokens;
    packed rows: `segments` [B, T] keep attention inside each example, `positions` [B, T]
    its rotary positions, from 0 per example). Returns each depth's outputs [B, T, H]
    (`depths` of them: the module count if None; the last module reused past it)."""
    b, t = tokens.shape
    pos = (jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
           if positions is None else positions)
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    if valid is not None:
        mask = mask & valid.astype(bool)[:, None, :]
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])
    empty = jnp.zeros((b, cfg.num_kv_heads, 0, cfg.head_dim), hidden.dtype)
    embedded = jax.lax.stop_gradient(backbone.embed_tokens(cfg, params, tokens))
    outs, h = [], hidden
    for k in range(depths or num_modules(heads)):
        m = min(k, num_modules(heads) - 1)
        out, _, _ = module(heads, cfg, m, shift(embedded, k + 1), h, pos, empty, empty, mask,
                           style=style)
        outs.append(out)
        h = fed_on(heads, cfg, m, out, style)
    return outs
