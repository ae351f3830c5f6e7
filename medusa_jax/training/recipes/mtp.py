"""Multi-token-prediction training: a recipe of the one trainer (`trainer.train`), post hoc
on a frozen backbone, with MaxText's loss (`layers/multi_token_prediction.py`).

The frozen backbone runs once over the batch and gives its final hidden states; the D
modules then run over the whole sequence, chained (`drafters.mtp.heads.chain_hidden`):
module k at position t reads module k-1's output at t (the backbone's state for k = 0) and
the embedding of token t+k+1 (teacher-forced from the data), and is scored on token t+k+2
through its final norm and the backbone's output head. The loss is each depth's
cross-entropy averaged over its counted tokens, then averaged over the depths (MaxText's,
without its `mtp_loss_scaling_factor`: here the modules' loss is the only one). A soft
`--target` (`training.targets`) replaces each depth's cross-entropy by `soft_loss` against the
frozen backbone's distribution at t+k+1, the position whose logits predict the same token
t+k+2 (the backbone's logits [B, T, V] are made once, unchunked, as each depth's are).

Packed rows: attention stays inside each example and rotary positions restart with it;
depth k at t counts only where token t+k+2 is a label of t's own example (`depth_masks`).
Metrics per depth: top-1 / top-5 = the data's token is the module's best / among its
best 5, over the counted positions.

The modules start as MTP checkpoints do when trained after the fact: each decoder layer a
copy of the backbone's last layer, the norms at one, eh_proj small and random.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.drafters.mtp import heads as mtp
from medusa_jax.drafters.mtp.drafter import bind
from medusa_jax.model.backbone import Params, logits_from_hidden
from medusa_jax.model.config import ModelConfig
from medusa_jax.training import step as ts
from medusa_jax.training import targets as soft_targets
from medusa_jax.training.recipes.mtp_config import MtpConfig  # noqa: F401 - re-exported
from medusa_jax.training.trainer import Context, Method, Recipe

TOP_K = 5


depth_masks = ts.ahead_masks  # depth k at t: token t+k+2 a label of t's own example


def mtp_loss_fn(model_cfg: ModelConfig, depths: int, style: str, batch_ways: int = 1,
                target: str = "hard", temperature: float = 1.0):
    """(params {"backbone", "heads"}, batch) -> (loss, metrics). With gradient accumulation
    (batch["totals"]: `mtp_totals` of the whole batch) the micro-batches' losses and
    metrics add up to the whole batch's. `target` (`training.targets`): hard = the data's
    token; a soft one = the backbone's distribution at t+k+1 for depth k at t, at
    `temperature`. The metrics are the data's token's either way."""
    if target != "hard" and target not in soft_targets.SOFT:
        raise ValueError(f"not a target: {target!r}")

    def loss_fn(params, batch):
        backbone = jax.lax.stop_gradient(params["backbone"])
        hidden = ts.frozen_hidden(backbone, model_cfg, batch, batch_ways).astype(jnp.float32)
        heads = params["heads"]
        tokens, seg = batch["tokens"], batch["segments"]
        outs = mtp.chain_hidden(backbone, model_cfg, heads, hidden, tokens, depths, style,
                                segments=seg, positions=batch["positions"])
        masks = depth_masks(batch, depths)
        own = jnp.sum(masks, axis=(1, 2))  # [D]
        count = batch.get("totals", {}).get("depths", own)
        denom = jnp.maximum(count, 1.0)
        if target != "hard":
            base = jax.lax.stop_gradient(logits_from_hidden(model_cfg, backbone, hidden))
        losses, top1, top5 = [], [], []
        for k, out in enumerate(outs):
            logits = mtp.logits(backbone, model_cfg, heads, min(k, mtp.num_modules(heads) - 1),
                                out)  # [B, T, V]
            label = mtp.shift(tokens, k + 2)
            if target == "hard":
                logp = jax.nn.log_softmax(logits, axis=-1)
                loss = -jnp.take_along_axis(logp, label[..., None], axis=-1)[..., 0]
            else:  # t+k+1 lies in t's example wherever depth k at t counts (t+k+2 does)
                loss = soft_targets.soft_loss(logits, mtp.shift(base, k + 1), target,
                                              temperature)
            losses.append(jnp.sum(loss * masks[k]) / denom[k])
            _, top = jax.lax.top_k(jax.lax.stop_gradient(logits), TOP_K)
            hit = top == label[..., None]
            top1.append(jnp.sum(hit[..., 0] * masks[k]) / denom[k])
            top5.append(jnp.sum(jnp.any(hit, -1) * masks[k]) / denom[k])
        losses = jnp.stack(losses)
        loss = jnp.mean(losses)
        return loss, {"loss": loss, "head_loss": losses, "top1": jnp.stack(top1),
                      "top5": jnp.stack(top5), "count": own}

    return loss_fn


def mtp_totals(batch: dict, depths: int) -> dict:
    """The whole batch's denominators (gradient accumulation): each depth's counted tokens."""
    return {"depths": jnp.sum(depth_masks(batch, depths), axis=(1, 2))}


def init_from_backbone(key: jax.Array, model_cfg: ModelConfig, backbone: Params,
                       modules: int) -> Params:
    """Fresh modules (`mtp.init_mtp`) whose decoder layers are copies of the backbone's
    last layer (its stacked training layout)."""
    heads = mtp.init_mtp(key, model_cfg, modules)
    layers = backbone["layers"]
    for n in list(heads):
        if n.startswith(mtp.LAYER):
            last = jnp.asarray(layers[n[len(mtp.LAYER):]][-1], jnp.float32)
            heads[n] = jnp.broadcast_to(last, heads[n].shape)
    return heads


class Mtp(Recipe):
    name = "mtp"
    head_label = "depth"

    def build(self, ctx: Context, total_steps: int) -> Method:
        return self.method(ctx.cfg, ctx.model_cfg, self.params(ctx.cfg, ctx.model_cfg,
                                                               ctx.backbone), total_steps)

    def num_heads(self, ctx: Context, heads: Params) -> int:
        return ctx.cfg.num_heads

    def tree_depth(self, ctx: Context, heads: Params) -> None:
        return None  # any depth: the last module is reused

    @staticmethod
    def params(cfg: MtpConfig, model_cfg: ModelConfig, backbone: Params) -> dict:
        heads = init_from_backbone(jax.random.key(cfg.seed), model_cfg, backbone, cfg.num_heads)
        return {"backbone": backbone, "heads": heads}

    def memory_params(self, cfg: MtpConfig, model_cfg, backbone) -> dict:
        return self.params(cfg, model_cfg, backbone)

    @staticmethod
    def method(cfg: MtpConfig, model_cfg: ModelConfig, params: dict, total_steps: int
               ) -> Method:
        labels = ts.heads_trained(params)
        tx, schedule = ts.make_optimizer(ts.optim_config(cfg), total_steps, labels)
        depths = cfg.num_heads
        return Method(params, labels, tx, schedule,
                      mtp_loss_fn(model_cfg, depths, cfg.style, cfg.batch_ways, cfg.target,
                                  cfg.target_temperature),
                      totals_fn=lambda batch: mtp_totals(batch, depths))

    def memory_heads(self, cfg: MtpConfig) -> str:
        return f"{cfg.num_heads} MTP modules ({cfg.style} style)"

    def heads_artifact(self, ctx: Context, heads: Params) -> Params:
        out = {n: np.asarray(a, np.float32) for n, a in heads.items()}
        return bind(out, ctx.model_cfg, ctx.cfg.style)

    def artifact_extra(self, ctx: Context) -> dict:
        return {"kind": mtp.KIND, "style": ctx.cfg.style, "modules": ctx.cfg.num_heads}
