"""Hydra heads (Ankner et al. 2024, zankner/Hydra): draft heads that also read the path.

Head i (0-based) guesses the token at depth i+1 below the root from concat(h, e(x_0), ...,
e(x_i)): the backbone's last hidden state h, the embedding of the root x_0 (the backbone's
own next token) and those of the tokens drafted at depths 1..i on this path, (i+2)H wide.
Its first block maps that to H as zankner/Hydra's `ResBlock(H, i+1)` does,
`x @ R + r + SiLU(x @ W + b)`, then L-1 residual blocks `x <- x + SiLU(x W + b)`, then a
projection to the vocabulary (with a bias, as the reference's `nn.Linear` head has).
Embeddings are the backbone's own (`params["embed"]`, frozen, read as they are).

Parameters, stacked over the K heads; input slot 0 is h, slot j >= 1 the path token at
depth j-1; head i uses slots 0..i+1 and its other slots are zero (checked on load):

    in_w    [K, K+1, H, H]   zero at init (the SiLU branch starts at 0)
    in_b    [K, H]           zero
    res_w   [K, K+1, H, H]   identity on slot 0, zero elsewhere at init (the residual map)
    res_b   [K, H]           zero
    w       [K, L-1, H, H]   zero at init
    b       [K, L-1, H]      zero
    proj    [K, H, V]        a copy of the backbone's output projection at init
    proj_b  [K, V]           zero

so at initialisation every head's logits are the base model's logits of h (as Medusa heads'
are); training teaches each head its own depth. `draft_tree` runs one head call per tree
depth, batched over that depth's nodes that have children; the tree is static, so every
shape is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.drafters.io import check_float_tensors
from medusa_jax.drafters.toolkit import tree_loop
from medusa_jax.model.backbone import Params, ParamSpec, output_projection
from medusa_jax.model.config import ModelConfig

KIND = "hydra"
NAMES = ("in_w", "in_b", "res_w", "res_b", "w", "b", "proj", "proj_b")


def is_hydra(heads) -> bool:
    """Whether a heads tree (arrays, numpy or shapes) holds Hydra heads."""
    return heads is not None and "in_w" in heads


def param_specs(hidden: int, vocab: int, num_heads: int, num_layers: int) -> dict:
    """{name: ParamSpec}: shapes and logical axes (see sharding) of Hydra heads."""
    k, lyr, h, v = num_heads, num_layers, hidden, vocab
    if k < 1 or lyr < 1:
        raise ValueError(f"need at least one Hydra head and one layer, got {k} heads, "
                         f"{lyr} layers")
    slots = ("medusa_heads", "medusa_layers", "embed", "embed_out")
    return {
        "in_w": ParamSpec((k, k + 1, h, h), slots),
        "in_b": ParamSpec((k, h), ("medusa_heads", "embed_out")),
        "res_w": ParamSpec((k, k + 1, h, h), slots),
        "res_b": ParamSpec((k, h), ("medusa_heads", "embed_out")),
        "w": ParamSpec((k, lyr - 1, h, h), ("medusa_heads", "medusa_layers", "embed",
                                            "embed_out")),
        "b": ParamSpec((k, lyr - 1, h), ("medusa_heads", "medusa_layers", "embed_out")),
        "proj": ParamSpec((k, h, v), ("medusa_heads", "embed", "vocab")),
        "proj_b": ParamSpec((k, v), ("medusa_heads", "vocab")),
    }


def axes() -> dict:
    """{name: logical axes} of Hydra heads' parameters."""
    return {n: s.axes for n, s in param_specs(1, 1, 1, 1).items()}


def init_hydra(cfg: ModelConfig, backbone: Params, num_heads: int = 4,
               num_layers: int = 2) -> Params:
    """Fresh Hydra heads on `backbone`: every head starts as the base model's output layer."""
    specs = param_specs(cfg.hidden_size, cfg.vocab_size, num_heads, num_layers)
    zeros = {n: jnp.zeros(s.shape, jnp.float32) for n, s in specs.items()}
    eye = jnp.eye(cfg.hidden_size, dtype=jnp.float32)
    proj = output_projection(cfg, backbone).astype(jnp.float32)
    return dict(zeros, res_w=zeros["res_w"].at[:, 0].set(eye),
                proj=jnp.broadcast_to(proj, specs["proj"].shape).copy())


