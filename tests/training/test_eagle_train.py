"""EAGLE-3 training (`train.eagle`): packed rows train as their examples alone (the
recipe's loss against the reference's form: tests/drafters/test_eagle3.py), a step counts
where its target is a label of its example, a few steps learn and leave the backbone alone,
the flags that depend on the model fail in one line, and the command runs,
stops, resumes exactly and writes an artifact that loads back."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters.eagle3 import heads as eagle3
from medusa_jax.model.backbone import init_params
from medusa_jax.model.config import ModelConfig
from medusa_jax.text import data
from medusa_jax.training import step as ts
from medusa_jax.training.config import EagleConfig, default_aux_layers
from medusa_jax.training.recipes import eagle3 as recipe
from train import eagle as train_eagle

CFG = ModelConfig(model_type="llama", vocab_size=40, hidden_size=16, intermediate_size=24,
                  num_layers=4, num_heads=4, num_kv_heads=2, head_dim=4,
                  max_position_embeddings=64)
AUX = (1, 2, 3)


def _inputs(b=3, t=12, seed=1):
    k = jax.random.split(jax.random.key(seed), 4)
    aux = jax.random.normal(k[0], (b, t, 3 * CFG.hidden_size))
    tokens = jax.random.randint(k[1], (b, t), 0, CFG.vocab_size)
    table = jax.random.normal(k[2], (CFG.vocab_size, CFG.hidden_size))
    target = 3 * jax.random.normal(k[3], (b, t, CFG.vocab_size))
    lengths = jnp.array([t, t - 3, t // 2])[:b]
    segments = (jnp.arange(t)[None] < lengths[:, None]).astype(jnp.int32)
    batch = {"tokens": tokens, "segments": segments,
             "loss_mask": (segments > 0) & (jnp.arange(t)[None] > 2)}
    return aux, tokens, table, target, batch


STEPS = 4  # three later steps: their keys on the diagonal, two of them from the cache


@pytest.mark.slow
def test_a_packed_row_trains_as_its_examples_alone():
    """Packed rows: the training-time test of two examples sharing a row gives each of them
    the logits, per-step counted positions and loss it has alone in a row of its own (the
    drafter never attends across examples, rotary positions restart with each, a step whose
    target is in the next example is not counted)."""
    c = eagle3.default_config(CFG, 24, AUX)
    heads = eagle3.init_eagle3(jax.random.key(0), c, np.arange(CFG.vocab_size)[::-1])
    aux, tokens, table, target, _ = _inputs(b=1, t=12)
    cut = 7  # example 1: positions 0..6, example 2: 7..11
    seg = jnp.asarray([[1] * cut + [2] * (12 - cut)], jnp.int32)
    pos = jnp.asarray([list(range(cut)) + list(range(12 - cut))], jnp.int32)
    lab = jnp.asarray([[0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1]], bool)
    packed = {"tokens": tokens, "segments": seg, "positions": pos, "loss_mask": lab}

    @jax.jit  # one program per row length (3): op by op it dispatches hundreds of kernels
    def run(batch, a, tgt):
        logits = eagle3.ttt_logits(heads, c, table, a, batch["tokens"], batch["segments"] > 0,
                                   STEPS, segments=batch["segments"],
                                   positions=batch["positions"])
        masks = recipe.step_masks(batch, STEPS)
        return logits, masks, recipe.ttt_loss(heads, c, logits, tgt, masks)[1]

    logits, masks, losses = run(packed, aux, target)
    total = jnp.zeros(STEPS)
    for lo, hi in ((0, cut), (cut, 12)):
        n = hi - lo
        alone = {"tokens": tokens[:, lo:hi], "segments": jnp.ones((1, n), jnp.int32),
                 "positions": jnp.arange(n)[None], "loss_mask": lab[:, lo:hi]}
        l1, m1, s1 = run(alone, aux[:, lo:hi], target[:, lo:hi])
        np.testing.assert_array_equal(np.asarray(masks[:, :, lo:hi]), np.asarray(m1))
        counted = np.asarray(m1, bool)[..., None]  # [S, 1, n, 1]: where the logits matter
        np.testing.assert_allclose(np.where(counted, np.asarray(logits[:, :, lo:hi]), 0),
                                   np.where(counted, np.asarray(l1), 0), atol=1e-5)
        total = total + s1 * n / 12  # the losses are means over all positions of the batch
    assert np.asarray(masks).sum() > 0
    np.testing.assert_allclose(np.asarray(losses), np.asarray(total), rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def tiny():
    params = jax.jit(lambda k: init_params(CFG, k, std=0.6))(jax.random.key(0))
    return params


def _rows(n=8, t=24, seed=3):
    rng = np.random.default_rng(seed)
    # a learnable sequence: token t+1 = (token t + 1) mod V from a random start
    start = rng.integers(0, CFG.vocab_size, (n, 1))
    tokens = ((start + np.arange(t)[None]) % CFG.vocab_size).astype(np.int32)
    return data.Packed(tokens=tokens, positions=np.tile(np.arange(t, dtype=np.int32), (n, 1)),
                       segments=np.ones((n, t), np.int32),
                       loss_mask=np.tile(np.arange(t) >= 2, (n, 1)))


def _method(backbone, rows):
    """The recipe's Method for a 24-id drafter over `rows`, 3 training-time-test steps."""
    cfg = EagleConfig(lr=1e-2, eval_prompts=0, ttt_steps=3, aux_layers=AUX, draft_vocab=24,
                      warmup_ratio=0.0)
    c = eagle3.default_config(CFG, 24, AUX)
    params = recipe.Eagle3.params(cfg, CFG, backbone, c,
                                  recipe.label_counts(rows, CFG.vocab_size))
    return recipe.Eagle3.method(cfg, CFG, params, 30, c)


