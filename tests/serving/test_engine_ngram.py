"""The engine with a drafter that keeps context but rebuilds it from tokens (the n-gram
drafter, alone and merged into Medusa's tree): greedy slots are plain greedy's tokens, also
after a cached prefix (the drafter begun on the whole prompt) and through plain steps above
`plain_above` (the drafter handed their tokens)."""

import threading

import pytest

from medusa_jax.api import Medusa
from medusa_jax.decoding.drafter import BoundParams
from medusa_jax.decoding.tree import chain_tree
from medusa_jax.drafters.ngram.drafter import NgramDrafter
from medusa_jax.drafters.ngram.merged import merged
from medusa_jax.runtime import assets
from medusa_jax.serving.engine import Engine, Request

SLOTS, CONTEXT, BUCKETS, WINDOW, NEW = 4, 128, (16, 64, 96), 64, 24


@pytest.fixture(scope="module")
def base(medusa_default):
    return medusa_default


def with_heads(base, heads):
    return Medusa(base.cfg, base.params, base.tokenizer, heads=heads,
                  model_dir=base.model_dir, default_tree=base.default_tree)


@pytest.fixture(scope="module")
def prompts(base):
    # repeated text, so the history has matches to draft from
    return [base.encode(p) for p in assets.heldout_prompts()[:6]]


def offline(base, prompt, n=NEW):
    return base.generate([prompt], max_new_tokens=n, medusa=False)[0].token_ids


@pytest.fixture
def run(patient):
    """`run(engine, prompt, n, wait)`: submit (and wait, `patient`): (request, tokens, done
    event)."""
    def run(engine, prompt, n=NEW, wait=True):
        out, done = [], threading.Event()

        def on_event(tokens, finish, error):
            out.extend(tokens)
            if finish is not None:
                done.set()

        req = engine.submit(Request(prompt=list(prompt), max_tokens=n, on_event=on_event))
        if wait:
            patient(done, engine, "a request")
        return req, out, done

    return run


def ngram_engine(base, **kw):
    m = with_heads(base, BoundParams({}, NgramDrafter()))
    return Engine(m, slots=SLOTS, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW,
                  prefill_batch=1, slot_buckets=(SLOTS,), tree=chain_tree(4), **kw)


@pytest.mark.slow
def test_ngram_engine_keeps_the_prefix_cache_and_plain_greedy_tokens(base, prompts, run):
    e = ngram_engine(base).start("lazy")
    try:
        assert e.prefix_cache
        p = prompts[0]
        _, first, _ = run(e, p)
        assert first == offline(base, p)
        again, out, _ = run(e, p)  # a cached prefix: the drafter begun on the whole prompt
        assert again.cached == len(p) - 1 and out == first
        follow = p + first + prompts[1][1:9]
        turn, out, _ = run(e, follow)
        assert turn.cached > len(p) and out == offline(base, follow)
        assert e.metrics.step_tokens > e.metrics.slot_steps  # it drafted and some stuck
    finally:
        e.stop()


@pytest.mark.slow
def test_ngram_engine_follows_plain_steps_above_plain_above(base, prompts, run, patient):
    """plain_above=1: while more than one slot is live the calls are plain steps, which hand
    the drafter their tokens; every request keeps plain greedy's tokens."""
    e = ngram_engine(base, plain_above=1).start("lazy")
    try:
        assert e.plain_above == 1
        a = run(e, prompts[0], 80, wait=False)
        rest = [run(e, p, NEW, wait=False) for p in prompts[1:4]]
        for _, _, done in [a] + rest:
            patient(done, e, "a request beside plain steps")
        assert e.metrics.plain_calls > 0
        assert a[1] == offline(base, prompts[0], 80)
        assert [r[1] for r in rest] == [offline(base, p) for p in prompts[1:4]]
    finally:
        e.stop()


@pytest.mark.slow
def test_merged_engine_keeps_plain_greedy_tokens_with_a_cached_prefix(base, prompts, run):
    heads = merged(base.heads, 3)
    m = with_heads(base, heads)
    tree = heads.drafter.tree_for(base.tree())
    e = Engine(m, slots=SLOTS, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW,
               prefill_batch=1, slot_buckets=(SLOTS,), tree=tree).start("lazy")
    try:
        assert e.prefix_cache and e.drafter.follows_plain_steps
        p = prompts[2]
        _, first, _ = run(e, p)
        assert first == offline(base, p)
        again, out, _ = run(e, p)
        assert again.cached == len(p) - 1 and out == first
    finally:
        e.stop()


def test_a_drafter_that_keeps_context_and_cannot_follow_plain_steps_is_refused(base):
    """The n-gram's answer is AND'ed with the inner drafter's: a merged drafter over one that
    keeps its own cache and cannot follow plain steps still refuses them."""
    class Kept(NgramDrafter):
        follows_plain_steps = False
        rebuilds_from_tokens = False

    m = with_heads(base, BoundParams({}, Kept()))
    with pytest.raises(ValueError, match="plain steps do not feed"):
        Engine(m, slots=SLOTS, max_context=CONTEXT, tree=chain_tree(4), plain_above=1)
    e = Engine(m, slots=SLOTS, max_context=CONTEXT, tree=chain_tree(4))
    assert not e.prefix_cache


@pytest.mark.slow
def test_a_shared_pool_speeds_up_a_repeated_prompt_and_keeps_its_text(base, prompts, run):
    """--ngram-shared: the second time a prompt comes, its output's n-grams are in the pool
    (written when the first finished), so it drafts them: more tokens per step, the same
    tokens."""
    e = ngram_engine(base, ngram_shared=True, ngram_shared_size=4096,
                     prefix_cache=False).start("lazy")
    try:
        assert e.pool is not None and e.pool.entries == 0
        p = prompts[3]
        rates, outs = [], []
        for _ in range(2):
            steps, toks = e.metrics.slot_steps, e.metrics.step_tokens
            outs.append(run(e, p, 48)[1])
            rates.append((e.metrics.step_tokens - toks) / (e.metrics.slot_steps - steps))
        assert outs[0] == outs[1] == offline(base, p, 48)
        assert e.pool.entries > 0 and e.metrics.pool_ngrams > 0 and e.metrics.pool_hits > 0
        assert rates[1] > rates[0]
    finally:
        e.stop()


def test_a_shared_pool_needs_a_drafter_that_keeps_one(base):
    with pytest.raises(ValueError, match="plain decoding drafts nothing"):
        Engine(base, slots=2, max_context=CONTEXT, medusa=False, ngram_shared=True)
    with pytest.raises(ValueError, match="keeps no shared n-gram pool"):
        Engine(base, slots=2, max_context=CONTEXT, ngram_shared=True)
    with pytest.raises(ValueError, match="over the pool's bound"):
        ngram_engine(base, ngram_shared=True, ngram_shared_size=1 << 40)


@pytest.mark.slow
def test_a_model_loaded_with_ngram_serves_merged_drafts(base, prompts, run):
    """`Medusa.load(ngram=N)` (`infer.serve --ngram N`): the engine merges the chain into
    the drafter's tree."""
    m = Medusa.load(heads="default", ngram=2)
    e = Engine(m, slots=SLOTS, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW,
               prefill_batch=1, slot_buckets=(SLOTS,)).start("lazy")
    try:
        assert e.drafter.name.endswith("+ngram") and e.tree.name.endswith("+ngram2")
        assert run(e, prompts[4])[1] == offline(base, prompts[4])
    finally:
        e.stop()