def config_of(heads: Params) -> tuple[int, int]:
    """(num_heads, num_layers) read off the parameters (the input block counts as one)."""
    return int(np.shape(heads["in_b"])[0]), int(np.shape(heads["b"])[1]) + 1


def split_per_head(heads: Params) -> Params:
    """Heads for decoding, with each head's weights cut out once: in_w and res_w as tuples
    over heads of [i+2, H, H], w as tuples over heads of tuples over blocks, proj as a
    tuple over heads (arrays or the CPU kernel's `KernelWeight`s). Inside a decoding loop
    a head's slice of a stacked weight would be copied out at every step."""
    k, layers = config_of(heads)
    out = dict(heads)
    for name in ("in_w", "res_w"):
        out[name] = tuple(heads[name][i, :i + 2] for i in range(k))
    out["w"] = tuple(tuple(heads["w"][i, j] for j in range(layers - 1)) for i in range(k))
    out["proj"] = tuple(heads["proj"][i] for i in range(k))
    return out


def slot_mask(num_heads: int) -> np.ndarray:
    """[K, K+1] bool: the input slots head i reads (0..i+1)."""
    return np.arange(num_heads + 1)[None, :] <= np.arange(num_heads)[:, None] + 1


def check(tensors: dict, cfg: ModelConfig | None, where, num_heads: int | None = None,
          num_layers: int | None = None):
    """Strict checks of Hydra heads against the backbone (hidden, vocab): names, shapes,
    float dtypes, finite values, zero unused input slots. One-line ValueError naming `where`."""
    names = set(tensors)
    if names != set(NAMES):
        raise ValueError(f"{where}: Hydra heads need tensors {', '.join(NAMES)}; "
                         f"missing {sorted(set(NAMES) - names)}, unexpected "
                         f"{sorted(names - set(NAMES))}")
    k, lyr = config_of(tensors)
    k = k if num_heads is None else num_heads
    lyr = lyr if num_layers is None else num_layers
    h = cfg.hidden_size if cfg is not None else int(np.shape(tensors["in_w"])[-1])
    v = cfg.vocab_size if cfg is not None else int(np.shape(tensors["proj"])[-1])
    for name, spec in param_specs(h, v, k, lyr).items():
        shape = tuple(np.shape(tensors[name]))
        if shape != spec.shape:
            raise ValueError(f"{where}: tensor {name} has shape {shape}, expected "
                             f"{spec.shape} for {k} Hydra heads x {lyr} layers on a backbone "
                             f"with hidden {h}, vocab {v}")
    check_float_tensors(tensors, NAMES, where)
    unused = ~slot_mask(k)
    for name in ("in_w", "res_w"):
        if np.any(np.asarray(tensors[name], np.float32)[unused] != 0):
            raise ValueError(f"{where}: tensor {name} has non-zero weights in input slots "
                             f"its heads do not read (head i reads slots 0..i+1)")


def _blocks(heads: Params, i: int, x: jax.Array) -> jax.Array:
    """Head i after its input block: the L-1 residual blocks and the projection.
    x [..., H] -> logits [..., V] float32."""
    dt = x.dtype
    for j in range(heads["b"].shape[1]):  # tiny and static: unrolled
        # heads["w"][i][j]: a stacked weight, or `split_per_head`'s tuples
        x = x + jax.nn.silu(kernels.matmul(x, heads["w"][i][j]) + heads["b"][i, j].astype(dt))
    proj = heads["proj"][i]
    if kernels.is_kernel_weight(proj):
        logits = kernels.matmul(x, proj)
    else:
        logits = jnp.einsum("...h,hv->...v", x, proj.astype(dt),
                            preferred_element_type=jnp.float32)
    return logits + heads["proj_b"][i].astype(jnp.float32)


