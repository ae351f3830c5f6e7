"""Acceptance rules. The key property: rejection sampling over the tree is lossless, i.e. the
tokens it emits follow exactly the distribution of plain sampling from the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding.acceptance import Sampling, log_probs
from medusa_jax.model.backbone import KVCache, causal_mask, forward, init_params
from medusa_jax.model.config import ModelConfig
from medusa_jax.decoding.decode import generate, medusa_generate, pad_prompts
from medusa_jax.drafters.medusa.heads import HeadsConfig, init_heads
from medusa_jax.decoding.tree import Tree

V = 8
CFG = ModelConfig(model_type="llama", vocab_size=V, hidden_size=16, intermediate_size=24,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                  max_position_embeddings=64)
TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
PROMPT = [1, 3, 5]
ROWS = 20000


@pytest.fixture(scope="module")
def tiny():
    params = init_params(CFG, jax.random.key(0), std=0.6)
    heads = init_heads(CFG, params, HeadsConfig(num_heads=2))
    noise = jax.random.split(jax.random.key(1), 3)
    heads = {k: v + 0.3 * jax.random.normal(n, v.shape) for (k, v), n in zip(heads.items(), noise)}
    return params, heads


def _next_logprobs(params, seqs, sampling):
    seqs = np.asarray(seqs)
    b, t = seqs.shape
    cache = KVCache.init(CFG, b, t)
    logits, _, _ = forward(params, CFG, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(t), (b, t)),
                           causal_mask(cache.lengths, t, t), cache)
    return np.exp(np.asarray(log_probs(logits[:, -1], sampling), np.float64))


def _exact_pair_distribution(params, sampling):
    """P(x1, x2) of plain sampling, [V, V]."""
    p1 = _next_logprobs(params, [PROMPT], sampling)[0]
    p2 = _next_logprobs(params, [PROMPT + [x] for x in range(V)], sampling)
    return p1[:, None] * p2


def _chi_square_ok(counts, probs, z=4.0):
    """Pearson chi-square with small cells pooled; accept unless p < ~3e-5 (z = 4)."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    if np.any(obs[~keep] > 0):
        return False, np.inf
    stat = np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep])
    df = keep.sum() - 1
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    return stat < crit, stat / crit


def _pair_counts(out):
    tokens = np.asarray(out.tokens)
    assert np.all(np.asarray(out.num_new) >= 2)
    counts = np.zeros((V, V))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    return counts


SAMPLINGS = [Sampling(mode="rejection", temperature=1.0),
             Sampling(mode="rejection", temperature=0.7, top_k=6, top_p=0.9)]


@pytest.mark.parametrize("sampling, cpu_kernel", [(SAMPLINGS[0], False), (SAMPLINGS[1], False),
                                                  (SAMPLINGS[1], True)],
                         ids=["t1", "t0.7-topk-topp", "t0.7-topk-topp-cpu-kernel"])
def test_rejection_sampling_matches_plain_sampling_distribution(tiny, sampling, cpu_kernel,
                                                                monkeypatch):
    params, heads = tiny
    if cpu_kernel:  # the decoding layout with every product on the CPU kernel
        from medusa_jax import kernels
        from medusa_jax.model.backbone import decoding_layout
        from medusa_jax.kernels import fewrow

        if not kernels.available():
            pytest.skip("the CPU kernel could not be built here")
        monkeypatch.setattr(fewrow, "MIN_BYTES", 0)
        params = decoding_layout(CFG, params)
        assert kernels.active(params)
    exact = _exact_pair_distribution(params, sampling)
    tokens, lengths = pad_prompts([PROMPT] * ROWS)
    key = jax.random.key(42)

    plain = generate(params, CFG, tokens, lengths, key, sampling=sampling, max_new_tokens=3)
    ok, ratio = _chi_square_ok(_pair_counts(plain).ravel(), exact.ravel())
    assert ok, f"plain sampling itself is off (chi2/crit={ratio:.2f}): the test is broken"

    out = medusa_generate(params, heads, CFG, tokens, lengths, key, tree=TREE,
                          sampling=sampling, max_new_tokens=3)
    ok, ratio = _chi_square_ok(_pair_counts(out).ravel(), exact.ravel())
    assert ok, f"rejection sampling is not lossless: chi2/critical = {ratio:.2f}"
    # the tree really was used: many steps accepted speculated tokens
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0.2 * hist.sum()


def test_typical_acceptance_is_lossy_and_the_test_detects_it(tiny):
    params, heads = tiny
    sampling = Sampling(mode="typical", temperature=1.0)
    exact = _exact_pair_distribution(params, Sampling(mode="rejection", temperature=1.0))
    tokens, lengths = pad_prompts([PROMPT] * ROWS)
    out = medusa_generate(params, heads, CFG, tokens, lengths, jax.random.key(42), tree=TREE,
                          sampling=sampling, max_new_tokens=3)
    ok, ratio = _chi_square_ok(_pair_counts(out).ravel(), exact.ravel())
    assert not ok and ratio > 10


def test_typical_thresholds_and_tie_break():
    from medusa_jax.decoding.acceptance import typical

    tree = Tree.from_paths([[0], [1]])
    # root's distribution: token 3 has p=0.5, token 4 p=0.3; threshold is min(0.09, 0.3*e^-H)
    probs = np.full(V, 0.2 / (V - 2))
    probs[3], probs[4] = 0.5, 0.3
    logits = jnp.log(jnp.asarray(np.tile(probs, (1, 3, 1)), jnp.float32))
    s = Sampling(mode="typical", temperature=1.0)
    best, acc, _ = typical(logits, jnp.array([[0, 4, 3]]), tree, s)
    assert int(acc[0]) == 1 and tree.paths[int(best[0])][1] == 2  # both accepted: likelier wins
    best, acc, _ = typical(logits, jnp.array([[0, 0, 1]]), tree, s)
    assert int(acc[0]) == 0  # 0.2/6 = 0.033 is below the threshold
