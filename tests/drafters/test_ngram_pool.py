"""The n-gram pool shared across requests: the host table (insert, lookup, eviction at its
bound, the size check), the device lookup agreeing with the host's, and a drafter reading a
pool whose every entry collides still decoding plain greedy's tokens (verification
decides)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding.decode import generate, medusa_generate, pad_prompts
from medusa_jax.decoding.tree import chain_tree
from medusa_jax.drafters.ngram import pool as pool_mod
from medusa_jax.drafters.ngram.drafter import NgramCarry, NgramDrafter
from medusa_jax.drafters.ngram.pool import (
    ENTRY_BYTES,
    MAX_POOL_BYTES,
    NgramPool,
    hash_device,
    hash_tokens,
    lookup,
)


def test_insert_then_lookup_gives_the_tokens_that_followed():
    p = NgramPool(1024, n=3, width=4)
    assert p.add([5, 6, 7, 8, 9, 10, 11]) == 4
    assert p.lookup([5, 6, 7]) == [8, 9, 10, 11]
    assert p.lookup([8, 9, 10]) == [11]  # the last n-gram: what followed, short
    assert p.lookup([1, 2, 3]) is None
    p.add([1, 5, 6, 7, 42])  # a later request wins the entry
    assert p.lookup([5, 6, 7]) == [42]
    assert p.add([1, 2]) == 0 and p.dirty


def test_the_table_never_holds_more_than_its_size():
    p = NgramPool(16, n=2, width=2)
    p.add(list(range(1000)))
    assert p.entries <= 16
    assert p.lookup([997, 998]) == [999]  # the latest n-grams stay (they were written last)


def test_a_pool_that_does_not_fit_is_refused_in_one_line(monkeypatch):
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            NgramPool(bad, n=2)
    with pytest.raises(ValueError, match="over the pool's bound"):
        NgramPool(MAX_POOL_BYTES // ENTRY_BYTES + 1, n=2)
    monkeypatch.setattr(pool_mod, "available_bytes", lambda: 10 * ENTRY_BYTES)
    with pytest.raises(ValueError, match="over the available memory"):
        NgramPool(11, n=2)
    with pytest.raises(ValueError, match="over the available memory"):
        NgramDrafter().shared_pool(11)


@pytest.mark.slow
def test_device_hash_and_lookup_agree_with_the_host():
    ctx = np.random.default_rng(0).integers(0, 32000, size=(5, 4))
    assert np.array_equal(np.asarray(hash_device(jnp.asarray(ctx, jnp.int32))),
                          hash_tokens(ctx))
    drafter, p = NgramDrafter(max_n=3).shared_pool(64)
    p.add([1, 2, 3, 4, 5, 6])
    heads = p.into(drafter.prepare({}, chain_tree(3)))
    hist = jnp.array([[9, 1, 2, 3, 0], [7, 7, 7, 7, 0]], jnp.int32)
    found, nxt, count = lookup(heads, hist, jnp.array([3, 3]), 3)
    assert found.tolist() == [True, False]
    assert nxt[0, :int(count[0])].tolist() == [4, 5, 6]


@pytest.mark.slow
def test_the_pool_drafts_where_the_row_has_no_match_and_counts_its_hits():
    drafter, p = NgramDrafter(max_n=3).shared_pool(64)
    p.add([1, 2, 3, 4, 5, 6, 7])
    heads = p.into(drafter.prepare({}, chain_tree(4)))
    carry = drafter.begin(None, heads, None, None, jnp.array([[9, 1, 2]], jnp.int32),
                          jnp.array([3]), jnp.array([3]), 16)
    prop = drafter.propose(None, heads, carry, jnp.array([3]), chain_tree(4))
    assert prop.tokens[0].tolist() == [3, 4, 5, 6, 7]
    after = drafter.advance(None, heads, carry, None, None,
                            jnp.array([[3, 4, 5, 6, 7]], jnp.int32), jnp.array([4]),
                            jnp.array([8]), jnp.array([8]), jnp.array([True]))
    assert drafter.pool_hits(after).tolist() == [1]
    assert isinstance(after.hist, NgramCarry) and int(after.hist.length[0]) == 8


@pytest.mark.slow
def test_colliding_entries_never_change_an_output(medusa_default):
    """A pool whose entries hold the contexts of the very outputs decoded next, but wrong
    tokens after them (as a hash collision would): every lookup hits and drafts wrong
    tokens, and greedy decoding is still plain greedy's."""
    m = medusa_default
    prompts = [m.encode(t) for t in ("Once upon a time", "The dog")]
    tokens, lengths = pad_prompts(prompts)
    plain = generate(m.params, m.cfg, tokens, lengths, jax.random.key(0), max_new_tokens=24)
    drafter, p = NgramDrafter(max_n=2).shared_pool(4096)
    for prompt, row in zip(prompts, np.asarray(plain.tokens).tolist()):
        p.add(prompt + row)
    p.next[:] = 7  # wrong continuations under the right keys
    heads = p.into(drafter.prepare({}, chain_tree(4)))
    out = medusa_generate(m.params, heads, m.cfg, tokens, lengths, jax.random.key(0),
                          tree=chain_tree(4), max_new_tokens=24)
    assert np.asarray(out.tokens).tolist() == np.asarray(plain.tokens).tolist()


def test_into_scatters_what_was_written_since_as_the_whole_table_would():
    drafter, p = NgramDrafter(max_n=2).shared_pool(256)
    heads = drafter.prepare({}, chain_tree(3))
    rng = np.random.default_rng(1)
    for _ in range(3):
        p.add(rng.integers(0, 50, size=20).tolist())
        heads = p.into(heads)
        assert not p.dirty
        whole = {k: np.asarray(v) for k, v in p.arrays().items()}
        assert all(np.array_equal(np.asarray(heads[k]), whole[k]) for k in whole)
