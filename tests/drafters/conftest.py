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


@pytest.fixture(scope="module")
def stepped_and_begun(stories):
    """`run(heads, prompts, tree, aux_layers=())` -> (state, fresh, full_len): the decode
    state after prefill and 6 steps of `tree` over `prompts` (some drafts accepted), and the
    drafter's carry begun afresh over each row's prompt + every token it emitted (lengths
    `full_len`), with the state's root. A drafter that keeps context must build step by step
    (`advance`) what `begin` builds at once."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from medusa_jax.decoding import step
    from medusa_jax.decoding.decode import pad_prompts
    from medusa_jax.decoding.sampling import Rows, Sampling
    from medusa_jax.drafters.registry import drafter_for
    from medusa_jax.model.backbone import KVCache, causal_mask, forward

    cfg, params, _ = stories
    steps, cap, max_new = 6, 96, 64

    def run(heads, prompts, tree, aux_layers=()):
        d = drafter_for(heads)
        tokens, lengths = pad_prompts(prompts)
        b = tokens.shape[0]
        rows = Rows.of(Sampling(), b, max_new, ())

        @jax.jit
        def stepped(params, heads):
            s = step.start(params, cfg, tokens, lengths, jax.random.split(jax.random.key(0), b),
                           rows, cap, d, heads, width=tree.depth + 1)
            out = jnp.zeros((b, max_new + tree.depth + 1), jnp.int32)

            def body(_, c):
                s, out = c
                s2, chunk, _ = step.medusa_step(params, cfg, d, heads, tree, s)
                return s2, step.append(out, chunk, s.count, ~s.done)

            return jax.lax.fori_loop(0, steps, body, (s, out))

        s, out = stepped(params, heads)
        count = np.asarray(s.count)
        assert np.any(count > steps)  # drafts were accepted in some step
        seqs = [list(p) + np.asarray(out[r, :count[r]]).tolist() for r, p in enumerate(prompts)]
        full, full_len = pad_prompts(seqs)

        @jax.jit
        def fresh(params, heads):
            p = full.shape[1]
            cache = KVCache.init(cfg, b, p)
            res = forward(params, cfg, jnp.asarray(full), jnp.broadcast_to(jnp.arange(p), (b, p)),
                          causal_mask(cache.lengths, p, p), cache, empty_cache=True,
                          aux_layers=tuple(aux_layers))
            aux = res[3] if aux_layers else None
            return d.begin(params, heads, res[1], aux, jnp.asarray(full), jnp.asarray(full_len),
                           s.root, cap)

        return s, fresh(params, heads), full_len

    return run
