"""The n-gram drafter: the match on hand-computed histories, greedy == plain greedy on the
embedded model (batch 1 and batch > 1, static and dynamic trees), more than one token a
step on repetitive text, rejection sampling lossless, and bad sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding.decode import generate, medusa_generate, pad_prompts
from medusa_jax.decoding.drafter import BoundParams
from medusa_jax.decoding.tree import DynamicTree, Tree, chain_tree
from medusa_jax.drafters.ngram.drafter import (
    NgramCarry,
    NgramDrafter,
    continuations,
    match_lengths,
    node_plan,
)
from medusa_jax.model.backbone import init_params

NGRAM = BoundParams({}, NgramDrafter())
BRANCHED = Tree.from_paths([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0], [0, 1], [0, 0, 0, 0]])


@pytest.mark.slow
def test_match_lengths_and_continuations_by_hand():
    #            0  1  2  3  4  5  6  7  8  9
    hist = [[5, 6, 7, 8, 5, 6, 7, 0, 0, 0],  # context ends at 6: "5 6 7"
            [1, 2, 3, 9, 2, 3, 4, 2, 3, 0],  # ends at 8: "2 3" twice before, "3" at 2, 5
            [4, 4, 4, 4, 0, 0, 0, 0, 0, 0],  # ends at 3: "4 4 4" at 2, shorter nearer
            [1, 2, 3, 4, 0, 0, 0, 0, 0, 0]]  # ends at 3: "4" never seen before
    hist, last = jnp.asarray(hist, jnp.int32), jnp.asarray([6, 8, 3, 3])
    n = np.asarray(match_lengths(hist, last, 4, 1))
    assert n[0].tolist() == [0, 0, 3, 0, 0, 0, 0, 0, 0, 0]
    assert n[1].tolist() == [0, 0, 2, 0, 0, 2, 0, 0, 0, 0]
    assert n[2].tolist() == [1, 2, 3, 0, 0, 0, 0, 0, 0, 0]
    assert n[3].tolist() == [0] * 10
    # min_n: shorter matches do not count
    assert np.asarray(match_lengths(hist, last, 4, 3))[2].tolist() == [0, 0, 3] + [0] * 7
    assert np.asarray(match_lengths(hist, last, 4, 3))[1].tolist() == [0] * 10
    drafts, found = continuations(hist, last, 2, 5, 4, 1)
    drafts, found = np.asarray(drafts), np.asarray(found)
    # row 0: "5 6 7" ended at 2, then 8 and the context again (period 4)
    assert drafts[0, 0].tolist() == [8, 5, 6, 7, 8] and found[0].tolist() == [True, False]
    assert drafts[0, 1].tolist() == [7] * 5  # no other match: the last token repeated
    # row 1: the most recent "2 3" (end 5) first; then the best match whose next token is
    # not 4: "2 3" at end 2 (next 9)
    assert drafts[1, 0].tolist() == [4, 2, 3, 4, 2] and drafts[1, 1].tolist() == [9, 2, 3, 4, 2]
    # row 2: the longest match first (the period-1 run continues)
    assert drafts[2, 0].tolist() == [4] * 5 and found[2].tolist() == [True, False]
    assert drafts[3].tolist() == [[4] * 5] * 2 and not found[3].any()


@pytest.mark.slow
def test_carry_begin_advance_and_the_tree_layout():
    d = NgramDrafter()
    tokens = jnp.asarray([[1, 2, 3, 0], [7, 8, 0, 0]], jnp.int32)
    carry = d.begin(None, {}, None, None, tokens, jnp.asarray([3, 2]), jnp.asarray([9, 9]), 8)
    assert carry.tokens.shape == (2, 9) and carry.length.tolist() == [3, 2]
    path = jnp.asarray([[9, 4, 5], [9, 6, 6]], jnp.int32)
    carry = d.advance(None, {}, carry, None, None, path, jnp.asarray([2, 0]),
                      jnp.asarray([1, 1]), None, jnp.asarray([True, False]))
    assert carry.length.tolist() == [6, 2]
    assert np.asarray(carry.tokens)[0, :6].tolist() == [1, 2, 3, 9, 4, 5]
    assert np.asarray(carry.tokens)[1, :3].tolist() == [7, 8, 0]
    # a full history drops what does not fit instead of shifting it
    full = NgramCarry(tokens=jnp.zeros((1, 4), jnp.int32), length=jnp.asarray([3]))
    full = d.advance(None, {}, full, None, None, jnp.asarray([[5, 6]]), jnp.asarray([1]),
                     jnp.asarray([0]), None, jnp.asarray([True]))
    assert np.asarray(full.tokens).tolist() == [[0, 0, 0, 5]]
    # rank-0 chains take candidate 0; a node takes the candidate of its deepest nonzero rank
    cand, depth = node_plan(((0,), (1,), (0, 0), (0, 2), (1, 0), (0, 2, 0)))
    assert cand.tolist() == [0, 0, 1, 0, 2, 1, 2] and depth.tolist() == [0, 1, 1, 2, 2, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("tree", [chain_tree(5), BRANCHED, DynamicTree(BRANCHED, 4)],
                         ids=["chain", "branched", "dynamic"])
def test_ngram_greedy_equals_plain_greedy(stories, story_plain, tree):
    cfg, params, _ = stories
    tokens, lengths = pad_prompts(story_plain.prompts)
    out = medusa_generate(params, NGRAM, cfg, tokens, lengths, jax.random.key(0), tree=tree,
                          max_new_tokens=story_plain.max_new, eos=(2,))
    assert story_plain.rows(out) == story_plain.rows_plain
    if tree is BRANCHED:  # batch 1: the first prompt alone
        one = medusa_generate(params, NGRAM, cfg, tokens[:1], lengths[:1], jax.random.key(0),
                              tree=tree, max_new_tokens=story_plain.max_new, eos=(2,))
        assert story_plain.rows(one) == story_plain.rows_plain[:1]


@pytest.mark.slow
def test_ngram_drafts_repetitive_text(stories):
    """Prompts that repeat a sentence: the model goes on looping, and the drafts (the
    loop's continuation) are accepted several at a time."""
    cfg, params, tok = stories
    texts = ["The cat sat on the mat. " * 8, "It is not angry. " * 6]
    tokens, lengths = pad_prompts([[1] + tok.encode(t.strip(), add_special_tokens=False)
                                   for t in texts])
    plain = generate(params, cfg, tokens, lengths, jax.random.key(0), max_new_tokens=64)
    out = medusa_generate(params, NGRAM, cfg, tokens, lengths, jax.random.key(0),
                          tree=chain_tree(6), max_new_tokens=64)
    assert np.asarray(out.tokens).tolist() == np.asarray(plain.tokens).tolist()
    tau = np.asarray(out.num_new) / np.asarray(out.steps)
    assert np.all(tau > 2.0), tau


@pytest.fixture(scope="module")
def toy_params(toy_lm):
    return jax.jit(lambda k: init_params(toy_lm.CFG, k, std=0.6))(jax.random.key(0))


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["t1", "t0.7-topk-topp"])
def test_ngram_rejection_sampling_is_lossless(toy_lm, toy_params, chi_square_ok, which):
    """Deterministic drafts (the history's continuations) accepted by the target's
    probability: the first two tokens follow plain sampling's distribution."""
    sampling = toy_lm.SAMPLINGS[which]
    exact = toy_lm.exact_pair_distribution(toy_params, sampling)
    tokens, lengths = pad_prompts([toy_lm.PROMPT] * toy_lm.ROWS)
    out = medusa_generate(toy_params, NGRAM, toy_lm.CFG, tokens, lengths, jax.random.key(7),
                          tree=toy_lm.TREE, sampling=sampling, max_new_tokens=3)
    ok, ratio = chi_square_ok(toy_lm.pair_counts(out).ravel(), exact.ravel())
    assert ok, f"n-gram rejection sampling is not lossless: chi2/critical = {ratio:.2f}"
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0.05 * hist.sum()  # drafts are accepted: the test has teeth