def apply_head(heads: Params, i: int, inputs: jax.Array) -> jax.Array:
    """Head i on its inputs [..., i+2, H] (h, then the path embeddings root first) ->
    logits [..., V] float32."""
    dt = inputs.dtype
    n = i + 2
    def part(w):  # [n, H, H]: of a stacked weight, or cut already (`split_per_head`)
        return (w[i] if isinstance(w, tuple) else w[i, :n]).astype(dt)

    w_in, r_in = part(heads["in_w"]), part(heads["res_w"])
    if kernels.is_kernel_weight(w_in):  # one batched kernel call per block, then the sum
        parts = jnp.moveaxis(inputs, -2, 0)  # [n, ..., H]
        y = kernels.matmul(parts, w_in).sum(0) + heads["in_b"][i].astype(dt)
        x = kernels.matmul(parts, r_in).sum(0) + heads["res_b"][i].astype(dt)
    else:
        y = jnp.einsum("...nh,nhg->...g", inputs, w_in) + heads["in_b"][i].astype(dt)
        x = jnp.einsum("...nh,nhg->...g", inputs, r_in) + heads["res_b"][i].astype(dt)
    return _blocks(heads, i, x + jax.nn.silu(y))


def embed(embed_table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """The backbone's input embeddings of `tokens` (as the backbone reads them)."""
    return embed_table[tokens].astype(dtype)


def teacher_forced_logits(heads: Params, hidden: jax.Array, emb: jax.Array) -> jax.Array:
    """Training: every head at every position, its path teacher-forced from the data.
    hidden [B, T, H] (the backbone's last hidden states), emb [B, T, H] (the embeddings of
    the same tokens) -> logits [K, B, T, V]; head i at position t reads h_t and the
    embeddings of tokens t+1 .. t+i+1 (wrapped at the end of a row: those positions have no
    valid target, see `training.recipes.medusa_loss.medusa_targets`)."""
    k = heads["in_w"].shape[0]
    path = [jnp.roll(emb, -(j + 1), axis=1) for j in range(k)]  # path[j]: token t+j+1
    out = []
    for i in range(k):
        inputs = jnp.stack([hidden, *path[:i + 1]], axis=-2)  # [B, T, i+2, H]
        out.append(apply_head(heads, i, inputs))
    return jnp.stack(out)


# ----------------------------------------------------------------------------- drafting


def draft_tree(heads: Params, embed_table: jax.Array, hidden: jax.Array, root: jax.Array,
               paths_ranks, num_nodes: int, top_k_fn, want_logp: bool = True, draw=None,
               top_k: int = 0):
    """Fill a static tree with Hydra drafts: hidden [B, H], root [B] -> (tokens [B, N],
    node log-probabilities [B, N]: each node's own, under its parent's head call; 0 at the
    root; sampled drafts or None; `toolkit.tree_loop.draft_tree`). One head call per depth
    over the nodes at the depth before it that have children; a node of rank r takes its
    parent's r-th most likely token. `want_logp` False (a static tree needs none): no log-softmax, None instead.
    `draw` (`decoding.step.DraftSampler`): a node of rank r takes its parent's r-th draw
    instead, and the drafts come back as (each node's `top_k` draws [B, N, top_k], the
    distribution they were drawn from [B, N, V])."""
    b, h = hidden.shape

    def level(state, d, paths, tokens):  # the head of depth d over the paths drafted so far
        path_emb = embed(embed_table, tokens[:, paths], hidden.dtype)  # [B, E, d+1, H]
        base = jnp.broadcast_to(hidden[:, None, None, :], (b, paths.shape[0], 1, h))
        return state, apply_head(heads, d, jnp.concatenate([base, path_emb], axis=2))

    return tree_loop.draft_tree(level, None, root, paths_ranks, num_nodes, want_logp, draw,
                                top_k, top_k_fn=top_k_fn)
