"""Medusa-2: the backbone is fine-tuned together with the heads.

Params are one tree {"backbone", "heads", "teacher"}:

    backbone  trained, its own optax partition (AdamW, warmup + cosine, peak lr)
    heads     trained, its own partition with `head_lr_ratio` x the backbone's lr (paper: 4x)
    teacher   an untouched copy of the original backbone, labelled "frozen": read under
              `stop_gradient` and given `set_to_zero` (no Adam moments); only in "kl" mode

Loss = lm_weight * L_LM + lambda(step) * sum_k decay^k * CE_k

  - the head term is exactly Medusa-1's (`medusa_loss.medusa_targets` / `medusa_loss`), but
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

The training step itself is `training.step.make_train_step` (sharded jit, frozen subtrees kept
bit-identical) and the loop `trainer.train`; Medusa-2 is its loss, labels and optimizer here,
plus `Medusa2Config` and the `Medusa2` recipe: the first stage (a Medusa-1 run, or --init),
anchor text, the fine-tuned backbone's export and the perplexity/KL report.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters.medusa import heads as heads_lib
from medusa_jax.model import weights
from medusa_jax.model.backbone import Params, logits_from_hidden
from medusa_jax.model.config import ModelConfig, as_dtype
from medusa_jax.runtime import assets, distributed, sharding
from medusa_jax.runtime.rundir import Interrupted
from medusa_jax.text import data
from medusa_jax.training import trainer
from medusa_jax.training.config import (  # noqa: F401
    HEAD_SCHEDULES,
    LM_LOSSES,
    Init,
    Medusa2Config,
    check_shared,
    resolve_init,
)
from medusa_jax.training.recipes import medusa_loss as ml
from medusa_jax.training.recipes.medusa1 import Medusa1
from medusa_jax.training.recipes.medusa_loss import medusa_targets
from medusa_jax.training.step import (
    Batch,
    LossFn,
    OptimConfig,
    TrainState,
    backbone_hidden,
    optim_config,
)

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


def _masked_mean(x: jax.Array, valid: jax.Array, total: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """Mean of x [B, T] over valid positions (0 when there are none, never NaN); count.
    `total`: the denominator instead of this batch's count (gradient accumulation)."""
    validf = valid.astype(jnp.float32)
    count = jnp.sum(validf)
    denom = jnp.maximum(count if total is None else total, 1.0)
    return jnp.sum(x * validf) / denom, count


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


def heads_targets(batch: Batch, num_heads: int) -> tuple[jax.Array, jax.Array]:
    """Medusa-1's head targets/validity [K, B, T], without the anchor (lm_only) rows."""
    h_targets, h_valid = medusa_targets(batch, num_heads)
    if "lm_only" in batch:  # anchor rows train the LM term only
        h_valid = h_valid & ~batch["lm_only"][None, :, None]
    return h_targets, h_valid


def loss_totals(batch: Batch, num_heads: int) -> dict:
    """The whole batch's denominators of the loss's means (gradient accumulation)."""
    _, valid = next_token_targets(batch)
    _, h_valid = heads_targets(batch, num_heads)
    return {"lm": jnp.sum(valid.astype(jnp.float32)),
            "heads": jnp.sum(h_valid.astype(jnp.float32), axis=(1, 2))}


# not sums over micro-batches: averaged by gradient accumulation
MEAN_METRICS = ("head_weight",)


