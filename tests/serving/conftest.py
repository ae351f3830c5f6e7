"""Serving tests' shared helper (test_engine, test_serve), as a fixture."""

import pytest


@pytest.fixture(scope="session")
def exact_pairs():
    """`exact_pairs(model, prompt, sampling)`: P(x1, x2) of plain sampling after `prompt`,
    [V, V] (acceptance.log_probs)."""
    def exact_pairs(model, prompt, sampling):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from medusa_jax.decoding.acceptance import log_probs
        from medusa_jax.model.backbone import KVCache, causal_mask, forward, standard_layout

        cfg, v = model.cfg, model.cfg.vocab_size

        @jax.jit
        def last_logprobs(params, seqs):
            b, t = seqs.shape
            cache = KVCache.init(cfg, b, t)
            logits, _, _ = forward(params, cfg, seqs, jnp.broadcast_to(jnp.arange(t), (b, t)),
                                   causal_mask(cache.lengths, t, t), cache, empty_cache=True)
            return log_probs(logits[:, -1], sampling)

        def next_probs(seqs):
            params = standard_layout(cfg, model.params)
            return np.exp(np.asarray(last_logprobs(params, np.asarray(seqs, np.int32)),
                                     np.float64))

        p1 = next_probs([prompt])[0]
        return p1[:, None] * next_probs([prompt + [x] for x in range(v)])

    return exact_pairs
