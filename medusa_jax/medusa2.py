"""Medusa-2: the backbone is fine-tuned together with the heads.

Params are one tree {"backbone", "heads", "teacher"}:

    backbone  trained, its own optax partition (AdamW, warmup + cosine, peak lr)
    heads     trained, its own partition with `head_lr_ratio` x the backbone's lr (paper: 4x)
    teacher   an untouched copy of the original backbone, labelled "frozen": read under
              `stop_gradient` and given `set_to_zero` (no Adam moments); only in "kl" mode

Loss = lm_weight * L_LM + lambda(step) * sum_k decay^k * CE_k

  - the head term is exactly Medusa-1's (`train_step.medusa_targets` / `medusa_loss`), but
    it now back-propagates into the backbone through the shared last hidden state;
  - L_LM ("ce") is next-token cross-entropy on the labels, or ("kl", for self-distilled data)
    the per-position KL(p_teacher || p_backbone) over the same positions, so the fine-tuned
    model keeps the original's output distribution (at the start loss and gradient are zero
    up to float rounding, ~1e-9);
  - lambda(step) is constant (paper: 0.2) or rises as lambda_peak * sin(pi/2 * step/ramp)
    (the paper's variant, peak 0.01). The step comes in the batch as `batch["step"]`, one
    copy per row ([B] int32) so it shards over the data axes like every other batch array.

Rows flagged `batch["lm_only"]` ([B] bool, from `data.concat`) count in the LM term only: real
text added to self-distilled answers so the KL also holds the model in place on text it did
not write (the heads must learn the model's own continuations, not the text's).

The training step itself is `train_step.make_train_step` (sharded jit, frozen subtrees kept
bit-identical); only the loss, the labels and the optimizer are Medusa-2's.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from medusa_jax import data
from medusa_jax.backbone import Params, logits_from_hidden
from medusa_jax.config import ModelConfig
from medusa_jax.heads import apply_heads
from medusa_jax.train_step import (Batch, LossFn, OptimConfig, backbone_hidden, medusa_loss,
                                   medusa_targets)

LM_LOSSES = ("kl", "ce")
HEAD_SCHEDULES = ("constant", "sine")
DEFAULT_HEAD_WEIGHT = {"constant": 0.2, "sine": 0.01}  # the paper's two settings


@dataclasses.dataclass(frozen=True)
class LossConfig:
    lm_loss: str = "kl"  # "kl": KL(teacher || backbone), "ce": next-token cross-entropy
    lm_weight: float = 1.0
    head_schedule: str = "constant"
    head_weight: float | None = None  # lambda_0 (constant) or the sine's peak; None: paper's
    head_ramp_steps: int = 1  # sine: steps to reach the peak (then it stays there)
    decay: float = 0.8  # head k (1-based) weighs decay**k

    def __post_init__(self):
        if self.lm_loss not in LM_LOSSES:
            raise ValueError(f"lm_loss must be one of {LM_LOSSES}, got {self.lm_loss!r}")
        if self.head_schedule not in HEAD_SCHEDULES:
            raise ValueError(f"head_schedule must be one of {HEAD_SCHEDULES}, "
                             f"got {self.head_schedule!r}")
        if self.lm_weight < 0 or (self.head_weight is not None and self.head_weight < 0):
            raise ValueError("loss weights must be >= 0")
        if self.head_ramp_steps < 1:
            raise ValueError(f"head_ramp_steps must be >= 1, got {self.head_ramp_steps}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    @property
    def peak_head_weight(self) -> float:
        if self.head_weight is not None:
            return float(self.head_weight)
        return DEFAULT_HEAD_WEIGHT[self.head_schedule]


def head_weight_schedule(cfg: LossConfig):
    """step ([] int array) -> lambda(step) float32: the weight of the heads' loss."""
    peak = cfg.peak_head_weight
    if cfg.head_schedule == "constant":
        return lambda step: jnp.float32(peak)

    def sine(step):
        frac = jnp.clip(jnp.asarray(step, jnp.float32) / cfg.head_ramp_steps, 0.0, 1.0)
        return jnp.float32(peak) * jnp.sin(0.5 * jnp.pi * frac)

    return sine


