"""Training at scale on small shapes: the chunked heads' loss equals the unchunked one and
never holds [K, B, T, V]; gradient accumulation equals one larger batch; the frozen backbone
in passes of a few rows equals one pass; shared-projection heads train only their blocks."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters.medusa import heads as heads_lib
from medusa_jax.model import backbone
from medusa_jax.model.config import ModelConfig
from medusa_jax.runtime import sharding
from medusa_jax.training import step as ts
from medusa_jax.training.recipes import medusa_loss as ml

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=24,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                  max_position_embeddings=128)
K = 3


def trained_heads(seed=0, layers=2):
    """Heads with non-zero blocks (init_heads' zero blocks would hide mistakes there)."""
    bb = backbone.init_params(CFG, jax.random.key(seed), std=0.2)
    heads = heads_lib.init_heads(CFG, bb, heads_lib.HeadsConfig(K, layers))
    ks = jax.random.split(jax.random.key(seed + 1), 3)
    heads = {"w": 0.3 * jax.random.normal(ks[0], heads["w"].shape),
             "b": 0.1 * jax.random.normal(ks[1], heads["b"].shape),
             "proj": heads["proj"] + 0.3 * jax.random.normal(ks[2], heads["proj"].shape)}
    return bb, heads


def random_batch(b=8, t=16, seed=0):
    """Packed rows whose examples and labels differ from row to row (so micro-batches hold
    different numbers of valid positions)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, (b, t)).astype(np.int32)
    segments = np.zeros((b, t), np.int32)
    positions = np.zeros((b, t), np.int32)
    for r in range(b):
        cut = int(rng.integers(4, t - 2))
        end = int(rng.integers(cut + 2, t + 1))  # a padded tail on some rows
        segments[r, :cut], segments[r, cut:end] = 1, 2
        positions[r, :cut], positions[r, cut:end] = np.arange(cut), np.arange(end - cut)
    loss_mask = (positions >= rng.integers(1, 4, (b, 1))) & (segments > 0)
    return {"tokens": tokens, "positions": positions, "segments": segments,
            "loss_mask": loss_mask}


def _unchunked(heads, hidden, targets, valid):
    return ml.medusa_loss(heads_lib.apply_heads(heads, hidden), targets, valid, 0.8)


@pytest.mark.slow
def test_chunked_loss_equals_unchunked_loss_metrics_and_gradients():
    chunk = 7  # 16 tokens per row: 2 full chunks and a padded last one
    _, heads = trained_heads()
    batch = random_batch(b=4, t=16)
    hidden = jax.random.normal(jax.random.key(3), (4, 16, CFG.hidden_size))
    targets, valid = ml.medusa_targets(batch, K)

    def both(h, x):  # one compile: losses, metrics and gradients of both
        ref = jax.value_and_grad(lambda h, x: _unchunked(h, x, targets, valid), argnums=(0, 1),
                                 has_aux=True)(h, x)
        got = jax.value_and_grad(lambda h, x: ml.chunked_medusa_loss(
            h, x, targets, valid, 0.8, chunk), argnums=(0, 1), has_aux=True)(h, x)
        return ref, got

    ((ref, ref_m), g_ref), ((got, got_m), g_got) = jax.jit(both)(heads, hidden)
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-6)
    for key in ("head_loss", "top1", "top5", "count"):
        np.testing.assert_allclose(np.asarray(got_m[key]), np.asarray(ref_m[key]),
                                   rtol=1e-6, atol=1e-7, err_msg=key)
    assert 0 < float(ref_m["top5"][0]) < 1  # the ranks are exercised, not trivially 0 or 1
    # gradients with respect to the heads and to the hidden state (Medusa-2 trains through it)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got)):
        assert np.any(np.asarray(a))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=1e-6)


def _largest_intermediate(jaxpr) -> int:
    """The most elements of any value computed in a jaxpr, sub-jaxprs (scan, checkpoint,
    custom derivatives) included."""
    most = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            most = max(most, int(np.prod(getattr(v.aval, "shape", ()) or (1,))))
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    most = max(most, _largest_intermediate(getattr(inner, "jaxpr", inner)))
    return most


@pytest.mark.slow
def test_chunked_loss_and_its_gradient_never_hold_all_logits():
    _, heads = trained_heads()
    b, t, chunk = 8, 32, 4  # a chunk's logits [K, 8, 4, V] outsize every parameter
    batch = random_batch(b=b, t=t)
    hidden = jnp.zeros((b, t, CFG.hidden_size))
    targets, valid = ml.medusa_targets(batch, K)
    everything = K * b * t * CFG.vocab_size

    def grad(fn):
        return jax.make_jaxpr(jax.grad(lambda h, x: fn(h, x)[0], argnums=(0, 1)))(
            heads, hidden).jaxpr

    assert _largest_intermediate(grad(lambda h, x: _unchunked(h, x, targets, valid))) \
        >= everything  # the check sees the unchunked logits
    chunked = _largest_intermediate(grad(lambda h, x: ml.chunked_medusa_loss(
        h, x, targets, valid, 0.8, chunk)))
    assert heads["proj"].size <= chunked <= K * b * chunk * CFG.vocab_size < everything


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True])
def test_vocab_chunked_loss_equals_unchunked_loss_metrics_and_gradients(shared):
    """Over 8 vocabulary chunks (columns j, j + 8, ...): the same loss, metrics and
    gradients (heads and hidden state) as the one-block loss; a frozen shared projection
    gets no gradient and its blocks the same ones."""
    _, heads = trained_heads()
    if shared:
        heads = dict(heads, proj=heads["proj"][:1])
    batch = random_batch(b=4, t=16)
    hidden = jax.random.normal(jax.random.key(3), (4, 16, CFG.hidden_size))
    targets, valid = ml.medusa_targets(batch, K)

    def both(h, x):
        ref = jax.value_and_grad(lambda h, x: _unchunked(h, x, targets, valid), argnums=(0, 1),
                                 has_aux=True)(h, x)
        got = jax.value_and_grad(lambda h, x: ml.vocab_chunked_medusa_loss(
            h, x, targets, valid, 0.8, 8, train_proj=not shared), argnums=(0, 1),
            has_aux=True)(h, x)
        return ref, got

    ((ref, ref_m), g_ref), ((got, got_m), g_got) = jax.jit(both)(heads, hidden)
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-6)
    for key in ("head_loss", "top1", "top5", "count"):
        np.testing.assert_allclose(np.asarray(got_m[key]), np.asarray(ref_m[key]),
                                   rtol=1e-6, atol=1e-7, err_msg=key)
    assert 0 < float(ref_m["top5"][0]) < 1
    if shared:
        assert not np.any(np.asarray(g_got[0]["proj"]))
        g_ref[0]["proj"] = g_got[0]["proj"]
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got)):
        assert shared or np.any(np.asarray(a))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=1e-6)


def test_loss_chunking_picks_the_vocabulary_for_large_trained_projections():
    # the embedded model's default job: one block
    assert ml.loss_chunking(256, 16, 5, 512) == ("one", 256)
    # Llama 3's 128,256 words, 4 rows of 2,048 tokens: 48 chunks of 2,672 columns, each
    # chunk's logits [5, 8,192, 2,672] float32 under 512 MiB and the next divisor's over
    how, n = ml.loss_chunking(2048, 4, 5, 128256)
    assert how == "vocab" and n == 48
    assert 5 * 8192 * (128256 // 48) * 4 <= ml.AUTO_CHUNK_BYTES < 5 * 8192 * (128256 // 39) * 4
    assert ml.loss_chunking(2048, 4, 5, 128254)[0] == "tokens"  # 2 x 64,127: no divisor
    # a frozen shared projection has no gradient to cut: token chunks
    assert ml.loss_chunking(2048, 4, 5, 128256, proj_heads=1, train_proj=False)[0] == "tokens"
    # Llama 2's 32,000 words at 8 rows: the heads' states of 16,384 tokens outweigh it
    assert ml.loss_chunking(2048, 8, 5, 32000) == ("tokens", 64)
    assert ml.loss_chunking(2048, 4, 5, 128256, chunk=300) == ("tokens", 300)


def test_chunk_size_is_automatic_and_one_block_when_everything_fits():
    # the embedded model's default job (16 rows x 256 tokens, 512 words): one block, today's
    assert ml.loss_chunk_size(256, 16, 5, 512) == 256
    # Llama-2-7B's 32,000 words, 5 heads, 8 rows a device: the largest power of two of
    # tokens per row whose logits stay under 512 MiB
    size = ml.loss_chunk_size(2048, 8, 5, 32000)
    per_token = 5 * 8 * 32000 * 4
    assert size == 64 and size * per_token <= ml.AUTO_CHUNK_BYTES < 2 * size * per_token
    assert ml.loss_chunk_size(2048, 1, 5, 32000) == 512  # 1 row a device (fsdp=8)
    assert ml.loss_chunk_size(2048, 8, 5, 32000, chunk=300) == 300
    assert ml.loss_chunk_size(100, 8, 5, 32000, chunk=300) == 100


def _step(grad_accum, mesh_spec="1,1"):
    bb, heads = trained_heads()
    params = {"backbone": bb, "heads": heads}
    labels = ml.medusa1_labels(params)
    tx, schedule = ts.make_optimizer(ts.OptimConfig(lr=1e-2, warmup_ratio=0.0), 10, labels)
    mesh = sharding.make_mesh(mesh_spec)
    shardings = ts.state_shardings(jax.eval_shape(lambda p: ts.init_state(p, tx), params),
                                   ts.param_axes(CFG, params), mesh)
    step = ts.make_train_step(ml.medusa1_loss_fn(CFG, 0.8), tx, labels, shardings, mesh,
                              schedule, grad_accum=grad_accum,
                              totals_fn=lambda b: ml.medusa_totals(b, K))
    return jax.device_put(ts.init_state(params, tx), shardings), step


@pytest.mark.slow
def test_gradient_accumulation_equals_one_larger_batch():
    # on two devices: each micro-batch's rows stay split over the batch axis
    mesh_spec = "data=2" if jax.device_count() >= 2 else "1,1"
    batch = random_batch(b=8)
    _, valid = ml.medusa_targets(batch, K)
    per_micro = np.asarray(valid).reshape(K, 2, 4, -1).sum(axis=(2, 3))
    assert len(set(per_micro[0].tolist())) > 1  # micro-batches hold different counts
    one, step1 = _step(1)
    acc, step4 = _step(4, mesh_spec)
    for i in range(2):
        batch = random_batch(b=8, seed=i)
        one, m1 = step1(one, batch)
        acc, m4 = step4(acc, batch)
        for key in ("loss", "head_loss", "top1", "top5", "count", "grad_norm", "lr"):
            np.testing.assert_allclose(np.asarray(m4[key]), np.asarray(m1[key]), rtol=2e-5,
                                       atol=1e-7, err_msg=key)
    # Adam divides by sqrt(v): where a gradient is ~0 its rounding moves the update, so the
    # parameters agree to 2% of one step (lr 1e-2), the gradient norms above to 2e-5
    for name in ("w", "b", "proj"):
        np.testing.assert_allclose(np.asarray(acc.params["heads"][name]),
                                   np.asarray(one.params["heads"][name]), atol=2e-4)
    # the frozen backbone is untouched and has no optimizer state
    for a, b in zip(jax.tree.leaves(one.params["backbone"]), jax.tree.leaves(acc.params["backbone"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_frozen_backbone_in_passes_of_a_few_rows_equals_one_pass(monkeypatch):
    bb, _ = trained_heads()
    batch = random_batch(b=8)
    whole = jax.jit(lambda p, b: ts.backbone_hidden(p, CFG, b))(bb, batch)
    # scores of 2 rows fit: 4 passes of rows (0, 4), (1, 5), ...
    monkeypatch.setattr(ts, "FROZEN_PASS_BYTES", 2 * CFG.num_heads * 16 * 16 * 4)
    assert ts.frozen_pass_rows(CFG, 8, 16) == 2
    jaxpr = jax.make_jaxpr(lambda p, b: ts.frozen_hidden(p, CFG, b))(bb, batch)
    assert "scan" in str(jaxpr)  # really in passes
    parts = jax.jit(lambda p, b: ts.frozen_hidden(p, CFG, b))(bb, batch)
    # XLA:CPU rounds a product of 2 rows differently from one of 8 (another code path):
    # float32 rounding of hidden states of order 1, so 1e-5 absolute
    np.testing.assert_allclose(np.asarray(parts), np.asarray(whole), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_shared_projection_heads_train_only_their_blocks_and_export_to_vllm(tmp_path):
    from medusa_jax.drafters import formats as heads_formats
    from medusa_jax.training.recipes.medusa1 import Medusa1, Medusa1Config

    cfg = Medusa1Config(num_heads=K, num_layers=1, batch_size=8, seq_len=16, lr=1e-2,
                        shared_proj=True)
    bb = backbone.init_params(CFG, jax.random.key(0), std=0.2)
    params = Medusa1.params(cfg, CFG, bb)
    assert params["heads"]["proj"].shape == (1, CFG.hidden_size, CFG.vocab_size)
    method = Medusa1.method(cfg, CFG, params, 10)
    mesh = sharding.make_mesh("1,1")
    state, shardings = ts.create_state(params, method.tx, mesh, ts.param_axes(CFG, params))
    proj = np.asarray(state.params["heads"]["proj"]).copy()
    step = ts.make_train_step(method.loss_fn, method.tx, method.labels, shardings, mesh,
                              method.schedule)
    for i in range(2):
        state, m = step(state, random_batch(seed=i))
    heads = jax.tree.map(np.asarray, state.params["heads"])
    np.testing.assert_array_equal(heads["proj"].view(np.uint32), proj.view(np.uint32))
    assert np.any(heads["w"]) and np.any(heads["b"])
    # Adam moments for the blocks only (w, b), nothing shaped like the projection
    shapes = sorted(tuple(x.shape) for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0)
    assert shapes == sorted([heads["w"].shape, heads["b"].shape] * 2)
    # vLLM's form: one original_lm_head, and it reads back as the same heads
    heads_formats.write_vllm(heads, tmp_path / "vllm")
    conf = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert conf["original_lm_head"] is True
    back, _ = heads_formats.load_heads(tmp_path / "vllm", CFG)
    for name in ("w", "b", "proj"):
        np.testing.assert_allclose(np.asarray(back[name]), heads[name], rtol=1e-6)


def test_shared_projection_refuses_heads_with_their_own(tmp_path, capsys):
    from train.medusa2 import command

    heads = heads_lib.init_heads(CFG, backbone.init_params(CFG, jax.random.key(0)),
                                 heads_lib.HeadsConfig(K, 1))
    heads_formats.save_heads(tmp_path / "own", heads, CFG)
    with pytest.raises(SystemExit) as e:
        command.parse_args(["--init", str(tmp_path / "own"), "--shared-proj"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--shared-proj: the heads in" in err[-1] and "have their own projections" in err[-1]


@pytest.mark.slow
def test_reduced_vocabulary_loss_is_the_full_loss_over_its_tokens_chunked_or_not():
    """The reduced heads' loss = the full-vocabulary loss of the same heads restricted to
    those columns (-inf elsewhere), over the positions whose target is kept; a target
    outside is a miss, and the means still divide by every valid position."""
    bb, heads = trained_heads()
    batch = random_batch(b=4, t=16)
    hidden = jax.random.normal(jax.random.key(3), (4, 16, CFG.hidden_size))
    targets, valid = ml.medusa_targets(batch, K)
    token_map, covered = ml.frequent_tokens(batch["tokens"], batch["loss_mask"],
                                            CFG.vocab_size, 24)
    assert len(token_map) == 24 and 0 < covered < 1
    index = ml.reduced_token_index(token_map, CFG.vocab_size)
    reduced = ml.reduce_heads(heads, token_map)
    kept = index[0][np.asarray(targets)] >= 0
    assert kept[np.asarray(valid)].any() and not kept[np.asarray(valid)].all()

    def both(h):
        got = ml.heads_loss(ml.reduce_heads(h, token_map), hidden, targets, valid, 0.8,
                            chunk=16, token_index=jnp.asarray(index))
        chunked = ml.heads_loss(ml.reduce_heads(h, token_map), hidden, targets, valid, 0.8,
                                chunk=5, token_index=jnp.asarray(index))
        # the decoding form: full-vocabulary logits, -inf outside the map
        full = heads_lib.apply_heads(dict(ml.reduce_heads(h, token_map),
                                          token_index=jnp.asarray(index)), hidden)
        safe_targets = jnp.where(jnp.asarray(kept), targets, token_map[0])
        ref = ml.medusa_loss(full, safe_targets, valid & jnp.asarray(kept), 0.8,
                             count=jnp.sum(valid, axis=(1, 2)).astype(jnp.float32))
        return got, chunked, ref

    fns = [lambda h, i=i: both(h)[i][0] for i in range(3)]
    (got, chunked, ref) = jax.jit(both)(heads)
    for out in (got, chunked):
        np.testing.assert_allclose(float(out[0]), float(ref[0]), rtol=1e-6)
        for key in ("head_loss", "top1", "top5"):
            np.testing.assert_allclose(np.asarray(out[1][key]), np.asarray(ref[1][key]),
                                       rtol=1e-6, atol=1e-7, err_msg=key)
        np.testing.assert_array_equal(np.asarray(out[1]["count"]),
                                      np.asarray(valid).sum((1, 2)))
    # a miss is a miss: top-5 never reaches the kept fraction's ceiling from outside it
    ceiling = (kept & np.asarray(valid)).sum((1, 2)) / np.asarray(valid).sum((1, 2))
    assert np.all(np.asarray(got[1]["top5"]) <= ceiling + 1e-6)
    g = [jax.grad(f)(heads)["proj"] for f in fns]
    np.testing.assert_allclose(np.asarray(g[0]), np.asarray(g[2]), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g[1]), np.asarray(g[2]), rtol=2e-5, atol=1e-6)
    del bb, reduced


@pytest.mark.slow
def test_reduced_vocabulary_run_writes_token_map_heads_that_decode_exactly(tmp_path):
    """train.medusa1 --reduced-vocab on the embedded model: the artifact holds token_index,
    exports to vLLM's token_map form, and greedy Medusa with it equals plain greedy."""
    from medusa_jax.api import Medusa
    from medusa_jax.drafters import formats as heads_formats
    from train.medusa1 import command

    run = tmp_path / "run"
    cfg, _, _ = command.parse_args(["--reduced-vocab", "128", "--steps", "3", "--batch-size", "4",
                              "--seq-len", "64", "--distill-samples", "16",
                              "--distill-max-new-tokens", "48", "--eval-prompts", "0",
                              "--num-layers", "1", "--output-dir", str(run)])
    command.run(cfg)
    heads, _ = heads_formats.load_heads(run / "heads", Medusa.load().cfg)
    assert heads["proj"].shape[-1] == 128 and heads["token_index"].shape == (1, 512)
    index = np.asarray(heads["token_index"][0])
    assert (index >= 0).sum() == 128 and sorted(index[index >= 0]) == list(range(128))
    heads_formats.write_vllm(jax.tree.map(np.asarray, heads), tmp_path / "vllm")
    conf = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert conf["truncated_vocab_size"] == 128
    m = Medusa.load(heads=str(tmp_path / "vllm"))
    prompts = ["Once upon a time", "The little dog"]
    medusa = m.generate(prompts, max_new_tokens=24)
    plain = m.generate(prompts, max_new_tokens=24, medusa=False)
    assert [g.token_ids for g in medusa] == [g.token_ids for g in plain]
    assert max(g.tokens_per_step for g in medusa) > 1  # the reduced heads are used


def test_reduced_vocabulary_errors_before_any_work(capsys):
    from train.medusa1 import command

    with pytest.raises(SystemExit) as e:
        command.parse_args(["--reduced-vocab", "-1"])
    assert e.value.code == 2 and "--reduced-vocab must be >= 0" in capsys.readouterr().err
    from medusa_jax.training.recipes.medusa1 import Medusa1Config, check_reduced_vocab

    with pytest.raises(ValueError, match="--reduced-vocab 512 is not below the model's "
                                         "vocabulary of 512 tokens"):
        check_reduced_vocab(Medusa1Config(reduced_vocab=512), 512)


def test_medusa2_refuses_reduced_vocabulary_heads(tmp_path, capsys):
    from medusa_jax.api import Medusa
    from train.medusa2 import command

    m = Medusa.load()
    heads = heads_lib.init_heads(m.cfg, m.params, heads_lib.HeadsConfig(K, 1))
    token_map = np.arange(0, 512, 2, dtype=np.int32)
    heads = dict(ml.reduce_heads(heads, token_map),
                 token_index=ml.reduced_token_index(token_map, 512))
    heads_formats.save_heads(tmp_path / "reduced", heads, m.cfg)
    with pytest.raises(SystemExit) as e:
        command.main(["--init", str(tmp_path / "reduced"), "--output-dir", str(tmp_path / "run"),
                      "--eval-prompts", "0"])
    err = str(e.value.code)  # SystemExit("error: ..."): one line, exit status 1
    assert err.startswith("error: --init ") and "\n" not in err
    assert "cover a reduced vocabulary (token_map)" in err and str(tmp_path / "reduced") in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_remat_gives_the_same_backbone_gradients():
    bb, _ = trained_heads()
    batch = random_batch(b=2)

    def grads(remat):
        return jax.jit(jax.grad(lambda p: jnp.sum(
            ts.backbone_hidden(p, CFG, batch, remat) ** 2)))(bb)

    for a, b in zip(jax.tree.leaves(grads(False)), jax.tree.leaves(grads(True))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_medusa2_accumulation_equals_one_batch_and_bfloat16_keeps_float32_state():
    from medusa_jax.training.recipes import medusa2

    bb, heads = trained_heads(layers=1)
    cfg16 = CFG.replace(param_dtype="float32", compute_dtype="bfloat16")
    params = medusa2.make_params(bb, heads, "kl", teacher_dtype="bfloat16")
    assert params["teacher"]["embed"].dtype == jnp.bfloat16
    lbl = medusa2.labels(params)
    tx, schedule = medusa2.make_joint_optimizer(ts.OptimConfig(lr=1e-3, warmup_ratio=0.0),
                                                10, lbl)
    loss_fn = medusa2.make_loss_fn(cfg16, medusa2.LossConfig(lm_loss="kl"))
    batch = medusa2.with_step(random_batch(b=4), 0)
    batch["lm_only"] = np.array([False, True, False, False])  # an anchor row
    mesh = sharding.make_mesh("1,1")
    out = {}
    for n in (1, 2):
        state, sh = ts.create_state(params, tx, mesh, ts.param_axes(CFG, params))
        step = ts.make_train_step(loss_fn, tx, lbl, sh, mesh, schedule, grad_accum=n,
                                  totals_fn=lambda b: medusa2.loss_totals(b, K),
                                  mean_metrics=medusa2.MEAN_METRICS)
        out[n] = step(state, batch)
    (s1, m1), (s2, m2) = out[1], out[2]
    for key in ("loss", "kl", "lm_nll", "heads_loss", "top1", "count", "head_weight",
                "grad_norm"):
        np.testing.assert_allclose(np.asarray(m2[key]), np.asarray(m1[key]), rtol=1e-4,
                                   atol=1e-6, err_msg=key)
    # master weights and Adam moments stay float32; the teacher is untouched
    mu = [s for s in jax.tree.leaves(s2.opt_state, is_leaf=lambda s: hasattr(s, "mu"))
          if hasattr(s, "mu")]
    assert all(x.dtype == jnp.float32 for m in mu for x in jax.tree.leaves(m.mu))
    assert s2.params["backbone"]["embed"].dtype == jnp.float32
    assert not np.array_equal(np.asarray(s2.params["backbone"]["embed"]), np.asarray(bb["embed"]))
