"""Dynamic trees: each step, each row verifies the pool nodes whose paths the heads find most
probable. Greedy stays identical to plain decoding; rejection sampling stays lossless."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding import decode
from medusa_jax.decoding.decode import medusa_generate, pad_prompts
from medusa_jax.decoding.tree import DynamicTree, Tree


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_the_chosen_nodes_are_the_most_probable_subtree(size):
    pool = Tree.load("mc_sim_7b_63")
    tree = DynamicTree(pool, size)
    if size <= 8:  # only the nodes that can be chosen: rank < size at every depth
        assert tree.pool.num_nodes < pool.num_nodes and tree.top_k == size
    rng = np.random.default_rng(0)
    head_logits = jnp.asarray(rng.normal(size=(5, 3, 40)) * 2, jnp.float32)
    root = jnp.array([1, 2, 3], jnp.int32)
    prop = decode.propose_candidates(root, head_logits, tree)
    logp = np.asarray(jax.nn.log_softmax(head_logits, axis=-1))
    ranks = np.argsort(-logp, axis=-1)
    for b in range(3):
        # indices into the choosable part of the pool; the choice is the best over all of it
        chosen = {tree.pool.paths_ranks[i - 1]
                  for i in np.flatnonzero(np.asarray(prop.valid[b])) if i > 0}
        assert len(chosen) == size and all(p[:-1] in chosen or len(p) == 1 for p in chosen)
        joint = {p: sum(logp[d, b, ranks[d, b, r]] for d, r in enumerate(p))
                 for p in pool.paths_ranks}
        best = sorted(joint.values(), reverse=True)[:size]
        assert sorted((joint[p] for p in chosen), reverse=True) == pytest.approx(best)
        # the verified tokens are those nodes' tokens, in pool order, root first
        fed = np.asarray(prop.fed[b])
        nodes = np.flatnonzero(np.asarray(prop.valid[b]))
        assert fed[0] == root[b] and list(fed) == list(np.asarray(prop.tokens[b])[nodes])


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["dynamic:4", "dynamic:12"])
def test_dynamic_greedy_equals_plain_greedy(stories, spec, medusa_default):
    m = medusa_default  # Medusa.load(heads="default")
    prompts = ["Once upon a time", "Lily and Ben", "The little dog was sad because",
               "One day, a big bird"]
    plain = m.generate(prompts, max_new_tokens=48, medusa=False, batch_size=4)
    static = m.generate(prompts, max_new_tokens=48, tree=spec.replace("dynamic", "mc_sim_7b_63"),
                        batch_size=4)
    dyn = m.generate(prompts, max_new_tokens=48, tree=spec, batch_size=4)
    for p, s, d in zip(plain, static, dyn):
        assert d.token_ids == p.token_ids
    # choosing per step does not lose to the static tree of the same size
    assert sum(d.new_tokens for d in dyn) / sum(d.steps for d in dyn) >= \
        sum(s.new_tokens for s in static) / sum(s.steps for s in static) - 0.05


@pytest.mark.slow
def test_dynamic_rejection_sampling_is_lossless(toy_lm, toy_medusa, chi_square_ok):
    CFG, PROMPT, ROWS, TREE = toy_lm.CFG, toy_lm.PROMPT, toy_lm.ROWS, toy_lm.TREE
    params, heads = toy_medusa
    sampling = toy_lm.SAMPLINGS[0]
    exact = toy_lm.exact_pair_distribution(params, sampling)
    tokens, lengths = pad_prompts([PROMPT] * ROWS)
    out = medusa_generate(params, heads, CFG, tokens, lengths, jax.random.key(7),
                          tree=DynamicTree(TREE, 2), sampling=sampling, max_new_tokens=3)
    ok, ratio = chi_square_ok(toy_lm.pair_counts(out).ravel(), exact.ravel())
    assert ok, f"dynamic-tree rejection sampling is not lossless: chi2/critical = {ratio:.2f}"
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0.1 * hist.sum()


@pytest.mark.parametrize("spec, heads, message", [
    ("dynamic:0", 5, "chooses 1 .. 63 nodes"),
    ("dynamic:64", 5, "chooses 1 .. 63 nodes"),
    ("dynamic:x", 5, "expected dynamic:N"),
    ("dynamic:4:mc_sim_7b_63", 3, "depth 4 but there are only 3 Medusa heads"),
    ("dynamic:4:dynamic:2", 5, "must be a static tree"),
])
def test_bad_dynamic_trees_are_one_line_errors(spec, heads, message):
    with pytest.raises(ValueError, match=message):
        Tree.load(spec, num_heads=heads)


@pytest.mark.slow
def test_rejection_never_accepts_an_unverified_node(toy_lm):
    """A dynamic tree's unverified pool nodes have no logits of their own (their rows are
    stand-ins): rejection must never walk into one, however likely its token is. Here the
    root's distribution puts almost all mass on the token of an unverified child."""
    from medusa_jax.decoding.acceptance import Sampling, rejection

    V = toy_lm.V
    tree = toy_lm.TREE  # children of the root: nodes 1, 2, 3 (tokens below)
    rows = 512
    tokens = jnp.broadcast_to(jnp.array([5, 0, 1, 2, 3, 4, 6], jnp.int32), (rows, tree.num_nodes))
    logits = jnp.zeros((rows, tree.num_nodes, V)).at[:, :, 1].set(12.0)  # token 1: node 2
    unverified = [i for i, p in enumerate(tree.paths_ranks, start=1) if p[0] == 1]
    valid = jnp.ones((rows, tree.num_nodes), bool).at[:, jnp.array(unverified)].set(False)
    keys = jax.random.split(jax.random.key(3), rows)
    best, acc_len, bonus = rejection(logits, tokens, tree, Sampling(mode="rejection"), keys,
                                     valid)
    paths = np.asarray(tree.paths)[np.asarray(best)]
    for path, n in zip(paths, np.asarray(acc_len)):
        assert not set(path[1:n + 1].tolist()) & set(unverified)
    # the token the unverified node carried is still what plain sampling would draw, as
    # the bonus token after the verified children were rejected
    assert np.mean(np.asarray(bonus) == 1) > 0.9
