"""EAGLE-3 training: a recipe of the one trainer (`trainer.train`), the backbone frozen.

The drafter (`drafters.eagle3.heads`: one decoder layer of its own over the residual stream
entering three backbone layers, `--aux-layers`) is trained with the reference's
training-time test (`ttt_loss`, SafeAILab/EAGLE's traineagle3): the frozen backbone
runs once over the batch and gives the aux features [B, T, 3H] and its logits at every
position; the drafter then runs `--ttt-steps` times over the whole sequence, each time on
its own previous outputs, step i at position t reading token t+i+1 and guessing token t+i+2
against the backbone's distribution (restricted to the draft vocabulary), step i's loss
weighted `--loss-decay`**i.

- The logits are `eagle3.ttt_logits`'; the loss (`ttt_loss`) is the reference's with the
  backbone's side computed once for every step (the same values and gradients as the
  reference's form, which tests/training/test_eagle_train.py keeps as its oracle).
- Packed rows, as the other recipes train on: the backbone's pass follows the segments and
  positions, and so does the training-time test: step 0's attention stays inside the
  query's example (`ttt_logits(segments=...)`), rotary positions restart with each
  example, and step i at t counts only when its target, token t+i+2, is a label of t's own
  example (`step_masks`): the drafter never attends across examples nor is scored on a
  guess of the next one. (The reference counts the label-ness of token t+i instead; the
  two agree inside an answer.)
- The draft vocabulary (`--draft-vocab`, default min(V, 32000)) is the most frequent label
  tokens of the training rows (`eagle3.vocab_maps`, as the reference's `scandata`), so a
  resumed run, which reads the same rows, rebuilds the same one.
- Metrics: per training-time-test step, top-1 and top-5 = the backbone's greedy token is
  among the drafter's best 1 / 5 (mapped to target ids), over the counted positions; a
  target outside the draft vocabulary is a miss. The trainer reports them per "step".
- `d2t`/`t2d` ride in the trained parameters as float32 copies labelled frozen (gradients
  are taken of the whole tree, which cannot hold integers); the artifact holds them as the
  drafter's int32 / bool, bound to the drafter's configuration (`heads_artifact`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.drafters.eagle3 import heads as eagle3
from medusa_jax.drafters.eagle3.drafter import bind
from medusa_jax.model import backbone as backbone_lib
from medusa_jax.model.backbone import KVCache, Params, forward_uncommitted
from medusa_jax.model.config import ModelConfig
from medusa_jax.text import data
from medusa_jax.training import step as ts
from medusa_jax.training.config import EagleConfig  # noqa: F401 - re-exported
from medusa_jax.training.trainer import Context, Method, Recipe

MAPS = ("d2t", "t2d")  # constants of the drafter, frozen in the training state
TOP_K = 5


# ----------------------------------------------------------------------------- data


def label_counts(rows: data.Packed, vocab: int) -> np.ndarray:
    """[V] how often each token is a label (an assistant token) of the rows."""
    tokens = rows.tokens[rows.loss_mask & (rows.segments > 0)]
    return np.bincount(tokens.ravel(), minlength=vocab)[:vocab]


# ----------------------------------------------------------------------------- the test


def ttt_loss(heads: Params, c: eagle3.Eagle3Config, logits: jax.Array,
             target_logits: jax.Array, masks: jax.Array,
             decay: float = eagle3.TTT_DECAY, target: str = "kl",
             temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """The reference trainer's loss from the training-time test's logits [S, B, T, Vd]
    (`eagle3.ttt_logits`) -> (the loss, the per-step losses [S]): sum_i decay**i * loss_i,
    loss_i the soft cross-entropy of step i's draft distribution against the backbone's
    softmax restricted to the draft vocabulary, averaged over all B*T positions, counting
    the positions of `masks` [S, B, T] (`step_masks`) where the backbone's argmax is in the
    draft vocabulary. The backbone's side (its argmax, whether that is in the draft
    vocabulary, its softmax over the draft vocabulary) is computed once and moved i + 1
    positions for step i. Equal to SafeAILab/EAGLE's loss on rows of one example each
    (tests/training/test_eagle_train.py against the reference's form kept there).

    `target` (`training.targets`): kl is that soft cross-entropy (KL(p || q) plus p's
    entropy, the same gradient); tv 0.5 * sum |p - q|; tv+kl their sum; hard the
    cross-entropy of the backbone's greedy token. p = softmax(backbone / T) over the draft
    vocabulary, q = softmax(drafter / T), T = `temperature` (1: the reference's)."""
    steps = logits.shape[0]
    tgt = jax.lax.stop_gradient(target_logits.astype(jnp.float32))
    in_draft = jnp.asarray(heads["t2d"], bool)[jnp.argmax(tgt, axis=-1)]  # [B, T]
    if c.draft_vocab_size != c.vocab_size:  # (the whole vocabulary: d2t is all zeros)
        tgt = tgt[..., eagle3.target_ids(heads)]
    if target == "hard":  # where it counts, the greedy token is in the draft vocabulary
        target_p = jax.nn.one_hot(jnp.argmax(tgt, axis=-1), tgt.shape[-1])
    else:
        target_p = jax.nn.softmax(tgt / temperature, axis=-1)  # [B, T, Vd]
    losses = []
    for i in range(steps):
        pos = eagle3.shift(in_draft.astype(jnp.float32), i + 1) * masks[i]
        logp = jax.nn.log_softmax(logits[i] / temperature, axis=-1)
        p = eagle3.shift(target_p, i + 1)
        terms = []  # each [B, T]
        if target in ("hard", "kl", "tv+kl"):
            terms.append(-jnp.sum(p * logp, axis=-1))
        if target in ("tv", "tv+kl"):
            terms.append(0.5 * jnp.sum(jnp.abs(p - jnp.exp(logp)), axis=-1))
        ce = terms[0] if len(terms) == 1 else terms[0] + terms[1]
        losses.append(jnp.mean(pos * ce))
    losses = jnp.stack(losses)
    return jnp.sum(decay ** jnp.arange(steps, dtype=jnp.float32) * losses), losses


# ----------------------------------------------------------------------------- loss


def backbone_features(params: Params, cfg: ModelConfig, batch: dict, aux_layers: tuple
                      ) -> tuple[jax.Array, jax.Array]:
    """One pass of the backbone over a packed batch -> (the inputs of `aux_layers`
    concatenated [B, T, 3H], its logits [B, T, V] float32)."""
    b, t = batch["tokens"].shape
    cache = KVCache.init(cfg, b, t)  # scratch: training attends within the batch only
    logits, _, _, aux = forward_uncommitted(
        params, cfg, batch["tokens"], batch["positions"], ts.packed_mask(batch["segments"]),
        cache, return_logits=True, empty_cache=True, aux_layers=aux_layers)
    return aux, logits


def frozen_features(params: Params, cfg: ModelConfig, batch: dict, aux_layers: tuple,
                    batch_ways: int = 1) -> tuple[jax.Array, jax.Array]:
    """`backbone_features` of a frozen backbone (no gradient), a few rows at a time in a
    `lax.map` when one pass's attention scores would be large (as `step.frozen_hidden`:
    pass j takes rows j, j + n, ..., so each device keeps its own rows)."""
    params = jax.lax.stop_gradient(params)
    b, t = batch["tokens"].shape
    local = max(1, b // batch_ways)
    n = local // ts.frozen_pass_rows(cfg, local, t)
    if n == 1:
        out = backbone_features(params, cfg, batch, aux_layers)
    else:
        keys = ("tokens", "positions", "segments")
        parts = {k: batch[k].reshape(b // n, n, t).swapaxes(0, 1) for k in keys}
        out = jax.lax.map(lambda part: backbone_features(params, cfg, part, aux_layers), parts)
        out = tuple(x.swapaxes(0, 1).reshape(b, t, -1) for x in out)
    return jax.lax.stop_gradient(out)


def embed_table(cfg: ModelConfig, params: Params) -> jax.Array:
    """[V, H] the backbone's embedding of every id as layer 0 reads it (`embed_tokens`:
    Gemma's scaled by sqrt(H); a Llama's is params["embed"])."""
    ids = jnp.arange(cfg.vocab_size, dtype=jnp.int32)[None]
    return jax.lax.stop_gradient(backbone_lib.embed_tokens(cfg, params, ids)[0])


step_masks = ts.ahead_masks  # step i at t: token t+i+2 a label of t's own example


def ttt_hits(heads: Params, logits: jax.Array, target_logits: jax.Array, k: int = TOP_K
             ) -> tuple[jax.Array, jax.Array]:
    """logits [S, B, T, Vd] of the training-time test, the backbone's [B, T, V] -> top-1 and
    top-5 hits [S, B, T] float32: the backbone's greedy token for step i at t (its argmax at
    t+i+1) is the drafter's best / among its best k (draft ids mapped to target ids; a
    target outside the draft vocabulary is never hit)."""
    steps = logits.shape[0]
    greedy = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, T]
    want = jnp.stack([eagle3.shift(greedy, i + 1) for i in range(steps)])  # [S, B, T]
    _, top = jax.lax.top_k(logits, min(k, logits.shape[-1]))  # [S, B, T, k] draft ids
    top = eagle3.to_target(heads, top.astype(jnp.int32))
    match = top == want[..., None]
    return match[..., 0].astype(jnp.float32), jnp.any(match, axis=-1).astype(jnp.float32)


def drafter_of(heads: Params) -> Params:
    """The trained parameters as the drafter reads them: d2t int32, t2d bool."""
    maps = jax.lax.stop_gradient({n: heads[n] for n in MAPS})
    return dict(heads, d2t=jnp.round(maps["d2t"]).astype(jnp.int32), t2d=maps["t2d"] > 0.5)


def eagle3_loss_fn(model_cfg: ModelConfig, c: eagle3.Eagle3Config, steps: int, decay: float,
                   batch_ways: int = 1, target: str = "kl", temperature: float = 1.0):
    """(params {"backbone", "heads"}, batch) -> (loss, metrics): the training-time test of
    an EAGLE-3 drafter on a frozen backbone (packed rows: `ttt_logits` and `step_masks`
    follow the segments).

    With gradient accumulation (batch["totals"]: `eagle3_totals` of the whole batch) the
    micro-batches' losses and metrics add up to the whole batch's."""
    aux_layers = tuple(c.aux_layers)

    def loss_fn(params, batch):
        backbone = jax.lax.stop_gradient(params["backbone"])
        aux, base = frozen_features(backbone, model_cfg, batch, aux_layers, batch_ways)
        heads = drafter_of(params["heads"])
        table = embed_table(model_cfg, backbone)
        aux = aux.astype(jnp.float32)
        tokens, seg = batch["tokens"], batch["segments"]
        masks = step_masks(batch, steps)
        logits = eagle3.ttt_logits(heads, c, table, aux, tokens, seg > 0, steps,
                                   segments=seg, positions=batch["positions"])
        loss, losses = ttt_loss(heads, c, logits, base, masks, decay, target, temperature)
        top1, top5 = ttt_hits(heads, jax.lax.stop_gradient(logits), base)
        own = jnp.sum(masks, axis=(1, 2))  # [S]
        b, t = tokens.shape
        totals = batch.get("totals", {})
        count = totals.get("steps", own)
        denom = jnp.maximum(count, 1.0)
        scale = b / totals["rows"] if "rows" in totals else 1.0
        loss = loss * scale
        metrics = {
            "loss": loss,
            # ttt_loss's step losses are means over all B*T positions: per counted one here
            "head_loss": losses * (b * t) / denom,
            "top1": jnp.sum(top1 * masks, axis=(1, 2)) / denom,
            "top5": jnp.sum(top5 * masks, axis=(1, 2)) / denom,
            "count": own,
        }
        return loss, metrics

    return loss_fn


def eagle3_totals(batch: dict, steps: int) -> dict:
    """The whole batch's denominators (gradient accumulation): its rows (ttt_loss's means
    are over every position) and each step's counted positions."""
    masks = step_masks(batch, steps)
    return {"rows": jnp.float32(batch["tokens"].shape[0]),
            "steps": jnp.sum(masks, axis=(1, 2))}


# ----------------------------------------------------------------------------- the recipe


class Eagle3(Recipe):
    name = "eagle3"
    head_label = "step"
    config: eagle3.Eagle3Config | None = None  # the drafter's (setup)
    counts: np.ndarray | None = None  # [V] label-token counts of the training rows

    def setup(self, ctx: Context) -> None:
        aux, vd = ctx.cfg.drafter_shape(ctx.model_cfg)
        self.config = eagle3.default_config(ctx.model_cfg, vd, aux)
        print(f"EAGLE-3 drafter: reads the inputs of backbone layers {list(aux)} of "
              f"{ctx.model_cfg.num_layers}; draft vocabulary {vd} of "
              f"{ctx.model_cfg.vocab_size}; training-time test over {ctx.cfg.ttt_steps} "
              f"steps", flush=True)

    def training_rows(self, ctx: Context, rows: data.Packed) -> data.Packed:
        out = rows  # packed: the training-time test follows the segments (`step_masks`)
        # from the training rows alone, so a resumed run rebuilds the same vocabulary
        self.counts = label_counts(out, ctx.model_cfg.vocab_size)
        vd = self.config.draft_vocab_size
        if vd < ctx.model_cfg.vocab_size:
            _, t2d = eagle3.vocab_maps(self.counts, vd)
            covered = self.counts[t2d].sum() / max(self.counts.sum(), 1)
            print(f"draft vocabulary: the {vd} most frequent of {ctx.model_cfg.vocab_size} "
                  f"tokens cover {covered:.1%} of the training labels", flush=True)
        return out

    def build(self, ctx: Context, total_steps: int) -> Method:
        params = self.params(ctx.cfg, ctx.model_cfg, ctx.backbone, self.config, self.counts)
        return self.method(ctx.cfg, ctx.model_cfg, params, total_steps, self.config)

    def num_heads(self, ctx: Context, heads: Params) -> int:
        return ctx.cfg.ttt_steps

    def tree_depth(self, ctx: Context, heads: Params) -> None:
        return None  # any depth: the drafter runs on its own outputs

    @staticmethod
    def params(cfg: EagleConfig, model_cfg: ModelConfig, backbone: Params,
               c: eagle3.Eagle3Config, counts=None) -> dict:
        """{"backbone", "heads"}: a fresh drafter (`init_eagle3`, seeded by --seed), its
        d2t/t2d as float32 (see the module's docstring)."""
        heads = eagle3.init_eagle3(jax.random.key(cfg.seed), c, counts)
        heads = dict(heads, **{n: jnp.asarray(heads[n], jnp.float32) for n in MAPS})
        return {"backbone": backbone, "heads": heads}

    @staticmethod
    def labels(params: dict) -> dict:
        """The backbone and the drafter's d2t/t2d frozen, its weights trained."""
        heads = {n: ("frozen" if n in MAPS else "train") for n in params["heads"]}
        return {name: (heads if name == "heads" else "frozen") for name in params}

    @classmethod
    def method(cls, cfg: EagleConfig, model_cfg: ModelConfig, params: dict, total_steps: int,
               c: eagle3.Eagle3Config) -> Method:
        labels = cls.labels(params)
        tx, schedule = ts.make_optimizer(ts.optim_config(cfg), total_steps, labels)
        steps = cfg.ttt_steps
        return Method(params, labels, tx, schedule,
                      eagle3_loss_fn(model_cfg, c, steps, cfg.loss_decay, cfg.batch_ways,
                                     cfg.target, cfg.target_temperature),
                      totals_fn=lambda batch: eagle3_totals(batch, steps))

    def memory_params(self, cfg, model_cfg, backbone) -> dict:
        """The drafter the run would train (its aux layers and draft vocabulary from the
        flags and the shape; the draft ids are placeholders of the same size). At a depth
        below the shape's (--memory-layers) the default aux layers are that depth's."""
        n = model_cfg.num_layers
        need = 4 if cfg.aux_layers is None else max(cfg.aux_layers) + 1
        if n < need:
            raise ValueError(f"--memory-layers: train.eagle's step compiled at {n} layers "
                             f"cannot read the drafter's aux layers; give depths of at least "
                             f"{need}")
        aux, vd = cfg.drafter_shape(model_cfg)
        self.config = eagle3.default_config(model_cfg, vd, aux)
        return self.params(cfg, model_cfg, backbone, self.config)

    def memory_method(self, cfg, model_cfg, params, total_steps) -> Method:
        return self.method(cfg, model_cfg, params, total_steps, self.config)

    def memory_heads(self, cfg) -> str:
        c = self.config
        return (f"an EAGLE-3 drafter over layers {list(c.aux_layers)} (draft vocabulary "
                f"{c.draft_vocab_size}, {cfg.ttt_steps} training-time-test steps)")

    def heads_artifact(self, ctx: Context, heads: Params) -> Params:
        out = {n: np.asarray(heads[n], np.float32) for n in eagle3.WEIGHTS}
        out["d2t"] = np.rint(np.asarray(heads["d2t"])).astype(np.int32)
        out["t2d"] = np.asarray(heads["t2d"]) > 0.5
        return bind(out, self.config, ctx.model_cfg)

    def artifact_extra(self, ctx: Context) -> dict:
        return {"kind": eagle3.KIND, "aux_layers": list(self.config.aux_layers),
                "draft_vocab_size": self.config.draft_vocab_size,
                "ttt_steps": ctx.cfg.ttt_steps}
