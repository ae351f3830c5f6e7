"""Soft targets (`training.targets`): the TV and KL objectives against numpy, the chunked soft
loss equal to the unchunked one, and the hard target and EAGLE-3's default unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.drafters.medusa import heads as heads_lib
from medusa_jax.model.backbone import init_params, logits_from_hidden
from medusa_jax.model.config import ModelConfig
from medusa_jax.training import step as ts
from medusa_jax.training import targets
from medusa_jax.training.recipes import medusa_loss as ml
from medusa_jax.training.recipes.hydra import teacher_ce

CFG = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                  max_position_embeddings=64)
K = 3


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


Z = np.array([[1.0, 0.0, -1.0, 0.5], [0.2, 2.0, -0.3, 0.0]])  # drafter logits
P_LOGITS = np.array([[0.0, 0.5, 0.2, -1.0], [1.0, 1.0, 0.0, -2.0]])  # backbone logits


@pytest.mark.parametrize("t", [1.0, 0.5, 2.0])
def test_tv_value_and_gradient_against_numpy(t):
    q, p = _softmax(Z / t), _softmax(P_LOGITS / t)
    tv = 0.5 * np.abs(p - q).sum(-1)
    # d TV / d z_j = sum_i 0.5 sign(q_i - p_i) dq_i/dz_j, dq_i/dz_j = q_i (d_ij - q_j) / T
    s = np.sign(q - p)
    grad = 0.5 / t * q * (s - (s * q).sum(-1, keepdims=True))
    loss = lambda z: targets.soft_loss(z, jnp.asarray(P_LOGITS), "tv", t)  # noqa: E731
    np.testing.assert_allclose(np.asarray(loss(jnp.asarray(Z))), tv, rtol=1e-5)
    g = np.asarray(jax.grad(lambda z: loss(z).sum())(jnp.asarray(Z)))
    np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)
    # the sign: a small step against the gradient raises the acceptance sum(min(p, q))
    after = _softmax((Z - 0.1 * g) / t)
    assert np.all(np.minimum(p, after).sum(-1) > np.minimum(p, q).sum(-1))
    # and the TV is 1 - sum(min(p, q))
    np.testing.assert_allclose(tv, 1 - np.minimum(p, q).sum(-1), rtol=1e-6)
    # the teacher gets no gradient
    gp = jax.grad(lambda y: targets.soft_loss(jnp.asarray(Z), y, "tv", t).sum())(
        jnp.asarray(P_LOGITS))
    assert not np.any(np.asarray(gp))


@pytest.mark.parametrize("t", [1.0, 0.8])
def test_kl_is_soft_cross_entropy_minus_entropy(t):
    q, p = _softmax(Z / t), _softmax(P_LOGITS / t)
    ce = -(p * np.log(q)).sum(-1)
    entropy = -(p * np.log(p)).sum(-1)
    kl = np.asarray(targets.soft_loss(jnp.asarray(Z), jnp.asarray(P_LOGITS), "kl", t))
    np.testing.assert_allclose(kl, ce - entropy, rtol=1e-5)
    both = np.asarray(targets.soft_loss(jnp.asarray(Z), jnp.asarray(P_LOGITS), "tv+kl", t))
    np.testing.assert_allclose(both, kl + 0.5 * np.abs(p - q).sum(-1), rtol=1e-5)
    # KL's gradient is the soft cross-entropy's: (q - p) / T
    g = jax.grad(lambda z: targets.soft_loss(z, jnp.asarray(P_LOGITS), "kl", t).sum())(
        jnp.asarray(Z))
    np.testing.assert_allclose(np.asarray(g), (q - p) / t, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def tiny():
    params = jax.jit(lambda k: init_params(CFG, k, std=0.6))(jax.random.key(0))
    heads = jax.jit(lambda p: heads_lib.init_heads(CFG, p, heads_lib.HeadsConfig(K, 1)))(params)
    noise = jax.random.normal(jax.random.key(1), heads["proj"].shape)
    return params, dict(heads, proj=heads["proj"] + 0.3 * noise)


def _batch(b=2, t=20, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)
    seg = jnp.concatenate([jnp.ones((b, 12), jnp.int32), jnp.full((b, t - 12), 2, jnp.int32)], 1)
    pos = jnp.concatenate([jnp.arange(12), jnp.arange(t - 12)])
    return {"tokens": tokens, "positions": jnp.broadcast_to(pos, (b, t)), "segments": seg,
            "loss_mask": jnp.broadcast_to(pos >= 2, (b, t))}


@pytest.mark.slow
@pytest.mark.parametrize("target", targets.SOFT)
def test_chunked_soft_loss_equals_the_unchunked_one(tiny, target):
    """Chunks of 7 tokens (T = 20: a padded last chunk), a reduced vocabulary too: the loss,
    every metric and the heads' gradient equal the whole-row computation."""
    params, heads = tiny
    batch = _batch()
    hidden = ts.backbone_hidden(params, CFG, batch)
    tgt, valid = ml.medusa_targets(batch, K)

    def run(heads, chunk, token_map=None):
        return ml.soft_loss(CFG, params, heads, hidden, tgt, valid, 0.8, target, 0.7, chunk,
                            token_map=token_map)

    @jax.jit
    def whole(heads):  # the unchunked computation, written out
        base = logits_from_hidden(CFG, params, hidden)
        return targets.shifted_soft_loss(heads_lib.apply_heads(heads, hidden), base, tgt,
                                         valid, 0.8, target, 0.7)

    for token_map in (None, np.array([0, 3, 4, 7, 9, 10, 20, 31])):
        h = heads if token_map is None else ml.reduce_heads(heads, token_map)
        one = jax.jit(lambda h: run(h, 20, token_map))
        chunked = jax.jit(lambda h: run(h, 7, token_map))
        (la, ma), ga = jax.value_and_grad(lambda h: one(h), has_aux=True)(h)
        (lb, mb), gb = jax.value_and_grad(lambda h: chunked(h), has_aux=True)(h)
        if token_map is None:
            lw, mw = whole(h)
            np.testing.assert_allclose(float(la), float(lw), rtol=1e-6)
            for k in mw:
                np.testing.assert_allclose(np.asarray(ma[k]), np.asarray(mw[k]), rtol=1e-6)
        np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
        assert float(la) > 0
        for k in ("head_loss", "top1", "top5", "count"):
            np.testing.assert_allclose(np.asarray(ma[k]), np.asarray(mb[k]), rtol=1e-5,
                                       atol=1e-7)
        for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_kl_target_has_the_teacher_losss_gradient(tiny):
    """Hydra++'s teacher loss is the soft cross-entropy: the kl target (at T 1) differs from
    it by p's entropy only, so the gradients agree."""
    params, heads = tiny
    batch = _batch(seed=3)
    hidden = ts.backbone_hidden(params, CFG, batch)
    base = logits_from_hidden(CFG, params, hidden)
    tgt, valid = ml.medusa_targets(batch, K)
    kl = lambda lg: targets.shifted_soft_loss(lg, base, tgt, valid, 0.8, "kl")[0]  # noqa
    ce = lambda lg: teacher_ce(lg, base, valid, 0.8)  # noqa: E731
    logits = heads_lib.apply_heads(heads, hidden)
    np.testing.assert_allclose(np.asarray(jax.grad(kl)(logits)),
                               np.asarray(jax.grad(ce)(logits)), rtol=1e-4, atol=1e-7)
    assert float(ce(logits)) > float(kl(logits)) > 0