@pytest.mark.parametrize("fields, needle", [
    ({"max_n": 0}, "max_n"), ({"min_n": -1}, "min_n"), ({"max_n": 2, "min_n": 3}, "min_n"),
    ({"max_n": 1000}, "max_n"), ({"max_n": 2.5}, "max_n")])
def test_bad_sizes_are_one_line_errors(one_line_error, fields, needle):
    one_line_error(ValueError, lambda: NgramDrafter(**fields), needle, "ngram")


def test_head_fn_is_refused(one_line_error):
    one_line_error(ValueError, lambda: NgramDrafter.from_head_fn(lambda *a: None), "head_fn")


@pytest.mark.slow
def test_empty_heads_are_the_ngram_kind(stories, story_plain):
    """The kind is registered: parameters with no tensors decode with the n-gram drafter."""
    from medusa_jax.drafters import registry

    assert registry.kind_of({}) == "ngram" and registry.depth_of({}) is None
    cfg, params, _ = stories
    tokens, lengths = pad_prompts(story_plain.prompts)
    out = medusa_generate(params, {}, cfg, tokens, lengths, jax.random.key(0),
                          tree=chain_tree(5), max_new_tokens=story_plain.max_new, eos=(2,))
    assert story_plain.rows(out) == story_plain.rows_plain