@pytest.mark.slow
def test_a_few_steps_learn_and_leave_the_backbone_alone(tiny, one_device_step):
    rows = _rows()
    state, step = one_device_step(_method(tiny, rows), CFG)
    batch = rows.rows(np.arange(8))
    before = jax.tree.map(np.asarray, state.params["backbone"])
    maps = {n: np.asarray(state.params["heads"][n]) for n in recipe.MAPS}
    losses = []
    for _ in range(15):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], \
        losses
    assert m["top1"].shape == m["top5"].shape == (3,)
    assert np.all(np.asarray(m["top5"]) >= np.asarray(m["top1"]))
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, state.params["backbone"]))
    for n in recipe.MAPS:  # the draft vocabulary is a constant of the run
        np.testing.assert_array_equal(maps[n], np.asarray(state.params["heads"][n]))


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_a_step_on_a_mesh_equals_the_one_device_step(tiny, one_device_step):
    """The one trainer's data/fsdp mesh (8 simulated devices, the rows split 8 ways; the
    drafter's weights and their Adam moments split over fsdp by the hidden dimension)
    computes the 1-device step's losses, accuracies and updates."""
    from medusa_jax.runtime import sharding

    rows = _rows()
    method = _method(tiny, rows)
    one, step1 = one_device_step(method, CFG)
    mesh = sharding.make_mesh("data=2,fsdp=4")
    many, shardings = ts.create_state(method.params, method.tx, mesh,
                                      ts.param_axes(CFG, method.params))
    step8 = ts.make_train_step(method.loss_fn, method.tx, method.labels, shardings, mesh,
                               method.schedule)
    P = jax.sharding.PartitionSpec
    assert many.params["heads"]["fc"].sharding.spec == P(None, "fsdp")
    assert many.params["heads"]["wq"].sharding.spec == P("fsdp", None, None)
    assert many.params["heads"]["input_norm"].sharding.spec == P()
    for seed in range(3):
        batch = rows.rows(np.random.default_rng(seed).permutation(8))
        one, m1 = step1(one, batch)
        many, m8 = step8(many, sharding.shard_batch(batch, mesh))
        np.testing.assert_allclose(float(m1["loss"]), float(m8["loss"]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(m1["top1"]), np.asarray(m8["top1"]), atol=1e-6)
    for n in eagle3.WEIGHTS:
        np.testing.assert_allclose(np.asarray(one.params["heads"][n]),
                                   np.asarray(many.params["heads"][n]), atol=1e-5, err_msg=n)


def test_default_aux_layers():
    assert default_aux_layers(5) == (1, 2, 4)  # the embedded model
    assert default_aux_layers(32) == (2, 16, 29)  # EAGLE's rule (backbone.eagle3_layers)
    with pytest.raises(ValueError, match="no default"):
        default_aux_layers(3)


@pytest.mark.parametrize("flags, needle", [
    (["--aux-layers", "1,2"], "--aux-layers 1,2: give three layers A,B,C"),
    (["--aux-layers", "2,1,4"], "--aux-layers 2,1,4: give three layers A,B,C"),
    (["--aux-layers", "1,-2,4"], "every value must be >= 0"),
    (["--aux-layers", "1,2,5"], "--aux-layers 1,2,5: layer 5 is past the 5 layers of --model "
                                  "stories260K (0 .. 4)"),
    (["--draft-vocab", "0"], "--draft-vocab must be >= 1"),
    (["--draft-vocab", "513"], "--draft-vocab 513 is larger than the model's vocabulary of "
                               "512 tokens"),
    (["--ttt-steps", "0"], "--ttt-steps must be >= 1"),
    (["--adam-b2", "1"], "--adam-b2 must be in [0, 1), got 1.0"),
    (["--grad-clip", "-1"], "--grad-clip must be >= 0, got -1.0"),
])
def test_bad_flags_are_one_line_errors(flags, needle, refused_flags):
    assert needle in refused_flags("eagle", flags)


def test_the_optimiser_is_the_references_by_default(tmp_path):
    """train.eagle's AdamW b2 and clip default to SafeAILab's traineagle3 (0.95, 0.5), the
    Medusa recipes' stay 0.999 and 1.0; the flags change them."""
    from train import hydra as train_hydra

    out = ["--output-dir", str(tmp_path / "run")]
    cfg, _, _ = train_eagle.command.parse_args(out)
    assert (cfg.adam_b2, cfg.grad_clip) == (0.95, 0.5)
    cfg, _, _ = train_eagle.command.parse_args([*out, "--adam-b2", "0.99", "--grad-clip", "1"])
    assert (cfg.adam_b2, cfg.grad_clip) == (0.99, 1.0)
    cfg, _, _ = train_hydra.command.parse_args(out)
    assert (cfg.adam_b2, cfg.grad_clip) == (0.999, 1.0)


def test_fewer_steps_than_the_benchmark_trees_depth_is_fine(tmp_path):
    """The drafter drafts any depth on its own outputs: --ttt-steps below the depth of the
    closing benchmark's tree (the default mc_sim_7b_63, depth 4) is no error."""
    cfg, _, _ = train_eagle.command.parse_args(["--output-dir", str(tmp_path / "run"),
                                                "--ttt-steps", "2"])
    assert cfg.ttt_steps == 2 and not (tmp_path / "run").exists()


TINY = ["--steps", "4", "--distill-samples", "8", "--distill-max-new-tokens", "24",
        "--distill-batch-size", "8", "--batch-size", "4", "--seq-len", "64",
        "--eval-prompts", "0", "--save-every", "2", "--log-every", "1", "--eval-every", "2",
        "--keep", "3", "--ttt-steps", "2", "--draft-vocab", "300", "--tree", "stories260K_cpu"]
# (two training-time-test steps, a benchmark tree of depth 3: the drafter drafts deeper)


def _train_losses(run):
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").open())
            if r["split"] == "train"]


