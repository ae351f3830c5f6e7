"""EAGLE-3 drafters in the decoders: greedy == plain greedy (static and dynamic trees, batch
> 1, rows of different lengths), the drafter's own cache after any number of steps equals
the cache begun over everything committed, rejection sampling lossless (and never into a
node the dynamic tree left unverified), the artifact (ours and the published layout) bound
to its configuration, the serving engine, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding.decode import medusa_generate, pad_prompts
from medusa_jax.decoding.drafter import BoundParams, drafter_for
from medusa_jax.decoding.tree import DynamicTree, Tree
from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters.eagle3 import heads as eagle3
from medusa_jax.drafters.eagle3.drafter import bind
from medusa_jax.model.backbone import init_params

AUX = (1, 2, 4)  # stories260K has 5 layers: below the published rule's 7
TREE = Tree.load("mc_sim_7b_63:16")


@pytest.fixture(scope="module")
def drafter(stories):
    """A random drafter over the 384 most frequent ids of a fixed count (a reduced draft
    vocabulary: d2t is not the identity), bound to its config."""
    cfg, _, _ = stories
    c = eagle3.default_config(cfg, 384, aux_layers=AUX)
    counts = np.random.default_rng(0).integers(0, 100, cfg.vocab_size)
    return bind(eagle3.init_eagle3(jax.random.key(1), c, counts, std=0.2), c, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [TREE, DynamicTree(Tree.load("mc_sim_7b_63:32"), 8)],
                         ids=["static", "dynamic"])
def test_greedy_equals_plain_greedy(stories, drafter, story_plain, tree):
    cfg, params, _ = stories
    tokens, lengths = pad_prompts(story_plain.prompts)
    out = medusa_generate(params, drafter, cfg, tokens, lengths, jax.random.key(0), tree=tree,
                          max_new_tokens=story_plain.max_new, eos=(2,))
    assert story_plain.rows(out) == story_plain.rows_plain
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0  # some drafts accepted: the commit path past the root ran


@pytest.mark.slow
def test_the_drafters_cache_after_steps_equals_its_cache_begun_over_the_committed_tokens(
        drafter, story_plain, stepped_and_begun):
    """After prefill and 6 Medusa steps (rows of lengths 3 and 7, some drafts accepted), the
    carry `advance` built step by step equals `begin` over prompt + every emitted token, with
    the state's root: each committed token's entry was fed its own aux features and the
    token after it, once."""
    prompts = [story_plain.prompts[0], story_plain.prompts[2]]
    s, want, full_len = stepped_and_begun(drafter, prompts, TREE, AUX)
    b = len(prompts)
    assert np.all(np.asarray(s.draft.length) == np.asarray(s.cache.lengths))
    assert np.array_equal(want.length, s.draft.length)
    assert float(jnp.max(jnp.abs(want.out - s.draft.out))) < 1e-4
    for r in range(b):
        n = int(full_len[r])
        assert float(jnp.max(jnp.abs(want.k[r, :, :n] - s.draft.k[r, :, :n]))) < 1e-4
        assert float(jnp.max(jnp.abs(want.v[r, :, :n] - s.draft.v[r, :, :n]))) < 1e-4


@pytest.mark.slow
def test_dynamic_rejection_never_walks_into_an_unverified_node(toy_lm, walks_into_unverified):
    """EAGLE-3's dynamic proposal (its choice from the drafter's own log-probabilities) marks
    the pool nodes it did not choose as unverified; even when the target puts almost all mass
    on such a node's token, rejection never accepts it (and does, without the mask)."""
    V = toy_lm.V
    dyn = DynamicTree(Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0]]), 3)
    toy = toy_lm.CFG.replace(num_layers=3)
    params = jax.jit(lambda k: init_params(toy, k, std=0.6))(jax.random.key(0))
    c = eagle3.default_config(toy, V, aux_layers=(0, 1, 2))
    heads = bind(jax.jit(lambda k: eagle3.init_eagle3(k, c, np.arange(V), std=0.5))(
        jax.random.key(4)), c, toy)
    rows, p = 128, 4
    keys = jax.random.split(jax.random.key(5), 3)
    aux = jax.random.normal(keys[0], (rows, p, 3 * toy.hidden_size))
    tokens = jax.random.randint(keys[1], (rows, p), 0, V)
    root = jax.random.randint(keys[2], (rows,), 0, V)
    d = drafter_for(heads)

    @jax.jit
    def propose(params, heads):
        carry = d.begin(params, heads, None, aux, tokens, jnp.full((rows,), p), root, 16)
        return d.propose(params, heads, carry, root, dyn)

    with_mask, without = walks_into_unverified(dyn.pool, propose(params, heads), V)
    assert not any(with_mask)
    assert sum(without) > rows // 4


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_rejection_sampling_is_lossless(toy_lm, dynamic):
    """EAGLE-3's drafts (a reduced draft vocabulary of 6 of the 8 words) over toy_lm's
    vocabulary on 3 layers (EAGLE-3 reads three), on a static tree and on a dynamic one (its
    per-row choice from the drafter's own log-probabilities): the first two sampled tokens
    follow plain sampling's exact joint distribution."""
    toy = toy_lm.CFG.replace(num_layers=3)
    params = jax.jit(lambda k: init_params(toy, k, std=0.6))(jax.random.key(0))
    c = eagle3.default_config(toy, 6, aux_layers=(0, 1, 2))
    heads = bind(jax.jit(lambda k: eagle3.init_eagle3(k, c, np.arange(toy_lm.V), std=0.5))(
        jax.random.key(2)), c, toy)
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
    tree = DynamicTree(tree, 3) if dynamic else tree
    ok, ratio, accepted = toy_lm.drafted_pairs(params, heads, tree, toy_lm.SAMPLINGS[0], toy)
    assert ok, f"EAGLE-3 rejection sampling is not lossless: chi2/critical = {ratio:.2f}"
    assert accepted > 0.05  # drafts are accepted: the test has teeth


