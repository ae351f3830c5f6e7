"""Fixtures the drafter tests share."""

import pytest


@pytest.fixture(scope="session")
def one_line_error():
    """check(exc_type, fn, *needles): `fn()` raises exc_type with a one-line message holding
    every needle; returns the message."""
    def check(exc_type, fn, *needles):
        with pytest.raises(exc_type) as e:
            fn()
        msg = str(e.value)
        assert "\n" not in msg, msg
        for n in needles:
            assert str(n) in msg, (n, msg)
        return msg

    return check


@pytest.fixture(scope="module")
def story_plain(stories):
    """The drafters' greedy-equality setting on the embedded model: `prompts` (three token
    lists of different lengths), `max_new` (40), `rows(out)` (each row's new tokens of a
    decoder's Output) and `rows_plain` (plain greedy decoding's, EOS 2)."""
    from types import SimpleNamespace

    import jax
    import numpy as np

    from medusa_jax.decoding.decode import generate, pad_prompts

    cfg, params, _ = stories
    prompts, max_new = [[1, 400, 30], [1, 50], [1, 9, 9, 9, 100, 7, 300]], 40

    def rows(out):
        return [np.asarray(out.tokens[i, :int(out.num_new[i])]).tolist()
                for i in range(len(out.num_new))]

    tokens, lengths = pad_prompts(prompts)
    plain = rows(generate(params, cfg, tokens, lengths, jax.random.key(0),
                          max_new_tokens=max_new, eos=(2,)))
    return SimpleNamespace(prompts=prompts, max_new=max_new, rows=rows, rows_plain=plain)
