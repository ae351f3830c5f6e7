"""Hydra training: a recipe of the one trainer (`trainer.train`), the backbone frozen.

Head i at position t reads h_t and the backbone's embeddings of tokens t+1 .. t+i+1 (the path
teacher-forced from the data) and is trained on token t+i+2: the same targets, validity,
per-head means and decay weights as Medusa-1 (`medusa_loss.medusa_targets`, `medusa_loss`),
so the held-out accuracy of head i is conditional on the true path above it. With
`--teacher-loss` (Hydra++'s) the hard label is replaced by the soft cross-entropy against
the frozen base model's own distribution at the target position; `--target` trains
against that distribution with the other objectives (`training.targets`). Data,
self-distillation, Orbax checkpoints, resume, signals, meshes and the report are the
trainer's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from medusa_jax.drafters.hydra import heads as hydra
from medusa_jax.model.backbone import logits_from_hidden
from medusa_jax.model.config import ModelConfig
from medusa_jax.training import step as ts
from medusa_jax.training import targets as soft_targets
from medusa_jax.training.config import HydraConfig  # noqa: F401 - re-exported
from medusa_jax.training.recipes import medusa_loss as ml
from medusa_jax.training.trainer import Context, Method, Recipe


def teacher_ce(head_logits: jax.Array, base_logits: jax.Array, valid: jax.Array,
               decay: float, count: jax.Array | None = None) -> jax.Array:
    """Hydra++'s loss: head_logits [K, B, T, V], the base model's logits [B, T, V] (of the
    token after each position), valid [K, B, T] -> sum_i decay**(i+1) * mean soft CE of
    head i at t against the base model's distribution of token t+i+2."""
    k = head_logits.shape[0]
    losses = []
    for i in range(k):
        p = jax.nn.softmax(jnp.roll(base_logits, -(i + 1), axis=1), axis=-1)  # [B, T, V]
        ce = -jnp.sum(p * jax.nn.log_softmax(head_logits[i], axis=-1), axis=-1)
        losses.append(jnp.sum(ce * valid[i]))
    denom = jnp.maximum(jnp.sum(valid.astype(jnp.float32), axis=(1, 2))
                        if count is None else count, 1.0)
    weights = decay ** jnp.arange(1, k + 1, dtype=jnp.float32)
    return jnp.sum(weights * jnp.stack(losses) / denom)


def hydra_loss_fn(cfg: ModelConfig, decay: float = 0.8, batch_ways: int = 1,
                  teacher_loss: bool = False, target: str = "hard",
                  temperature: float = 1.0):
    """(params {"backbone", "heads"}, batch) -> (loss, metrics): Hydra heads on a frozen
    backbone's last hidden states and input embeddings, paths teacher-forced. `target`
    (`training.targets`): a soft target against the backbone's distribution at the target
    position, at `temperature` (the backbone's logits [B, T, V] are made once, unchunked)."""

    def loss_fn(params, batch):
        backbone = jax.lax.stop_gradient(params["backbone"])
        hidden = ts.frozen_hidden(backbone, cfg, batch, batch_ways)  # [B, T, H]
        emb = hydra.embed(backbone["embed"], batch["tokens"], hidden.dtype)
        heads = params["heads"]
        targets, valid = ml.medusa_targets(batch, hydra.config_of(heads)[0])
        logits = hydra.teacher_forced_logits(heads, hidden, emb)  # [K, B, T, V]
        count = batch.get("totals", {}).get("heads")
        if target != "hard":
            base = jax.lax.stop_gradient(logits_from_hidden(cfg, backbone, hidden))
            return soft_targets.shifted_soft_loss(logits, base, targets, valid, decay, target,
                                                  temperature, count)
        loss, metrics = ml.medusa_loss(logits, targets, valid, decay, count)
        if teacher_loss:
            base = jax.lax.stop_gradient(logits_from_hidden(cfg, backbone, hidden))
            loss = teacher_ce(logits, base, valid, decay, count)
            metrics = dict(metrics, loss=loss)
        return loss, metrics

    return loss_fn


class Hydra(Recipe):
    name = "hydra"

    def build(self, ctx: Context, total_steps: int) -> Method:
        return self.method(ctx.cfg, ctx.model_cfg, self.params(ctx.cfg, ctx.model_cfg,
                                                               ctx.backbone), total_steps)

    @staticmethod
    def params(cfg: HydraConfig, model_cfg, backbone) -> dict:
        return {"backbone": backbone,
                "heads": hydra.init_hydra(model_cfg, backbone, cfg.num_heads, cfg.num_layers)}

    def memory_params(self, cfg: HydraConfig, model_cfg, backbone) -> dict:
        return self.params(cfg, model_cfg, backbone)

    @staticmethod
    def method(cfg: HydraConfig, model_cfg, params: dict, total_steps: int) -> Method:
        labels = ts.heads_trained(params)
        tx, schedule = ts.make_optimizer(ts.optim_config(cfg), total_steps, labels)
        num_heads = hydra.config_of(params["heads"])[0]
        return Method(params, labels, tx, schedule,
                      hydra_loss_fn(model_cfg, cfg.loss_decay, cfg.batch_ways,
                                    cfg.teacher_loss, cfg.target, cfg.target_temperature),
                      totals_fn=lambda batch: ml.medusa_totals(batch, num_heads))

    def artifact_extra(self, ctx: Context) -> dict:
        return {"kind": hydra.KIND}
