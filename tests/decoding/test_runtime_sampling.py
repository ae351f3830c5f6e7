"""Sampling and token limits as runtime values (`Rows.values`): one compiled decoder serves
every temperature, filter, seed and limit, and its draws are still exactly plain sampling's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding.decode import generate, length_bucket, medusa_generate, pad_prompts
from medusa_jax.decoding.sampling import Rows


def test_values_check_each_row_and_name_the_field():
    with pytest.raises(ValueError, match=r"^row 1: temperature must be > 0"):
        Rows.values(2, 8, mode="rejection", temperature=[0.7, 0.0])
    with pytest.raises(ValueError, match=r"^top_p has 3 values for 2 rows"):
        Rows.values(2, 8, mode="rejection", top_p=[0.5, 0.6, 0.7])
    with pytest.raises(ValueError, match=r"^mode 'sample' is not one of"):
        Rows.values(1, 8, mode="sample")
    with pytest.raises(ValueError,
                       match=r"^row 0: max_tokens must be an integer in 1\.\.2147483647, got 0$"):
        Rows.values(2, [0, 3])
    with pytest.raises(ValueError, match=r"^temperature must be a finite number, got inf"):
        Rows.values(1, 8, mode="rejection", temperature=float("inf"))
    assert Rows.values(3, 8).modes == ("greedy",)  # a greedy program compiles argmax only
    mixed = Rows.values(2, 8, mode=["greedy", "typical"])
    assert mixed.modes == ("greedy", "typical", "rejection")
    assert np.asarray(mixed.mode).tolist() == [0, 1]


@pytest.mark.parametrize("kw, message", [
    (dict(top_k=2**32 + 1), r"^top_k must be an integer in 0\.\.2147483647 \(0: off\), "
                            r"got 4294967297$"),
    (dict(top_k=2**31), r"^top_k must be an integer in 0\.\.2147483647 \(0: off\), "
                        r"got 2147483648$"),
    (dict(top_k=2.5), r"^top_k must be an integer in 0\.\.2147483647 \(0: off\), got 2\.5$"),
    (dict(top_k=True), r"^top_k must be an integer in 0\.\.2147483647 \(0: off\), got True$"),
    (dict(max_tokens=2**32 + 3), r"^max_tokens must be an integer in 1\.\.2147483647, "
                                 r"got 4294967299$"),
    (dict(max_tokens=3.7), r"^max_tokens must be an integer in 1\.\.2147483647, got 3\.7$"),
    (dict(temperature="hot"), r"^temperature must be a number, got 'hot'$"),
    (dict(temperature=1e39), r"^temperature must be a finite number, got 1e\+39$"),
    (dict(top_p="0.5"), r"^top_p must be a number, got '0\.5'$"),
    (dict(epsilon=float("inf")), r"^epsilon must be a finite number >= 0, got inf$"),
    (dict(stop=(2**40,)), r"^stop token ids must be integers in 0\.\.2147483647, "
                          r"got 1099511627776$"),
    (dict(stop=(1.5,)), r"^stop token ids must be integers in 0\.\.2147483647, got 1\.5$"),
])
def test_values_refuse_what_int32_and_float32_cannot_hold(kw, message):
    """Nothing wraps, truncates or reads a string as a number: one line naming the field."""
    kw = dict(dict(max_tokens=8, mode="rejection"), **kw)
    with pytest.raises(ValueError, match=message):
        Rows.values(1, kw.pop("max_tokens"), **kw)


def test_sampling_refuses_a_top_k_int32_cannot_hold():
    from medusa_jax.decoding.sampling import Sampling, check

    with pytest.raises(ValueError, match=r"^top_k must be an integer in 0\.\.2147483647"):
        Sampling("rejection", top_k=2**31)
    check("rejection", top_k=2**31 - 1)  # the largest is fine (a filter of everything)


def test_length_bucket():
    assert [length_bucket(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, 128]
    assert length_bucket(65, room=100) == 100  # never past the context
    assert length_bucket(65, room=10) == 65  # nor below the limit itself


@pytest.mark.slow
def test_one_program_for_every_temperature_filter_seed_and_limit(toy_lm, toy_medusa):
    CFG, TREE = toy_lm.CFG, toy_lm.TREE
    params, heads = toy_medusa
    tokens, lengths = pad_prompts([toy_lm.PROMPT] * 4)
    settings = [dict(mode="rejection", temperature=0.7),
                dict(mode="rejection", temperature=1.3, top_k=3, top_p=0.8),
                dict(mode="typical", temperature=0.5, epsilon=0.2, delta=0.5),
                dict(mode=["rejection", "typical", "greedy", "rejection"], temperature=0.9)]
    outs = []
    for i, kw in enumerate(settings):
        limit = [5, 9, 16, 3][i]
        rows = Rows.values(4, limit, **kw)
        out = medusa_generate(params, heads, CFG, tokens, lengths, jax.random.key(i), tree=TREE,
                              max_new_tokens=16, rows=rows)
        if i == 0:
            size = medusa_generate._cache_size()
        assert medusa_generate._cache_size() == size, f"setting {i} compiled again"
        assert np.all(np.asarray(out.num_new) == limit)  # no stop token in the toy's vocabulary
        outs.append(np.asarray(out.tokens))
    # it really samples: two seeds of the same setting give different outputs
    rows = Rows.values(4, 16, mode="rejection", temperature=1.0)
    a, b = (np.asarray(medusa_generate(params, heads, CFG, tokens, lengths, jax.random.key(s),
                                       tree=TREE, max_new_tokens=16, rows=rows).tokens)
            for s in (7, 8))
    assert not np.array_equal(a, b)
    assert medusa_generate._cache_size() == size


@pytest.mark.slow
def test_a_row_limit_past_max_new_tokens_is_clipped_to_it(toy_lm, toy_medusa):
    """The output holds max_new_tokens per row: a row's limit past it is clipped (a check
    of the runtime values would need them on the host inside the jitted decoder)."""
    CFG, TREE = toy_lm.CFG, toy_lm.TREE
    params, heads = toy_medusa
    tokens, lengths = pad_prompts([toy_lm.PROMPT] * 3)
    key = jax.random.key(0)
    rows = Rows.values(3, [1000, 16, 5])
    plain = generate(params, CFG, tokens, lengths, key, max_new_tokens=16, rows=rows)
    spec = medusa_generate(params, heads, CFG, tokens, lengths, key, tree=TREE,
                           max_new_tokens=16, rows=rows)
    for out in (plain, spec):  # no stop token in the toy's vocabulary
        assert np.asarray(out.num_new).tolist() == [16, 16, 5]


@pytest.mark.slow
def test_greedy_rows_decode_as_the_static_greedy_decoder(toy_lm, toy_medusa):
    CFG, TREE = toy_lm.CFG, toy_lm.TREE
    params, heads = toy_medusa
    prompts = [[1] + list(np.random.default_rng(i).integers(3, toy_lm.V, 4)) for i in range(6)]
    tokens, lengths = pad_prompts(prompts)
    key = jax.random.key(0)
    want = np.asarray(generate(params, CFG, tokens, lengths, key, max_new_tokens=12).tokens)
    for limit in (12, 7):
        rows = Rows.values(6, limit)
        plain = generate(params, CFG, tokens, lengths, key, max_new_tokens=16, rows=rows)
        spec = medusa_generate(params, heads, CFG, tokens, lengths, key, tree=TREE,
                               max_new_tokens=16, rows=rows)
        for out in (plain, spec):
            np.testing.assert_array_equal(np.asarray(out.num_new), limit)
            np.testing.assert_array_equal(np.asarray(out.tokens)[:, :limit], want[:, :limit])


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["t1", "t0.7-topk-topp"])
def test_runtime_rejection_sampling_matches_plain_sampling_distribution(
        toy_lm, toy_medusa, chi_square_ok, which):
    """The lossless-sampling check of test_acceptance, with the sampling values as runtime
    arrays (every rule compiled in, the filters applied per row)."""
    CFG, ROWS = toy_lm.CFG, toy_lm.ROWS
    s = toy_lm.SAMPLINGS[which]
    params, heads = toy_medusa
    exact = toy_lm.exact_pair_distribution(params, s)
    tokens, lengths = pad_prompts([toy_lm.PROMPT] * ROWS)
    rows = Rows.values(ROWS, 3, mode="rejection", temperature=s.temperature, top_k=s.top_k,
                       top_p=s.top_p)
    key = jax.random.key(42)
    plain = generate(params, CFG, tokens, lengths, key, max_new_tokens=3, rows=rows)
    ok, ratio = chi_square_ok(toy_lm.pair_counts(plain).ravel(), exact.ravel())
    assert ok, f"plain sampling with runtime values is off: chi2/critical = {ratio:.2f}"
    out = medusa_generate(params, heads, CFG, tokens, lengths, key, tree=toy_lm.TREE,
                          max_new_tokens=3, rows=rows)
    ok, ratio = chi_square_ok(toy_lm.pair_counts(out).ravel(), exact.ravel())
    assert ok, f"rejection sampling with runtime values is not lossless: {ratio:.2f}"
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0.2 * hist.sum()


def test_row_log_probs_without_filters_is_the_tempered_softmax_and_with_them_filters():
    from medusa_jax.decoding.sampling import row_log_probs

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 20)) * 3, jnp.float32)
    t = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
    off = row_log_probs(logits, t, jnp.zeros(3, jnp.int32), jnp.ones(3, jnp.float32))
    np.testing.assert_allclose(off, jax.nn.log_softmax(logits / t[:, None, None]), atol=1e-6)
    # one row filtering: its top-2 alone keep mass; the others are untouched
    on = row_log_probs(logits, t, jnp.asarray([0, 2, 0], jnp.int32), jnp.ones(3, jnp.float32))
    np.testing.assert_allclose(np.delete(np.asarray(on), 1, 0), np.delete(np.asarray(off), 1, 0),
                               atol=1e-6)
    assert np.all(np.sum(np.exp(np.asarray(on[1])) > 1e-12, axis=-1) == 2)
