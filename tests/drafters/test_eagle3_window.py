"""EAGLE-3's own cache follows the backbone's attention window (`Drafter.window`): offline,
each cache phase's steps draft over that phase's window of the drafter's cache; in the
serving engine, the slots' drafter cache is as wide as the slots' window (resized with it)
and a call cut to fewer rows or a narrower window cuts it too. Greedy tokens stay those of
plain greedy decoding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding import decode
from medusa_jax.decoding.decode import cache_phases, medusa_generate, pad_prompts
from medusa_jax.decoding.drafter import BoundParams, carry_window, put_leading
from medusa_jax.decoding.tree import Tree
from medusa_jax.drafters.eagle3 import heads as eagle3
from medusa_jax.drafters.eagle3.drafter import Eagle3Carry, Eagle3Drafter, bind
from medusa_jax.drafters.medusa.drafter import MedusaDrafter

AUX = (1, 2, 4)  # stories260K has 5 layers
TREE = Tree.load("mc_sim_7b_63:16")
SEEN: list[int] = []  # the context widths of the carries `propose` was traced with


@dataclasses.dataclass(frozen=True)
class _Recording(Eagle3Drafter):
    """EAGLE-3, noting the width of the drafter cache each traced draft attends over."""

    def propose(self, params, heads, carry, root, tree, draw=None):
        SEEN.append(carry.k.shape[2])
        return super().propose(params, heads, carry, root, tree, draw)


@pytest.fixture(scope="module")
def recording(stories):
    cfg, _, _ = stories
    c = eagle3.default_config(cfg, 384, aux_layers=AUX)
    counts = np.random.default_rng(0).integers(0, 100, cfg.vocab_size)
    heads = bind(eagle3.init_eagle3(jax.random.key(1), c, counts, std=0.2), c, cfg)
    return BoundParams(dict(heads), _Recording(c, cfg))


def test_window_cuts_pads_and_writes_back_the_drafters_cache():
    k = jnp.arange(2 * 1 * 8 * 2, dtype=jnp.float32).reshape(2, 1, 8, 2)
    carry = Eagle3Carry(k=k, v=-k, out=jnp.ones((2, 3)), length=jnp.array([3, 5]))
    d = Eagle3Drafter()
    cut = carry_window(d, carry, 6)
    assert cut.k.shape == (2, 1, 6, 2) and cut.out.shape == (2, 3)
    assert carry_window(d, carry, 10).k.shape == (2, 1, 10, 2)
    sub = cut.replace(k=cut.k + 100, length=cut.length + 1)
    back = put_leading(carry, sub)
    np.testing.assert_array_equal(np.asarray(back.k[:, :, :6]), np.asarray(k[:, :, :6] + 100))
    np.testing.assert_array_equal(np.asarray(back.k[:, :, 6:]), np.asarray(k[:, :, 6:]))
    assert np.asarray(back.length).tolist() == [4, 6]
    # a drafter without a context cache (the protocol's default `window`), or plain
    # decoding, keeps its carry as it is
    assert carry_window(MedusaDrafter(), carry, 6) is carry
    assert carry_window(None, carry, 6) is carry


@pytest.mark.slow
def test_offline_phases_draft_over_their_window_and_equal_plain_greedy(
        stories, recording, story_plain, monkeypatch):
    cfg, params, _ = stories
    monkeypatch.setattr(decode, "CACHE_BLOCK", 16)  # phases in a 40-token decode
    tokens, lengths = pad_prompts(story_plain.prompts)
    cap = decode.medusa_capacity(tokens.shape[1], story_plain.max_new, TREE)
    windows = cache_phases(tokens.shape[1], cap, TREE.num_nodes)
    assert len(windows) >= 3
    SEEN.clear()
    out = medusa_generate(params, recording, cfg, tokens, lengths, jax.random.key(0),
                          tree=TREE, max_new_tokens=story_plain.max_new, eos=(2,))
    assert story_plain.rows(out) == story_plain.rows_plain
    # one traced step per phase, each drafting over its phase's window, not the whole cache
    assert sorted(set(SEEN)) == list(windows)


@pytest.mark.slow
def test_the_engine_drafts_over_the_window_and_gives_offline_tokens(
        stories, recording, story_plain):
    from medusa_jax.api import Medusa
    from medusa_jax.serving import programs
    from medusa_jax.serving.engine import Engine, generate_offline
    from medusa_jax.serving.layout import StepKey

    cfg, params, tok = stories
    m = Medusa(cfg, params, tok, heads=recording)
    SEEN.clear()
    e = Engine(m, slots=2, max_context=256, buckets=(16,), window_block=128, tree=TREE,
               steps_per_call=2, slot_buckets=(2,), prefill_batch=1).start(warmup="lazy")
    try:
        got = generate_offline(e, story_plain.prompts, story_plain.max_new, stop_ids=(2,))
        assert got == story_plain.rows_plain
        assert e.layout.windows == [128, 256]
        # the slots' drafter cache is as wide as their window: memory follows the window
        for w in e.layout.windows:
            assert e.programs.state_shapes(w).draft.k.shape[2] == w
        # every draft traced attended over the 128-slot window, not the 256-slot context
        assert SEEN and set(SEEN) == {128}
        # and the compiled step holds no context-wide drafter cache anywhere (its per-step
        # copies included: they are window-wide too)
        k = e.programs.state_shapes(128).draft.k
        wide = "f32[" + ",".join(map(str, k.shape[:2] + (256,) + k.shape[3:])) + "]"
        assert wide not in e.programs.get(StepKey(128, 2)).as_text()
        # a call over fewer rows and a narrower window than the state cuts the carry too
        state = e.programs.state_shapes(256)
        sub = jax.eval_shape(lambda s: programs.leading_rows(s, 1, 128, 0, e.drafter), state)
        assert sub.draft.k.shape[:3] == (1, state.draft.k.shape[1], 128)
        assert sub.cache.capacity == 128
        back = jax.eval_shape(programs.put_leading_rows, state, sub)
        assert back.draft.k.shape == state.draft.k.shape
    finally:
        e.stop()
