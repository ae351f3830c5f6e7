"""The stages of a Medusa step, one by one (decode.py): propose, verify, accept, emit, commit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding import acceptance, decode
from medusa_jax.decoding.acceptance import Sampling
from medusa_jax.decoding.tree import Tree
from medusa_jax.model.backbone import KVCache, causal_mask, forward, init_params
from medusa_jax.model.config import ModelConfig

V = 32
CFG = ModelConfig(model_type="llama", vocab_size=V, hidden_size=16, intermediate_size=24,
                  num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                  max_position_embeddings=64)
TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0), std=0.5)


def _fed(cand, tree):
    """A static tree's proposal of the given tokens."""
    return decode.Proposal(fed=cand, fed_depth=jnp.asarray(tree.node_depth),
                           fed_mask=jnp.asarray(tree.mask), tokens=cand, valid=None, slot=None)


def _prefilled(params, prompts):
    """A cache holding `prompts` (equal lengths), committed."""
    tokens = jnp.asarray(prompts, jnp.int32)
    b, p = tokens.shape
    cache = KVCache.init(CFG, b, 40)
    _, _, cache = forward(params, CFG, tokens, jnp.broadcast_to(jnp.arange(p), (b, p)),
                          causal_mask(cache.lengths, p, 40), cache)
    return cache.advance(jnp.full((b,), p))


def test_propose_candidates_reads_each_node_from_its_heads_rank():
    rng = np.random.default_rng(0)
    head_logits = jnp.asarray(rng.normal(size=(3, 2, V)), jnp.float32)  # [K, B, V]
    root = jnp.array([7, 9], jnp.int32)
    prop = decode.propose_candidates(root, head_logits, TREE)
    cand = np.asarray(prop.fed)
    assert prop.valid is None and np.array_equal(cand, np.asarray(prop.tokens))
    order = np.argsort(-np.asarray(head_logits), axis=-1)  # [K, B, V] ranks
    assert cand.shape == (2, TREE.num_nodes)
    for b in range(2):
        assert cand[b, 0] == root[b]
        for i, path in enumerate(TREE.paths_ranks, start=1):
            assert cand[b, i] == order[len(path) - 1, b, path[-1]], (b, path)


@pytest.mark.slow
def test_verify_on_a_chain_equals_a_causal_forward(params):
    chain = Tree.from_paths([[0], [0, 0], [0, 0, 0]])
    cache = _prefilled(params, [[1, 2, 3, 4], [5, 6, 7, 8]])
    cand = jnp.array([[10, 11, 12, 13], [20, 21, 22, 23]], jnp.int32)
    logits, hidden, (k_new, _), _ = decode.verify(params, CFG, _fed(cand, chain), cache)
    want, want_hidden, want_cache = forward(
        params, CFG, cand, cache.lengths[:, None] + jnp.arange(4)[None],
        causal_mask(cache.lengths, 4, cache.capacity), cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-5)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(want_hidden), atol=1e-5)
    np.testing.assert_allclose(np.asarray(k_new), np.asarray(want_cache.k[:, :, :, 4:8]),
                               atol=1e-6)
    assert int(cache.lengths[0]) == 4  # verify commits nothing


@pytest.mark.slow
def test_each_row_follows_its_own_acceptance_rule(params):
    """`accept_rows`, the acceptance the step runs: rows of a batch in different modes each
    get what their mode's rule gives them alone."""
    cache = _prefilled(params, [[1, 2, 3], [5, 6, 7]])
    prop = decode.propose_candidates(jnp.array([4, 9]), jax.random.normal(
        jax.random.key(1), (3, 2, V)), TREE)
    logits, _, _, _ = decode.verify(params, CFG, prop, cache)
    keys = jax.random.split(jax.random.key(0), 2)
    rows = decode.Rows.values(2, 8, mode=["greedy", "typical"], temperature=0.7)
    got = acceptance.accept_rows(logits, prop.fed, TREE, rows, keys)
    greedy = acceptance.greedy(logits, prop.fed, TREE)
    typical = acceptance.typical(logits, prop.fed, TREE, Sampling("typical", temperature=0.7))
    for a, g, t in zip(got, greedy, typical):
        np.testing.assert_array_equal(np.asarray(a), [np.asarray(g)[0], np.asarray(t)[1]])


def _state(b, count, done):
    z = jnp.zeros((b,), jnp.int32)
    return decode.DecodeState(cache=None, root=z, draft=None,
                              count=jnp.asarray(count, jnp.int32), steps=z, hist=None,
                              done=jnp.asarray(done), keys=None,
                              rows=decode.Rows.of(Sampling(), b, 4, (2,)))


def test_emit_appends_the_accepted_chunk_and_stops_at_eos():
    s = _state(3, [2, 0, 5], [False, False, True])
    chunk = jnp.array([[5, 6, 7, 8], [5, 2, 7, 8], [5, 6, 7, 8]], jnp.int32)
    acc_len = jnp.array([2, 3, 3])
    kept, count, done = decode.emit(s, chunk, acc_len + 1)
    out = np.asarray(decode.step.append(jnp.full((3, 12), -1, jnp.int32), chunk, s.count,
                                        ~s.done))
    # row 0: root + 2 accepted appended at 2, and the 4-token limit is reached
    assert list(out[0, 2:5]) == [5, 6, 7] and int(count[0]) == 4 and bool(done[0])
    assert int(kept[0]) == 2  # the histogram counts only the tokens that fit
    # row 1: EOS (2) is the 2nd token of the chunk: keep it, stop there
    assert list(out[1, :2]) == [5, 2] and int(count[1]) == 2 and bool(done[1])
    # row 2 was already done: untouched
    assert np.all(out[2] == -1) and int(count[2]) == 5 and int(kept[2]) == 0


@pytest.mark.slow
def test_commit_keeps_only_the_accepted_path_in_consecutive_slots(params):
    cache = _prefilled(params, [[1, 2, 3], [4, 5, 6]])
    cand = jnp.array([[9, 10, 11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22, 23, 24]],
                     jnp.int32)
    _, _, (k_new, v_new), _ = decode.verify(params, CFG, _fed(cand, TREE), cache)
    # row 0 keeps root -> [0] -> [0, 1] (nodes 0, 1, 5); row 1 keeps root -> [1] (nodes 0, 2)
    path = jnp.array([[0, 1, 5, 0], [0, 2, 0, 0]], jnp.int32)
    acc_len = jnp.array([2, 1])
    committed = decode.commit(cache, k_new, v_new, path, acc_len + 1)
    np.testing.assert_array_equal(np.asarray(committed.lengths), [6, 5])
    for b, kept in ((0, [9, 10, 14]), (1, [17, 19])):
        # the same tokens fed causally after the same prefix give the same keys/values
        toks = jnp.asarray([kept], jnp.int32)
        one = _prefilled(params, [[1, 2, 3] if b == 0 else [4, 5, 6]])
        n = len(kept)
        _, _, ref = forward(params, CFG, toks, 3 + jnp.arange(n)[None],
                            causal_mask(one.lengths, n, one.capacity), one)
        np.testing.assert_allclose(np.asarray(committed.k[:, b, :, 3:3 + n]),
                                   np.asarray(ref.k[:, 0, :, 3:3 + n]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(committed.v[:, b, :, 3:3 + n]),
                                   np.asarray(ref.v[:, 0, :, 3:3 + n]), atol=1e-5)
