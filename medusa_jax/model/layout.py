"""The backbone's parameter layouts: the parameter tree's single source of truth
(`param_specs`: shapes and logical axes, for initialisation, loading and sharding), the
decoding layout (per-layer dicts, fused projections, the CPU's kernel weights and output
layer) and back (`standard_layout`), and a fresh backbone (`init_params`). The forward pass
(`backbone`) takes either layout; `backbone` re-exports these names.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from medusa_jax import kernels
from medusa_jax.model.config import ModelConfig, as_dtype

Params = dict


# The decoding layout on the CPU keeps a small tied embedding's output layer under this key
# as well: a contiguous [H, V] copy (`with_cpu_output`). XLA:CPU multiplies a tree pass's few
# rows by the transposed embedding in a library call that costs several times a product with
# a contiguous matrix (one row is as fast either way). Larger embeddings are left alone: the
# CPU kernel reads them in place (`kernels.output_weight`), and a copy would double them.
CPU_OUTPUT = "cpu_output"


def with_cpu_output(params: Params) -> Params:
    """`params` (the decoding layout, on the CPU) with `CPU_OUTPUT`: a contiguous copy of a
    tied embedding too small for the CPU kernel (`kernels.wants`) as the output layer
    [H, V]. Unchanged for an untied lm_head, a larger embedding, or weights on another
    platform."""
    embed = params.get("embed")
    if ("lm_head" in params or not isinstance(embed, jax.Array) or kernels.wants(embed)
            or any(d.platform != "cpu" for d in embed.devices())):
        return params
    return dict(params, **{CPU_OUTPUT: jnp.transpose(embed)})


def without_cpu_output(params: Params) -> Params:
    """Undo `with_cpu_output`."""
    return {k: v for k, v in params.items() if k != CPU_OUTPUT}


def on_cpu(cfg: ModelConfig, params: Params, cpu_kernels: bool | None = None) -> Params:
    """The decoding layout's CPU part, once its layers are laid out: the kernel's weights
    (`kernels.use_cpu_kernels`) and a small tied embedding's contiguous output layer
    (`with_cpu_output`). Parameters on another platform come back as they are."""
    return with_cpu_output(kernels.use_cpu_kernels(params, cpu_kernels, cfg.head_dim))


class ParamSpec(NamedTuple):
    """A parameter's shape and the logical name of each dimension (what `sharding.RULES`
    maps to mesh axes)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]


# Projections that read the same input, fused into one product each in the decoding layout:
# fused name -> (the parameters concatenated along their output axis, in order).
FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"),
         "w_gate_up": ("w_gate", "w_up")}


def fuse_layer(layer: dict, concatenate=jnp.concatenate) -> dict:
    """One layer's parameters (no layer axis) with the `FUSED` projections concatenated.
    `concatenate=np.concatenate` fuses host arrays (loading builds the layout that way)."""
    layer = dict(layer)
    for fused, parts in FUSED.items():
        if all(p in layer for p in parts):
            layer[fused] = concatenate([layer.pop(p) for p in parts], axis=-1)
    return layer


def is_decoding_layout(params: Params) -> bool:
    return isinstance(params["layers"], (tuple, list))


def decoding_layout(cfg: ModelConfig, params: Params, cpu_kernels: bool | None = None
                    ) -> Params:
    """The layout decoding runs fastest with, on one device, for a backbone of any depth
    (tensor-parallel weights keep the stacked layout: fused projections would mix
    differently sharded heads):

    - the layers as a tuple of per-layer dicts, which `forward` runs as a straight line:
      each layer's weights are read in place. In a `lax.scan` over stacked weights, slicing
      layer i out of a stacked array inside the decoding `while_loop` copies every weight of
      every layer at every step (docs/benchmarks/2026-12-01-decoding-layout.md);
    - q/k/v and gate/up projections fused (`FUSED`): 3 fewer matrix products per layer;
    - on the CPU, a small tied embedding also as a contiguous output layer (`CPU_OUTPUT`).

    Converting stacked arrays holds a second copy of each stacked weight while its layers
    are sliced out; `weights.load_pretrained(..., decoding_layout=True)` builds this layout
    straight from the checkpoint instead (what `api.Medusa.load` does). `forward` takes this
    layout and the standard one; `standard_layout` undoes it. Done once, outside jit.

    On the CPU the products' weights come wrapped for the few-row kernel
    (`kernels.use_cpu_kernels`; `cpu_kernels=False`, --no-cpu-kernels or
    MEDUSA_JAX_CPU_KERNELS=0 keep XLA's products)."""
    layers = params["layers"]
    if is_decoding_layout(params) or any(k in FUSED for k in layers):
        # already in the decoding layout
        return on_cpu(cfg, params, cpu_kernels)
    layers = dict(layers)
    per_layer = [{} for _ in range(cfg.num_layers)]
    for key in list(layers):  # one stacked weight at a time: it is dropped once sliced
        stacked = layers.pop(key)
        for i in range(cfg.num_layers):
            per_layer[i][key] = stacked[i]
        del stacked
    return on_cpu(cfg, dict(params, layers=tuple(fuse_layer(layer) for layer in per_layer)),
                  cpu_kernels)