def make_loss_fn(cfg: ModelConfig, loss_cfg: LossConfig = LossConfig(), *, chunk: int = 0,
                 remat: bool = False, batch_ways: int = 1, frozen_proj: bool = False) -> LossFn:
    """(params, batch) -> (loss, metrics). Metrics keep Medusa-1's per-head keys (head_loss,
    top1, top5, count: [K] arrays) so Medusa-1's evaluation and plots read them unchanged.
    `chunk`: tokens per row per chunk of the heads' loss (`medusa_loss.heads_loss`; 0 = auto
    for rows split `batch_ways` ways); `frozen_proj`: no gradient for the heads' projection;
    `remat`: the trained backbone's layers rematerialised in the backward pass."""
    lam_fn = head_weight_schedule(loss_cfg)

    def loss_fn(params: Params, batch: Batch):
        if loss_cfg.lm_loss == "kl" and "teacher" not in params:
            raise ValueError('the "kl" LM loss needs params["teacher"] (see make_params)')
        totals = batch.get("totals", {})
        # one backbone pass, differentiated: both the LM term and the heads train it
        hidden = backbone_hidden(params["backbone"], cfg, batch, remat)  # [B, T, H]
        logits = logits_from_hidden(cfg, params["backbone"], hidden)  # [B, T, V] float32
        targets, valid = next_token_targets(batch)  # [B, T]
        lm_total = totals.get("lm")
        nll, count = _masked_mean(token_nll(logits, targets), valid, lm_total)
        metrics = {"lm_nll": nll, "lm_count": count,
                   "lm_top1": _masked_mean(jnp.argmax(logits, -1) == targets, valid,
                                           lm_total)[0]}
        if loss_cfg.lm_loss == "kl":
            teacher = jax.lax.stop_gradient(params["teacher"])
            t_hidden = backbone_hidden(teacher, cfg, batch)
            t_logits = jax.lax.stop_gradient(logits_from_hidden(cfg, teacher, t_hidden))
            lm, _ = _masked_mean(token_kl(t_logits, logits), valid, lm_total)
            metrics["kl"] = lm
        else:
            lm = nll
        heads = params["heads"]
        if frozen_proj:
            heads = dict(heads, proj=jax.lax.stop_gradient(heads["proj"]))
        h_targets, h_valid = heads_targets(batch, heads["w"].shape[0])
        heads_loss, head_metrics = ml.heads_loss(heads, hidden, h_targets, h_valid,
                                                 loss_cfg.decay, chunk, totals.get("heads"),
                                                 batch_ways, train_proj=not frozen_proj)
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


def labels(params: Params, frozen_proj: bool = False) -> dict:
    """One optax partition per top-level subtree; the teacher is frozen (and, with
    `frozen_proj`, the heads' shared projection: only their residual blocks train)."""
    heads = {n: ("frozen" if n == "proj" else "heads") for n in params["heads"]} \
        if frozen_proj else "heads"
    names = {"backbone": "backbone", "heads": heads, "teacher": "frozen"}
    unknown = set(params) - set(names)
    if unknown:
        raise ValueError(f"unexpected parameter subtrees {sorted(unknown)}")
    return {k: names[k] for k in params}


def make_params(backbone: Params, heads: Params, lm_loss: str = "kl",
                teacher_dtype=None) -> Params:
    """{"backbone", "heads"} plus, for the KL loss, "teacher": a separate copy of the
    backbone (its own buffers: the train step donates the state, and two leaves sharing one
    buffer cannot both be donated), in `teacher_dtype` when given (it is only read: a
    bfloat16 run keeps it in bfloat16, half the float32 master weights' memory)."""
    params = {"backbone": backbone, "heads": heads}
    if lm_loss == "kl":
        params["teacher"] = jax.tree.map(
            lambda a: jnp.array(a, dtype=as_dtype(teacher_dtype or a.dtype), copy=True),
            backbone)
    return params


