"""Device mesh and parameter/batch shardings for training.

The mesh has two axes: "data" (pure data parallelism: parameters replicated) and "fsdp"
(data parallel too, but parameters and optimizer state are split across it). Every parameter
dimension has a logical name; `RULES` maps logical names to mesh axes in priority order, and
a tensor takes the first rule whose dimension divides evenly by the mesh axis (a mesh axis is
used at most once per tensor). Anything else is replicated, so any model runs on any mesh.

Leaves are recognised by their last dict key (e.g. "wq", "proj"), so the same rules shard
the parameters and every parameter-shaped leaf of the optimizer state (Adam's moments).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp")

# leaf name -> logical axes of its dims (backbone names from backbone.param_shapes, heads
# names from heads.init_heads)
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("norm",),
    "attn_norm": ("layers", "norm"),
    "mlp_norm": ("layers", "norm"),
    "wq": ("layers", "embed", "qkv"),
    "wk": ("layers", "embed", "qkv"),
    "wv": ("layers", "embed", "qkv"),
    "wo": ("layers", "qkv", "embed"),
    "bq": ("layers", "qkv"),
    "bk": ("layers", "qkv"),
    "bv": ("layers", "qkv"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    # Medusa heads: w [K, L, H, H], b [K, L, H], proj [K, H, V]
    "w": ("medusa_heads", "medusa_layers", "embed", "embed_out"),
    "b": ("medusa_heads", "medusa_layers", "embed_out"),
    "proj": ("medusa_heads", "embed", "vocab"),
}

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


def spec_for(name: str | None, shape: tuple[int, ...], mesh: Mesh,
             rules=RULES) -> P:
    """PartitionSpec for a leaf called `name` of this shape (replicated when unknown)."""
    axes = LOGICAL_AXES.get(name or "")
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


def _leaf_name(path) -> str | None:
    for entry in reversed(path):
        if isinstance(entry, jax.tree_util.DictKey):
            return str(entry.key)
    return None


def tree_shardings(tree, mesh: Mesh, rules=RULES):
    """NamedSharding for every array leaf of `tree` (params, or an optimizer state)."""

    def one(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        return NamedSharding(mesh, spec_for(_leaf_name(path), shape, mesh, rules))

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
