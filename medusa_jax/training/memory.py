"""Per-device memory of a training step at a real model's shape, from the compiled step.

`training_memory` builds the training state and a batch as shapes only
(`jax.ShapeDtypeStruct`s with their shardings: no weights are created or read), compiles
the real training step (`training.step.make_train_step` with the recipe's parameters, loss and
optimizer: `Medusa1.method` / `Medusa2.method`) at the model's full depth (the layers are
one `lax.scan`, so that compile costs no more than a shallow one), and reads
`compiled.memory_analysis()`:

    params, optimizer state  exact, at the full depth: each leaf's per-device shard bytes
                             from its sharding (`training.step.state_shardings`)
    temporaries              what the compiled step allocates besides its arguments
                             (activations, gradients, the loss's logits); with two
                             depths given (`--memory-layers A,B`), extrapolated linearly
                             from them to all the layers
    batch                    the step's batch arrays

The state is donated to the step (its output reuses the input's buffers), so the step's
peak is about their sum. `python -m train.medusa1 --memory-report --shape llama-2-7b ...`
prints it (`Command`); on a CPU machine the mesh's devices are simulated
(`jax_num_cpu_devices`), so the figures are XLA:CPU's buffer assignment, not a GPU's or a
TPU's.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import jax
import numpy as np

from medusa_jax.model.backbone import head_units, init_params
from medusa_jax.model.config import ModelConfig
from medusa_jax.runtime import sharding
from medusa_jax.training import step as ts
from medusa_jax.training.recipes import medusa_loss as ml

GB, GIB = 10 ** 9, 2 ** 30


def parse_bytes(text: str) -> int:
    """"80GB" (10^9), "80GiB" (2^30), "512MB", "1e9" -> bytes; ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b?)?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"bad memory size {text!r}: expected e.g. 80GB, 80GiB or 16e9")
    unit = (m.group(2) or "").lower().rstrip("b")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
             "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}[unit]
    return int(float(m.group(1)) * scale)


def model_config(shape: str) -> ModelConfig:
    """A named shape (`bench.SHAPES`) or a Hugging Face model folder (its config.json only)."""
    from medusa_jax.tools.bench import SHAPES

    if shape in SHAPES:
        return ModelConfig(**SHAPES[shape])
    if Path(shape).is_dir():
        return ModelConfig.from_dir(shape)
    raise ValueError(f"--shape {shape!r}: neither a known shape ({', '.join(SHAPES)}) nor a "
                     f"model folder")


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def _bytes(tree, shardings) -> int:
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        total += int(np.prod(s.shard_shape(tuple(x.shape)))) * np.dtype(x.dtype).itemsize
    return total


@dataclasses.dataclass
class Compiled:
    state: object  # the abstract TrainState
    shardings: object
    memory: object  # compiled.memory_analysis()
    batch_bytes: int
    seconds: float


def compile_step(recipe, cfg, model_cfg: ModelConfig, mesh) -> Compiled:
    """The recipe's real training step for `model_cfg`, compiled from shapes alone."""
    t0 = time.perf_counter()
    dtypes = recipe.backbone_dtypes(cfg)
    mc = model_cfg.replace(**dtypes)
    key = jax.random.key(0)
    holder = {}

    def build():
        backbone = init_params(mc, key)
        params = recipe.memory_params(cfg, mc, backbone)
        m = recipe.memory_method(cfg, mc, params, cfg.steps or cfg.DEFAULT_STEPS)
        holder["method"] = m
        return ts.init_state(params, m.tx)

    abstract = jax.eval_shape(build)
    method = holder["method"]
    shardings = ts.state_shardings(abstract, ts.param_axes(mc, abstract.params), mesh,
                                   head_units(mc))
    b, t = cfg.batch_size, cfg.seq_len
    host = {"tokens": np.zeros((b, t), np.int32), "positions": np.zeros((b, t), np.int32),
            "segments": np.ones((b, t), np.int32), "loss_mask": np.ones((b, t), bool)}
    host = recipe.batch(host, 0)
    batch_sh = sharding.batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sh)
             for k, v in host.items()}
    step = ts.make_train_step(method.loss_fn, method.tx, method.labels, shardings, mesh,
                              method.schedule, cfg.grad_accum, method.totals_fn,
                              method.mean_metrics)
    compiled = step.lower(_abstract(abstract, shardings), batch).compile()
    batch_bytes = sum(_bytes(v, batch_sh) for v in host.values())
    return Compiled(abstract, shardings, compiled.memory_analysis(), batch_bytes,
                    time.perf_counter() - t0)


