"""EAGLE-3 drafter parameters and forward pass (Li et al. 2025; SafeAILab/EAGLE's
`eagle/model/cnets.py` and `eagle/traineagle3/cnets.py`).

The drafter is one Llama decoder layer of its own, fed two things per position: a feature
`hidden` [H] and the backbone's embedding of the next token. At the root, `hidden` is
`fc(concat(f_low, f_mid, f_high))`, the residual stream entering three backbone layers
(`eagle3_layers`, read with `aux_layers`); deeper down the tree it is the layer's
own previous output (pre-norm), so the drafter runs on its own outputs. The layer normalises
the two inputs apart (`input_norm` on the embedding, `hidden_norm` on the feature),
concatenates them embedding first into 2H and projects that to q, k, v; its residual is the
un-normalised feature. Logits come from `final_norm` then `lm_head` over a reduced draft
vocabulary Vd; `d2t` maps a draft id to its target id (target = draft + d2t[draft]) and `t2d`
marks the target ids the draft vocabulary holds.

Parameters (ours are [in, out]: y = x @ w; H hidden, Ht the backbone's hidden, NH/KVH query
and key-value heads of size D, F intermediate, V the backbone's vocabulary):

    fc              [3*Ht, H]
    wq              [2H, NH, D]      wk, wv [2H, KVH, D]      wo [NH, D, H]
    w_gate, w_up    [H, F]           w_down [F, H]
    input_norm, hidden_norm, post_attn_norm, final_norm   [H]
    lm_head         [H, Vd]
    d2t             [Vd] int32 (target id - draft id)      t2d [V] bool

`layer` is the one decoder layer with its own KV cache over drafted positions: the backbone's
own `backbone.decoder_layer` (its weights in that layout, `layer_weights`; q, k and v
projected from the normalised 2H input, `attention_input`), attending with the backbone's
`cached_attention` (the cache only read); the caller passes the attention mask (a causal
mask, the training-time-test mask, or a tree mask: just another mask). `ttt_logits` is the
reference trainer's training-time test: the drafter run on its own outputs for 7 steps (its
loss, step i's weighted 0.8**i: `training.recipes.eagle3`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.drafters.eagle3.layers import eagle3_layers
from medusa_jax.drafters.io import check_float_tensors
from medusa_jax.drafters.toolkit.sequence import shift
from medusa_jax.model import backbone
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig

KIND = "eagle3"
WEIGHTS = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "input_norm",
           "hidden_norm", "post_attn_norm", "final_norm", "lm_head")
NAMES = WEIGHTS + ("d2t", "t2d")
TTT_STEPS, TTT_DECAY = 7, 0.8  # eagle/traineagle3: Model.length = 7, weights 0.8 ** i


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """What the forward pass needs beyond the parameters' shapes. Hashable (a static
    argument of jitted functions). `aux_layers` are backbone layer indices whose INPUT the
    drafter reads (`eagle3_layers`); checkpoints store the OUTPUT-of-layer ids, one
    less (`formats`)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    vocab_size: int  # the backbone's (target) vocabulary
    aux_layers: tuple = ()
    target_hidden_size: int | None = None  # the backbone's hidden size (None: hidden_size)
    rms_norm_eps: float = 1e-6  # LlamaRMSNorm's default in the reference
    rope_theta: float = 10000.0
    rope_scaling: tuple = ("default",)  # as ModelConfig.rope_scaling
    max_position_embeddings: int = 2048

    @property
    def feature_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    def replace(self, **changes) -> "Eagle3Config":
        return dataclasses.replace(self, **changes)


def default_config(model_cfg: ModelConfig, draft_vocab_size: int | None = None,
                   aux_layers=None) -> Eagle3Config:
    """A drafter shaped like one layer of `model_cfg` (as SpecForge's configs are: heads,
    head size, intermediate size, norm eps and rope copied from the target), reading
    `eagle3_layers`, over the full vocabulary unless `draft_vocab_size` is given."""
    v = model_cfg.vocab_size
    return Eagle3Config(
        hidden_size=model_cfg.hidden_size, num_heads=model_cfg.num_heads,
        num_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim,
        intermediate_size=model_cfg.intermediate_size,
        draft_vocab_size=v if draft_vocab_size is None else int(draft_vocab_size),
        vocab_size=v, target_hidden_size=model_cfg.hidden_size,
        aux_layers=tuple(aux_layers) if aux_layers is not None
        else eagle3_layers(model_cfg.num_layers),
        rms_norm_eps=model_cfg.rms_norm_eps, rope_theta=model_cfg.rope_theta,
        rope_scaling=model_cfg.rope_scaling,
        max_position_embeddings=model_cfg.max_position_embeddings)


