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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=0.01), dict(top_k=2, top_p=0.5)],
                         ids=["top_k=1", "top_p=0.01", "top_k=2-top_p=0.5"])
def test_typical_never_accepts_a_token_top_k_or_top_p_removes(toy_lm, filters):
    """At the root, token 3 has p=0.5 and token 4 p=0.3: both pass the typical threshold,
    but top-k 1 or top-p 0.01 (or 0.5) keep token 3 alone, so token 4 must be refused, in a
    static Sampling and in per-row `Rows` (the serving engine's)."""
    from medusa_jax.decoding.acceptance import Rows, typical

    V = toy_lm.V
    tree = Tree.from_paths([[0]])
    probs = np.full(V, 0.2 / (V - 2))
    probs[3], probs[4] = 0.5, 0.3
    logits = jnp.log(jnp.asarray(np.tile(probs, (1, 2, 1)), jnp.float32))
    unfiltered = Sampling(mode="typical", temperature=1.0)
    _, acc, _ = typical(logits, jnp.array([[0, 4]]), tree, unfiltered)
    assert int(acc[0]) == 1  # the test can fail: without filters token 4 is accepted
    s = Sampling(mode="typical", temperature=1.0, **filters)
    mixed = Rows.of(s, 1, 8)
    mixed = mixed.replace(same=None, modes=("greedy", "typical"), mode=jnp.ones(1, jnp.int32))
    for rule in (s, Rows.of(s, 1, 8), mixed):
        _, acc, _ = typical(logits, jnp.array([[0, 4]]), tree, rule)
        assert int(acc[0]) == 0, rule
        best, acc, root = typical(logits, jnp.array([[0, 3]]), tree, rule)
        assert int(acc[0]) == 1 and int(root[0]) == int(jnp.argmax(logits[0, 1]))


@pytest.mark.slow
def test_typical_with_top_k_1_decodes_as_plain_greedy(toy_lm, toy_medusa):
    """The issue's case end to end: typical acceptance at top-k 1 keeps only the argmax at
    every node, so its output is plain greedy decoding's, token for token (and without the
    filter the toy heads' guesses do change it: the comparison can fail)."""
    CFG, TREE = toy_lm.CFG, toy_lm.TREE
    params, heads = toy_medusa
    prompts = [[1] + list(np.random.default_rng(i).integers(3, toy_lm.V, 4)) for i in range(16)]
    tokens, lengths = pad_prompts(prompts)
    key = jax.random.key(3)
    plain = generate(params, CFG, tokens, lengths, key, sampling=Sampling(), max_new_tokens=12)
    want = np.asarray(plain.tokens)

    def typical_out(**filters):
        s = Sampling(mode="typical", temperature=0.7, **filters)
        out = medusa_generate(params, heads, CFG, tokens, lengths, key, tree=TREE, sampling=s,
                              max_new_tokens=12)
        return np.asarray(out.tokens)

    assert not np.array_equal(typical_out(), want)
    np.testing.assert_array_equal(typical_out(top_k=1), want)
    np.testing.assert_array_equal(typical_out(top_p=0.01), want)


@pytest.mark.slow
def test_sampled_drafts_stay_lossless_over_skipped_ranks_and_an_exhausted_support(
        toy_lm, toy_medusa, chi_square_ok):
    """Rejection rows draw their drafts from the heads (`step.DraftSampler`). The tree skips
    ranks (the root's 2nd draft and node [2]'s first three are no child: accepting one ends
    the path), and top-k 2 leaves each head 2 tokens to draw from, so the 3rd and 4th drafts
    lie outside the draft distribution's support (offered as deterministic drafts)."""
    CFG, PROMPT, ROWS = toy_lm.CFG, toy_lm.PROMPT, toy_lm.ROWS
    params, heads = toy_medusa
    tree = Tree.from_paths([[0], [2], [0, 1], [2, 3]])
    for sampling in (Sampling(mode="rejection", temperature=0.7, top_k=2),
                     Sampling(mode="rejection", temperature=1.0)):
        exact = toy_lm.exact_pair_distribution(params, sampling)
        tokens, lengths = pad_prompts([PROMPT] * ROWS)
        out = medusa_generate(params, heads, CFG, tokens, lengths, jax.random.key(5),
                              tree=tree, sampling=sampling, max_new_tokens=3)
        ok, ratio = chi_square_ok(toy_lm.pair_counts(out).ravel(), exact.ravel())
        assert ok, f"{sampling}: sampled drafts are not lossless: chi2/critical = {ratio:.2f}"
        hist = np.asarray(out.accept_hist).sum(0)
        assert hist[2:].sum() > 0.1 * hist.sum()  # drafts were accepted


@pytest.mark.slow
def test_rejection_drafted_rule_on_a_hand_computable_node():
    """One node, target p = (0.5, 0.3, 0.2), draft q = (0.2, 0.8, 0): x1 = token 1 is
    accepted with min(1, 0.3 / 0.8) = 0.375; then p' = max(p - q, 0) = (0.3, 0, 0.2) / 0.5
    and q' = q without token 1 = (1, 0, 0): x2 = token 0 is accepted with 0.6; else the
    bonus is drawn from max(p' - q', 0) = token 2. So the next root is token 1 w.p. 0.375,
    token 0 w.p. 0.625 * 0.6 = 0.375 and token 2 w.p. 0.25 (= p: lossless)."""
    from medusa_jax.decoding.acceptance import rejection_drafted

    tree = Tree.from_paths([[0], [1]])
    n = 40000
    logp = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]] * 3, jnp.float32))[None].repeat(n, 0)
    logq = jnp.log(jnp.asarray([[0.2, 0.8, 0.0]] * 3, jnp.float32))[None].repeat(n, 0)
    draws = jnp.broadcast_to(jnp.asarray([[1, 0], [0, 0], [0, 0]], jnp.int32), (n, 3, 2))
    keys = jax.random.split(jax.random.key(0), n)
    best, acc, root = rejection_drafted(logp, tree, keys, None, draws, logq)
    root, acc = np.asarray(root), np.asarray(acc)
    # token 1 is node 1 (rank 0), token 0 node 2 (rank 1): an accepted one is walked into
    first = np.where(acc == 1, np.asarray(draws[0, 0])[np.asarray(best)], root)
    assert np.all(acc[first == 2] == 0)
    np.testing.assert_allclose(np.bincount(first, minlength=3) / n, [0.375, 0.375, 0.25],
                               atol=0.01)
    # and each first token came the way the rule says: drafts 1 and 0 accepted, 2 drawn
    assert np.all(acc[first != 2] == 1)
