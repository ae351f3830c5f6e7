"""Device mesh and parameter/batch/cache shardings for training and decoding.

The mesh has three axes (the MaxText / jax-llm-examples layout):

    data   pure data parallelism: batch rows split, parameters replicated
    fsdp   data parallel too, but parameters and optimizer state are split across it
    model  tensor (Megatron) parallelism: q/k/v and gate/up split by output columns
           (attention heads, MLP width), o/down by input rows, the vocabulary of the
           embedding, the output projection and the Medusa heads' projections, and the KV
           cache by KV heads

Every parameter dimension has a logical name, declared next to its shape
(`backbone.param_specs`, `heads.heads_param_specs`); rules map logical names to mesh axes in
priority order, and a tensor takes the first rule whose dimension divides evenly by the mesh
axis (a mesh axis is used at most once per tensor, a dimension takes one mesh axis). On the
`model` axis a head dimension ("q_heads", "kv_heads": heads x head_dim flattened) is split
only when the number of heads divides (`units`), so a shard always holds whole heads; KV heads
that do not divide are replicated. Anything else is replicated, so any model runs on any mesh.
`TRAIN_RULES` use fsdp and model; `DECODE_RULES` use model only (decoding has no optimizer
state to spread, and `fsdp` then acts as a second batch axis).

The optimizer state holds parameter-shaped leaves (Adam's moments) under its own nesting;
each takes the sharding of the parameter whose path ends its own path.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")  # batch rows are split over these

# (logical axis, mesh axis), highest priority first
MODEL_RULES: tuple[tuple[str, str], ...] = (
    ("vocab", "model"),
    ("mlp", "model"),
    ("q_heads", "model"),
    ("kv_heads", "model"),
    ("embed_out", "model"),  # the Medusa heads' residual blocks, by output column
)
FSDP_RULES: tuple[tuple[str, str], ...] = (  # the big vocab/MLP dims before hidden
    ("vocab", "fsdp"),
    ("mlp", "fsdp"),
    ("q_heads", "fsdp"),
    ("kv_heads", "fsdp"),
    ("embed_out", "fsdp"),
    ("embed", "fsdp"),
)
TRAIN_RULES = MODEL_RULES + FSDP_RULES
DECODE_RULES = MODEL_RULES
RULES = TRAIN_RULES  # the default


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """"2,4", "2,4,1" or "data=2,fsdp=4,model=1" (any order, missing axes = 1) ->
    {"data": 2, "fsdp": 4, "model": 1}. Two bare sizes are data,fsdp (the old form)."""
    usage = (f"bad mesh {spec!r}: expected sizes like '1,1', '2,1,4' (data,fsdp,model) or "
             f"'data=2,model=4'")

    def size(text: str) -> int:
        if not text.strip().isdigit() or int(text) < 1:
            raise ValueError(f"{usage} (sizes are integers >= 1)")
        return int(text)

    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    out, seen = dict.fromkeys(AXES, 1), set()
    if parts and all("=" in p for p in parts):
        for p in parts:
            name, value = (s.strip() for s in p.split("=", 1))
            if name not in AXES:
                raise ValueError(f"bad mesh {spec!r}: unknown axis {name!r} "
                                 f"(axes: {', '.join(AXES)})")
            if name in seen:
                raise ValueError(f"bad mesh {spec!r}: axis {name!r} given twice")
            seen.add(name)
            out[name] = size(value)
    elif len(parts) in (2, 3) and not any("=" in p for p in parts):
        out.update({a: size(p) for a, p in zip(AXES, parts)})
    else:
        raise ValueError(usage)
    return out


def make_mesh(spec: "str | Mesh" = "1,1", devices=None) -> Mesh:
    """A ("data", "fsdp", "model") mesh over the first data*fsdp*model devices (a Mesh is
    returned as it is). Devices keep `jax.devices()` order, process by process, with `model`
    varying fastest: a model-parallel group stays inside one host, and each process holds a
    contiguous block of batch rows."""
    if isinstance(spec, Mesh):
        return spec
    sizes = parse_mesh_spec(spec)
    devices = list(devices if devices is not None else jax.devices())
    need = math.prod(sizes.values())
    if need > len(devices):
        raise ValueError(f"mesh {spec!r} needs {need} devices, only {len(devices)} available")
    if devices and len({d.process_index for d in devices}) > 1 and need != len(devices):
        raise ValueError(f"mesh {spec!r} uses {need} of the {len(devices)} devices of "
                         f"{jax.process_count()} processes: a multi-process mesh must use "
                         f"every device")
    grid = np.array(devices[:need], dtype=object).reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES)


def check_model_axis(cfg, mesh):
    """A `model` axis that splits none of the backbone's big dimensions (`cfg`: a
    ModelConfig) would only copy the model to every device: refused in one line, for
    decoding and training alike."""
    m = make_mesh(mesh).shape["model"]
    if m == 1:
        return
    if cfg.vocab_size % m and cfg.intermediate_size % m and cfg.num_heads % m:
        raise ValueError(f"mesh model={m} splits none of this model's tensors (vocabulary "
                         f"{cfg.vocab_size}, MLP width {cfg.intermediate_size}, "
                         f"{cfg.num_heads} attention heads): pick a model size that divides "
                         f"them")


def mesh_str(mesh: Mesh) -> str:
    return ",".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)


def spec_for(axes: tuple[str, ...] | None, shape: tuple[int, ...], mesh: Mesh,
             rules=RULES, units: dict | None = None) -> P:
    """PartitionSpec for a tensor of this shape whose dims are named `axes` (None or a
    length mismatch: replicated). `units` ({logical name: count}, e.g. attention heads):
    on the `model` axis such a dimension is split only when the count divides too."""
    if axes is None or len(axes) != len(shape):
        return P()
    assigned: list[str | None] = [None] * len(shape)
    used = set()
    for logical, mesh_axis in rules:
        size = mesh.shape.get(mesh_axis, 1)
        if logical not in axes or mesh_axis in used or size == 1:
            continue
        dim = axes.index(logical)
        whole = mesh_axis != "model" or (units or {}).get(logical, size) % size == 0
        if assigned[dim] is None and shape[dim] % size == 0 and whole:
            assigned[dim] = mesh_axis
            used.add(mesh_axis)
    return P(*assigned)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def tree_shardings(axes, tree, mesh: Mesh, rules=RULES, units: dict | None = None):
    """NamedSharding for every leaf of `tree` (arrays or ShapeDtypeStructs), given `axes`: a
    tree of the same structure whose leaves are tuples of logical axis names."""
    return jax.tree.map(lambda a, x: NamedSharding(mesh, spec_for(a, tuple(x.shape), mesh,
                                                                  rules, units)),
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
    """Batch rows split over the data axes: [B, ...] with B over ("data", "fsdp")."""
    return NamedSharding(mesh, P(BATCH_AXES))


def batch_ways(mesh: Mesh) -> int:
    return math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def check_batch_size(batch_size: int, mesh: Mesh):
    n = batch_ways(mesh)
    if batch_size % n:
        raise ValueError(f"batch size {batch_size} is not divisible by the {n} batch shards "
                         f"of mesh data={mesh.shape['data']},fsdp={mesh.shape['fsdp']}")


def process_rows(mesh: Mesh, batch_size: int) -> slice:
    """The rows of a global [batch_size, ...] batch that this process's devices hold (one
    contiguous block: `make_mesh` orders devices process by process)."""
    sh = batch_sharding(mesh)
    idx = sh.addressable_devices_indices_map((batch_size,))
    starts = [i[0].start or 0 for i in idx.values()]
    stops = [batch_size if i[0].stop is None else i[0].stop for i in idx.values()]
    lo, hi = min(starts), max(stops)
    if sum(s1 - s0 for s0, s1 in set(zip(starts, stops))) != hi - lo:
        raise ValueError("this process's batch rows are not contiguous on this mesh")
    return slice(lo, hi)


def shard_batch(batch: dict, mesh: Mesh) -> dict:
    """A host batch (the same global batch on every process) onto the mesh: each process
    hands over only the rows its own devices hold (`make_array_from_process_local_data`)."""
    sh = batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(batch, sh)
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        rows = process_rows(mesh, v.shape[0])
        out[k] = jax.make_array_from_process_local_data(sh, v[rows], v.shape)
    return out


def put(value, sharding: NamedSharding) -> jax.Array:
    """An array onto its sharding, each device receiving only its own shard: a host (numpy)
    array with no full copy on any one device (across processes too, when every process
    holds the same value); a device array of a one-process run is resharded on the devices,
    without a round trip through host memory."""
    if isinstance(value, jax.Array) and jax.process_count() == 1:
        return jax.device_put(value, sharding)
    host = np.asarray(jax.device_get(value))
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def to_host(tree):
    """numpy copies of (possibly multi-process, sharded) arrays: every process gets the whole
    value (an all-gather across processes when the array is not fully addressable)."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)


