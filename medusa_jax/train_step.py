"""The Medusa training step: loss, metrics, optimizer with a frozen backbone, sharded jit.

Params are one tree {"backbone": ..., "heads": ...}. Which subtrees train is decided by a
label per top-level key ("train" or "frozen"), used twice:
  - the optimizer is an `optax.partition`: AdamW (+ clipping, warmup + cosine) on "train"
    leaves, `set_to_zero` on "frozen" ones, so frozen leaves get no Adam moments at all;
  - the loss runs the backbone under `stop_gradient` when it is frozen (Medusa-1), so no
    backbone gradient is computed (XLA drops the dead branch).
Medusa-2 (joint training) reuses `make_train_step` with the backbone labelled "train" (or
its own transform) and a loss that adds the backbone's LM loss.

Loss: head k (1-based) at position t is trained on token t+k+1, only where that token is a
label (assistant token) of the same packed example. Per head, cross-entropy is averaged over
its valid positions (0 when there are none, never NaN); heads are summed with weight decay**k.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from medusa_jax import sharding
from medusa_jax.backbone import KVCache, Params, forward
from medusa_jax.backbone import param_axes as backbone_param_axes
from medusa_jax.config import ModelConfig
from medusa_jax.heads import apply_heads, heads_axes

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
    b2: float = 0.999


# ----------------------------------------------------------------------------- loss


def packed_mask(segments: jax.Array) -> jax.Array:
    """[B, T] segment ids -> [B, T, T] causal mask that never crosses examples."""
    t = segments.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T(query), T(key)]
    same = segments[:, :, None] == segments[:, None, :]
    return causal[None] & same


def backbone_hidden(params: Params, cfg: ModelConfig, batch: Batch) -> jax.Array:
    """Final-norm hidden states [B, T, H] of a packed batch."""
    b, t = batch["tokens"].shape
    cache = KVCache.init(cfg, b, t)  # scratch: training attends within the batch only
    _, hidden, _ = forward(params, cfg, batch["tokens"], batch["positions"],
                           packed_mask(batch["segments"]), cache, return_logits=False,
                           empty_cache=True)
    return hidden


def medusa_targets(batch: Batch, num_heads: int) -> tuple[jax.Array, jax.Array]:
    """Targets and validity for every head: both [K, B, T].

    Head k (1-based) at position t predicts tokens[t+k+1]; valid when that token is a label
    and belongs to the same example as position t (packed rows hold several).
    """
    tokens, seg, mask = batch["tokens"], batch["segments"], batch["loss_mask"]
    t = tokens.shape[1]
    targets, valid = [], []
    for k in range(1, num_heads + 1):
        shift = k + 1
        pad = ((0, 0), (0, shift))
        tgt = jnp.pad(tokens[:, shift:], pad) if shift < t else jnp.zeros_like(tokens)
        tgt_seg = jnp.pad(seg[:, shift:], pad) if shift < t else jnp.zeros_like(seg)
        tgt_lbl = jnp.pad(mask[:, shift:], pad) if shift < t else jnp.zeros_like(mask)
        targets.append(tgt)
        valid.append(tgt_lbl & (tgt_seg == seg) & (seg > 0))
    return jnp.stack(targets), jnp.stack(valid)


def medusa_loss(head_logits: jax.Array, targets: jax.Array, valid: jax.Array,
                decay: float) -> tuple[jax.Array, dict]:
    """head_logits [K, B, T, V], targets/valid [K, B, T] -> (loss, metrics with [K] arrays)."""
    k = head_logits.shape[0]
    logits = head_logits.astype(jnp.float32)
    tgt_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [K, B, T]
    ce = jax.nn.logsumexp(logits, axis=-1) - tgt_logit
    # rank of the target = how many logits beat it (ties count in its favour)
    rank = jnp.sum(logits > tgt_logit[..., None], axis=-1)
    validf = valid.astype(jnp.float32)
    count = jnp.sum(validf, axis=(1, 2))  # [K]
    denom = jnp.maximum(count, 1.0)  # no valid position: loss 0, not NaN
    head_loss = jnp.sum(ce * validf, axis=(1, 2)) / denom
    weights = decay ** jnp.arange(1, k + 1, dtype=jnp.float32)
    loss = jnp.sum(weights * head_loss)
    metrics = {
        "loss": loss,
        "head_loss": head_loss,
        "top1": jnp.sum((rank < 1) * validf, axis=(1, 2)) / denom,
        "top5": jnp.sum((rank < 5) * validf, axis=(1, 2)) / denom,
        "count": count,
    }
    return loss, metrics


def medusa1_loss_fn(cfg: ModelConfig, decay: float = 0.8) -> LossFn:
    """Medusa-1: frozen backbone (stop_gradient), heads on its last hidden state."""

    def loss_fn(params: Params, batch: Batch):
        backbone = jax.lax.stop_gradient(params["backbone"])
        hidden = jax.lax.stop_gradient(backbone_hidden(backbone, cfg, batch))
        head_logits = apply_heads(params["heads"], hidden)  # [K, B, T, V]
        targets, valid = medusa_targets(batch, head_logits.shape[0])
        return medusa_loss(head_logits, targets, valid, decay)

    return loss_fn


# ----------------------------------------------------------------------------- optimizer


def medusa1_labels(params: Params) -> dict:
    """Label per top-level subtree (a prefix of the params tree)."""
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
             "heads": lambda: heads_axes(params["heads"])}
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


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, labels: dict,
                    shardings: TrainState, mesh, schedule: optax.Schedule | None = None):
    """jit(step)(state, batch) -> (state, metrics); state is donated."""
    frozen = frozen_keys(labels)

    def step(state: TrainState, batch: Batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
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
