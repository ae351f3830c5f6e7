"""Acceptance rules. The key property: rejection sampling over the tree is lossless, i.e. the
tokens it emits follow exactly the distribution of plain sampling from the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding.acceptance import Sampling
from medusa_jax.decoding.decode import generate, medusa_generate, pad_prompts
from medusa_jax.decoding.tree import Tree

# The toy model (its config, tree, prompt, samplings, exact pair distribution and counts) is
# tests/conftest.py's `toy_lm`, its weights and heads `toy_medusa`: test_dynamic_tree and
# drafters/test_hydra use them too.


@pytest.mark.slow
@pytest.mark.parametrize("which, cpu_kernel", [(0, False), (1, False), (1, True)],
                         ids=["t1", "t0.7-topk-topp", "t0.7-topk-topp-cpu-kernel"])
def test_rejection_sampling_matches_plain_sampling_distribution(toy_lm, toy_medusa, chi_square_ok,
                                                                which, cpu_kernel,
                                                                monkeypatch):
    CFG, PROMPT, ROWS, TREE = toy_lm.CFG, toy_lm.PROMPT, toy_lm.ROWS, toy_lm.TREE
    sampling = toy_lm.SAMPLINGS[which]
    params, heads = toy_medusa
    if cpu_kernel:  # the decoding layout with every product on the CPU kernel
        from medusa_jax import kernels
        from medusa_jax.kernels import fewrow
        from medusa_jax.model.backbone import decoding_layout

        if not kernels.available():
            pytest.skip("the CPU kernel could not be built here")
        monkeypatch.setattr(fewrow, "MIN_BYTES", 0)
        params = decoding_layout(CFG, params)
        assert kernels.active(params)
    exact = toy_lm.exact_pair_distribution(params, sampling)
    tokens, lengths = pad_prompts([PROMPT] * ROWS)
    key = jax.random.key(42)

    plain = generate(params, CFG, tokens, lengths, key, sampling=sampling, max_new_tokens=3)
    ok, ratio = chi_square_ok(toy_lm.pair_counts(plain).ravel(), exact.ravel())
    assert ok, f"plain sampling itself is off (chi2/crit={ratio:.2f}): the test is broken"

    out = medusa_generate(params, heads, CFG, tokens, lengths, key, tree=TREE,
                          sampling=sampling, max_new_tokens=3)
    ok, ratio = chi_square_ok(toy_lm.pair_counts(out).ravel(), exact.ravel())
    assert ok, f"rejection sampling is not lossless: chi2/critical = {ratio:.2f}"
    # the tree really was used: many steps accepted speculated tokens
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0.2 * hist.sum()


def test_typical_acceptance_is_lossy_and_the_test_detects_it(toy_lm, toy_medusa, chi_square_ok):
    CFG, PROMPT, ROWS, TREE = toy_lm.CFG, toy_lm.PROMPT, toy_lm.ROWS, toy_lm.TREE
    params, heads = toy_medusa
    sampling = Sampling(mode="typical", temperature=1.0)
    exact = toy_lm.exact_pair_distribution(params, Sampling(mode="rejection", temperature=1.0))
    tokens, lengths = pad_prompts([PROMPT] * ROWS)
    out = medusa_generate(params, heads, CFG, tokens, lengths, jax.random.key(42), tree=TREE,
                          sampling=sampling, max_new_tokens=3)
    ok, ratio = chi_square_ok(toy_lm.pair_counts(out).ravel(), exact.ravel())
    assert not ok and ratio > 10


def test_typical_thresholds_and_tie_break(toy_lm):
    from medusa_jax.decoding.acceptance import typical

    V = toy_lm.V
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