# ----------------------------------------------------------------------------- loss


def next_token_targets(batch: Batch) -> tuple[jax.Array, jax.Array]:
    """The LM's own targets: position t predicts tokens[t+1]. Both [B, T].

    Valid where tokens[t+1] is a label of the same example (the heads' rule, shift 1)."""
    tokens, seg, mask = batch["tokens"], batch["segments"], batch["loss_mask"]
    pad = ((0, 0), (0, 1))
    tgt = jnp.pad(tokens[:, 1:], pad)
    valid = jnp.pad(mask[:, 1:], pad) & (jnp.pad(seg[:, 1:], pad) == seg) & (seg > 0)
    return tgt, valid


def _masked_mean(x: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean of x [B, T] over valid positions (0 when there are none, never NaN); count."""
    validf = valid.astype(jnp.float32)
    count = jnp.sum(validf)
    return jnp.sum(x * validf) / jnp.maximum(count, 1.0), count


def token_kl(teacher_logits: jax.Array, student_logits: jax.Array) -> jax.Array:
    """KL(p_teacher || p_student) per position: [..., V] logits -> [...] in float32."""
    lt = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    ls = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(lt) * (lt - ls), axis=-1)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """-log p(target) per position: logits [..., V], targets [...] -> [...] float32."""
    logits = logits.astype(jnp.float32)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - tgt


def make_loss_fn(cfg: ModelConfig, loss_cfg: LossConfig = LossConfig()) -> LossFn:
    """(params, batch) -> (loss, metrics). Metrics keep Medusa-1's per-head keys (head_loss,
    top1, top5, count: [K] arrays) so Medusa-1's evaluation and plots read them unchanged."""
    lam_fn = head_weight_schedule(loss_cfg)

    def loss_fn(params: Params, batch: Batch):
        if loss_cfg.lm_loss == "kl" and "teacher" not in params:
            raise ValueError('the "kl" LM loss needs params["teacher"] (see make_params)')
        # one backbone pass, differentiated: both the LM term and the heads train it
        hidden = backbone_hidden(params["backbone"], cfg, batch)  # [B, T, H]
        logits = logits_from_hidden(cfg, params["backbone"], hidden)  # [B, T, V] float32
        targets, valid = next_token_targets(batch)  # [B, T]
        nll, count = _masked_mean(token_nll(logits, targets), valid)
        metrics = {"lm_nll": nll, "lm_count": count,
                   "lm_top1": _masked_mean(jnp.argmax(logits, -1) == targets, valid)[0]}
        if loss_cfg.lm_loss == "kl":
            teacher = jax.lax.stop_gradient(params["teacher"])
            t_hidden = backbone_hidden(teacher, cfg, batch)
            t_logits = jax.lax.stop_gradient(logits_from_hidden(cfg, teacher, t_hidden))
            lm, _ = _masked_mean(token_kl(t_logits, logits), valid)
            metrics["kl"] = lm
        else:
            lm = nll
        head_logits = apply_heads(params["heads"], hidden)  # [K, B, T, V]
        h_targets, h_valid = medusa_targets(batch, head_logits.shape[0])
        if "lm_only" in batch:  # anchor rows train the LM term only
            h_valid = h_valid & ~batch["lm_only"][None, :, None]
        heads_loss, head_metrics = medusa_loss(head_logits, h_targets, h_valid, loss_cfg.decay)
        # eval batches carry no step: they are scored with the peak weight
        lam = lam_fn(jnp.max(batch["step"])) if "step" in batch else \
            jnp.float32(loss_cfg.peak_head_weight)
        loss = loss_cfg.lm_weight * lm + lam * heads_loss
        metrics.update(head_metrics, loss=loss, lm_loss=lm, heads_loss=heads_loss,
                       head_weight=lam)
        return loss, metrics

    return loss_fn


def with_step(batch: dict, step: int) -> dict:
    """Add the optimizer step to a host batch, one copy per row ([B] int32)."""
    b = batch["tokens"].shape[0]
    return dict(batch, step=np.full((b,), step, np.int32))


# ----------------------------------------------------------------------------- optimizer


