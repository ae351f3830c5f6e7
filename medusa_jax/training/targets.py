"""What a drafter is trained towards at each drafted position (`--target`, the same flag in
every recipe that trains on a frozen backbone).

    hard    the data's next token (cross-entropy): what the heads decode greedily best
    kl      the frozen backbone's distribution p there: KL(p || q)
    tv      the acceptance a sampled draft gets, sum(min(p, q)) = 1 - TV(p, q), maximised:
            TV(p, q) = 0.5 * sum |p - q| minimised
    tv+kl   their sum

p = softmax(backbone logits / T) and q = softmax(drafter logits / T), T the
`--target-temperature`: decoding draws a node's drafts from softmax(drafter logits / T) at the
request's temperature T, so the drafter's logits are trained on the backbone's scale and the
loss compares the two distributions a request at temperature T sees.

`soft_loss` is the per-position loss; `soft_heads_loss` the Medusa heads' loss with soft
targets over token chunks (as `recipes.medusa_loss.chunked_medusa_loss`: the teacher's logits
of a chunk are made from the backbone's hidden states in the chunk, never for the whole
row); `shifted_soft_loss` the same from whole [K, B, T, V] logits (Hydra's, and the unchunked
computation the chunked one equals).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from medusa_jax.training.config import SOFT_TARGETS as SOFT
from medusa_jax.training.config import TARGETS, check_target  # noqa: F401 - re-exported


def soft_loss(logits: jax.Array, teacher_logits: jax.Array, target: str,
              temperature: float = 1.0) -> jax.Array:
    """logits, teacher_logits [..., V] -> the loss [...] of `target` (one of `SOFT`) at each
    position, p = softmax(teacher / T) held constant, q = softmax(logits / T)."""
    logq = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    logp = jax.nn.log_softmax(
        jax.lax.stop_gradient(teacher_logits.astype(jnp.float32)) / temperature, axis=-1)
    p = jnp.exp(logp)
    loss = jnp.zeros(logq.shape[:-1], jnp.float32)
    if target in ("kl", "tv+kl"):
        loss = loss + jnp.sum(p * (logp - logq), axis=-1)
    if target in ("tv", "tv+kl"):
        loss = loss + 0.5 * jnp.sum(jnp.abs(p - jnp.exp(logq)), axis=-1)
    if target not in SOFT:
        raise ValueError(f"not a soft target: {target!r}")
    return loss


def _hits(logits, targets):
    """Top-1 / top-5 hits [...] of the data's targets (ties count in their favour)."""
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    rank = jnp.sum(logits > tgt[..., None], axis=-1)
    return rank < 1, rank < 5


def _totals(loss_sums, top1, top5, own, count, decay):
    k = loss_sums.shape[0]
    denom = jnp.maximum(own if count is None else count, 1.0)
    head_loss = loss_sums / denom
    loss = jnp.sum(decay ** jnp.arange(1, k + 1, dtype=jnp.float32) * head_loss)
    return loss, {"loss": loss, "head_loss": head_loss, "top1": top1 / denom,
                  "top5": top5 / denom, "count": own}


def shifted_soft_loss(head_logits: jax.Array, base_logits: jax.Array, targets: jax.Array,
                      valid: jax.Array, decay: float, target: str, temperature: float = 1.0,
                      count: jax.Array | None = None, scored: jax.Array | None = None
                      ) -> tuple[jax.Array, dict]:
    """Heads' logits [K, B, T, V'] against the backbone's [B, T, V'] (its columns the heads'):
    head i at t (predicting token t+i+2) against the backbone's distribution at t+i+1, the
    position whose logits predict that token. Loss sum_i decay**(i+1) * mean of head i's
    `soft_loss` over its valid positions; the metrics as `medusa_loss.medusa_loss`'s (top-1 /
    top-5 of the data's targets [K, B, T]; `scored`: the valid ones the heads can predict)."""
    k, b, t = targets.shape
    own = jnp.sum(valid.astype(jnp.float32), axis=(1, 2))
    validf = valid.astype(jnp.float32)
    hitf = (valid if scored is None else valid & scored).astype(jnp.float32)
    sums, one, five = [], [], []
    for i in range(k):
        teacher = jnp.pad(base_logits[:, i + 1:], ((0, 0), (0, i + 1), (0, 0)))
        logits = head_logits[i].astype(jnp.float32)
        sums.append(jnp.sum(soft_loss(logits, teacher, target, temperature) * validf[i]))
        h1, h5 = _hits(jax.lax.stop_gradient(logits), targets[i])
        one.append(jnp.sum(h1 * hitf[i]))
        five.append(jnp.sum(h5 * hitf[i]))
    return _totals(jnp.stack(sums), jnp.stack(one), jnp.stack(five), own, count, decay)


def soft_heads_loss(heads_logits_fn: Callable, teacher_logits_fn: Callable, hidden: jax.Array,
                    targets: jax.Array, valid: jax.Array, decay: float, target: str,
                    temperature: float, chunk: int, count: jax.Array | None = None,
                    scored: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """`shifted_soft_loss` of Medusa heads on the last hidden state [B, T, H], `chunk`
    tokens of every row at a time (chunk >= T: in one block). `heads_logits_fn(h [B, C, H])
    -> [K, B, C, V']` the heads' logits, `teacher_logits_fn(h [B, C, H]) -> [B, C, V']` the
    backbone's over the heads' columns. A chunk holds the heads' logits of its C positions
    and the backbone's of C + K positions (those the heads' targets follow); each chunk is
    rematerialised in the backward pass, as the hard loss's chunks are."""
    k, b, t = targets.shape
    if chunk >= t:
        return shifted_soft_loss(heads_logits_fn(hidden), teacher_logits_fn(hidden), targets,
                                 valid, decay, target, temperature, count, scored)
    own = jnp.sum(valid.astype(jnp.float32), axis=(1, 2))
    hit = valid if scored is None else valid & scored
    pad = -t % chunk
    m = (t + pad) // chunk
    # the teacher reads K positions past a chunk's end: zeros there (those targets are
    # invalid: past the row's end)
    hid = jnp.pad(hidden, ((0, 0), (0, pad + k), (0, 0)))
    tv = jnp.pad(jnp.stack([targets, valid, hit]), ((0, 0), (0, 0), (0, 0), (0, pad)))

    def body(j):
        start = j * chunk
        h = jax.lax.dynamic_slice_in_dim(hid, start, chunk + k, axis=1)  # [B, C + K, H]
        tgt, val, sc = (jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=2) for x in tv)
        logits = heads_logits_fn(h[:, :chunk])  # [K, B, C, V']
        base = teacher_logits_fn(h)  # [B, C + K, V']
        sums, one, five = [], [], []
        for i in range(k):
            teacher = base[:, i + 1:i + 1 + chunk]
            sums.append(jnp.sum(soft_loss(logits[i], teacher, target, temperature) *
                                val[i].astype(jnp.float32)))
            h1, h5 = _hits(jax.lax.stop_gradient(logits[i]), tgt[i].astype(jnp.int32))
            one.append(jnp.sum(h1 * sc[i]))
            five.append(jnp.sum(h5 * sc[i]))
        return jnp.stack(sums), jnp.stack(one), jnp.stack(five)

    body = jax.checkpoint(body, prevent_cse=False)

    def step(acc, j):
        return jax.tree.map(jnp.add, acc, body(j)), None

    zeros = jnp.zeros((k,), jnp.float32)
    (sums, one, five), _ = jax.lax.scan(step, (zeros, zeros, zeros), jnp.arange(m))
    return _totals(sums, one, five, own, count, decay)