@pytest.mark.slow
def test_train_eagle_stops_resumes_exactly_and_writes_its_drafter(tmp_path, stories):
    from safetensors.numpy import load_file

    straight, run = tmp_path / "straight", tmp_path / "run"
    cfg, _, _ = train_eagle.command.parse_args(["--output-dir", str(straight), *TINY])
    summary = train_eagle.command.run(cfg)
    assert summary["step"] == 4 and len(summary["heldout_top1"]) == 2
    cfg, _, stop_after = train_eagle.command.parse_args(
        ["--output-dir", str(run), "--stop-after", "2", *TINY])
    train_eagle.command.run(cfg, None, stop_after)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    assert not (run / "heads").exists()
    # the resumed run also decodes with its drafter (greedy: exactly plain decoding's output)
    cfg, resume, _ = train_eagle.command.parse_args(
        ["--resume", str(run), "--eval-prompts", "1", "--eval-max-new-tokens", "16"])
    summary = train_eagle.command.run(cfg, resume)
    assert summary["step"] == 4
    bench = summary["benchmark"]
    assert bench["identical_outputs"] == 1 and bench["tokens_per_step"] >= 1.0
    assert _train_losses(run) == _train_losses(straight)
    a = load_file(str(straight / "heads" / "medusa_heads.safetensors"))
    b = load_file(str(run / "heads" / "medusa_heads.safetensors"))
    assert sorted(a) == sorted(eagle3.NAMES)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)
    assert a["lm_head"].shape == (stories[0].hidden_size, 300)
    assert int(a["t2d"].sum()) == 300 and a["d2t"].dtype == np.int32
    conf = json.loads((run / "config.json").read_text())
    assert conf["method"] == "eagle" and conf["ttt_steps"] == 2
    heads, meta = heads_formats.load_heads(run / "heads", stories[0])
    assert meta["kind"] == "eagle3" and meta["aux_layers"] == [1, 2, 4]
    assert heads.drafter.config == eagle3.default_config(stories[0], 300, (1, 2, 4))
    for n in eagle3.NAMES:
        np.testing.assert_array_equal(np.asarray(heads[n]), b[n], err_msg=n)
    assert meta["extra"]["ttt_steps"] == 2 and len(meta["extra"]["heldout_top1"]) == 2


