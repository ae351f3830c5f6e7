"""MTP training (`train.mtp`): depth k counts where its target is a label of its example,
packed rows train as their examples alone, a few steps learn and leave the backbone alone,
gradient accumulation changes nothing, a soft `--target` is the backbone's distribution one
position on, and the command writes modules that decode as plain greedy decoding and load back
as the mtp kind."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters.mtp import heads as mtp
from medusa_jax.model.backbone import init_params, logits_from_hidden
from medusa_jax.model.config import ModelConfig
from medusa_jax.text import data
from medusa_jax.training import step as ts
from medusa_jax.training.recipes import mtp as recipe
from medusa_jax.training.recipes.mtp_config import MtpConfig
from train import mtp as train_mtp

CFG = ModelConfig(model_type="llama", vocab_size=40, hidden_size=16, intermediate_size=24,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                  max_position_embeddings=64)


@pytest.fixture(scope="module")
def tiny():
    return jax.jit(lambda k: init_params(CFG, k, std=0.6))(jax.random.key(0))


def _rows(n=8, t=24, seed=3):
    rng = np.random.default_rng(seed)
    # a learnable sequence: token t+1 = (token t + 1) mod V from a random start
    start = rng.integers(0, CFG.vocab_size, (n, 1))
    tokens = ((start + np.arange(t)[None]) % CFG.vocab_size).astype(np.int32)
    return data.Packed(tokens=tokens, positions=np.tile(np.arange(t, dtype=np.int32), (n, 1)),
                       segments=np.ones((n, t), np.int32),
                       loss_mask=np.tile(np.arange(t) >= 2, (n, 1)))


def test_a_packed_row_trains_as_its_examples_alone(tiny):
    """Two examples sharing a row: each depth's outputs at the counted positions are those
    each example has alone (attention stays inside it, positions restart with it)."""
    heads = mtp.init_mtp(jax.random.key(1), CFG, 2, std=0.3)
    k = jax.random.split(jax.random.key(2), 2)
    hidden = jax.random.normal(k[0], (1, 12, CFG.hidden_size))
    tokens = jax.random.randint(k[1], (1, 12), 0, CFG.vocab_size)
    cut = 7
    seg = jnp.asarray([[1] * cut + [2] * (12 - cut)], jnp.int32)
    pos = jnp.asarray([list(range(cut)) + list(range(12 - cut))], jnp.int32)
    lab = jnp.ones((1, 12), bool)
    run = jax.jit(lambda h, t, s, p: mtp.chain_hidden(tiny, CFG, heads, h, t, 3,
                                                      segments=s, positions=p))
    packed = run(hidden, tokens, seg, pos)
    masks = np.asarray(recipe.depth_masks({"loss_mask": lab, "segments": seg}, 3), bool)
    for lo, hi in ((0, cut), (cut, 12)):
        n = hi - lo
        alone = run(hidden[:, lo:hi], tokens[:, lo:hi], jnp.ones((1, n), jnp.int32),
                    jnp.arange(n)[None])
        for d in range(3):
            counted = masks[d, 0, lo:hi]
            assert counted.any()
            np.testing.assert_allclose(np.asarray(packed[d][0, lo:hi])[counted],
                                       np.asarray(alone[d][0])[counted], atol=1e-5)


def _method(backbone, steps=30, target="hard", temperature=1.0):
    cfg = MtpConfig(lr=1e-2, eval_prompts=0, num_heads=2, warmup_ratio=0.0, target=target,
                    target_temperature=temperature)
    return recipe.Mtp.method(cfg, CFG, recipe.Mtp.params(cfg, CFG, backbone), steps)


def _packed_batch():
    """Two rows: one of two packed examples, one with labels cut short (unequal counts)."""
    t = 12
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, CFG.vocab_size, (2, t)).astype(np.int32)
    seg = np.array([[1] * 7 + [2] * 5, [1] * 10 + [0] * 2], np.int32)
    pos = np.array([list(range(7)) + list(range(5)), list(range(t))], np.int32)
    lab = (seg > 0) & (np.arange(t) >= 1)
    lab[1, 8:] = False
    return {"tokens": tokens, "positions": pos, "segments": seg, "loss_mask": lab}


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("target, temperature", [("kl", 1.0), ("tv", 0.7), ("tv+kl", 0.8)])
def test_soft_loss_is_the_backbones_distribution_one_position_on(tiny, target, temperature):
    """Depth k at t (scored on token t+k+2) against the backbone's distribution at t+k+1,
    averaged over each depth's counted positions, then over the depths; computed here in
    numpy from the module's and the backbone's logits."""
    b = _packed_batch()
    batch = {k: jnp.asarray(v) for k, v in b.items()}
    method = _method(tiny, target=target, temperature=temperature)
    loss, m = jax.jit(method.loss_fn)(method.params, batch)
    heads = method.params["heads"]
    hidden = ts.frozen_hidden(tiny, CFG, batch).astype(jnp.float32)
    teacher = np.asarray(logits_from_hidden(CFG, tiny, hidden), np.float64)  # [B, T, V]
    outs = mtp.chain_hidden(tiny, CFG, heads, hidden, batch["tokens"], 2,
                            segments=batch["segments"], positions=batch["positions"])
    seg, lab = b["segments"], b["loss_mask"]
    n, t = seg.shape
    want = []
    for k in range(2):
        q_logits = np.asarray(mtp.logits(tiny, CFG, heads, k, outs[k]), np.float64)
        losses = []
        for r in range(n):
            for p in range(t):
                j = p + k + 2
                if not (j < t and lab[r, j] and seg[r, j] == seg[r, p] > 0):
                    continue
                pp = _softmax(teacher[r, p + k + 1] / temperature)
                qq = _softmax(q_logits[r, p] / temperature)
                value = 0.0
                if "kl" in target:
                    value += np.sum(pp * (np.log(pp) - np.log(qq)))
                if "tv" in target:
                    value += 0.5 * np.sum(np.abs(pp - qq))
                losses.append(value)
        assert len(losses) >= 4
        want.append(np.mean(losses))
    np.testing.assert_allclose(np.asarray(m["head_loss"]), want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(float(loss), np.mean(want), rtol=2e-5, atol=1e-7)


def test_a_soft_target_from_the_command_changes_the_loss(tiny, tmp_path):
    """`--target kl` reaches the loss (not silently the hard labels); hard stays the default
    and its metrics are the same."""
    assert MtpConfig.target == "hard"
    cfg, _, _ = train_mtp.command.parse_args(["--output-dir", str(tmp_path / "r"), "--target",
                                              "kl", "--target-temperature", "0.8"])
    assert (cfg.target, cfg.target_temperature) == ("kl", 0.8)
    batch = {k: jnp.asarray(v) for k, v in _packed_batch().items()}
    results = {}
    for target, temperature in (("hard", 1.0), (cfg.target, cfg.target_temperature)):
        method = _method(tiny, target=target, temperature=temperature)
        results[target] = jax.jit(method.loss_fn)(method.params, batch)
    (hard, mh), (kl, mk) = results["hard"], results["kl"]
    assert abs(float(kl) - float(hard)) > 1e-3 * abs(float(hard)), (float(kl), float(hard))
    for k in ("top1", "top5", "count"):
        np.testing.assert_array_equal(np.asarray(mk[k]), np.asarray(mh[k]), err_msg=k)


@pytest.mark.parametrize("flags, needle", [
    (["--target", "js"], "argument --target: invalid choice: 'js'"),
    (["--target", "kl", "--target-temperature", "0"],
     "--target-temperature must be finite and > 0, got 0.0"),
    (["--target-temperature", "0.8"], "--target-temperature 0.8 applies to the soft targets"),
])
def test_bad_targets_are_one_line_errors(flags, needle, refused_flags):
    assert needle in refused_flags("mtp", flags)


@pytest.mark.slow
def test_a_few_steps_learn_and_leave_the_backbone_alone(tiny, one_device_step):
    rows = _rows()
    state, step = one_device_step(_method(tiny), CFG)
    batch = rows.rows(np.arange(8))
    before = jax.tree.map(np.asarray, state.params["backbone"])
    losses = []
    for _ in range(12):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses
    assert m["top1"].shape == m["top5"].shape == m["head_loss"].shape == (2,)
    assert np.all(np.asarray(m["top5"]) >= np.asarray(m["top1"]))
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, state.params["backbone"]))


@pytest.mark.parametrize("target", ["hard", "tv+kl"])
def test_gradient_accumulation_changes_nothing(tiny, target):
    rows = _rows(n=4, t=12)
    batch = {k: jnp.asarray(v) for k, v in rows.rows(np.arange(4)).items()}
    batch["loss_mask"] = batch["loss_mask"].at[1, 7:].set(False)  # rows of unequal counts
    method = _method(tiny, target=target, temperature=1.0 if target == "hard" else 0.8)
    params = method.params

    @jax.jit
    def both(params, batch):
        whole = jax.value_and_grad(lambda h: method.loss_fn({**params, "heads": h}, batch),
                                   has_aux=True)(params["heads"])
        return whole, ts.accumulate(method.loss_fn, method.totals_fn, params, batch,
                                    ("heads",), 2)

    ((loss, m), g), ((loss2, m2), g2) = both(params, batch)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-5)
    for k in ("top1", "top5", "head_loss", "count"):
        np.testing.assert_allclose(np.asarray(m2[k]), np.asarray(m[k]), rtol=1e-5, err_msg=k)
    for n in g:
        np.testing.assert_allclose(np.asarray(g2["heads"][n]), np.asarray(g[n]), rtol=1e-4,
                                   atol=1e-6 * float(jnp.max(jnp.abs(g[n]))), err_msg=n)


def test_bad_style_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_mtp.command.parse_args(["--output-dir", str(tmp_path / "r"), "--style", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--style" in err and not (tmp_path / "r").exists()


TINY = ["--steps", "4", "--distill-samples", "8", "--distill-max-new-tokens", "24",
        "--distill-batch-size", "8", "--batch-size", "4", "--seq-len", "64",
        "--log-every", "1", "--eval-every", "2", "--save-every", "2",
        "--tree", "stories260K_cpu", "--eval-prompts", "1", "--eval-max-new-tokens", "16"]


@pytest.mark.slow
def test_train_mtp_writes_modules_that_decode_as_plain(tmp_path, stories):
    run = tmp_path / "run"
    cfg, _, _ = train_mtp.command.parse_args(["--output-dir", str(run), *TINY])
    summary = train_mtp.command.run(cfg)
    assert summary["step"] == 4 and len(summary["heldout_top1"]) == 2
    bench = summary["benchmark"]
    assert bench["identical_outputs"] == 1 and bench["tokens_per_step"] >= 1.0
    conf = json.loads((run / "config.json").read_text())
    assert conf["method"] == "mtp" and conf["style"] == "deepseek"
    heads, meta = heads_formats.load_heads(run / "heads", stories[0])
    assert meta["kind"] == "mtp" and heads.drafter.style == "deepseek"
    assert mtp.num_modules(heads) == 2 and meta["extra"]["modules"] == 2