def standard_layout(cfg: ModelConfig, params: Params) -> Params:
    """Undo `decoding_layout`: layers stacked, every projection on its own (`param_specs`)."""
    params = without_cpu_output(kernels.unwrap(params))
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    layers = dict(layers)
    specs = param_specs(cfg)["layers"]
    for fused, parts in FUSED.items():
        if fused in layers:
            sizes = [specs[p].shape[-1] for p in parts]
            split = jnp.split(layers.pop(fused), list(itertools.accumulate(sizes))[:-1], axis=-1)
            layers.update(zip(parts, split))
    return dict(params, layers=layers)


def param_specs(cfg: ModelConfig) -> dict:
    """The backbone's parameter tree as {name: ParamSpec}: the single source of truth for
    initialisation, loading and sharding. Layers are stacked on a leading "layers" axis."""
    h, f, lyr = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    S = ParamSpec
    layers = {
        "attn_norm": S((lyr, h), ("layers", "norm")),
        "wq": S((lyr, h, qd), ("layers", "embed", "q_heads")),
        "wk": S((lyr, h, kvd), ("layers", "embed", "kv_heads")),
        "wv": S((lyr, h, kvd), ("layers", "embed", "kv_heads")),
        "wo": S((lyr, qd, h), ("layers", "q_heads", "embed")),
        "mlp_norm": S((lyr, h), ("layers", "norm")),  # before the MLP (Gemma 2/3: pre_feedforward)
        "w_gate": S((lyr, h, f), ("layers", "embed", "mlp")),
        "w_up": S((lyr, h, f), ("layers", "embed", "mlp")),
        "w_down": S((lyr, f, h), ("layers", "mlp", "embed")),
    }
    if cfg.attention_bias:
        layers.update(bq=S((lyr, qd), ("layers", "q_heads")),
                      bk=S((lyr, kvd), ("layers", "kv_heads")),
                      bv=S((lyr, kvd), ("layers", "kv_heads")))
    if cfg.sandwich_norms:  # Gemma 2/3: after attention and after the MLP
        layers.update(post_attn_norm=S((lyr, h), ("layers", "norm")),
                      post_mlp_norm=S((lyr, h), ("layers", "norm")))
    if cfg.qk_norm:
        layers.update(q_norm=S((lyr, cfg.head_dim), ("layers", "head_dim")),
                      k_norm=S((lyr, cfg.head_dim), ("layers", "head_dim")))
    specs = {"embed": S((cfg.vocab_size, h), ("vocab", "embed")), "layers": layers,
             "final_norm": S((h,), ("norm",))}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = S((h, cfg.vocab_size), ("embed", "vocab"))
    return specs


def head_units(cfg: ModelConfig) -> dict:
    """How many whole heads the "q_heads"/"kv_heads" dims hold: tensor parallelism splits
    them only where the head count divides the `model` axis (see `sharding.spec_for`)."""
    return {"q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_shapes(cfg: ModelConfig) -> dict:
    """{name: shape} of `param_specs`."""
    return jax.tree.map(lambda s: s.shape, param_specs(cfg), is_leaf=_is_spec)


def param_axes(cfg: ModelConfig) -> dict:
    """{name: logical axes} of `param_specs`."""
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> Params:
    """Random backbone (norms at one: weights 1, or 0 with Gemma's 1 + weight), for tests
    and random-weight benchmarks."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    dtype = as_dtype(cfg.param_dtype)
    out = []
    for path, shape, k in zip(paths, leaves, keys):
        if "norm" in path:
            out.append(jnp.full(shape, 1.0 - cfg.norm_offset, dtype))
        else:
            out.append((std * jax.random.normal(k, shape)).astype(dtype))
    return jax.tree.unflatten(treedef, out)
