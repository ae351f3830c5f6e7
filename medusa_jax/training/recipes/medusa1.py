"""Medusa-1: the backbone is frozen; only the heads train, on its last hidden state.

The loss is `medusa_loss.medusa1_loss_fn` (sum over heads of decay**k * CE_k, the backbone
under stop_gradient; a soft `--target`: the backbone's own distribution, `training.targets`)
and the optimizer `training.step.make_optimizer` (AdamW on the heads, `set_to_zero` and no
state for the backbone). The loop is `trainer.train`.
"""

from __future__ import annotations

import numpy as np

from medusa_jax.drafters.medusa import heads as heads_lib
from medusa_jax.training import step as ts
from medusa_jax.training.config import DEFAULT_LR, SELF_DISTILL_LR, Medusa1Config  # noqa: F401
from medusa_jax.training.recipes import medusa_loss as ml
from medusa_jax.training.trainer import Context, Method, Recipe


def check_reduced_vocab(cfg: Medusa1Config, vocab: int):
    if cfg.reduced_vocab >= vocab:
        raise ValueError(f"--reduced-vocab {cfg.reduced_vocab} is not below the model's "
                         f"vocabulary of {vocab} tokens")


class Medusa1(Recipe):
    name = "medusa1"
    token_map = None  # [T] token ids of the reduced vocabulary (--reduced-vocab)

    def setup(self, ctx: Context) -> None:
        check_reduced_vocab(ctx.cfg, ctx.model_cfg.vocab_size)

    def training_rows(self, ctx: Context, rows):
        if ctx.cfg.reduced_vocab:
            # from the training rows alone (not the held-out ones), so a resumed run, which
            # reads the same rows, rebuilds the same map
            self.token_map, covered = ml.frequent_tokens(
                rows.tokens, rows.loss_mask & (rows.segments > 0), ctx.model_cfg.vocab_size,
                ctx.cfg.reduced_vocab)
            print(f"reduced vocabulary: the {len(self.token_map)} most frequent of "
                  f"{ctx.model_cfg.vocab_size} tokens cover {covered:.1%} of the training "
                  f"labels", flush=True)
        return rows

    def build(self, ctx: Context, total_steps: int) -> Method:
        params = self.params(ctx.cfg, ctx.model_cfg, ctx.backbone, self.token_map)
        return self.method(ctx.cfg, ctx.model_cfg, params, total_steps, self.token_map)

    def heads_artifact(self, ctx: Context, heads: dict) -> dict:
        if self.token_map is None:
            return heads
        return dict(heads, token_index=ml.reduced_token_index(self.token_map,
                                                              ctx.model_cfg.vocab_size))

    @staticmethod
    def params(cfg: Medusa1Config, model_cfg, backbone, token_map=None) -> dict:
        """{"backbone", "heads"}: fresh heads on `backbone` (arrays, or shapes under
        `jax.eval_shape`); with --reduced-vocab, their projection's columns `token_map`."""
        heads = heads_lib.init_heads(model_cfg, backbone,
                                     heads_lib.HeadsConfig(cfg.num_heads, cfg.num_layers),
                                     shared_proj=cfg.shared_proj)
        if cfg.reduced_vocab:
            heads = ml.reduce_heads(heads, placeholder_map(cfg, token_map))
        return {"backbone": backbone, "heads": heads}

    def memory_params(self, cfg: Medusa1Config, model_cfg, backbone) -> dict:
        """The parameters `memory.training_memory` compiles with (under `jax.eval_shape`)."""
        check_reduced_vocab(cfg, model_cfg.vocab_size)
        return self.params(cfg, model_cfg, backbone)

    @staticmethod
    def method(cfg: Medusa1Config, model_cfg, params: dict, total_steps: int,
               token_map=None) -> Method:
        """Labels, optimizer and loss for `params` (also what `memory` compiles, with a
        placeholder map of the same size when the vocabulary is reduced)."""
        frozen_proj = cfg.shared_proj
        labels = ml.medusa1_labels(params, frozen_proj)
        tx, schedule = ts.make_optimizer(ts.optim_config(cfg), total_steps, labels)
        num_heads = params["heads"]["w"].shape[0]
        return Method(params, labels, tx, schedule,
                      ml.medusa1_loss_fn(model_cfg, cfg.loss_decay, cfg.loss_chunk,
                                         cfg.batch_ways, frozen_proj,
                                         placeholder_map(cfg, token_map)
                                         if cfg.reduced_vocab else None,
                                         cfg.target, cfg.target_temperature),
                      totals_fn=lambda batch: ml.medusa_totals(batch, num_heads))


def placeholder_map(cfg: Medusa1Config, token_map):
    """`token_map`, or tokens 0..N-1 where only its size matters (the memory report)."""
    return np.arange(cfg.reduced_vocab, dtype=np.int32) if token_map is None else token_map