def test_hard_target_is_the_loss_it_was(tiny):
    """--target hard (the default) computes exactly what the loss computed before targets:
    frozen hidden states, then `heads_loss`."""
    params, heads = tiny
    batch = _batch(seed=5)
    p = {"backbone": params, "heads": heads}

    def before(p, batch):
        hidden = ts.frozen_hidden(p["backbone"], CFG, batch)
        t, v = ml.medusa_targets(batch, K)
        return ml.heads_loss(p["heads"], hidden, t, v, 0.8, count=None)

    (lb, mb), gb = jax.jit(jax.value_and_grad(before, has_aux=True))(p, batch)
    for fn in (ml.medusa1_loss_fn(CFG, 0.8), ml.medusa1_loss_fn(CFG, 0.8, target="hard")):
        (la, ma), ga = jax.jit(jax.value_and_grad(fn, has_aux=True))(p, batch)
        assert np.array_equal(np.asarray(la), np.asarray(lb))
        for x, y in zip(jax.tree.leaves((ma, ga["heads"])), jax.tree.leaves((mb, gb["heads"]))):
            assert np.array_equal(np.asarray(x), np.asarray(y))


def test_eagle_default_target_is_the_references_loss():
    """ttt_loss's default (kl at T 1) is the reference's soft cross-entropy, bit for bit;
    tv and hard compute what they say."""
    from medusa_jax.drafters.eagle3 import heads as eagle3
    from medusa_jax.training.recipes.eagle3 import ttt_loss

    s, b, t, v = 2, 2, 6, 8
    c = eagle3.Eagle3Config(hidden_size=16, intermediate_size=24, num_heads=2, num_kv_heads=1,
                            head_dim=8, vocab_size=v, draft_vocab_size=v, aux_layers=(0, 1, 2))
    heads = {"t2d": jnp.ones((v,), bool), "d2t": jnp.zeros((v,), jnp.int32)}
    logits = jax.random.normal(jax.random.key(0), (s, b, t, v))
    tgt = 2 * jax.random.normal(jax.random.key(1), (b, t, v))
    masks = jnp.ones((s, b, t))
    default = ttt_loss(heads, c, logits, tgt, masks)
    kl = ttt_loss(heads, c, logits, tgt, masks, target="kl", temperature=1.0)
    want = []  # the reference's form
    p = jax.nn.softmax(tgt, axis=-1)
    for i in range(s):
        ce = -jnp.sum(eagle3.shift(p, i + 1) * jax.nn.log_softmax(logits[i], axis=-1), -1)
        want.append(jnp.mean(eagle3.shift(jnp.ones((b, t)), i + 1) * ce))
    for x, y in zip(jax.tree.leaves(default), jax.tree.leaves(kl)):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_allclose(np.asarray(default[1]), np.asarray(jnp.stack(want)), rtol=1e-6)
    # tv at T 0.5 and hard, against numpy
    lg, tg = np.asarray(logits, np.float64), np.asarray(tgt, np.float64)
    tv = ttt_loss(heads, c, logits, tgt, masks, target="tv", temperature=0.5)[1]
    hard = ttt_loss(heads, c, logits, tgt, masks, target="hard")[1]
    for i in range(s):
        pi = np.roll(_softmax(tg / 0.5), -(i + 1), axis=1)
        qi = _softmax(lg[i] / 0.5)
        keep = np.arange(t) < t - i - 1  # shifted past the end: not counted
        tv_i = (0.5 * np.abs(pi - qi).sum(-1) * keep).mean()
        np.testing.assert_allclose(float(tv[i]), tv_i, rtol=1e-5)
        greedy = np.roll(tg.argmax(-1), -(i + 1), axis=1)
        logq = np.log(_softmax(lg[i]))
        ce = -np.take_along_axis(logq, greedy[..., None], -1)[..., 0]
        np.testing.assert_allclose(float(hard[i]), (ce * keep).mean(), rtol=1e-5)


