"""Enlarge a model (and its Medusa or Hydra heads) to a bigger shape, same function.

There is no big real model on a machine without network access, but a small one can be
grown into a bigger shape exactly (in real arithmetic), Net2Net-style: the enlarged model
reads as many bytes per token as a real model of the target shape, so decoding it is bound
by memory bandwidth as real models are, while its predictions (and so Medusa's acceptance)
stay the small model's. `train.enlarge` is the command.

The construction, for a source of hidden size H, head_dim D, G query heads per KV head and a
target of H' >= H, D' = m D, G':

- zero padding everywhere (the source's values at the first H hidden dimensions, the first F
  MLP channels, ...), so the residual stream is zero in the new dimensions;
- every RMSNorm over the residual stream gets weight * sqrt(H / H') and eps * H / H': the
  mean of squares over H' dimensions is H / H' of the mean over the H real ones, and this
  cancels it exactly;
- head dimension j of a rotary pair (j, j + D/2) goes to dimension j*m (and j*m + D'/2):
  the target's rotary frequency there is the source's (the source's rope base is kept), and
  the queries absorb the change of the 1/sqrt(head_dim) factor (times sqrt(D'/D));
- query head i of KV group s keeps its keys and values: with G' >= G it goes to slot i % G
  of target group s; with G' < G (G a multiple of G') it stays head i and target KV head
  i // G' holds a copy of source KV head s; extra heads have zero output projections;
- extra layers copy a source layer's weights but have zero output projections (wo, w_down):
  each is an identity, yet reads its weights like a real layer;
- the heads' residual blocks and projections are padded the same way (their input, the
  final hidden state, is the source's padded with zeros); a Hydra head's (i+2)H-wide input
  (h, then embeddings of the path) is padded block by block: each H-wide block goes to the
  first H of its H'-wide block, since the enlarged embedding is the source's padded with
  zeros too;
- an EAGLE-3 drafter's layer grows like a backbone layer, to the target's layer shape (so it
  costs what a real drafter of that model would); its three-feature input `fc` and its
  two-part q/k/v input (embedding, feature) are padded block by block. It reads the same
  layers' inputs: the source layers keep their indices (the extra layers come after them).

`rotate` (a seed) then folds every RMSNorm's scale into the adjacent projections and turns
the residual stream by a random orthogonal matrix Q (RMSNorm with unit weights commutes
with it), so that the embedding, the output layer and every projection's residual-stream
side are dense (the columns of new attention heads, head dimensions and MLP channels stay
zero: they are not on the residual stream); the function is unchanged up to rounding. The
heads cannot follow a rotation (their SiLU is elementwise: it does not commute with Q), so
`enlarge_heads` refuses a rotated model.

All arrays are numpy; the arithmetic is float64, the result float32.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from medusa_jax.drafters import registry
from medusa_jax.model.config import ModelConfig

# The dimensions a target shape gives (the rest of the config is the source's).
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim")


class EnlargeError(ValueError):
    """A source and target shape that cannot be enlarged exactly (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where each source dimension lands in the target."""

    src: ModelConfig
    dst: ModelConfig
    q_cols: tuple[np.ndarray, np.ndarray]  # (source, target) columns of the q projection
    kv_cols: tuple[np.ndarray, np.ndarray]  # (source, target) columns of k/v (copies too)
    head_dim_map: np.ndarray  # [D] target position of each source head dimension


def target_config(src: ModelConfig, shape: dict) -> ModelConfig:
    """The enlarged config: `shape`'s dimensions (`SHAPE_FIELDS`), the source's everything
    else, RMSNorm eps scaled by H / H'. Raises EnlargeError when no exact enlargement exists."""
    if src.norm_offset or src.sandwich_norms or src.layer_windows:
        raise EnlargeError(f"enlarging a {src.model_type} model is not supported (its (1 + w) "
                           f"norms do not scale as the Llama family's)")
    dims = {f: int(shape[f]) for f in SHAPE_FIELDS}
    h, h2, d, d2 = src.hidden_size, dims["hidden_size"], src.head_dim, dims["head_dim"]
    names = {"hidden_size": "hidden size", "intermediate_size": "MLP width",
             "num_layers": "layer count", "num_heads": "query heads", "head_dim": "head_dim"}
    for field, name in names.items():
        if dims[field] < getattr(src, field):
            raise EnlargeError(f"the target's {name} {dims[field]} is smaller than the "
                               f"source's {getattr(src, field)}: a model can only grow")
    if dims["num_heads"] % dims["num_kv_heads"]:
        raise EnlargeError(f"the target's {dims['num_heads']} query heads are not a multiple "
                           f"of its {dims['num_kv_heads']} KV heads")
    if d2 % d:
        raise EnlargeError(f"the target's head_dim {d2} is not a multiple of the source's "
                           f"{d}: the rotary pairs could not keep their frequencies")
    g, g2 = src.q_per_kv, dims["num_heads"] // dims["num_kv_heads"]
    if g2 >= g:
        if dims["num_kv_heads"] < src.num_kv_heads:
            raise EnlargeError(f"the target has {dims['num_kv_heads']} KV heads for the "
                               f"source's {src.num_kv_heads} KV groups")
    elif g % g2:
        raise EnlargeError(f"the source's {g} query heads per KV head cannot be regrouped "
                           f"into the target's {g2} per KV head (not a divisor)")
    if src.qk_norm and h * d2 != h2 * d:
        raise EnlargeError(f"q/k RMSNorm ({src.model_type}) shares one eps with the hidden "
                           f"norms: the hidden size and head_dim must grow by the same factor "
                           f"(here {h2}/{h} and {d2}/{d})")
    return src.replace(**dims, rms_norm_eps=src.rms_norm_eps * h / h2)


def plan(src: ModelConfig, dst: ModelConfig) -> Plan:
    d, d2 = src.head_dim, dst.head_dim
    m = d2 // d
    half = np.arange(d // 2)
    head_dim_map = np.concatenate([half * m, d2 // 2 + half * m])
    g, g2 = src.q_per_kv, dst.q_per_kv
    q_src, q_dst, kv = [], [], {}
    for i in range(src.num_heads):
        s = i // g
        t = s * g2 + i % g if g2 >= g else i  # target query head
        q_src.append(i * d + np.arange(d))
        q_dst.append(t * d2 + head_dim_map)
        kv[t // g2] = s  # target KV head -> the source KV head it holds
    kv_src = [s * d + np.arange(d) for s in kv.values()]
    kv_dst = [t * d2 + head_dim_map for t in kv]
    return Plan(src, dst, (np.concatenate(q_src), np.concatenate(q_dst)),
                (np.concatenate(kv_src), np.concatenate(kv_dst)), head_dim_map)


def _np(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _place(shape, src: np.ndarray, rows=None, cols=None) -> np.ndarray:
    """A zero array of `shape` with `src` at the given rows / columns (default: leading)."""
    out = np.zeros(shape)
    rows = np.arange(src.shape[0]) if rows is None else rows
    if src.ndim == 1:
        out[rows] = src
        return out
    cols = np.arange(src.shape[1]) if cols is None else cols
    out[np.ix_(rows, cols)] = src
    return out


def enlarge_backbone(cfg: ModelConfig, params: dict, shape: dict, *, rotate: int | None = None
                     ) -> tuple[ModelConfig, dict]:
    """(target config, target params) for the backbone `params` (the standard, stacked
    layout of `backbone.param_specs`) grown to `shape` (`SHAPE_FIELDS`)."""
    dst = target_config(cfg, shape)
    p = plan(cfg, dst)
    h, h2, f2 = cfg.hidden_size, dst.hidden_size, dst.intermediate_size
    qd2, kvd2 = dst.num_heads * dst.head_dim, dst.num_kv_heads * dst.head_dim
    norm_scale = math.sqrt(h / h2)
    q_scale = 1.0 if cfg.qk_norm else math.sqrt(dst.head_dim / cfg.head_dim)
    hid = np.arange(h)
    (qs, qt), (ks, kt) = p.q_cols, p.kv_cols
    src_layers = {k: _np(v) for k, v in params["layers"].items()}

    def layer(i: int, identity: bool) -> dict:
        w = {k: v[i] for k, v in src_layers.items()}
        out = {
            "attn_norm": _place((h2,), w["attn_norm"] * norm_scale),
            "mlp_norm": _place((h2,), w["mlp_norm"] * norm_scale),
            "wq": _place((h2, qd2), w["wq"][:, qs] * q_scale, hid, qt),
            "wk": _place((h2, kvd2), w["wk"][:, ks], hid, kt),
            "wv": _place((h2, kvd2), w["wv"][:, ks], hid, kt),
            "wo": _place((qd2, h2), w["wo"][qs], qt, hid),
            "w_gate": _place((h2, f2), w["w_gate"]),
            "w_up": _place((h2, f2), w["w_up"]),
            "w_down": _place((f2, h2), w["w_down"]),
        }
        if cfg.attention_bias:
            out["bq"] = _place((qd2,), w["bq"][qs] * q_scale, qt)
            out["bk"] = _place((kvd2,), w["bk"][ks], kt)
            out["bv"] = _place((kvd2,), w["bv"][ks], kt)
        if cfg.qk_norm:  # times sqrt(D/D') for the eps, times sqrt(D'/D) for the scores (q)
            out["q_norm"] = _place((dst.head_dim,), w["q_norm"], p.head_dim_map)
            out["k_norm"] = _place((dst.head_dim,), w["k_norm"] * norm_scale, p.head_dim_map)
        if identity:  # an extra layer: real weights, no contribution to the residual stream
            out["wo"] = np.zeros_like(out["wo"])
            out["w_down"] = np.zeros_like(out["w_down"])
        return out

    layers = [layer(i % cfg.num_layers, i >= cfg.num_layers) for i in range(dst.num_layers)]
    new = {"embed": _place((cfg.vocab_size, h2), _np(params["embed"]), None, hid),
           "final_norm": _place((h2,), _np(params["final_norm"]) * norm_scale),
           "layers": {k: np.stack([lyr[k] for lyr in layers]) for k in layers[0]}}
    if not cfg.tie_word_embeddings:
        new["lm_head"] = _place((h2, cfg.vocab_size), _np(params["lm_head"]))
    if rotate is not None:
        dst, new = _rotate(dst, new, rotate)
    return dst, {k: (v.astype(np.float32) if not isinstance(v, dict) else
                     {n: a.astype(np.float32) for n, a in v.items()}) for k, v in new.items()}


def random_orthogonal(n: int, seed: int) -> np.ndarray:
    """A Haar-random orthogonal [n, n] matrix (QR of a Gaussian, signs fixed)."""
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    return q * np.sign(np.diag(r))[None, :]


def _rotate(cfg: ModelConfig, p: dict, seed: int) -> tuple[ModelConfig, dict]:
    """Fold the residual-stream RMSNorm scales into the projections that read them, then
    turn the residual stream by a random orthogonal Q: x -> x Q. Every projection reading the
    stream becomes Q^T W, every one writing it W Q; RMSNorm with unit weights commutes with
    Q. The output projection is no longer the embedding's transpose (untied)."""
    q = random_orthogonal(cfg.hidden_size, seed)
    lyr = dict(p["layers"])
    lm_head = p["lm_head"] if "lm_head" in p else p["embed"].T
    for norm, reads in (("attn_norm", ("wq", "wk", "wv")), ("mlp_norm", ("w_gate", "w_up"))):
        for name in reads:
            lyr[name] = q.T @ (lyr[norm][:, :, None] * lyr[name])  # [L, H, out], batched
        lyr[norm] = np.ones_like(lyr[norm])
    for name in ("wo", "w_down"):
        lyr[name] = lyr[name] @ q
    out = {"embed": p["embed"] @ q, "final_norm": np.ones_like(p["final_norm"]),
           "lm_head": q.T @ (p["final_norm"][:, None] * lm_head), "layers": lyr}
    return cfg.replace(tie_word_embeddings=False), out


def enlarge_heads(heads: dict, src: ModelConfig, dst: ModelConfig, *, rotated: bool = False
                  ) -> dict:
    """A drafter of any kind for the enlarged backbone: its kind's `enlarge(heads, src, dst,
    grow)` (`grow`: this module, whose `plan` and `place` grow a layer as the backbone's
    grow). The heads' SiLU is elementwise, so none follows --rotate."""
    if rotated:
        raise EnlargeError("drafters cannot follow --rotate: their SiLU is elementwise, so a "
                           "rotation of their input cannot be undone; enlarge without "
                           "--rotate to keep the heads")
    import sys

    cls = registry.drafter_class(registry.kind_of(heads))
    try:
        return cls.enlarge(heads, src, dst, sys.modules[__name__])
    except ValueError as e:
        raise EnlargeError(str(e)) from None


def place(shape, a, rows=None, cols=None):
    """`a` written into zeros of `shape` at `rows` x `cols` (default: the leading corner)."""
    return _place(shape, a, rows, cols)


def hf_config(source: dict, cfg: ModelConfig) -> dict:
    """The source's Hugging Face config.json dict with the enlarged shape written in."""
    out = dict(source)
    out.update(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
               num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
               rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
               dtype="float32")
    out.pop("torch_dtype", None)
    # a source that carries its own MTP layers: the enlarged weights do not (its drafter,
    # enlarged, is written apart)
    out.pop("num_nextn_predict_layers", None)
    return out
