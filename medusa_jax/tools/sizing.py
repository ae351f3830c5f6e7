"""Per-device memory of decoding with a drafter on a real backbone shape (`infer.bench
--size-model`): measured on a few layers with random weights, extrapolated to all."""

from __future__ import annotations

import time

import jax
import numpy as np

from medusa_jax.decoding.decode import medusa_capacity, medusa_generate
from medusa_jax.decoding.tree import Tree
from medusa_jax.drafters import registry
from medusa_jax.model.backbone import init_params
from medusa_jax.model.config import ModelConfig, as_dtype
from medusa_jax.model.shapes import SHAPES


def _shard_bytes(x, s) -> int:
    shape = s.shard_shape(tuple(x.shape))
    return int(np.prod(shape)) * np.dtype(x.dtype).itemsize


def size_model(shape: str, layers: int, mesh_spec: str, *, dtype: str = "bfloat16",
               batch: int = 1, context: int = 2048, tree: Tree | None = None,
               num_heads: int = 5, steps: int = 4, seed: int = 0,
               kind: str = registry.HEAD_FN_KIND) -> dict:
    """Per-device memory of decoding with a fresh drafter of `kind` (its `init`) on a real
    backbone shape, measured on `layers`
    of its layers (random weights, created directly in their shardings) and extrapolated
    to all of them.

    Compiles `medusa_generate` on the mesh (batch rows, a `context`-token KV cache), runs
    it for `steps` new tokens, and reads each buffer's per-device bytes from its sharding
    and the compiled step's temporaries from `compiled.memory_analysis()`. Per-layer
    tensors (stacked on the layers axis) and the KV cache scale with the depth; the
    embedding, output projection and heads do not; the temporaries (KV cache aside) are
    extrapolated from their growth between a compile at `layers` and one at `layers + 1`
    (from shapes only)."""
    from medusa_jax import api
    from medusa_jax.runtime import sharding

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    full = ModelConfig(**SHAPES[shape], param_dtype=dtype, compute_dtype=dtype)
    if not 1 <= layers <= full.num_layers:
        raise ValueError(f"--layers must be in 1..{full.num_layers} for {shape}")
    cfg = full.replace(num_layers=layers)
    mesh = sharding.make_mesh(mesh_spec)
    api.check_model_axis(cfg, mesh)
    tree = tree or Tree.load("mc_sim_7b_63")
    bb_sh, _ = api.decode_shardings(cfg, mesh)
    params = jax.jit(lambda k: init_params(cfg, k), out_shardings=bb_sh)(jax.random.key(seed))
    init = registry.drafter_class(kind).init  # fresh heads of `num_heads` levels

    def make_heads(p):
        return init(cfg, p, jax.random.key(seed), num_heads)

    abstract_heads = jax.eval_shape(make_heads, params)
    _, hd_sh = api.decode_shardings(cfg, mesh, abstract_heads)
    heads = jax.jit(make_heads, out_shardings=hd_sh)(params)

    prompt = min(context // 2, 256)
    max_new = context - prompt - tree.num_nodes - 1
    tokens = np.ones((batch, prompt), np.int32)
    lengths = np.full((batch,), prompt, np.int32)
    key = jax.random.key(seed)

    def compiled_at(n: int):
        """The decoder compiled for n layers, from shapes and shardings only."""
        c = cfg.replace(num_layers=n)
        bb, hd = api.decode_shardings(c, mesh, abstract_heads)
        spec = lambda tree, sh: jax.tree.map(  # noqa: E731
            lambda x, s_: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s_), tree, sh)
        abs_params = spec(jax.eval_shape(lambda k: init_params(c, k), key), bb)
        return medusa_generate.lower(spec(abs_params, bb), spec(abstract_heads, hd), c,
                                     tokens, lengths, key, tree=tree, max_new_tokens=max_new,
                                     eos=()).compile()

    with jax.set_mesh(mesh):
        compiled = compiled_at(layers)
        deeper = compiled_at(layers + 1) if layers < full.num_layers else None
        # a few steps only: the same loop with a small token budget, on the random weights
        small = medusa_generate.lower(params, heads, cfg, tokens, lengths, key, tree=tree,
                                      max_new_tokens=steps, eos=()).compile()
        t0 = time.perf_counter()
        out = jax.block_until_ready(small(params, heads, tokens, lengths, key))
        run_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    scale = full.num_layers / layers

    def by_depth(tree_, shardings):
        per_layer = fixed = 0
        for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(tree_)[0],
                                jax.tree.leaves(shardings)):
            b = _shard_bytes(x, s)
            if any(getattr(k, "key", None) == "layers" for k in path):
                per_layer += b
            else:
                fixed += b
        return per_layer, fixed

    p_layer, p_fixed = by_depth(params, bb_sh)
    h_layer, h_fixed = by_depth(heads, hd_sh)
    capacity = medusa_capacity(prompt, max_new, tree)
    kv_spec = sharding.cache_spec(mesh, cfg.num_kv_heads, batch)
    kv_shape = (layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    kv_local = jax.sharding.NamedSharding(mesh, kv_spec).shard_shape(kv_shape)
    kv = 2 * int(np.prod(kv_local)) * np.dtype(as_dtype(dtype)).itemsize
    temp = int(mem.temp_size_in_bytes)
    other_temp = max(temp - kv, 0)
    # what the temporaries (KV cache aside) grow by per layer, from a compile one layer deeper
    per_layer_temp = 0 if deeper is None else max(
        int(deeper.memory_analysis().temp_size_in_bytes) - temp - kv // layers, 0)
    gib = 2 ** 30
    measured = {"params": p_layer + p_fixed, "heads": h_layer + h_fixed, "kv_cache": kv,
                "temporaries": other_temp}
    extrapolated = {"params": p_layer * scale + p_fixed, "heads": h_layer + h_fixed,
                    "kv_cache": kv * scale,
                    "temporaries": other_temp + per_layer_temp * (full.num_layers - layers)}
    return {
        "shape": shape, "layers_measured": layers, "layers": full.num_layers,
        "mesh": sharding.mesh_str(mesh), "devices": mesh.size, "dtype": dtype,
        "batch": batch, "context": capacity, "tree_nodes": tree.num_nodes,
        "heads": num_heads, "platform": jax.devices()[0].platform,
        "compiled_argument_bytes": int(mem.argument_size_in_bytes),
        "compiled_temp_bytes": temp, "temp_bytes_per_layer": per_layer_temp,
        "measured_gib": {k: v / gib for k, v in measured.items()},
        "per_device_gib": {k: v / gib for k, v in extrapolated.items()},
        "total_per_device_gib": sum(extrapolated.values()) / gib,
        "run_seconds": run_s, "new_tokens": int(np.asarray(out.num_new).max()),
    }


# ----------------------------------------------------------------------------- breakdown

# What a kernel is in optimized HLO: every instruction that runs, not those that only name,
# split or join buffers.