def param_shapes(c: Eagle3Config) -> dict[str, tuple]:
    """{name: shape} of the parameters of a drafter configured by `c`."""
    h, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    nh, kvh = c.num_heads, c.num_kv_heads
    return {
        "fc": (3 * c.feature_size, h),
        "wq": (2 * h, nh, d), "wk": (2 * h, kvh, d), "wv": (2 * h, kvh, d),
        "wo": (nh, d, h),
        "w_gate": (h, f), "w_up": (h, f), "w_down": (f, h),
        "input_norm": (h,), "hidden_norm": (h,), "post_attn_norm": (h,), "final_norm": (h,),
        "lm_head": (h, c.draft_vocab_size),
        "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,),
    }


# Logical axes (`runtime.sharding`): only "embed" has a rule, fsdp's. Training splits the
# drafter's weights and their optimizer state over fsdp by the hidden dimension; decoding
# (model-axis rules only) keeps them whole on every device, so drafting needs no collectives.
AXES = {
    "fc": ("eagle_features", "embed"),
    "wq": ("embed", "eagle_heads", "eagle_head_dim"),
    "wk": ("embed", "eagle_kv_heads", "eagle_head_dim"),
    "wv": ("embed", "eagle_kv_heads", "eagle_head_dim"),
    "wo": ("eagle_heads", "eagle_head_dim", "embed"),
    "w_gate": ("embed", "eagle_mlp"), "w_up": ("embed", "eagle_mlp"),
    "w_down": ("eagle_mlp", "embed"),
    "lm_head": ("embed", "eagle_vocab"),
}