@pytest.mark.slow
def test_gradient_accumulation_and_row_passes_change_nothing(tiny, monkeypatch):
    """Two micro-batches (`--grad-accum 2`) give the whole batch's loss, gradients and
    metrics; a frozen pass split into row groups (`lax.map`, large models) the same aux
    features and logits as one pass."""
    rows = _rows(n=4, t=12)
    batch = {k: jnp.asarray(v) for k, v in rows.rows(np.arange(4)).items()}
    batch["loss_mask"] = batch["loss_mask"].at[1, 7:].set(False)  # rows of unequal counts
    cfg = EagleConfig(lr=1e-2, eval_prompts=0, ttt_steps=2, aux_layers=AUX, draft_vocab=24)
    c = eagle3.default_config(CFG, 24, AUX)
    params = recipe.Eagle3.params(cfg, CFG, tiny, c, recipe.label_counts(rows, CFG.vocab_size))
    method = recipe.Eagle3.method(cfg, CFG, params, 10, c)
    trained = ("heads",)

    @jax.jit
    def both(params, batch):
        whole = jax.value_and_grad(lambda h: method.loss_fn({**params, "heads": h}, batch),
                                   has_aux=True)(params["heads"])
        return whole, ts.accumulate(method.loss_fn, method.totals_fn, params, batch, trained,
                                    2)

    ((loss, m), g), ((loss2, m2), g2) = both(params, batch)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-5)
    for k in ("top1", "top5", "head_loss", "count"):
        np.testing.assert_allclose(np.asarray(m2[k]), np.asarray(m[k]), rtol=1e-5, err_msg=k)
    for n in eagle3.WEIGHTS:
        np.testing.assert_allclose(np.asarray(g2["heads"][n]), np.asarray(g[n]), rtol=1e-4,
                                   atol=1e-6 * float(jnp.max(jnp.abs(g[n]))), err_msg=n)

    one = jax.jit(lambda p, b: recipe.frozen_features(p, CFG, b, AUX))(tiny, batch)
    monkeypatch.setattr(ts, "FROZEN_PASS_BYTES", 1)  # one row per pass
    split = jax.jit(lambda p, b: recipe.frozen_features(p, CFG, b, AUX))(tiny, batch)
    for a, b in zip(one, split):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4,
                                   atol=1e-5 * float(jnp.max(jnp.abs(a))))
