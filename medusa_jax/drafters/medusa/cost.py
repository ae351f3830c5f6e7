"""What Medusa heads cost per call, for each projection layout they may have (`infer.bench
--heads-cost`): timed here, on random heads."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from medusa_jax.drafters.medusa.heads import apply_heads


def _median_time(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile + warm-up, not timed
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def heads_cost(hidden: int, vocab: int, *, num_heads: int = 5, num_layers: int = 1,
               reduced: int | None = None, reps: int = 30, seed: int = 0) -> dict[str, float]:
    """Seconds of one jitted `apply_heads` call on one token (random heads, float32), for
    each projection the heads may have: one per head [K, H, V], one shared [1, H, V], a
    reduced vocabulary of `reduced` tokens (default V // 4) per head, or shared and
    reduced. Median of `reps` calls after a warm-up."""
    reduced = reduced or max(1, vocab // 4)
    keys = jax.random.split(jax.random.key(seed), 4)
    k, lyr = num_heads, num_layers
    blocks = {"w": 0.01 * jax.random.normal(keys[0], (k, lyr, hidden, hidden)),
              "b": jnp.zeros((k, lyr, hidden))}
    index = jnp.where(jnp.arange(vocab) < reduced, jnp.arange(vocab), -1).astype(jnp.int32)
    variants = {
        "per-head": {"proj": jax.random.normal(keys[1], (k, hidden, vocab))},
        "shared": {"proj": jax.random.normal(keys[1], (1, hidden, vocab))},
        "reduced": {"proj": jax.random.normal(keys[2], (k, hidden, reduced)),
                    "token_index": jnp.broadcast_to(index, (k, vocab))},
        "shared+reduced": {"proj": jax.random.normal(keys[2], (1, hidden, reduced)),
                           "token_index": index[None]},
    }
    x = jax.random.normal(keys[3], (1, hidden))
    fn = jax.jit(apply_heads)
    return {name: _median_time(lambda h=dict(blocks, **v): fn(h, x), reps)
            for name, v in variants.items()}
