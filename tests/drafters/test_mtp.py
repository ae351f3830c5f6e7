"""MTP modules in the decoders: greedy == plain greedy (static and dynamic trees, batch > 1,
rows of different lengths, trees deeper than the modules), every module's own cache after
steps equals its cache begun over everything committed (the modules' lag included), and
rejection sampling lossless."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding.decode import medusa_generate, pad_prompts
from medusa_jax.decoding.drafter import BoundParams
from medusa_jax.decoding.tree import DynamicTree, Tree
from medusa_jax.drafters import registry
from medusa_jax.drafters.mtp import heads as mtp
from medusa_jax.drafters.mtp.drafter import MtpDrafter, bind
from medusa_jax.model.backbone import init_params

TREE = Tree.load("mc_sim_7b_63:16")  # depth 3


def modules(cfg, d, seed=1):
    """Random modules that draft something like the backbone: the hidden half of eh_proj
    near the identity, the rest small."""
    h = mtp.init_mtp(jax.random.key(seed), cfg, d, std=0.05)
    eye = jnp.eye(cfg.hidden_size)
    h["eh_proj"] = h["eh_proj"].at[:, cfg.hidden_size:].add(eye)
    return h


@pytest.fixture(scope="module")
def drafters(stories):
    cfg, _, _ = stories
    out = {d: bind(modules(cfg, d), cfg) for d in (1, 2, 3)}
    out["mimo"] = bind(modules(cfg, 2), cfg, "mimo")
    return out


def test_the_kind_is_registered_and_known_by_its_parameters(stories, drafters):
    cfg, _, _ = stories
    heads = drafters[2]
    assert registry.kind_of(dict(heads)) == "mtp" and registry.kind_of(heads) == "mtp"
    assert registry.depth_of(heads) is None  # the last module is reused
    assert registry.depth_of(bind(dict(heads), cfg, reuse_last=False)) == 2
    mtp.check(dict(heads), cfg)
    axes = registry.axes_of(heads)
    assert set(axes) == set(heads)
    half = registry.with_weight_dtype(heads, "bfloat16")
    assert half["eh_proj"].dtype == jnp.bfloat16 and half["enorm"].dtype == jnp.float32


@pytest.mark.slow
@pytest.mark.parametrize("d,tree", [
    (2, TREE), (3, TREE), (1, TREE),
    (2, DynamicTree(Tree.load("mc_sim_7b_63:32"), 8)),
    (2, Tree.from_paths([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [1]])),
    ("mimo", TREE),
], ids=["static-2", "static-3", "static-1", "dynamic-2", "chain4-reuse", "mimo-2"])
def test_greedy_equals_plain_greedy(stories, drafters, story_plain, d, tree):
    cfg, params, _ = stories
    tokens, lengths = pad_prompts(story_plain.prompts)
    out = medusa_generate(params, drafters[d], cfg, tokens, lengths, jax.random.key(0),
                          tree=tree, max_new_tokens=story_plain.max_new, eos=(2,))
    assert story_plain.rows(out) == story_plain.rows_plain
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0  # some drafts accepted: the commit path past the root ran


@pytest.mark.slow
def test_each_modules_cache_after_steps_equals_its_cache_begun_over_the_committed_tokens(
        drafters, story_plain, stepped_and_begun):
    """Three modules (module k lags k positions), rows of lengths 2 and 7: after prefill and
    6 steps, every module's cache built step by step equals `begin` over prompt + emitted
    tokens with the state's root."""
    heads = drafters[3]
    prompts = [story_plain.prompts[1], story_plain.prompts[2]]
    s, want, full_len = stepped_and_begun(heads, prompts, TREE)
    b = len(prompts)
    assert np.all(np.asarray(s.draft[0].length) == np.asarray(s.cache.lengths))
    for k, (w, g) in enumerate(zip(want, s.draft)):
        assert np.array_equal(w.length, g.length), k
        assert np.array_equal(np.asarray(w.length), np.maximum(np.asarray(full_len) - k, 0))
        assert float(jnp.max(jnp.abs(w.out - g.out))) < 1e-4, k
        for r in range(b):
            n = int(w.length[r])
            assert float(jnp.max(jnp.abs(w.k[r, :, :n] - g.k[r, :, :n]))) < 1e-4, (k, r)
            assert float(jnp.max(jnp.abs(w.v[r, :, :n] - g.v[r, :, :n]))) < 1e-4, (k, r)


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_rejection_sampling_is_lossless(toy_lm, dynamic):
    """Two MTP modules over toy_lm's 8 words (a tree of depth 2 and one of depth 3, where
    the last module is reused): the first two sampled tokens follow plain sampling's exact
    joint distribution."""
    toy = toy_lm.CFG
    params = jax.jit(lambda k: init_params(toy, k, std=0.6))(jax.random.key(0))
    heads = bind(jax.jit(lambda k: mtp.init_mtp(k, toy, 2, std=0.5))(jax.random.key(2)), toy)
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    tree = DynamicTree(tree, 3) if dynamic else tree
    ok, ratio, accepted = toy_lm.drafted_pairs(params, heads, tree, toy_lm.SAMPLINGS[0], toy)
    assert ok, f"MTP rejection sampling is not lossless: chi2/critical = {ratio:.2f}"
    assert accepted > 0.05  # drafts are accepted: the test has teeth


def test_a_tree_deeper_than_the_modules_is_refused_without_reuse(stories, drafters):
    cfg, params, _ = stories
    heads = bind(dict(drafters[2]), cfg, reuse_last=False)
    tokens, lengths = pad_prompts([[1, 50, 60]])
    with pytest.raises(ValueError, match="depth 3 but there are only 2"):
        medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0), tree=TREE,
                        max_new_tokens=4)


@pytest.mark.slow
def test_cache_phases_fit_every_modules_cache_to_the_window(stories, drafters, story_plain,
                                                             monkeypatch):
    """Cache phases in a 40-token decode: each phase's step drafts over that phase's window
    of every module's cache (`window`), and greedy stays plain greedy."""
    from medusa_jax.decoding import decode
    from medusa_jax.decoding.decode import cache_phases

    cfg, params, _ = stories
    monkeypatch.setattr(decode, "CACHE_BLOCK", 16)
    tokens, lengths = pad_prompts(story_plain.prompts)
    cap = decode.medusa_capacity(tokens.shape[1], story_plain.max_new, TREE)
    windows = cache_phases(tokens.shape[1], cap, TREE.num_nodes)
    assert len(windows) >= 3
    seen = []

    @dataclasses.dataclass(frozen=True)
    class Recording(MtpDrafter):  # a class of its own: traced afresh, whatever ran before
        def window(self, carry, slots):
            out = super().window(carry, slots)
            seen.append(tuple(c.k.shape[2] for c in out))
            return out

    heads = BoundParams(dict(drafters[3]), Recording(cfg))
    out = medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0),
                          tree=TREE, max_new_tokens=story_plain.max_new, eos=(2,))
    assert story_plain.rows(out) == story_plain.rows_plain
    assert {w for w, _, _ in seen} >= set(windows[:-1])
    assert all(len(set(s)) == 1 for s in seen)  # every module's cache cut alike
