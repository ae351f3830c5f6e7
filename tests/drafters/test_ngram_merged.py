"""Merged drafts (a drafter's tree plus the n-gram chain): the merged tree's layout, greedy
== plain greedy for Medusa, Hydra and EAGLE-3 (static and dynamic trees, batch > 1),
rejection sampling lossless, and bad input."""

import jax
import numpy as np
import pytest

from medusa_jax.api import default_heads_dir, shipped_heads_dir
from medusa_jax.decoding.decode import medusa_generate, pad_prompts
from medusa_jax.decoding.tree import DynamicTree, Tree
from medusa_jax.drafters import formats
from medusa_jax.drafters.ngram.merged import (
    MergedDrafter,
    _layout,
    merge_tree,
    merged,
    split_tree,
)


def test_merge_and_split_tree():
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1]])
    m = merge_tree(tree, 3)
    assert m.top_k == 3 and m.depth == 3 and m.num_nodes == tree.num_nodes + 3
    assert {(2,), (2, 0), (2, 0, 0)} <= set(m.paths_ranks)
    inner, extra = split_tree(m)
    assert inner == tree and extra == 3
    # merged node order: (0) (1) (2) (0,0) (0,1) (2,0) (2,0,0) -> inner 1 2 _ 3 4, chain
    assert _layout(m.paths_ranks, m.top_k).tolist() == [0, 1, 2, 5, 3, 4, 6, 7]
    dyn = DynamicTree(Tree.load("mc_sim_7b_63:16"), 6)
    md = merge_tree(dyn, 2)
    assert isinstance(md, DynamicTree) and md.size == 8 and md.num_nodes == 9
    inner, extra = split_tree(md)
    assert (inner.pool, inner.size, extra) == (dyn.pool, dyn.size, 2)
    # a merged tree rebuilt as a plain dynamic tree (as `Medusa.tree` does) still splits:
    # its pool is cut for size + extra, the inner tree keeps what is left
    again = DynamicTree(md.pool, md.size)
    inner, extra = split_tree(again)
    assert extra == 2 and inner.size == 6 and set(dyn.pool.paths_ranks) <= set(
        inner.pool.paths_ranks)


def test_bad_input_is_a_one_line_error(one_line_error, stories):
    tree = Tree.from_paths([[0], [0, 0]])
    for bad in (0, -1, 2.0, True):
        one_line_error(ValueError, lambda: merge_tree(tree, bad), "ngram extra", repr(bad))
    one_line_error(ValueError, lambda: split_tree(tree), "merge_tree")
    one_line_error(ValueError, lambda: MergedDrafter(None, extra=0), "ngram extra")
    cfg, params, _ = stories
    heads = merged(formats.load_heads(default_heads_dir(), cfg)[0], 2)
    deep = heads.drafter.tree_for(Tree.from_paths([[0] * d for d in range(1, 9)]))
    tokens, lengths = pad_prompts([[1, 2, 3]])
    one_line_error(ValueError, lambda: medusa_generate(
        params, heads, cfg, tokens, lengths, jax.random.key(0), tree=deep, max_new_tokens=4),
        "depth 8", "Medusa heads")


@pytest.mark.slow
@pytest.mark.parametrize("kind, tree", [
    ("medusa", Tree.load("stories260K_cpu")),
    ("hydra", DynamicTree(Tree.load("mc_sim_7b_63:16"), 6)),
    pytest.param("eagle3", Tree.load("mc_sim_7b_63:8"), marks=pytest.mark.slow),
])
def test_merged_greedy_equals_plain_greedy(stories, story_plain, kind, tree):
    cfg, params, _ = stories
    heads = {"medusa": lambda: formats.load_heads(default_heads_dir(), cfg)[0],
             "hydra": lambda: formats.load_heads(shipped_heads_dir("hydra"), cfg)[0],
             "eagle3": lambda: formats.load_heads(shipped_heads_dir("eagle"), cfg)[0]}[kind]()
    heads = merged(heads, 3)
    tokens, lengths = pad_prompts(story_plain.prompts)
    out = medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0),
                          tree=heads.drafter.tree_for(tree), max_new_tokens=story_plain.max_new,
                          eos=(2,))
    assert story_plain.rows(out) == story_plain.rows_plain
    assert np.sum(out.num_new) / np.sum(out.steps) > 1.5  # the inner drafter still drafts


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["t1", "t0.7-topk-topp"])
def test_merged_rejection_sampling_is_lossless(toy_lm, toy_medusa, chi_square_ok, which):
    sampling = toy_lm.SAMPLINGS[which]
    params, heads = toy_medusa
    heads = merged(heads, 2)
    exact = toy_lm.exact_pair_distribution(params, sampling)
    tokens, lengths = pad_prompts([toy_lm.PROMPT] * toy_lm.ROWS)
    out = medusa_generate(params, heads, toy_lm.CFG, tokens, lengths, jax.random.key(7),
                          tree=heads.drafter.tree_for(toy_lm.TREE), sampling=sampling,
                          max_new_tokens=3)
    ok, ratio = chi_square_ok(toy_lm.pair_counts(out).ravel(), exact.ravel())
    assert ok, f"merged rejection sampling is not lossless: chi2/critical = {ratio:.2f}"
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0.05 * hist.sum()  # drafts are accepted: the test has teeth