def labels(params: Params) -> dict:
    """One optax partition per top-level subtree; the teacher is frozen."""
    names = {"backbone": "backbone", "heads": "heads", "teacher": "frozen"}
    unknown = set(params) - set(names)
    if unknown:
        raise ValueError(f"unexpected parameter subtrees {sorted(unknown)}")
    return {k: names[k] for k in params}


def make_params(backbone: Params, heads: Params, lm_loss: str = "kl") -> Params:
    """{"backbone", "heads"} plus, for the KL loss, "teacher": a separate copy of the
    backbone (its own buffers: the train step donates the state, and two leaves sharing one
    buffer cannot both be donated)."""
    params = {"backbone": backbone, "heads": heads}
    if lm_loss == "kl":
        params["teacher"] = jax.tree.map(jnp.copy, backbone)
    return params


def make_optimizer2(opt: OptimConfig, total_steps: int, labels: dict,
                    head_lr_ratio: float = 4.0
                    ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW per partition: backbone at `opt.lr`, heads at `head_lr_ratio * opt.lr`, both
    with linear warmup + cosine decay; the teacher gets `set_to_zero` (no state at all).

    Gradient clipping is one global norm over everything trained (clipping backbone and heads
    separately would change their relative step sizes). Returns (transform, the backbone's
    schedule)."""
    if head_lr_ratio <= 0:
        raise ValueError(f"head_lr_ratio must be > 0, got {head_lr_ratio}")
    total_steps = max(1, int(total_steps))

    def schedule(peak):
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=peak, warmup_steps=int(opt.warmup_ratio * total_steps),
            decay_steps=total_steps, end_value=0.0)

    bb_schedule = schedule(opt.lr)
    adam = lambda s: optax.adamw(s, b1=opt.b1, b2=opt.b2,  # noqa: E731
                                 weight_decay=opt.weight_decay)
    tx = optax.partition({"backbone": adam(bb_schedule),
                          "heads": adam(schedule(opt.lr * head_lr_ratio)),
                          "frozen": optax.set_to_zero()}, labels)
    if opt.grad_clip > 0:
        # the teacher's gradient is exactly zero (stop_gradient): it does not move the norm
        tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip), tx)
    return tx, bb_schedule


# ----------------------------------------------------------------------------- evaluation


def make_lm_eval(cfg: ModelConfig):
    """jit(original, finetuned, batch) -> sums over the batch's next-token label positions:
    nll_original, nll_finetuned, kl (original || fine-tuned), count. Shardings follow the
    inputs (params on the training mesh, batch from `sharding.shard_batch`)."""

    @jax.jit
    def ev(original: Params, finetuned: Params, batch: Batch) -> dict:
        targets, valid = next_token_targets(batch)
        validf = valid.astype(jnp.float32)
        out = {}
        lo = logits_from_hidden(cfg, original, backbone_hidden(original, cfg, batch))
        lf = logits_from_hidden(cfg, finetuned, backbone_hidden(finetuned, cfg, batch))
        out["nll_original"] = jnp.sum(token_nll(lo, targets) * validf)
        out["nll_finetuned"] = jnp.sum(token_nll(lf, targets) * validf)
        out["kl"] = jnp.sum(token_kl(lo, lf) * validf)
        out["count"] = jnp.sum(validf)
        return out

    return ev


def lm_report(cfg: ModelConfig, original: Params, finetuned: Params, rows: data.Packed,
              batch_size: int, put_batch=lambda b: b) -> dict:
    """Perplexity of both models and mean per-token KL(original || fine-tuned) on `rows`.

    `put_batch` places a host batch (e.g. `sharding.shard_batch` on the training mesh)."""
    ev = make_lm_eval(cfg)
    sums: dict[str, float] = {}
    for batch in data.eval_batches(rows, batch_size):
        part = jax.device_get(ev(original, finetuned, put_batch(batch)))
        for k, v in part.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    n = max(sums.get("count", 0.0), 1.0)
    ppl_o, ppl_f = math.exp(sums["nll_original"] / n), math.exp(sums["nll_finetuned"] / n)
    return {"tokens": int(sums["count"]), "ppl_original": ppl_o, "ppl_finetuned": ppl_f,
            "ppl_change": ppl_f / ppl_o - 1.0, "kl_mean": sums["kl"] / n}