def make_joint_optimizer(opt: OptimConfig, total_steps: int, labels: dict,
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
        part = sharding.to_host(ev(original, finetuned, put_batch(batch)))
        for k, v in part.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    n = max(sums.get("count", 0.0), 1.0)
    ppl_o, ppl_f = math.exp(sums["nll_original"] / n), math.exp(sums["nll_finetuned"] / n)
    return {"tokens": int(sums["count"]), "ppl_original": ppl_o, "ppl_finetuned": ppl_f,
            "ppl_change": ppl_f / ppl_o - 1.0, "kl_mean": sums["kl"] / n}


# ----------------------------------------------------------------------------- the recipe


class Medusa2(trainer.Recipe):
    name = "medusa2"

    def backbone_dtypes(self, cfg):
        """The trained backbone keeps float32 master weights (and float32 Adam moments);
        --dtype is what it computes in (the frozen teacher is stored in it)."""
        return {"param_dtype": "float32", "compute_dtype": cfg.dtype}

    def setup(self, ctx: trainer.Context) -> None:
        """Heads first: --init, or a Medusa-1 run in <run>/stage1 (resumed if interrupted);
        then its self-distilled data is reused when the settings match."""
        cfg = ctx.cfg
        if cfg.init is not None:
            self.init = resolve_init(cfg.init)
            check_init_kind(cfg.init, self.init)
        else:
            self.init = self._stage1(cfg, ctx.run_dir)
        check_init_model(cfg, self.init)
        self.heads, _ = heads_formats.load_heads(self.init.heads, ctx.model_cfg)
        if "token_index" in self.heads:
            raise ValueError(f"--init {cfg.init}: these heads cover a reduced vocabulary "
                             f"(token_map); train.medusa2 trains full or shared-projection "
                             f"heads only")
        if cfg.shared_proj:
            check_shared(self.init.heads, self.heads["proj"].shape)
        reuse_distilled(self.init, ctx.run_dir)

    @staticmethod
    def _stage1(cfg: Medusa2Config, run_dir: Path) -> Init:
        stage_dir = run_dir / "stage1"
        if (stage_dir / "heads" / heads_lib.HEADS_FILE).is_file():
            print(f"stage 1 (heads only) already done: {stage_dir}", flush=True)
            return Init(heads=stage_dir / "heads", run_dir=stage_dir)
        ckpts = stage_dir / "checkpoints"
        resume = str(stage_dir) if ckpts.is_dir() and any(ckpts.iterdir()) else None
        print(f"stage 1: heads only, {cfg.stage1_steps} steps (train.medusa1 in {stage_dir})",
              flush=True)
        try:
            trainer.train(cfg.stage1_config(run_dir), Medusa1(), resume)
        except Interrupted as e:  # resuming means resuming the whole Medusa-2 run
            raise Interrupted(f"{str(e).split(';')[0]} of stage 1; continue with --resume "
                              f"{run_dir}", e.code - 128) from None
        print("stage 2: backbone and heads jointly", flush=True)
        return Init(heads=stage_dir / "heads", run_dir=stage_dir)

    def training_rows(self, ctx, rows):
        anchor = ctx.cfg.resolved_anchor_text
        if anchor is None:
            return rows
        report = data.LoadReport()
        docs = data.split_documents(data.read_file(anchor, "text", report), ctx.tokenizer,
                                     ctx.cfg.seq_len)
        a_rows = data.build(docs, ctx.tokenizer, seq_len=ctx.cfg.seq_len, template="plain",
                            seed=ctx.cfg.seed, report=report, what=f"--anchor-text {anchor}")
        print(f"anchor text (LM term only) {anchor}: {report.summary()}", flush=True)
        return data.concat([rows, a_rows], lm_only=[False, True])

    def build(self, ctx, total_steps):
        cfg = ctx.cfg
        lm_loss = cfg.resolved_lm_loss
        loss_cfg = self.loss_config(cfg, total_steps)
        # the state takes the backbone over (the train step donates its buffers); the original
        # stays as the frozen teacher (KL) or is reloaded for the final report
        params = make_params(ctx.backbone, self.heads, lm_loss,
                             teacher_dtype=ctx.model_cfg.compute_dtype)
        ctx.backbone, self.heads = None, None
        method = self.method(cfg, ctx.model_cfg, params, total_steps)
        print(f"joint training: {total_steps} steps, LM term {lm_loss}, heads weight "
              f"{cfg.head_schedule} {loss_cfg.peak_head_weight}, lr {cfg.lr:g} (backbone) / "
              f"{cfg.lr * cfg.head_lr_ratio:g} (heads)", flush=True)
        self.head_lr_ratio = cfg.head_lr_ratio
        return method

    def memory_params(self, cfg, model_cfg, backbone) -> Params:
        """The parameters `memory.training_memory` compiles with (under `jax.eval_shape`):
        fresh heads of --num-heads/--num-layers stand for the first stage's."""
        heads = heads_lib.init_heads(model_cfg, backbone,
                                     heads_lib.HeadsConfig(cfg.num_heads, cfg.num_layers),
                                     shared_proj=cfg.shared_proj)
        return make_params(backbone, heads, cfg.resolved_lm_loss,
                           teacher_dtype=model_cfg.compute_dtype)

    @staticmethod
    def loss_config(cfg, total_steps: int) -> LossConfig:
        return LossConfig(lm_loss=cfg.resolved_lm_loss, lm_weight=cfg.lm_weight,
                          head_schedule=cfg.head_schedule, head_weight=cfg.head_weight,
                          head_ramp_steps=total_steps, decay=cfg.loss_decay)

    @classmethod
    def method(cls, cfg, model_cfg, params: Params, total_steps: int) -> trainer.Method:
        """Labels, optimizer and loss for `params` (also what `memory` compiles)."""
        lbl = labels(params, cfg.shared_proj)
        tx, schedule = make_joint_optimizer(
            optim_config(cfg), total_steps, lbl,
            cfg.head_lr_ratio)
        num_heads = params["heads"]["w"].shape[0]
        loss_fn = make_loss_fn(model_cfg, cls.loss_config(cfg, total_steps),
                               chunk=cfg.loss_chunk, remat=cfg.remat,
                               batch_ways=cfg.batch_ways, frozen_proj=cfg.shared_proj)
        return trainer.Method(params, lbl, tx, schedule, loss_fn,
                              totals_fn=lambda batch: loss_totals(batch, num_heads),
                              mean_metrics=MEAN_METRICS)

    def batch(self, batch, step):
        return with_step(batch, step)

    def train_log(self, m):
        rec = {"lm_loss": float(m["lm_loss"]), "lm_nll": float(m["lm_nll"]),
               "heads_loss": float(m["heads_loss"]), "head_weight": float(m["head_weight"]),
               "lr_heads": float(m["lr"]) * self.head_lr_ratio}
        if "kl" in m:
            rec["kl"] = float(m["kl"])
        return rec

    def postfix(self, m):
        lm = f"kl={float(m['kl']):.4f}" if "kl" in m else f"nll={float(m['lm_nll']):.3f}"
        return f"{lm} heads={float(m['heads_loss']):.3f}"

    def artifact_extra(self, ctx):
        return {"stage": "medusa2", "backbone": str(ctx.run_dir / "model"),
                "init": str(self.init.heads)}

    def finish(self, ctx, state: TrainState, summary: dict) -> Params:
        """Export the fine-tuned backbone; report how far it moved from the original."""
        cfg, mcfg = ctx.cfg, ctx.model_cfg
        summary["init"] = str(self.init.heads)
        finetuned = sharding.to_host(state.params["backbone"])
        source = cfg.model or str(assets.model_dir())
        model_out = ctx.run_dir / "model"
        if distributed.is_writer():  # process 0 writes; every process computes the report
            weights.save_pretrained(mcfg, finetuned, model_out, source_dir=source)
            print(f"fine-tuned backbone (Hugging Face layout): {model_out} "
                  f"(the heads artifact is for this backbone)")
        if cfg.medusa2_folder and distributed.is_writer():
            folder = heads_formats.write_medusa2_model(
                ctx.run_dir / "medusa2_model", mcfg, finetuned,
                sharding.to_host(state.params["heads"]), source_dir=source)
            print(f"Medusa-2 model folder (reference layout, backbone + heads): {folder}")
        print("\noriginal vs fine-tuned model (next-token perplexity, KL):")
        # whole stories where the context allows (training rows may be shorter)
        text_rows, what = eval_text_rows(
            cfg, ctx.tokenizer, max(cfg.seq_len, min(mcfg.max_position_embeddings, 1024)))
        original = state.params["teacher"] if "teacher" in state.params else \
            weights.load_pretrained(cfg.model, **self.backbone_dtypes(cfg))[1]
        closeness = {}
        if text_rows is not None:
            closeness["eval_text"] = dict(lm_report(
                mcfg, original, state.params["backbone"], text_rows, cfg.batch_size, ctx.put),
                source=what)
            print_lm_report(f"held-out text [{what}]", closeness["eval_text"])
        else:
            print(f"  held-out text: skipped ({what})")
        if ctx.held_rows is not None:
            closeness["heldout"] = lm_report(mcfg, original, state.params["backbone"],
                                             ctx.held_rows, cfg.batch_size, ctx.put)
            print_lm_report("held-out set (label tokens)", closeness["heldout"])
        summary["closeness"] = closeness
        num_heads = heads_lib.heads_config_of(state.params["heads"]).num_heads
        trees = ",".join(t.name for t in trainer.benchmark_trees(cfg, num_heads))
        print(f"compare: python -m infer.bench --model {model_out} --heads "
              f"{ctx.run_dir / 'heads'} --trees {trees}")
        return finetuned


def reuse_distilled(init: Init, run_dir: Path):
    """Copy the first stage's self-distilled data (and its settings sidecar) into this run:
    `distill.distill_cached` then reuses it when the settings match, and regenerates in this
    run's directory (never the other run's) when they do not."""
    if init.run_dir is None or init.run_dir.resolve() == run_dir.resolve():
        return
    src, dst = init.run_dir / "distill", run_dir / "distill"
    if not src.is_dir():
        return
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name.endswith((".jsonl", ".jsonl.meta.json")) and \
                not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)


