"""Fixtures the drafter tests share."""

import pytest


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


@pytest.fixture(scope="session")
def walks_into_unverified():
    """walks(tree, prop, vocab): for a dynamic tree's Proposal over the pool `tree`, put
    almost all of the target's mass on the token of an unverified child of the root (a
    verified one where a row has none) and run rejection sampling, with the proposal's
    `valid` mask and without it -> (with, without): per row, whether the accepted path holds
    an unverified node. Also checks the proposal's shape: the root and some nodes verified,
    not all."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from medusa_jax.decoding.acceptance import Sampling, rejection

    def walks(tree, prop, vocab):
        valid, drafted = np.asarray(prop.valid), np.asarray(prop.tokens)
        rows = valid.shape[0]
        assert not valid.all() and valid[:, 0].all()
        children = [i for i, r in enumerate(tree.paths_ranks, start=1) if len(r) == 1]
        target = np.zeros(rows, np.int64)
        for r in range(rows):
            unver = [n for n in children if not valid[r, n]]
            target[r] = drafted[r, unver[0]] if unver else drafted[r, children[0]]
        logits = jnp.zeros((rows, tree.num_nodes, vocab)).at[
            jnp.arange(rows), :, target].set(12.0)
        run = jax.jit(lambda lg, tok, k, m: rejection(lg, tok, tree, Sampling(
            mode="rejection"), k, m))
        keys = jax.random.split(jax.random.key(3), rows)

        def walked(mask):
            best, acc_len, _ = run(logits, prop.tokens, keys, mask)
            paths = np.asarray(tree.paths)[np.asarray(best)]
            return [not valid[r, path[1:n + 1]].all()
                    for r, (path, n) in enumerate(zip(paths, np.asarray(acc_len)))]

        return walked(prop.valid), walked(jnp.ones_like(prop.valid))

    return walks