def test_hydra_soft_target_is_the_shifted_soft_loss():
    """train.hydra --target tv: its heads' teacher-forced logits against the backbone's
    distribution at each target position, as `shifted_soft_loss` says."""
    from medusa_jax.drafters.hydra import heads as hydra
    from medusa_jax.training.recipes.hydra import hydra_loss_fn

    params = jax.jit(lambda k: init_params(CFG, k, std=0.6))(jax.random.key(0))
    heads = jax.jit(lambda p: hydra.init_hydra(CFG, p, K, 1))(params)
    batch = _batch(seed=7)

    @jax.jit
    def run(params, heads, batch):
        got = hydra_loss_fn(CFG, 0.8, target="tv", temperature=0.7)(
            {"backbone": params, "heads": heads}, batch)
        hidden = ts.backbone_hidden(params, CFG, batch)
        emb = hydra.embed(params["embed"], batch["tokens"], hidden.dtype)
        logits = hydra.teacher_forced_logits(heads, hidden, emb)
        tgt, valid = ml.medusa_targets(batch, K)
        want = targets.shifted_soft_loss(logits, logits_from_hidden(CFG, params, hidden), tgt,
                                         valid, 0.8, "tv", 0.7)
        return got, want

    (lg, mg), (lw, mw) = run(params, heads, batch)
    np.testing.assert_allclose(float(lg), float(lw), rtol=1e-6)
    assert 0 < float(lg)
    for k in mw:
        np.testing.assert_allclose(np.asarray(mg[k]), np.asarray(mw[k]), rtol=1e-6)