def vocab_maps(counts, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference trainer's draft vocabulary (`Model.scandata`): the `draft_vocab_size`
    most frequent target tokens, kept in target-id order. counts [V] token frequencies ->
    (d2t [Vd] int32: target id - draft id, t2d [V] bool). Ties, and tokens never seen when
    fewer than Vd were, go to the lower id (the reference's Counter order is arbitrary there
    and it builds a short map when fewer than Vd tokens occur)."""
    counts = np.asarray(counts)
    v = counts.shape[0]
    if not 1 <= draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size={draft_vocab_size!r}: need 1 <= size <= {v} "
                         f"(the target vocabulary)")
    order = np.lexsort((np.arange(v), -counts.astype(np.float64)))  # count desc, id asc
    used = np.sort(order[:draft_vocab_size])
    t2d = np.zeros(v, bool)
    t2d[used] = True
    return (used - np.arange(draft_vocab_size)).astype(np.int32), t2d


# The fan-in of each linear weight (ours are [in, ...]; wo's input is NH x D).
_FAN_IN_DIMS = {"wo": 2}


def init_eagle3(key: jax.Array, c: Eagle3Config, counts=None,
                std: float | None = None) -> Params:
    """A fresh drafter: norms at one, the draft vocabulary from token `counts` [V]
    (`vocab_maps`; None: the first Vd ids), linear weights as the reference's: torch's
    default `nn.Linear` initialisation, uniform in +-1/sqrt(fan_in) (kaiming-uniform with
    a = sqrt(5)); at this width it trains to a better drafter than a small normal. `std`:
    normal(0, std) instead (tests that want drafts of a given spread)."""
    shapes = param_shapes(c)
    linear = [n for n in WEIGHTS if "norm" not in n]
    keys = dict(zip(linear, jax.random.split(key, len(linear))))
    out = {}
    for n in linear:
        if std is not None:
            out[n] = std * jax.random.normal(keys[n], shapes[n], jnp.float32)
            continue
        bound = 1.0 / math.sqrt(math.prod(shapes[n][:_FAN_IN_DIMS.get(n, 1)]))
        out[n] = jax.random.uniform(keys[n], shapes[n], jnp.float32, -bound, bound)
    out.update({n: jnp.ones(shapes[n], jnp.float32) for n in WEIGHTS if "norm" in n})
    d2t, t2d = vocab_maps(np.zeros(c.vocab_size) if counts is None else counts,
                          c.draft_vocab_size)
    out.update(d2t=jnp.asarray(d2t), t2d=jnp.asarray(t2d))
    return out


def is_eagle3(heads) -> bool:
    """Whether a heads tree (arrays, numpy or shapes) holds an EAGLE-3 drafter."""
    return heads is not None and "fc" in heads and "d2t" in heads


def config_of(heads: Params, **fields) -> Eagle3Config:
    """The sizes read off the parameters; what shapes do not hold (aux_layers, rms_norm_eps,
    rope_theta, ...) from `fields` (else the defaults)."""
    nh, d, h = (int(n) for n in np.shape(heads["wo"]))
    sizes = dict(hidden_size=h, num_heads=nh, num_kv_heads=int(np.shape(heads["wk"])[1]),
                 head_dim=d, intermediate_size=int(np.shape(heads["w_up"])[1]),
                 draft_vocab_size=int(np.shape(heads["lm_head"])[1]),
                 vocab_size=int(np.shape(heads["t2d"])[0]),
                 target_hidden_size=int(np.shape(heads["fc"])[0]) // 3)
    sizes.update(fields)
    if "aux_layers" in sizes:
        sizes["aux_layers"] = tuple(int(i) for i in sizes["aux_layers"])
    return Eagle3Config(**sizes)


def check_draft_ids(d2t, t2d, vocab_size: int, where="EAGLE-3 drafter") -> None:
    """d2t [Vd] and t2d [V] must describe one subset of the target vocabulary: draft id i
    maps to target id i + d2t[i], in [0, V), strictly increasing (the reference keeps the
    subset in target-id order; its trainer selects target logits with t2d in that order), and
    t2d marks exactly those ids. One-line ValueError naming `where` otherwise."""
    d2t, t2d = np.asarray(d2t), np.asarray(t2d)
    if d2t.ndim != 1 or t2d.ndim != 1:
        raise ValueError(f"{where}: d2t and t2d must be vectors, got shapes {d2t.shape}, "
                         f"{t2d.shape}")
    if t2d.shape[0] != vocab_size:
        raise ValueError(f"{where}: t2d has {t2d.shape[0]} entries, expected {vocab_size} "
                         f"(the backbone's vocabulary)")
    targets = np.arange(d2t.shape[0]) + d2t.astype(np.int64)
    bad = np.flatnonzero((targets < 0) | (targets >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: d2t maps draft id {i} to target id {int(targets[i])}, "
                         f"outside the vocabulary [0, {vocab_size})")
    down = np.flatnonzero(np.diff(targets) <= 0)
    if down.size:
        i = int(down[0]) + 1
        raise ValueError(f"{where}: d2t is not a subset of the vocabulary in increasing order: "
                         f"draft id {i} maps to target id {int(targets[i])}, draft id {i - 1} "
                         f"to {int(targets[i - 1])}")
    marked = np.flatnonzero(t2d)
    if marked.shape != targets.shape or np.any(marked != targets):
        extra = np.setdiff1d(marked, targets)
        missing = np.setdiff1d(targets, marked)
        what = (f"marks target id {int(extra[0])}, which no draft id maps to" if extra.size
                else f"does not mark target id {int(missing[0])}, which d2t maps to")
        raise ValueError(f"{where}: t2d disagrees with d2t: it {what} ({marked.size} marked, "
                         f"{targets.size} draft ids)")


_SIZES = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
          "draft_vocab_size", "vocab_size", "max_position_embeddings")


def check_config(c: Eagle3Config, where="EAGLE-3 drafter", prefix: str = "") -> None:
    """The configuration's own values, whatever wrote them (a config.json, our artifact's
    metadata): sizes are integers >= 1, the norm eps and rope base finite numbers > 0 (a
    negative eps never drafts a usable token; a string base fails only while decoding), the
    rope scaling one of the forms `ModelConfig.rope_scaling` takes. One-line ValueError
    naming `where` and the field (`prefix` + its name)."""
    def bad(field, value, want):
        raise ValueError(f"{where}: {prefix}{field}={value!r} is not {want}")

    def positive(field, value):
        if not _number(value) or not math.isfinite(value) or value <= 0:
            bad(field, value, "a finite number > 0")

    for field in _SIZES:
        value = getattr(c, field)
        if not _integer(value) or value < 1:
            bad(field, value, "an integer >= 1")
    if c.target_hidden_size is not None and (not _integer(c.target_hidden_size)
                                             or c.target_hidden_size < 1):
        bad("target_hidden_size", c.target_hidden_size, "an integer >= 1 or null")
    positive("rms_norm_eps", c.rms_norm_eps)
    positive("rope_theta", c.rope_theta)
    if not all(_integer(i) for i in c.aux_layers):
        bad("aux_layers", list(c.aux_layers), "a list of layer indices")
    scaling = tuple(c.rope_scaling)
    forms = {"default": 0, "linear": 1, "llama3": 4}
    if not scaling or not isinstance(scaling[0], str) or scaling[0] not in forms \
            or len(scaling) != 1 + forms[scaling[0]]:
        bad("rope_scaling", list(scaling), '["default"], ["linear", factor] or ["llama3", '
            'factor, low_freq_factor, high_freq_factor, original_max_position_embeddings]')
    for value in scaling[1:4]:
        positive("rope_scaling", value)
    if scaling[0] == "llama3" and (not _integer(scaling[4]) or scaling[4] < 1):
        bad("rope_scaling", list(scaling), "llama3 scaling with an integer "
            "original_max_position_embeddings >= 1")


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and \
        not isinstance(value, (bool, np.bool_))


def check(heads: Params, model_cfg: ModelConfig | None, c: Eagle3Config,
          where="EAGLE-3 drafter") -> None:
    """Strict checks of a drafter against its config and the backbone: the config's own
    values (`check_config`), sizes (hidden, vocabulary), aux layers within the backbone's
    depth, every tensor's name, shape and dtype, finite weights, d2t/t2d one subset of the
    vocabulary. One-line ValueError naming `where`."""
    check_config(c, where)
    if model_cfg is not None:
        for field, theirs in (("hidden_size", c.hidden_size),
                              ("target_hidden_size", c.feature_size)):
            if theirs != model_cfg.hidden_size:
                raise ValueError(f"{where}: {field}={theirs}, but the backbone's hidden size "
                                 f"is {model_cfg.hidden_size}")
        if c.vocab_size != model_cfg.vocab_size:
            raise ValueError(f"{where}: vocab_size={c.vocab_size}, but the backbone's "
                             f"vocabulary is {model_cfg.vocab_size}")
    if not 1 <= c.draft_vocab_size <= c.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size={c.draft_vocab_size} is not in "
                         f"[1, vocab_size={c.vocab_size}]")
    if c.num_heads % c.num_kv_heads:
        raise ValueError(f"{where}: num_attention_heads={c.num_heads} is not a multiple of "
                         f"num_key_value_heads={c.num_kv_heads}")
    layers = tuple(c.aux_layers)
    if len(layers) != 3:
        raise ValueError(f"{where}: aux layers {list(layers)}: EAGLE-3 reads exactly three "
                         f"backbone layers (its fc takes 3 x hidden)")
    if model_cfg is not None:
        try:
            backbone.check_aux_layers(model_cfg, layers)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    names = set(heads)
    if names != set(NAMES):
        raise ValueError(f"{where}: an EAGLE-3 drafter needs tensors {', '.join(NAMES)}; "
                         f"missing {sorted(set(NAMES) - names)}, unexpected "
                         f"{sorted(names - set(NAMES))}")
    for name, shape in param_shapes(c).items():
        got = tuple(np.shape(heads[name]))
        if got != shape:
            raise ValueError(f"{where}: tensor {name} has shape {got}, expected {shape}")
    check_float_tensors(heads, WEIGHTS, where)
    d2t, t2d = np.asarray(heads["d2t"]), np.asarray(heads["t2d"])
    if d2t.dtype.kind not in "iu":
        raise ValueError(f"{where}: tensor d2t has dtype {d2t.dtype}, expected an integer type")
    if t2d.dtype != np.bool_:
        raise ValueError(f"{where}: tensor t2d has dtype {t2d.dtype}, expected bool")
    check_draft_ids(d2t, t2d, c.vocab_size, where)


# ----------------------------------------------------------------------------- forward


def _model_cfg(c: Eagle3Config) -> ModelConfig:
    """The drafter's layer as a backbone layer's configuration: what `backbone.decoder_layer`
    reads (heads, head size, norm eps, rope; a Llama layer: silu MLP, no bias, softcap or
    sandwich norms, 1/sqrt(D))."""
    return ModelConfig(model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                       intermediate_size=c.intermediate_size, num_layers=1,
                       num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                       head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
                       rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                       rope_scaling=tuple(c.rope_scaling))


def layer_weights(params: Params, dtype) -> dict:
    """The drafter's layer weights in the backbone layer's layout (`backbone.decoder_layer`):
    q, k, v [2H, NH*D] / [2H, KVH*D] and wo [NH*D, H] (the stored [in, heads, D] blocks,
    reshaped in place), `post_attn_norm` as the layer's `mlp_norm`; cast to `dtype`, the
    activations' (None: as stored). No `attn_norm`: the caller passes the normalised input
    (`attention_input`). Parameters prepared for decoding carry theirs (`decoding_layout`)."""
    if LAYER in params:
        return params[LAYER]

    def flat_out(w):  # [I, N, D] -> [I, N*D]
        return w.reshape(w.shape[0], -1).astype(dtype or w.dtype)

    wo = params["wo"]
    return {"wq": flat_out(params["wq"]), "wk": flat_out(params["wk"]),
            "wv": flat_out(params["wv"]),
            "wo": wo.reshape(-1, wo.shape[-1]).astype(dtype or wo.dtype),
            "mlp_norm": params["post_attn_norm"],
            **{n: params[n].astype(dtype or params[n].dtype)
               for n in ("w_gate", "w_up", "w_down")}}


LAYER = "layer"  # the key of a decoding-layout layer (`decoding_layout`)


def decoding_layout(heads: Params) -> Params:
    """The parameters as the decoders run them on the CPU kernel: the layer's weights in
    the backbone's decoding layout (q, k, v in one `wqkv`, gate and up in one `w_gate_up`)
    under `LAYER`, and the layer's, `fc`'s and `lm_head`'s products of at least the
    kernel's minimum size wrapped for it (`kernels.KernelWeight`), as the backbone's are.
    Training never sees this layout. Parameters already in it are returned as they are."""
    if LAYER in heads:
        return heads
    w = layer_weights(heads, None)
    layer = {"wqkv": jnp.concatenate([w["wq"], w["wk"], w["wv"]], axis=1), "wo": w["wo"],
             "w_gate_up": jnp.concatenate([w["w_gate"], w["w_up"]], axis=1),
             "w_down": w["w_down"], "mlp_norm": w["mlp_norm"]}

    def wrap(a):
        return kernels.KernelWeight.pack(a) if kernels.wants(a) else a

    out = dict(heads, fc=wrap(heads["fc"]), lm_head=wrap(heads["lm_head"]))
    out[LAYER] = {k: a if k == "mlp_norm" else wrap(a) for k, a in layer.items()}
    return out


def attention_input(params: Params, c: Eagle3Config, x_embed: jax.Array, hidden: jax.Array
                    ) -> jax.Array:
    """[B, T, 2H]: the embedding and the feature normalised apart (`input_norm`,
    `hidden_norm`), concatenated embedding first: what the layer projects q, k, v from."""
    dt, eps = hidden.dtype, c.rms_norm_eps
    return jnp.concatenate([backbone.rms_norm(x_embed.astype(dt), params["input_norm"], eps),
                            backbone.rms_norm(hidden, params["hidden_norm"], eps)], axis=-1)


def rope_frequencies(c: Eagle3Config) -> jax.Array:
    """[D/2] inverse frequencies of the drafter's rotary embedding (the backbone's code)."""
    return backbone.rope_frequencies(_model_cfg(c))


def features(heads: Params, aux: jax.Array) -> jax.Array:
    """aux [..., 3*Ht] (the backbone's low, mid, high features, concatenated in that order)
    -> the drafter's input feature [..., H] (`fc`, no bias)."""
    if kernels.is_kernel_weight(heads["fc"]):
        return kernels.matmul(aux, heads["fc"]).astype(aux.dtype)
    return jnp.einsum("...i,ih->...h", aux, heads["fc"].astype(aux.dtype))


def embed(model_cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """The backbone's own input embedding of `tokens` [B, T] -> [B, T, H] (the drafter has
    no embedding of its own: the reference loads the target's, frozen)."""
    return backbone.embed_tokens(model_cfg, params, tokens)


def causal_mask(num: int) -> jax.Array:
    """[1, T, T] bool: position t sees positions 0..t (a drafter run over T new positions
    with an empty cache)."""
    return jnp.tril(jnp.ones((num, num), bool))[None]


def layer(params: Params, c: Eagle3Config, x_embed: jax.Array, hidden: jax.Array,
          positions: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
          mask: jax.Array, extra: tuple | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The drafter's decoder layer over T new positions.

    x_embed [B, T, H] the backbone's embeddings of the tokens, hidden [B, T, H] the features
    (`features` at the root, the layer's previous output below it), positions [B, T] their
    rotary positions, k_cache / v_cache [B, KVH, S, D] the keys (rotated) and values of S
    earlier positions (S may be 0; heads first, the backbone attention's layout, so they
    are read as they lie), `extra` None or (k, v [B, KVH, N, D]) N more earlier positions
    (a tree's nodes drafted so far: a block of their own, so the S are never copied), mask
    [B or 1, T, S + N + T] bool: which of the S cached, the N extra, then the T new
    positions each query sees. Returns (out [B, T, H] before the final norm: the next
    step's `hidden`, and the input of `draft_logits`; k_new, v_new [B, KVH, T, D] for the
    caller's cache, in the cache's dtype, the activations' when S = 0, as the backbone's)."""
    s = k_cache.shape[2]
    n = 0 if extra is None else extra[0].shape[2]
    rope = backbone.rope_table(positions, rope_frequencies(c))
    return backbone.decoder_layer(
        _model_cfg(c), hidden, layer_weights(params, hidden.dtype), k_cache if s else None,
        v_cache if s else None, rope, mask[..., :s], mask[..., s + n:],
        (extra[0], extra[1], mask[..., s:s + n]) if n else None,
        attn_input=attention_input(params, c, x_embed, hidden))


def draft_logits(heads: Params, c: Eagle3Config, out: jax.Array) -> jax.Array:
    """out [..., H] (a `layer` output) -> logits over the draft vocabulary [..., Vd] float32."""
    x = backbone.rms_norm(out, heads["final_norm"], c.rms_norm_eps)
    if kernels.is_kernel_weight(heads["lm_head"]):
        return kernels.matmul(x, heads["lm_head"]).astype(jnp.float32)
    return jnp.einsum("...h,hv->...v", x, heads["lm_head"].astype(x.dtype),
                      preferred_element_type=jnp.float32)


def to_target(heads: Params, draft_ids: jax.Array) -> jax.Array:
    """Draft-vocabulary ids -> the backbone's token ids (id + d2t[id], as the reference)."""
    return draft_ids + jnp.asarray(heads["d2t"])[draft_ids].astype(draft_ids.dtype)


def target_ids(heads: Params) -> jax.Array:
    """[Vd] the target id of every draft id."""
    d2t = jnp.asarray(heads["d2t"])
    return jnp.arange(d2t.shape[0], dtype=d2t.dtype) + d2t


# ----------------------------------------------------------------------------- training


def ttt_mask(num: int, step: int, valid: jax.Array | None = None) -> jax.Array:
    """[B or 1, T, (step+1) T] bool, the mask of training-time-test step `step` over the keys
    of steps 0..step: step 0's keys causally (and only `valid` [B, T] ones: the reference's
    padding mask), each later step's key only at the query's own position (the chain of
    drafts that position made)."""
    causal = causal_mask(num)
    if valid is not None:
        causal = causal & valid.astype(bool)[:, None, :]
    eye = jnp.broadcast_to(jnp.eye(num, dtype=bool)[None], (causal.shape[0], num, num))
    return jnp.concatenate([causal] + [eye] * step, axis=-1)


def _ttt_layer(params: Params, c: Eagle3Config, x_embed: jax.Array, hidden: jax.Array,
               positions: jax.Array, k0: jax.Array | None, v0: jax.Array | None,
               diag_k: list, diag_v: list, causal: jax.Array):
    """`layer` at training-time-test step i = len(diag_k) (+1 for the new keys when i > 0)
    with the step's mask (`ttt_mask`) used as what it is: step 0's keys causally (`causal`
    [B or 1, T, T]), each later step's key only at the query's own position, so those are
    one product per position instead of a masked [T, T] block each. k0/v0: step 0's keys
    and values (None at step 0: the new ones); diag_k/diag_v: those of steps 1 .. i-1.
    Returns (out, k_new, v_new) as `layer`."""
    b, t, _ = hidden.shape
    dt = hidden.dtype
    nh, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
    cfg, weights = _model_cfg(c), layer_weights(params, dt)
    rope = backbone.rope_table(positions, rope_frequencies(c))
    q, k, v = backbone.attention_inputs(cfg, attention_input(params, c, x_embed, hidden),
                                        weights, rope, dt)  # k, v [B, KVH, T, D]
    first = k0 is None
    k0, v0 = (k, v) if first else (k0, v0)
    dk, dv = ([] if first else [*diag_k, k]), ([] if first else [*diag_v, v])
    qg = q.reshape(b, t, kvh, nh // kvh, d)
    scale = 1.0 / math.sqrt(d)
    s0 = jnp.einsum("btkgd,bksd->bkgts", qg, k0,
                    preferred_element_type=jnp.float32) * scale  # [B, KVH, G, T, T]
    s0 = jnp.where(causal[:, None, None], s0, jnp.finfo(jnp.float32).min)
    if dk:
        sd = jnp.stack([jnp.einsum("btkgd,bktd->bkgt", qg, kj,
                                   preferred_element_type=jnp.float32) for kj in dk],
                       -1) * scale  # [B, KVH, G, T, i]
        p = jax.nn.softmax(jnp.concatenate([s0, sd], -1), axis=-1).astype(dt)
        p0, pd = p[..., :t], p[..., t:]
        o = jnp.einsum("bkgts,bksd->btkgd", p0, v0)
        o = o + sum(jnp.einsum("bkgt,bktd->btkgd", pd[..., j], vj)
                    for j, vj in enumerate(dv))
    else:
        p0 = jax.nn.softmax(s0, axis=-1).astype(dt)
        o = jnp.einsum("bkgts,bksd->btkgd", p0, v0)
    return backbone.residual_and_mlp(cfg, hidden, o.reshape(b, t, nh * d), weights), k, v


def ttt_logits(heads: Params, c: Eagle3Config, embed_table: jax.Array, aux: jax.Array,
               tokens: jax.Array, attention_mask: jax.Array | None = None,
               steps: int = TTT_STEPS, segments: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """Training-time test (eagle/traineagle3/cnets.py `Model.forward`): the drafter over a
    whole sequence, `steps` times, each step on the previous step's outputs.

    aux [B, T, 3*Ht] the backbone's features at every position, tokens [B, T] the sequence,
    embed_table [V, H] the backbone's (frozen) embedding as layer 0 reads it (a Gemma
    backbone's scaled by sqrt(H): `embed` of every id), attention_mask [B, T] 1 on real
    tokens. Step i at position t reads token t+1+i and (i = 0) fc(aux_t) or (i > 0) step
    i-1's output at t, at rotary position t+i, and guesses token t+2+i; it attends step 0's
    keys causally and each later step's key at t only (`ttt_mask`), which `_ttt_layer`
    computes as T + i keys per query rather than (i + 1) T masked ones.

    Packed rows: `segments` [B, T] (the examples' ids, 0 padding) confine step 0's keys to
    the query's own example, and `positions` [B, T] (each example's from 0; default
    0..T-1) are step 0's rotary positions. A later step's input at t may then read a token
    of the next example, but only where its target lies past t's example too, which the
    caller never counts; so the drafter never attends across examples. Returns logits
    [steps, B, T, Vd] float32."""
    b, t = tokens.shape
    hidden = features(heads, aux)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    table = jax.lax.stop_gradient(embed_table)
    causal = ttt_mask(t, 0, attention_mask)  # [B or 1, T, T]
    if segments is not None:
        causal = causal & (segments[:, :, None] == segments[:, None, :])
    k0 = v0 = None
    dk, dv, out = [], [], []
    for i in range(steps):  # static and short: unrolled
        x_embed = table[shift(tokens, i + 1)].astype(hidden.dtype)
        hidden, k_new, v_new = _ttt_layer(heads, c, x_embed, hidden, positions + i, k0, v0,
                                          dk, dv, causal)
        if i == 0:
            k0, v0 = k_new, v_new
        else:
            dk.append(k_new)
            dv.append(v_new)
        out.append(draft_logits(heads, c, hidden))
    return jnp.stack(out)