def test_our_artifact_and_the_published_layout_load_bound_and_decode_alike(
        tmp_path, stories, drafter, story_plain, one_line_error):
    cfg, params, _ = stories
    file = heads_formats.save_heads(tmp_path / "ours", drafter, cfg, {"note": "x"})
    ours, meta = heads_formats.load_heads(tmp_path / "ours", cfg)
    heads_formats.write(drafter, "eagle3", tmp_path / "published", cfg=cfg)
    published, pmeta = heads_formats.load_heads(tmp_path / "published", cfg)
    for got, m in ((ours, meta), (published, pmeta)):
        assert isinstance(got, BoundParams) and got.drafter.config == drafter.drafter.config
        assert m["kind"] == "eagle3" and m["aux_layers"] == list(AUX)
        assert sorted(got) == sorted(drafter)
        for n in drafter:
            assert np.array_equal(np.asarray(got[n]), np.asarray(drafter[n])), n
    assert meta["extra"] == {"note": "x"}
    # bare parameters cannot be saved: their aux layers would be lost
    one_line_error(ValueError, lambda: heads_formats.save_heads(tmp_path / "bare",
                                                                dict(drafter), cfg), "bind")
    # another backbone's artifact: refused before any work
    other = cfg.replace(num_layers=3)
    one_line_error(ValueError, lambda: heads_formats.load_heads(file, other), "aux",
                   "3-layer")


@pytest.mark.slow
def test_the_serving_engine_gives_offline_tokens(stories, drafter, story_plain):
    from medusa_jax.api import Medusa
    from medusa_jax.serving.engine import Engine, generate_offline  # noqa: F401

    cfg, params, tok = stories
    m = Medusa(cfg, params, tok, heads=drafter)
    # one slot count and one prefill batch: fewer programs to compile, the same two
    # requests decoded side by side
    e = Engine(m, slots=2, max_context=128, buckets=(16,), window_block=64, tree=TREE,
               steps_per_call=2, slot_buckets=(2,), prefill_batch=1).start()
    try:
        import threading

        from medusa_jax.serving.engine import Request
        results = []
        for p in story_plain.prompts:
            out, done = [], threading.Event()
            e.submit(Request(prompt=list(p), max_tokens=story_plain.max_new, stop_ids=(2,),
                             on_event=lambda t, f, err, out=out, done=done: (
                                 out.extend(t), f is not None and done.set())))
            results.append((out, done))
        for out, done in results:
            assert done.wait(300)
        assert [out for out, _ in results] == story_plain.rows_plain
    finally:
        e.stop()
    with pytest.raises(ValueError, match="plain_above"):
        Engine(m, slots=2, max_context=128, plain_above=1)


@pytest.mark.slow
def test_the_shipped_drafter_decodes_as_plain_and_drafts_well(stories, story_plain):
    """`--heads eagle`: the drafter `train.eagle` trains by default, bound to its config by
    load_heads; greedy output identical, and over two tokens per step on the 16 nodes
    of the published tree (a random drafter: about one)."""
    from medusa_jax.api import shipped_heads_dir

    cfg, params, _ = stories
    heads, meta = heads_formats.load_heads(shipped_heads_dir("eagle"), cfg)
    assert meta["kind"] == "eagle3" and heads.drafter.aux_layers == AUX
    tokens, lengths = pad_prompts(story_plain.prompts)
    out = medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0), tree=TREE,
                          max_new_tokens=story_plain.max_new, eos=(2,))
    assert story_plain.rows(out) == story_plain.rows_plain
    assert sum(len(r) for r in story_plain.rows_plain) / int(np.sum(out.steps)) > 2.0
