"""Device mesh and parameter/batch shardings for training.

The mesh has two axes: "data" (pure data parallelism: parameters replicated) and "fsdp"
(data parallel too, but parameters and optimizer state are split across it). Every parameter
dimension has a logical name, declared next to its shape (`backbone.param_specs`,
`heads.heads_param_specs`); `RULES` maps logical names to mesh axes in priority order, and a
tensor takes the first rule whose dimension divides evenly by the mesh axis (a mesh axis is
used at most once per tensor). Anything else is replicated, so any model runs on any mesh.

The optimizer state holds parameter-shaped leaves (Adam's moments) under its own nesting;
each takes the sharding of the parameter whose path ends its own path.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp")

# (logical axis, mesh axis), highest priority first: the big vocab/MLP dims before hidden
RULES: tuple[tuple[str, str], ...] = (
    ("vocab", "fsdp"),
    ("mlp", "fsdp"),
    ("qkv", "fsdp"),
    ("embed_out", "fsdp"),
    ("embed", "fsdp"),
)


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """"2,4" or "data=2,fsdp=4" (either order, missing axes = 1) -> {"data": 2, "fsdp": 4}."""
    usage = f"bad mesh {spec!r}: expected sizes like '1,1' or 'data=2,fsdp=4'"

    def size(text: str) -> int:
        if not text.strip().isdigit() or int(text) < 1:
            raise ValueError(f"{usage} (sizes are integers >= 1)")
        return int(text)

    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    out = dict.fromkeys(AXES, 1)
    if parts and all("=" in p for p in parts):
        for p in parts:
            name, value = (s.strip() for s in p.split("=", 1))
            if name not in AXES:
                raise ValueError(f"bad mesh {spec!r}: unknown axis {name!r} "
                                 f"(axes: {', '.join(AXES)})")
            out[name] = size(value)
    elif len(parts) == len(AXES) and not any("=" in p for p in parts):
        out = {a: size(p) for a, p in zip(AXES, parts)}
    else:
        raise ValueError(usage)
    return out


def make_mesh(spec: str = "1,1", devices=None) -> Mesh:
    """A ("data", "fsdp") mesh over the first data*fsdp devices."""
    sizes = parse_mesh_spec(spec)
    devices = list(devices if devices is not None else jax.devices())
    need = math.prod(sizes.values())
    if need > len(devices):
        raise ValueError(f"mesh {spec!r} needs {need} devices, only {len(devices)} available")
    grid = np.array(devices[:need], dtype=object).reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES)


def spec_for(axes: tuple[str, ...] | None, shape: tuple[int, ...], mesh: Mesh,
             rules=RULES) -> P:
    """PartitionSpec for a tensor of this shape whose dims are named `axes` (None or a
    length mismatch: replicated)."""
    if axes is None or len(axes) != len(shape):
        return P()
    assigned: list[str | None] = [None] * len(shape)
    used = set()
    for logical, mesh_axis in rules:
        size = mesh.shape[mesh_axis]
        if logical not in axes or mesh_axis in used or size == 1:
            continue
        dim = axes.index(logical)
        if assigned[dim] is None and shape[dim] % size == 0:
            assigned[dim] = mesh_axis
            used.add(mesh_axis)
    return P(*assigned)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def tree_shardings(axes, tree, mesh: Mesh, rules=RULES):
    """NamedSharding for every leaf of `tree` (arrays or ShapeDtypeStructs), given `axes`: a
    tree of the same structure whose leaves are tuples of logical axis names."""
    return jax.tree.map(lambda a, x: NamedSharding(mesh, spec_for(a, tuple(x.shape), mesh,
                                                                  rules)),
                        axes, tree, is_leaf=_is_axes)


def _dict_keys(path) -> tuple:
    return tuple(e.key for e in path if isinstance(e, jax.tree_util.DictKey))


def like_params(tree, params, param_shardings, mesh: Mesh):
    """Shardings for an optimizer state: a leaf whose dict-key path ends with a parameter's
    path (and has its shape) is sharded like that parameter; everything else replicated."""
    by_path = {}
    for (path, p), s in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                            jax.tree.leaves(param_shardings)):
        by_path[_dict_keys(path)] = (tuple(p.shape), s)

    def one(path, leaf):
        keys = _dict_keys(path)
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit is not None and hit[0] == tuple(getattr(leaf, "shape", ())):
                return hit[1]
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows split over every device: [B, T] with B over ("data", "fsdp")."""
    return NamedSharding(mesh, P(AXES))


def check_batch_size(batch_size: int, mesh: Mesh):
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch_size % n:
        raise ValueError(f"batch size {batch_size} is not divisible by the {n} devices of "
                         f"mesh data={mesh.shape['data']},fsdp={mesh.shape['fsdp']}")


def shard_batch(batch: dict, mesh: Mesh) -> dict:
    return jax.device_put(batch, batch_sharding(mesh))