def check_init_kind(flag_value, init: Init):
    """--init gives Medusa heads: Hydra heads and EAGLE-3 drafters are refused from their
    config or header, before their tensors are read and before any data is distilled."""
    kind = heads_formats.kind_at(init.heads)
    if kind != "medusa":
        what, trainer_cmd = (("Hydra heads", "train.hydra") if kind == "hydra" else
                             ("an EAGLE-3 drafter", "train.eagle"))
        raise ValueError(f"--init {flag_value}: holds {what}; train.medusa2 fine-tunes the "
                         f"backbone with Medusa heads (train {what} with python -m "
                         f"{trainer_cmd})")


def check_init_model(cfg: Medusa2Config, init: Init):
    """A Medusa-1 run trained on another backbone is refused (its heads would not match)."""
    if init.run_dir is None or not (init.run_dir / "config.json").is_file():
        return
    try:
        theirs = json.loads((init.run_dir / "config.json").read_text()).get("model")
    except json.JSONDecodeError:
        return
    where = lambda m: None if m is None else Path(m).resolve()  # noqa: E731
    if where(theirs) != where(cfg.model):
        raise ValueError(f"--init {init.run_dir}: trained on model {theirs or 'stories260K'}, "
                         f"this run uses {cfg.model or 'stories260K'}")