# ----------------------------------------------------------------------------- decoding


def decode_shardings(axes, tree, mesh: Mesh, units: dict | None = None):
    """Tensor-parallel shardings of a decoding params tree (backbone or heads)."""
    return tree_shardings(axes, tree, mesh, DECODE_RULES, units)


def _rows_spec(mesh, batch: int):
    """The batch axes a [B, ...] decode array splits over (None when B does not divide)."""
    axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    n = math.prod(mesh.shape[a] for a in axes) if axes else 1
    return (axes if len(axes) > 1 else axes[0]) if axes and batch % n == 0 else None


def cache_spec(mesh, num_kv_heads: int, batch: int) -> P:
    """[L, B, KVH, S, D]: rows over the batch axes, KV heads over `model` (replicated when
    the KV heads do not divide it)."""
    m = mesh.shape.get("model", 1)
    heads = "model" if m > 1 and num_kv_heads % m == 0 else None
    return P(None, _rows_spec(mesh, batch), heads, None, None)


def current_mesh():
    """The mesh set with `jax.set_mesh` (None outside one, or a mesh without our axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not set(mesh.axis_names) <= set(AXES):
        return None
    return mesh


def constrain_cache(k: jax.Array, v: jax.Array, num_kv_heads: int):
    """Inside a jitted decoder run under `jax.set_mesh`: pin the KV cache's sharding."""
    mesh = current_mesh()
    if mesh is None:
        return k, v
    spec = cache_spec(mesh, num_kv_heads, k.shape[1])
    return (jax.lax.with_sharding_constraint(k, spec),
            jax.lax.with_sharding_constraint(v, spec))


def constrain_rows(x: jax.Array) -> jax.Array:
    """Inside a jitted decoder run under `jax.set_mesh`: split a [B, ...] array's rows over
    the batch axes."""
    mesh = current_mesh()
    if mesh is None:
        return x
    spec = P(_rows_spec(mesh, x.shape[0]), *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)
