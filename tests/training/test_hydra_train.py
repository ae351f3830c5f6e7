"""Hydra training: the teacher-forced loss sees what drafting sees, a few steps learn on a tiny
config, and `python -m train.hydra` runs, stops, resumes and ships usable heads."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding import decode
from medusa_jax.decoding.tree import Tree
from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters.hydra import heads as hydra
from medusa_jax.drafters.medusa import heads as heads_lib
from medusa_jax.model.backbone import init_params
from medusa_jax.model.config import ModelConfig
from medusa_jax.training import step as ts
from medusa_jax.training.recipes import medusa_loss as ml
from medusa_jax.training.recipes.hydra import HydraConfig, hydra_loss_fn
from train import hydra as train_hydra

CFG = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                  max_position_embeddings=64)


def _noisy(heads, seed=1, scale=0.3):
    keys = jax.random.split(jax.random.key(seed), len(heads))
    mask = hydra.slot_mask(hydra.config_of(heads)[0])[:, :, None, None]
    return {n: v + scale * jax.random.normal(k, v.shape) * (mask if n in ("in_w", "res_w")
                                                             else 1.0)
            for (n, v), k in zip(heads.items(), keys)}


@pytest.fixture(scope="module")
def tiny():
    # jitted: one compile instead of one per eager op
    params = jax.jit(lambda k: init_params(CFG, k, std=0.6))(jax.random.key(0))
    return params, jax.jit(lambda p: _noisy(hydra.init_hydra(CFG, p, 3, 2)))(params)


def _batch(b=4, t=24, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)
    return {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(t), (b, t)),
            "segments": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.ones((b, t), bool)}


@pytest.mark.slow
def test_teacher_forced_logits_are_the_drafting_logits(tiny):
    """Head i at position t in training reads exactly what it reads when drafting the path
    x_{t+1} .. x_{t+i+1} (a chain tree along the data's own tokens)."""
    params, heads = tiny
    batch = _batch(b=1, t=12)

    @jax.jit
    def run(params, heads, batch):
        hidden = ts.backbone_hidden(params, CFG, batch)
        emb = hydra.embed(params["embed"], batch["tokens"], hidden.dtype)
        return hidden, emb, hydra.teacher_forced_logits(heads, hidden, emb)  # [K, 1, T, V]

    hidden, emb, forced = run(params, heads, batch)
    t = 4
    for i in range(3):
        inputs = jnp.stack([hidden[0, t]] + [emb[0, t + 1 + j] for j in range(i + 1)])
        np.testing.assert_allclose(np.asarray(jax.jit(hydra.apply_head, static_argnums=1)(
                                       heads, i, inputs)),
                                   np.asarray(forced[i, 0, t]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_few_steps_learn_and_leave_the_backbone_alone(tiny, one_device_step):
    params, _ = tiny
    p = {"backbone": params, "heads": hydra.init_hydra(CFG, params, 3, 2)}
    cfg = HydraConfig(lr=3e-2, eval_prompts=0)
    from medusa_jax.training.recipes.hydra import Hydra

    method = Hydra.method(cfg, CFG, p, 30)
    state, step = one_device_step(method, CFG)
    batch = _batch(b=4, t=24, seed=3)
    before = jax.tree.map(np.asarray, state.params["backbone"])
    losses = []
    for _ in range(12):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.9 * losses[0]
    assert m["top1"].shape == (3,)
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, state.params["backbone"]))


@pytest.mark.slow
def test_teacher_loss_is_the_soft_cross_entropy_against_the_base_model(tiny):
    """Hydra++'s loss: heads that equal the base model's output layer, read at the position
    of their target, would score exactly the base model's entropy; here it is checked
    against a direct computation for random heads."""
    params, heads = tiny
    batch = _batch(b=2, t=16, seed=4)
    from medusa_jax.model.backbone import logits_from_hidden

    @jax.jit
    def run(params, heads, batch):
        loss, _ = hydra_loss_fn(CFG, 0.8, teacher_loss=True)(
            {"backbone": params, "heads": heads}, batch)
        hidden = ts.backbone_hidden(params, CFG, batch)
        emb = hydra.embed(params["embed"], batch["tokens"], hidden.dtype)
        return (loss, hydra.teacher_forced_logits(heads, hidden, emb),
                logits_from_hidden(CFG, params, hidden))

    loss, logits, base = run(params, heads, batch)
    logits, base = np.asarray(logits, np.float64), np.asarray(base, np.float64)
    _, valid = ml.medusa_targets(batch, 3)
    valid = np.asarray(valid)
    want = 0.0
    for i in range(3):
        p = np.exp(base - base.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        p = np.roll(p, -(i + 1), axis=1)
        lq = logits[i] - logits[i].max(-1, keepdims=True)
        lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
        ce = -(p * lq).sum(-1)
        want += 0.8 ** (i + 1) * (ce * valid[i]).sum() / max(valid[i].sum(), 1)
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)


def test_medusa_only_flags_are_refused():
    with pytest.raises(ValueError, match="--shared-proj is a Medusa-heads option"):
        HydraConfig(shared_proj=True).validate()
    with pytest.raises(ValueError, match="--loss-chunk is a Medusa-heads option"):
        HydraConfig(loss_chunk=8).validate()


TINY = ["--steps", "4", "--distill-samples", "8", "--distill-max-new-tokens", "24",
        "--distill-batch-size", "8", "--batch-size", "4", "--seq-len", "64",
        "--eval-prompts", "1", "--eval-max-new-tokens", "16", "--save-every", "2",
        "--log-every", "1", "--eval-every", "2", "--num-heads", "3", "--keep", "2",
        "--tree", "stories260K_cpu"]


@pytest.mark.slow
def test_train_hydra_stops_resumes_and_decodes(tmp_path, stories, capsys):
    run = tmp_path / "run"
    cfg, _, stop_after = train_hydra.command.parse_args(
        ["--output-dir", str(run), "--stop-after", "2", *TINY])
    train_hydra.command.run(cfg, None, stop_after)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    assert not (run / "heads").exists()
    cfg, resume, _ = train_hydra.command.parse_args(["--resume", str(run)])
    summary = train_hydra.command.run(cfg, resume)
    assert summary["step"] == 4 and len(summary["heldout_top1"]) == 3
    # the resumed session's 2 steps: at most 2 full batches of real tokens, a rate per minute
    seen = summary["tokens_seen"]
    assert 0 < seen <= 2 * int(TINY[TINY.index("--batch-size") + 1]) * \
        int(TINY[TINY.index("--seq-len") + 1])
    assert "trained 2 steps in " in capsys.readouterr().out
    s = summary["train_seconds"]  # rounded to 0.1 s
    assert 60 * seen / (s + 0.05) - 1 <= summary["tokens_per_minute"] <= \
        60 * seen / max(s - 0.05, 1e-3) + 1
    bench = summary["benchmark"]
    assert bench["identical_outputs"] == 1 and bench["tokens_per_step"] >= 1.0
    heads, meta = heads_formats.load_heads(run / "heads", stories[0])
    assert meta["kind"] == "hydra" and hydra.config_of(heads) == (3, 2)
    assert json.loads((run / "config.json").read_text())["method"] == "hydra"
