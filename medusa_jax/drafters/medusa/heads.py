"""Medusa heads: K light heads on the backbone's last hidden state, head k guessing token t+k+1.

Each head is L residual blocks `x <- x + SiLU(x W + b)` then a projection to the vocabulary.
All heads are stacked and computed together (one einsum over the head axis):

    w     [K, L, H, H]   zero at init, each block of each head its own matrix
    b     [K, L, H]      zero at init
    proj  [K, H, V]      a copy of the backbone's output projection at init

so at initialisation every head's logits equal the base model's logits exactly.

Two optional variants cut the projection's cost on large vocabularies (both read from vLLM's
Medusa layout, see `drafters.formats`): `proj` [1, H, V] is one projection shared by all heads,
and `proj` [K or 1, H, T] with `token_index` [K or 1, V] (int32) predicts over T < V tokens:
token id v gets column token_index[v] of proj, or logit -inf where token_index[v] = -1.

Hydra heads (`drafters.hydra`: each head also reads the path drafted above it) are another
kind of drafter; `drafters.artifact.heads_config_of` and `drafters.formats`' `save_heads` and
`load_heads` take heads of any kind (the artifact's `kind` field says which), the rest only
Medusa heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from medusa_jax import kernels
from medusa_jax.drafters import registry
from medusa_jax.drafters.artifact import (  # noqa: F401 - kind-neutral, here too
    HEADS_FILE,
    HeadsConfig,
    heads_config_of,
)
from medusa_jax.model.backbone import Params, ParamSpec, output_projection
from medusa_jax.model.config import ModelConfig


def heads_param_specs(hidden: int, vocab: int, heads_cfg: HeadsConfig = HeadsConfig()) -> dict:
    """{name: ParamSpec}: each heads parameter's shape and logical axes (see sharding)."""
    k, lyr, h, v = heads_cfg.num_heads, heads_cfg.num_layers, hidden, vocab
    return {
        "w": ParamSpec((k, lyr, h, h), ("medusa_heads", "medusa_layers", "embed", "embed_out")),
        "b": ParamSpec((k, lyr, h), ("medusa_heads", "medusa_layers", "embed_out")),
        "proj": ParamSpec((k, h, v), ("medusa_heads", "embed", "vocab")),
    }


def heads_axes(heads: Params | None = None) -> dict:
    """{name: logical axes} of the heads parameters (they do not depend on the sizes), for
    the leaves `heads` has (default: those of `init_heads`)."""
    axes = {name: s.axes for name, s in heads_param_specs(1, 1).items()}
    axes["token_index"] = ("medusa_heads", "vocab")  # reduced-vocabulary heads only
    return {k: axes[k] for k in (heads if heads is not None else ("w", "b", "proj"))}


def init_heads(cfg: ModelConfig, backbone: Params, heads_cfg: HeadsConfig = HeadsConfig(),
               shared_proj: bool = False) -> Params:
    """Zero residual blocks and copies of the output projection (exact base logits at init);
    `shared_proj`: one copy [1, H, V] for all heads (vLLM's `original_lm_head` form)."""
    specs = heads_param_specs(cfg.hidden_size, cfg.vocab_size, heads_cfg)
    proj = output_projection(cfg, backbone).astype(jnp.float32)
    shape = (1, *specs["proj"].shape[1:]) if shared_proj else specs["proj"].shape
    return {
        "w": jnp.zeros(specs["w"].shape, jnp.float32),
        "b": jnp.zeros(specs["b"].shape, jnp.float32),
        "proj": jnp.broadcast_to(proj, shape).copy(),
    }


def has_shared_proj(heads: Params) -> bool:
    """One projection for every head (proj [1, H, V] with more than one head)."""
    return heads["proj"].shape[0] == 1 and heads["w"].shape[0] > 1


_NAMES = {"w", "b", "proj", "token_index"}  # token_index: reduced-vocabulary heads


def is_medusa(heads: Params) -> bool:
    """Whether a heads tree (arrays, numpy or shapes) holds Medusa heads: these names only."""
    return heads is not None and {"w", "b", "proj"} <= set(heads) <= _NAMES


def head_states(heads: Params, hidden: jax.Array) -> jax.Array:
    """The heads' residual blocks: hidden [..., H] -> [K, ..., H], what each head projects
    (`apply_heads`; the training loss over vocabulary chunks projects it itself)."""
    dt = hidden.dtype
    k, num_layers = heads["b"].shape[:2]
    x = jnp.broadcast_to(hidden, (k, *hidden.shape))
    for layer in range(num_layers):  # L is tiny and static: unrolled on purpose
        # prepared for the CPU kernel, `w` is a tuple of the blocks' [K, H, H] weights
        w = heads["w"][layer] if isinstance(heads["w"], tuple) else heads["w"][:, layer]
        w = w.astype(dt)
        b = heads["b"][:, layer].astype(dt)
        y = (kernels.matmul(x, w) if kernels.is_kernel_weight(w)
             else jnp.einsum("k...h,khg->k...g", x, w))
        y = y + b.reshape(k, *([1] * (x.ndim - 2)), -1)
        x = x + jax.nn.silu(y)
    return x


def apply_heads(heads: Params, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] (after the final norm) -> logits [K, ..., V] in float32."""
    if not is_medusa(heads):
        raise ValueError(f"apply_heads computes Medusa heads (tensors w, b, proj); these are "
                         f"{registry.kind_of(heads)} heads (tensors {', '.join(sorted(heads))})")
    dt = hidden.dtype
    k = heads["b"].shape[0]
    x = head_states(heads, hidden)
    proj = heads["proj"].astype(dt)
    if kernels.is_kernel_weight(proj):  # a [1, H, V] projection is shared by every head
        logits = kernels.matmul(x, proj)
    elif proj.shape[0] == 1 and k > 1:  # one projection shared by every head
        logits = jnp.einsum("k...h,hv->k...v", x, proj[0], preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("k...h,khv->k...v", x, proj, preferred_element_type=jnp.float32)
    if "token_index" in heads:  # reduced vocabulary: columns -> token ids, -inf elsewhere
        index = heads["token_index"]
        logits = jnp.concatenate([logits, jnp.full((*logits.shape[:-1], 1), -jnp.inf)], -1)
        index = jnp.where(index < 0, logits.shape[-1] - 1, index)
        index = index.reshape(index.shape[0], *([1] * (logits.ndim - 2)), index.shape[-1])
        logits = jnp.take_along_axis(
            logits, jnp.broadcast_to(index, (k, *logits.shape[1:-1], index.shape[-1])), -1)
    return logits


