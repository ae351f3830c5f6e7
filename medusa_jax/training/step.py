"""The Medusa training step: loss, metrics, optimizer with a frozen backbone, sharded jit.

Params are one tree {"backbone": ..., "heads": ...}. Which subtrees train is decided by a
label per top-level key ("train" or "frozen"), used twice:
  - the optimizer is an `optax.partition`: AdamW (+ clipping, warmup + cosine) on "train"
    leaves, `set_to_zero` on "frozen" ones, so frozen leaves get no Adam moments at all;
  - the loss runs the backbone under `stop_gradient` when it is frozen (Medusa-1), so no
    backbone gradient is computed (XLA drops the dead branch).
Medusa-2 (joint training) reuses `make_train_step` with the backbone labelled "train" (or
its own transform) and a loss that adds the backbone's LM loss.

The methods' losses live with their recipes (`training.recipes`: the Medusa heads' loss,
shared by Medusa-1, Hydra and Medusa-2, is `recipes.medusa_loss`); this module holds what
every method shares: the frozen backbone's pass, the optimizer, the sharded step and
gradient accumulation.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from medusa_jax.drafters import registry as drafter
from medusa_jax.drafters.toolkit.sequence import shift
from medusa_jax.model.backbone import KVCache, Params, forward_uncommitted
from medusa_jax.model.backbone import param_axes as backbone_param_axes
from medusa_jax.model.config import ModelConfig
from medusa_jax.runtime import sharding

Batch = dict  # tokens, positions, segments [B, T] int32; loss_mask [B, T] bool
LossFn = Callable[[Params, Batch], tuple[jax.Array, dict]]


@struct.dataclass
class TrainState:
    step: jax.Array  # [] int32: optimizer steps taken
    params: Params  # {"backbone": ..., "heads": ...}
    opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    warmup_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global norm over the trained leaves; 0 = off
    b1: float = 0.9
    b2: float = 0.999  # each recipe passes its config's --adam-b2


# ----------------------------------------------------------------------------- loss


def packed_mask(segments: jax.Array) -> jax.Array:
    """[B, T] segment ids -> [B, T, T] causal mask that never crosses examples."""
    t = segments.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T(query), T(key)]
    same = segments[:, :, None] == segments[:, None, :]
    return causal[None] & same


def backbone_hidden(params: Params, cfg: ModelConfig, batch: Batch,
                    remat: bool = False) -> jax.Array:
    """Final-norm hidden states [B, T, H] of a packed batch (`remat`: each layer
    rematerialised in the backward pass, see `backbone.forward_uncommitted`)."""
    b, t = batch["tokens"].shape
    cache = KVCache.init(cfg, b, t)  # scratch: training attends within the batch only
    # uncommitted: the new keys/values are dropped, never written into a [L, B, KVH, T, D]
    # cache (at 7B, batch 8 x 2,048 tokens, that cache would be 8.6 GB in bfloat16)
    _, hidden, _ = forward_uncommitted(params, cfg, batch["tokens"], batch["positions"],
                                       packed_mask(batch["segments"]), cache,
                                       return_logits=False, empty_cache=True, remat=remat)
    return hidden


# A frozen backbone's pass (no gradient, nothing kept for a backward pass) runs a few rows
# at a time, so that one layer's attention scores [rows, NH, T, T] float32 stay under this
# many bytes per device: at 7B (32 heads) and 2,048 tokens a row's scores are 0.54 GB, and
# 8 rows at once would hold 4.3 GB of scores and as much of probabilities.
FROZEN_PASS_BYTES = 2 ** 30


def frozen_pass_rows(cfg: ModelConfig, rows: int, seq_len: int) -> int:
    """How many of a device's `rows` one frozen backbone pass takes (a divisor of rows)."""
    per_row = cfg.num_heads * seq_len * seq_len * 4
    most = max(1, FROZEN_PASS_BYTES // per_row)
    return max(g for g in range(1, rows + 1) if rows % g == 0 and g <= most)


def frozen_hidden(params: Params, cfg: ModelConfig, batch: Batch,
                  batch_ways: int = 1) -> jax.Array:
    """`backbone_hidden` of a frozen backbone (under stop_gradient), a few rows at a time
    (`frozen_pass_rows`; `batch_ways`: the devices the rows are split over) in a `lax.map`
    when the whole batch's attention scores would be large; one pass otherwise (the
    embedded model's batches). Pass j takes rows j, j + n, j + 2n, ...: each device keeps
    its own rows."""
    params = jax.lax.stop_gradient(params)
    b, t = batch["tokens"].shape
    local = max(1, b // batch_ways)
    n = local // frozen_pass_rows(cfg, local, t)  # passes
    if n == 1:
        return jax.lax.stop_gradient(backbone_hidden(params, cfg, batch))
    keys = ("tokens", "positions", "segments")
    parts = {k: batch[k].reshape(b // n, n, t).swapaxes(0, 1) for k in keys}
    hidden = jax.lax.map(lambda part: backbone_hidden(params, cfg, part), parts)
    return jax.lax.stop_gradient(hidden.swapaxes(0, 1).reshape(b, t, -1))


# ----------------------------------------------------------------------------- optimizer


def ahead_masks(batch: dict, n: int) -> jax.Array:
    """[n, B, T] float32: where the prediction at t of token t+i+2 (EAGLE-3's training-time
    step i, MTP's depth i) is scored: that token is a label of t's own example (packed rows
    hold several)."""
    seg = batch["segments"]
    label = batch["loss_mask"] & (seg > 0)
    return jnp.stack([(shift(label, i + 2) & (shift(seg, i + 2) == seg)).astype(jnp.float32)
                      for i in range(n)])


def optim_config(cfg) -> OptimConfig:
    """The optimizer of a recipe's config: its --lr, --warmup-ratio, --weight-decay,
    --grad-clip and --adam-b2 (every recipe's config has them)."""
    return OptimConfig(lr=cfg.lr, warmup_ratio=cfg.warmup_ratio, weight_decay=cfg.weight_decay,
                       grad_clip=cfg.grad_clip, b2=cfg.adam_b2)


def heads_trained(params: dict) -> dict:
    """`make_optimizer`'s labels for a drafter on a frozen backbone: "heads" trained, every
    other entry (the backbone) frozen."""
    return {name: ("train" if name == "heads" else "frozen") for name in params}


def make_optimizer(opt: OptimConfig, total_steps: int, labels: dict
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup + cosine decay on "train" leaves, nothing on "frozen" ones."""
    total_steps = max(1, int(total_steps))
    warmup = int(opt.warmup_ratio * total_steps)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=opt.lr, warmup_steps=warmup,
        decay_steps=total_steps, end_value=0.0)
    chain = [optax.clip_by_global_norm(opt.grad_clip)] if opt.grad_clip > 0 else []
    chain.append(optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay))
    tx = optax.partition({"train": optax.chain(*chain), "frozen": optax.set_to_zero()}, labels)
    return tx, schedule


def frozen_keys(labels: dict) -> tuple[str, ...]:
    return tuple(k for k, v in labels.items() if v == "frozen")


def init_state(params: Params, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


# ----------------------------------------------------------------------------- sharded jit


def param_axes(cfg: ModelConfig, params: Params) -> dict:
    """The logical axes of a training params tree: "backbone" and "teacher" are backbones,
    "heads" are Medusa heads."""
    kinds = {"backbone": lambda: backbone_param_axes(cfg),
             "teacher": lambda: backbone_param_axes(cfg),
             "heads": lambda: drafter.axes_of(params["heads"])}
    unknown = set(params) - set(kinds)
    if unknown:
        raise ValueError(f"unexpected parameter subtrees {sorted(unknown)}")
    return {k: kinds[k]() for k in params}


def state_shardings(state_or_abstract: TrainState, axes: dict, mesh,
                    units: dict | None = None) -> TrainState:
    """NamedShardings for a TrainState (pass an abstract one from `jax.eval_shape`);
    `axes` is `param_axes` of its params, `units` `backbone.head_units` (needed only for
    tensor parallelism on a `model` axis: whole attention heads per shard)."""
    params = sharding.tree_shardings(axes, state_or_abstract.params, mesh, sharding.TRAIN_RULES,
                                     units)
    return TrainState(
        step=sharding.replicated(mesh), params=params,
        opt_state=sharding.like_params(state_or_abstract.opt_state, state_or_abstract.params,
                                       params, mesh))


def create_state(params: Params, tx: optax.GradientTransformation, mesh, axes: dict,
                 units: dict | None = None) -> tuple[TrainState, TrainState]:
    """Place params on the mesh and build the optimizer state there, already sharded (each
    device receives only its shards, on one or many processes).

    Returns (state, its shardings)."""
    abstract = jax.eval_shape(lambda p: init_state(p, tx), params)
    shardings = state_shardings(abstract, axes, mesh, units)
    params = jax.tree.map(sharding.put, params, shardings.params)
    state = jax.jit(lambda p: init_state(p, tx), out_shardings=shardings)(params)
    return state, shardings


def accumulate(loss_fn: LossFn, totals_fn: Callable[[Batch], dict], params: Params,
               batch: Batch, trained: tuple[str, ...], micro_batches: int,
               mean_metrics: tuple[str, ...] = (), mesh=None):
    """(loss, metrics), gradients of the `trained` subtrees: one `micro_batches`-times
    smaller batch at a time (a `lax.scan`), equal to one pass over the whole batch.

    Equal, not an average of micro-batch means: every micro-batch's loss divides by the
    whole batch's valid-position counts (`totals_fn`, passed as batch["totals"]), so the
    micro-batches' losses, gradients and metrics add up to the whole batch's. Metrics named
    in `mean_metrics` (the same in every micro-batch, e.g. a loss weight) are averaged.
    Micro-batch j holds rows j, j + N, j + 2N, ...: each device keeps its own rows."""
    totals = totals_fn(batch)
    n = micro_batches

    def split(x):  # [B, ...] -> [N, B/N, ...], row r -> (r % N, r // N)
        x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
        if mesh is None:
            return x
        spec = jax.sharding.PartitionSpec(None, sharding.BATCH_AXES, *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))

    micro = jax.tree.map(split, batch)
    fixed = {k: v for k, v in params.items() if k not in trained}

    def grad_of(tr, mb):
        loss, metrics = loss_fn({**tr, **fixed}, dict(mb, totals=totals))
        return loss, metrics

    grad_fn = jax.value_and_grad(grad_of, has_aux=True)
    tr0 = {k: params[k] for k in trained}

    def body(acc, mb):
        (_, metrics), grads = grad_fn(tr0, mb)
        return jax.tree.map(jnp.add, acc, (grads, metrics)), None

    abstract = jax.eval_shape(grad_fn, tr0, jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (abstract[1], abstract[0][1]))
    (grads, metrics), _ = jax.lax.scan(body, zeros, micro)
    metrics = {k: (v / n if k in mean_metrics else v) for k, v in metrics.items()}
    return (metrics["loss"], metrics), grads


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, labels: dict,
                    shardings: TrainState, mesh, schedule: optax.Schedule | None = None,
                    grad_accum: int = 1, totals_fn: Callable[[Batch], dict] | None = None,
                    mean_metrics: tuple[str, ...] = ()):
    """jit(step)(state, batch) -> (state, metrics); state is donated.

    `grad_accum` > 1: the batch is `grad_accum` micro-batches, one forward/backward pass
    each, one optimizer step (`accumulate`; `totals_fn` gives the whole batch's
    denominators, the loss function reads them from batch["totals"])."""
    frozen = frozen_keys(labels)
    if grad_accum > 1 and totals_fn is None:
        raise ValueError("gradient accumulation needs the loss's totals_fn")

    def step(state: TrainState, batch: Batch):
        if grad_accum > 1:
            trained = tuple(k for k in state.params if k not in frozen)
            (loss, metrics), grads = accumulate(loss_fn, totals_fn, state.params, batch,
                                                trained, grad_accum, mean_metrics, mesh)
            # frozen subtrees: zero gradients for the optimizer's set_to_zero (never used)
            grads = {k: grads[k] if k in grads else jax.tree.map(jnp.zeros_like, v)
                     for k, v in state.params.items()}
        else:
            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # frozen subtrees keep their exact arrays (set_to_zero makes the update 0 already;
        # reusing the input also skips p + 0 and keeps -0.0 bit-identical)
        params = {k: (state.params[k] if k in frozen else v) for k, v in params.items()}
        trained = {k: v for k, v in grads.items() if k not in frozen}
        metrics = dict(metrics, grad_norm=optax.tree.norm(trained))
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return jax.jit(step, in_shardings=(shardings, sharding.batch_sharding(mesh)),
                   out_shardings=(shardings, sharding.replicated(mesh)), donate_argnums=0)


def make_eval_step(loss_fn: LossFn, shardings: TrainState, mesh):
    """jit(eval)(params, batch) -> metrics (the loss function's, no update)."""

    def ev(params, batch):
        return loss_fn(params, batch)[1]

    return jax.jit(ev, in_shardings=(shardings.params, sharding.batch_sharding(mesh)),
                   out_shardings=sharding.replicated(mesh))
