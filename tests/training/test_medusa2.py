"""Medusa-2: the joint loss, the two-rate optimizer, the frozen teacher, export, sharding, CLI."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters.medusa import heads as heads_lib
from medusa_jax.model import backbone
from medusa_jax.model.config import ModelConfig
from medusa_jax.runtime import sharding
from medusa_jax.training import step as ts
from medusa_jax.training.recipes import medusa2

ROOT = Path(__file__).resolve().parents[2]  # the repository
# every sharded dim (vocab 64, mlp 32, qkv 16/8, hidden 16) divides by fsdp=4
CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                  max_position_embeddings=128, rms_norm_eps=1e-6)
K = 3


def make_params(lm_loss="kl", seed=0, perturb=0.0):
    """Random backbone + fresh heads (+ teacher for "kl"). `perturb` moves the student away
    from the teacher, as mid-training: at the original the KL gradient is float noise
    (~1e-9), and Adam turns noise into lr-sized updates no two reduction orders agree on."""
    params = _make_params(jax.random.key(seed), jnp.float32(perturb))
    return params if lm_loss == "kl" else {k: v for k, v in params.items() if k != "teacher"}


@jax.jit  # eagerly, every small random op would compile on its own
def _make_params(key, perturb):
    k_bb, k_noise = jax.random.split(key)
    bb = backbone.init_params(CFG, k_bb, std=0.2)
    params = medusa2.make_params(bb, heads_lib.init_heads(CFG, bb, heads_lib.HeadsConfig(K, 1)))
    leaves, tdef = jax.tree.flatten(bb)
    keys = jax.random.split(k_noise, len(leaves))
    params["backbone"] = jax.tree.unflatten(tdef, [
        x + perturb * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    return params


def random_batch(b=8, t=16, seed=0, vocab=CFG.vocab_size):
    """Two examples per row, each a 3-token prompt then an answer (the labels)."""
    rng = np.random.default_rng(seed)
    half = t // 2
    positions = np.concatenate([np.arange(half), np.arange(t - half)])[None].repeat(b, 0)
    return {"tokens": rng.integers(3, vocab, (b, t)).astype(np.int32),
            "positions": positions.astype(np.int32),
            "segments": np.repeat([[1] * half + [2] * (t - half)], b, 0).astype(np.int32),
            "loss_mask": positions >= 3}


def make_trainer(lm_loss, lr=1e-3, ratio=4.0, mesh_spec="1,1", devices=None):
    """(fresh_state(params), jitted step, shardings): compiled once, shared by tests."""
    params = make_params(lm_loss)
    labels = medusa2.labels(params)
    tx, schedule = medusa2.make_joint_optimizer(ts.OptimConfig(lr=lr, warmup_ratio=0.0), 20,
                                           labels, ratio)
    mesh = sharding.make_mesh(mesh_spec, devices)
    shardings = ts.state_shardings(jax.eval_shape(lambda p: ts.init_state(p, tx), params),
                                   ts.param_axes(CFG, params), mesh)
    init = jax.jit(lambda p: ts.init_state(p, tx), out_shardings=shardings)
    loss_fn = medusa2.make_loss_fn(CFG, medusa2.LossConfig(lm_loss=lm_loss))
    step = ts.make_train_step(loss_fn, tx, labels, shardings, mesh, schedule)
    return (lambda p: init(jax.device_put(p, shardings.params))), step, shardings


@pytest.fixture(scope="module")
def ce_trainer():
    return make_trainer("ce")


@pytest.fixture(scope="module")
def kl_trainer():
    return make_trainer("kl", devices=jax.devices()[:1])


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.mark.slow
def test_kl_term_is_zero_with_zero_gradient_at_the_original():
    params = make_params("kl")
    batch = medusa2.with_step(random_batch(), 0)
    loss_fn = medusa2.make_loss_fn(CFG, medusa2.LossConfig("kl", head_weight=0.0))
    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, m), g = grad(params, batch)
    assert abs(float(loss)) < 1e-6 and abs(float(m["kl"])) < 1e-6
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g["backbone"])) < 1e-6
    assert all(not np.any(x) for x in jax.tree.leaves(g["heads"]))  # lambda 0: no head signal
    assert all(not np.any(x) for x in jax.tree.leaves(g["teacher"]))  # stop_gradient
    # a student away from the original is far from zero: the checks above can fail
    (loss, m), g = grad(make_params("kl", perturb=0.05), batch)
    assert float(loss) > 1e-3 and float(loss) == pytest.approx(float(m["kl"]))
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g["backbone"])) > 1e-3


@pytest.mark.slow
def test_lm_only_rows_train_the_lm_term_but_not_the_heads():
    params = make_params("kl", perturb=0.05)
    loss_fn = medusa2.make_loss_fn(CFG, medusa2.LossConfig("kl"))
    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    batch = medusa2.with_step(random_batch(), 0)
    flags = np.zeros(8, bool)
    (_, m_all), _ = grad(params, dict(batch, lm_only=flags))
    (_, m_ref), _ = grad(params, batch)  # no flag: the same as all False
    np.testing.assert_allclose(float(m_all["loss"]), float(m_ref["loss"]), rtol=1e-6)
    # half the rows anchor text: the heads see only the other half, the KL sees both
    flags[4:] = True
    (_, m_half), _ = grad(params, dict(batch, lm_only=flags))
    first = {k: v[:4] for k, v in batch.items()}
    (_, m_first), _ = grad(params, first)
    np.testing.assert_allclose(m_half["count"], m_first["count"])
    np.testing.assert_allclose(float(m_half["heads_loss"]), float(m_first["heads_loss"]),
                               rtol=1e-5)
    np.testing.assert_allclose(float(m_half["kl"]), float(m_ref["kl"]), rtol=1e-5)
    # only anchor rows: no head signal at all, yet the backbone still learns from the KL
    (_, m_none), g = grad(params, dict(batch, lm_only=np.ones(8, bool)))
    assert float(m_none["heads_loss"]) == 0.0 and not np.any(m_none["count"])
    assert all(not np.any(x) for x in jax.tree.leaves(g["heads"]))
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g["backbone"])) > 1e-4


@pytest.mark.slow
def test_head_weight_schedules_and_heads_train_the_backbone():
    sine = medusa2.head_weight_schedule(medusa2.LossConfig(head_schedule="sine",
                                                           head_ramp_steps=100))
    assert float(sine(0)) == 0.0
    np.testing.assert_allclose(float(sine(50)), 0.01 * np.sin(np.pi / 4), rtol=1e-6)
    assert float(sine(100)) == pytest.approx(0.01) and float(sine(1000)) == pytest.approx(0.01)
    assert float(medusa2.head_weight_schedule(medusa2.LossConfig())(7)) == pytest.approx(0.2)
    # the step in the batch drives lambda; the heads' loss reaches the backbone's gradient
    params = make_params("kl")
    loss_fn = medusa2.make_loss_fn(CFG, medusa2.LossConfig(head_schedule="sine",
                                                           head_ramp_steps=10))
    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (_, m), _ = grad(params, medusa2.with_step(random_batch(), 5))
    np.testing.assert_allclose(float(m["head_weight"]), 0.01 * np.sin(np.pi / 4), rtol=1e-6)
    np.testing.assert_allclose(float(m["loss"]), float(m["kl"]) + float(m["head_weight"])
                               * float(m["heads_loss"]), rtol=1e-5, atol=1e-7)
    (_, m), g = grad(params, medusa2.with_step(random_batch(), 10))
    assert float(m["head_weight"]) == pytest.approx(0.01)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g["backbone"])) > 1e-4


@pytest.mark.slow
def test_heads_learning_rate_is_ratio_times_backbones(ce_trainer):
    lr, ratio = 1e-3, 4.0  # make_trainer's
    fresh, step, _ = ce_trainer
    params = make_params("ce")
    before = host(params)
    state, m = step(fresh(params), medusa2.with_step(random_batch(), 0))
    after = host(state.params)
    assert float(m["lr"]) == pytest.approx(lr)

    def first_update(name):
        # Adam's first update is lr * g / (|g| + eps): lr for every element with |g| >> eps
        # (all of them in LM mode, bar embedding rows of absent tokens: exactly 0, left out)
        d = np.concatenate([np.abs(a - b).ravel() for a, b in zip(
            jax.tree.leaves(after[name]), jax.tree.leaves(before[name]))])
        return d[d > 0]

    bb, hd = first_update("backbone"), first_update("heads")
    assert bb.size > 1000 and hd.size > 1000
    np.testing.assert_allclose(np.median(bb), lr, rtol=0.02)
    np.testing.assert_allclose(np.median(hd) / np.median(bb), ratio, rtol=0.02)


@pytest.mark.slow
def test_teacher_is_frozen_and_has_no_optimizer_state(kl_trainer):
    fresh, step, _ = kl_trainer
    params = make_params("kl")
    before = host(params)
    state = fresh(params)
    for i in range(3):
        state, m = step(state, medusa2.with_step(random_batch(seed=i), i))
    after = host(state.params)
    for a, b in zip(jax.tree.leaves(before["teacher"]), jax.tree.leaves(after["teacher"])):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))  # bit-identical
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before["backbone"]),
                                                      jax.tree.leaves(after["backbone"]))]
    assert all(moved)
    assert float(m["kl"]) > 0  # the backbone left the teacher
    # Adam moments for backbone and heads leaves only: 2 x (backbone + heads), no teacher
    trained = jax.tree.leaves(before["backbone"]) + jax.tree.leaves(before["heads"])
    arrays = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
    assert sorted(x.shape for x in arrays) == sorted([x.shape for x in trained] * 2)
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu"))
            if hasattr(s, "mu")]
    assert len(adam) == 2  # one per trained partition
    for s in adam:
        assert isinstance(s.mu["teacher"], optax.MaskedNode)


@pytest.mark.slow
def test_exported_backbone_loads_in_transformers_with_equal_logits(ce_trainer, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from medusa_jax.model.weights import load_pretrained, save_pretrained

    src = tmp_path / "src"
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-6, tie_word_embeddings=False).save_pretrained(src)
    cfg = ModelConfig.from_dir(src)
    assert cfg.replace(bos_token_id=None, eos_token_id=()) == \
        CFG.replace(bos_token_id=None, eos_token_id=())
    fresh, step, _ = ce_trainer
    state = fresh(make_params("ce", seed=3))
    for i in range(2):  # fine-tune, so the export is not just the initial weights
        state, _ = step(state, medusa2.with_step(random_batch(seed=i), i))
    tuned = host(state.params["backbone"])
    out = save_pretrained(cfg, tuned, tmp_path / "model", source_dir=src)
    _, reloaded = load_pretrained(out)
    for a, b in zip(jax.tree.leaves(tuned), jax.tree.leaves(reloaded)):
        np.testing.assert_array_equal(a, np.asarray(b))

    tokens = np.random.default_rng(1).integers(0, 64, (2, 12)).astype(np.int32)
    cache = backbone.KVCache.init(cfg, 2, 12)
    ours, _, _ = backbone.forward(tuned, cfg, tokens, np.tile(np.arange(12), (2, 1)),
                                  backbone.causal_mask(cache.lengths, 12, 12), cache)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sharded_step_equals_single_device(kl_trainer):
    fresh1, step1, _ = kl_trainer
    fresh8, step8, shard8 = make_trainer("kl", mesh_spec="data=2,fsdp=4")
    one, many = fresh1(make_params("kl", perturb=0.05)), fresh8(make_params("kl", perturb=0.05))
    spec = shard8.params["backbone"]["layers"]["w_gate"].spec
    assert spec == jax.sharding.PartitionSpec(None, None, "fsdp")  # [L, H, F]: F split
    assert shard8.params["backbone"]["embed"].spec == jax.sharding.PartitionSpec("fsdp", None)
    assert len(many.params["backbone"]["layers"]["wq"].sharding.device_set) == 8
    for i in range(3):
        batch = medusa2.with_step(random_batch(seed=i), i)
        one, m1 = step1(one, batch)
        many, m8 = step8(many, batch)
        for k in ("loss", "kl", "heads_loss"):
            np.testing.assert_allclose(float(m1[k]), float(m8[k]), atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(host(one.params)), jax.tree.leaves(host(many.params))):
        np.testing.assert_allclose(a, b, atol=1e-5)
    mu = [s for s in jax.tree.leaves(many.opt_state, is_leaf=lambda s: hasattr(s, "mu"))
          if hasattr(s, "mu")][0].mu
    assert mu["backbone"]["layers"]["w_gate"].sharding.spec == spec  # Adam state sharded too


# ----------------------------------------------------------------------------- the CLI


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "train.medusa2", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, **kw)


def test_bad_flags_are_one_line_errors(tmp_path, capsys):
    from train.medusa2 import command

    cases = [(["--init", str(tmp_path / "nope")], "no such file or directory"),
             (["--init", str(tmp_path)], "neither a Medusa-1 run directory"),
             (["--head-lr-ratio", "0"], "--head-lr-ratio must be > 0"),
             (["--eval-text", str(tmp_path / "x.txt")], "no such file"),
             (["--anchor-text", str(tmp_path / "a.txt")], "--anchor-text"),
             (["--steps", "0"], "--steps must be >= 1"),
             (["--resume", str(tmp_path)], "no config.json there")]
    for args, message in cases:
        with pytest.raises(SystemExit):
            command.parse_args(args)
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)


@pytest.mark.slow
@pytest.mark.subprocess
def test_end_to_end_run_writes_model_and_heads_that_generate_loads(stories, tmp_path):
    from infer import generate

    cfg, params, _ = stories
    init = heads_formats.save_heads(tmp_path / "m1heads",
                                heads_lib.init_heads(cfg, params, heads_lib.HeadsConfig(3)), cfg)
    openings = (ROOT / "medusa_jax/assets/prompts/train_openings.txt").read_text().splitlines()
    records = [{"conversations": [{"from": "human", "value": o},
                                  {"from": "gpt", "value": " She liked to play in the park."}]}
               for o in openings[:24]]
    data_file = tmp_path / "d.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    text = tmp_path / "eval.txt"
    text.write_text("Once upon a time, there was a cat.\n\nThe cat liked to sleep in the sun.\n")
    run = tmp_path / "run"
    proc = _cli("--init", str(init.parent), "--data", str(data_file), "--lm-loss", "kl",
                "--template", "plain", "--steps", "3", "--batch-size", "4", "--seq-len", "64",
                "--log-every", "1", "--eval-every", "2", "--save-every", "2",
                "--eval-prompts", "0", "--heldout-fraction", "0.2", "--eval-text", str(text),
                "--anchor-text", str(text), "--tree", "mc_sim_7b_63:4", "--output-dir", str(run),
                "--medusa2-folder")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "anchor text (LM term only)" in out and "2 records" in out.split("anchor")[1]
    assert "held-out accuracy" in out and "perplexity" in out and "KL(original" in out
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all("kl" in r for r in train)
    assert train[0]["lr_heads"] == pytest.approx(4 * train[0]["lr"])
    assert (run / "accuracy.png").is_file() and sorted(
        p.name for p in (run / "checkpoints").iterdir()) == ["2", "3"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["closeness"]["eval_text"]["tokens"] > 10
    # the single Medusa-2 folder (reference layout) holds the same backbone and heads
    exported, _ = heads_formats.load_heads(run / "heads", cfg)
    folded, _ = heads_formats.load_heads(run / "medusa2_model", cfg)
    for name in ("w", "b", "proj"):
        np.testing.assert_array_equal(np.asarray(exported[name]), np.asarray(folded[name]))
    # the exported model + heads load and decode through the user-facing CLI
    rc = generate.main(["--model", str(run / "model"), "--heads", str(run / "heads"),
                        "--prompt", "Once upon a time", "--max-new-tokens", "6",
                        "--tree", "mc_sim_7b_63:4", "--json"])
    assert rc == 0
    # a finished run refuses to start over in place (checked before any work is done)
    from medusa_jax.training.checkpoint import CheckpointError
    from medusa_jax.training.recipes.medusa2 import Medusa2Config
    from train.medusa2 import command

    with pytest.raises(CheckpointError, match="already holds checkpoints; use --resume"):
        command.run(Medusa2Config(init=str(init.parent), data=(str(data_file),),
                              output_dir=str(run)))