# Compiled depths by default: none, the full depth itself. Extrapolating from two shallow
# compiles is wrong whenever the step's peak moves from one phase to another with depth:
# Llama-3-8B, Medusa-1, full heads, bfloat16, batch 4 x 2,048 (XLA:CPU) peaks in the
# heads' optimizer update at 2 and 3 layers (22.36 GB of temporaries at both: "0 per
# layer"), but in the backbone's pass at 32 layers (45.70 GB), where XLA:CPU's float32
# copies of the bfloat16 layer weights (0.87 GB a layer) add up. (And not 1 and 2 layers
# when extrapolating: with one layer XLA drops the loop over the layers.)
DEFAULT_LAYERS = None


def training_memory(recipe, cfg, shape: str, device_memory: int | None = None,
                    layers: tuple[int, int] | None = DEFAULT_LAYERS) -> dict:
    """Per-device bytes of `recipe`'s training step for `shape` under `cfg` (its batch,
    sequence length, mesh, dtype, accumulation, loss chunk, remat), from compiles at two
    depths `layers` extrapolated linearly to the shape's (default: compiled at the shape's
    own depth; see the module docstring)."""
    full = model_config(shape)
    layers = layers or (full.num_layers, full.num_layers)
    depths = sorted({max(1, min(n, full.num_layers)) for n in layers})
    lo, hi = depths[0], depths[-1]
    mesh_sizes = sharding.parse_mesh_spec(cfg.mesh)
    need = int(np.prod(list(mesh_sizes.values())))
    devices = jax.devices()
    if len(devices) < need:
        devices = jax.devices("cpu")  # simulated (see `Command`: jax_num_cpu_devices)
    if len(devices) < need:
        raise ValueError(f"--mesh {cfg.mesh} needs {need} devices, {len(devices)} available")
    mesh = sharding.make_mesh(cfg.mesh, devices)
    from medusa_jax.training.config import check_batch

    check_batch(cfg, mesh)
    runs = {n: compile_step(recipe, cfg, full.replace(num_layers=n), mesh)
            for n in sorted({lo, hi})}
    one, two = runs[lo], runs[hi]
    temp1, temp2 = int(one.memory.temp_size_in_bytes), int(two.memory.temp_size_in_bytes)
    per_layer = (temp2 - temp1) // (hi - lo) if hi > lo else 0
    temps = temp1 + per_layer * (full.num_layers - lo)
    # the full depth's state, exactly (shapes only)
    dtypes = recipe.backbone_dtypes(cfg)
    mc = full.replace(**dtypes)
    key = jax.random.key(0)

    def build():
        params = recipe.memory_params(cfg, mc, init_params(mc, key))
        m = recipe.memory_method(cfg, mc, params, cfg.steps or cfg.DEFAULT_STEPS)
        return ts.init_state(params, m.tx)

    state = jax.eval_shape(build)
    sh = ts.state_shardings(state, ts.param_axes(mc, state.params), mesh, head_units(mc))
    params = {k: _bytes(state.params[k], sh.params[k]) for k in state.params}
    opt = _bytes(state.opt_state, sh.opt_state)
    parts = {"params": sum(params.values()), "optimizer_state": opt, "temporaries": temps,
             "batch": one.batch_bytes}
    total = sum(parts.values())
    # a check that memory_analysis counts per device: its arguments at the smaller depth are
    # that state's and the batch's per-device bytes
    arg1 = _bytes(one.state, one.shardings) + one.batch_bytes
    out = {
        "method": recipe.name, "shape": shape, "layers": full.num_layers,
        "layers_compiled": sorted(runs), "mesh": sharding.mesh_str(mesh),
        "devices": mesh.size, "platform": devices[0].platform,
        "batch_size": cfg.batch_size,
        "batch_per_device": cfg.batch_size // sharding.batch_ways(mesh),
        "seq_len": cfg.seq_len, "grad_accum": cfg.grad_accum, "dtype": cfg.dtype,
        "backbone_param_dtype": dtypes["param_dtype"], "num_heads": cfg.num_heads,
        "head_layers": cfg.num_layers, "loss_chunking": ml.loss_chunking(
            cfg.seq_len, cfg.batch_size // cfg.grad_accum // sharding.batch_ways(mesh),
            cfg.num_heads, getattr(cfg, "reduced_vocab", 0) or full.vocab_size,
            cfg.loss_chunk, 1 if cfg.shared_proj else cfg.num_heads, not cfg.shared_proj,
            soft=cfg.target != "hard"),
        "target": cfg.target, "target_temperature": cfg.target_temperature,
        "remat": bool(getattr(cfg, "remat", False)), "heads": recipe.memory_heads(cfg),
        "per_device_bytes": total, "parts_bytes": parts, "params_bytes": params,
        "temporaries_bytes_by_layers": {str(n): int(r.memory.temp_size_in_bytes)
                                        for n, r in runs.items()},
        "temporaries_bytes_per_layer": per_layer,
        "compiled_argument_bytes": int(one.memory.argument_size_in_bytes),
        "state_and_batch_bytes": arg1,
        "compile_seconds": round(sum(r.seconds for r in runs.values()), 1),
    }
    if device_memory is not None:
        out["device_memory_bytes"] = device_memory
        out["fits"] = total <= device_memory
        # temporaries grow at most in proportion to the batch (gradients, for one, do not
        # grow at all): this many rows per device fit at least
        fixed = total - temps - one.batch_bytes
        rows = out["batch_per_device"]
        per_row = (temps + one.batch_bytes) / rows
        out["max_batch_per_device_estimate"] = max(0, int((device_memory - fixed) // per_row))
    return out


def _chunking(how) -> str:
    kind, size = how
    return {"one": "in one block", "tokens": f"{size} tokens per row at a time",
            "vocab": f"over the vocabulary in {size} chunks"}[kind]


def print_report(r: dict):
    gb = lambda b: f"{b / GB:8.2f} GB"  # noqa: E731
    print(f"{r['method']} training step, {r['shape']} ({r['layers']} layers; compiled at "
          f"{' and '.join(map(str, r['layers_compiled']))}"
          f"{'' if r['layers_compiled'] == [r['layers']] else ', extrapolated'}), mesh {r['mesh']} "
          f"({r['devices']} {r['platform']} devices), batch {r['batch_size']} "
          f"({r['batch_per_device']} per device) x {r['seq_len']} tokens, grad-accum "
          f"{r['grad_accum']}, backbone {r['dtype']} (weights {r['backbone_param_dtype']}), "
          + (r.get("heads") or f"{r['num_heads']} heads, heads' loss "
                                 f"{_chunking(r['loss_chunking'])}")
          + f", target {r['target']}" + (f" at T {r['target_temperature']}"
                                         if r["target"] != "hard" else "")
          + (", remat" if r["remat"] else ""))
    print("per-device memory:")
    names = {"params": "parameters", "optimizer_state": "optimizer state",
             "temporaries": "temporaries", "batch": "batch"}
    for k, label in names.items():
        extra = ""
        if k == "params":
            extra = "  (" + ", ".join(f"{n} {v / GB:.2f} GB" for n, v in
                                      r["params_bytes"].items()) + ")"
        if k == "temporaries":
            extra = (f"  ({r['temporaries_bytes_per_layer'] / GB:.3f} GB per layer; "
                     f"activations, gradients, the loss's logits)")
        print(f"  {label:<16} {gb(r['parts_bytes'][k])}{extra}")
    print(f"  {'total':<16} {gb(r['per_device_bytes'])}")
    if "device_memory_bytes" in r:
        print(f"fits {r['device_memory_bytes'] / GB:.0f} GB per device: "
              f"{'yes' if r['fits'] else 'no'}; at least "
              f"{r['max_batch_per_device_estimate']} rows per device would fit (if the "
              f"temporaries grew in proportion to the batch)")
    print(f"(XLA:{r['platform'].upper()} compilation from shapes, no weights: buffer sizes, "
          f"not timings; {r['compile_seconds']:.0f} s of compiling)")