def eval_text_rows(cfg: Medusa2Config, tokenizer, seq_len: int) -> tuple[data.Packed | None, str]:
    """(packed rows, description) of the perplexity text; (None, why) when there is none.
    Documents longer than `seq_len` tokens are cut there (and counted)."""
    if cfg.eval_text is not None:
        convs = data.read_file(cfg.eval_text, "text")
        what = f"{cfg.eval_text} ({len(convs)} documents)"
    elif assets.is_embedded(cfg.model):
        file = assets.text_file("heldout")
        convs = data.read_file(file, "text")
        what = f"{len(convs)} held-out TinyStories stories, {file.name}"
    else:
        return None, "no --eval-text given for this model"
    report = data.LoadReport()
    rows = data.build(convs, tokenizer, seq_len=seq_len, template="plain", seed=cfg.seed,
                      report=report, what="evaluation text")
    if report.truncated:
        what += f"; {report.truncated} cut to {seq_len} tokens"
    return rows, what


def print_lm_report(title: str, r: dict):
    print(f"  {title}: {r['tokens']} tokens, perplexity {r['ppl_original']:.4f} (original) -> "
          f"{r['ppl_finetuned']:.4f} (fine-tuned), {100 * r['ppl_change']:+.2f}%; "
          f"mean KL(original || fine-tuned) {r['kl_mean']:.5f} nats/token")
