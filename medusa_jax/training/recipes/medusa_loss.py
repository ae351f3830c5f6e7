"""The Medusa heads' loss, shared by the recipes that train Medusa-shaped heads
(`medusa1`, `hydra`, `medusa2`): the targets of head k (token t+k+1 of the same packed
example), the per-head cross-entropy and its accuracies, computed in one block, over token
chunks or over vocabulary chunks (`heads_loss`), reduced-vocabulary heads, the frozen
backbone's loss function (`medusa1_loss_fn`) and its labels and gradient-accumulation
totals.

Loss: head k (1-based) at position t is trained on token t+k+1, only where that token is a
label (assistant token) of the same packed example. Per head, cross-entropy is averaged over
its valid positions (0 when there are none, never NaN); heads are summed with weight decay**k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.drafters.medusa.heads import apply_heads, head_states
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig
from medusa_jax.training.step import Batch, LossFn, frozen_hidden


def medusa_targets(batch: Batch, num_heads: int) -> tuple[jax.Array, jax.Array]:
    """Targets and validity for every head: both [K, B, T].

    Head k (1-based) at position t predicts tokens[t+k+1]; valid when that token is a label
    and belongs to the same example as position t (packed rows hold several).
    """
    tokens, seg, mask = batch["tokens"], batch["segments"], batch["loss_mask"]
    t = tokens.shape[1]
    targets, valid = [], []
    for k in range(1, num_heads + 1):
        shift = k + 1
        pad = ((0, 0), (0, shift))
        tgt = jnp.pad(tokens[:, shift:], pad) if shift < t else jnp.zeros_like(tokens)
        tgt_seg = jnp.pad(seg[:, shift:], pad) if shift < t else jnp.zeros_like(seg)
        tgt_lbl = jnp.pad(mask[:, shift:], pad) if shift < t else jnp.zeros_like(mask)
        targets.append(tgt)
        valid.append(tgt_lbl & (tgt_seg == seg) & (seg > 0))
    return jnp.stack(targets), jnp.stack(valid)


def medusa_loss(head_logits: jax.Array, targets: jax.Array, valid: jax.Array,
                decay: float, count: jax.Array | None = None,
                scored: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """head_logits [K, B, T, V], targets/valid [K, B, T] -> (loss, metrics with [K] arrays).
    `count` ([K]): the per-head means' denominators (default: the valid positions here).
    `scored` ([K, B, T], reduced-vocabulary heads): the valid positions whose target the
    heads can predict; the others add nothing to the loss and count as misses."""
    k = head_logits.shape[0]
    logits = head_logits.astype(jnp.float32)
    tgt_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [K, B, T]
    ce = jax.nn.logsumexp(logits, axis=-1) - tgt_logit
    # rank of the target = how many logits beat it (ties count in its favour)
    rank = jnp.sum(logits > tgt_logit[..., None], axis=-1)
    own = jnp.sum(valid.astype(jnp.float32), axis=(1, 2))  # [K]
    validf = (valid if scored is None else valid & scored).astype(jnp.float32)
    # no valid position: loss 0, not NaN
    denom = jnp.maximum(own if count is None else count, 1.0)
    head_loss = jnp.sum(ce * validf, axis=(1, 2)) / denom
    weights = decay ** jnp.arange(1, k + 1, dtype=jnp.float32)
    loss = jnp.sum(weights * head_loss)
    metrics = {
        "loss": loss,
        "head_loss": head_loss,
        "top1": jnp.sum((rank < 1) * validf, axis=(1, 2)) / denom,
        "top5": jnp.sum((rank < 5) * validf, axis=(1, 2)) / denom,
        "count": own,
    }
    return loss, metrics


# One chunk's heads' logits [K, rows, chunk, V] float32 (per device) stay under this many
# bytes when the chunk is automatic: 512 MiB, so a 7B model's 8 rows x 2,048 tokens on one
# device are scored 64 tokens of every row at a time (5 heads, 32,000 words: 0.33 GB per
# chunk) instead of in one 10.5 GB block. (1 GiB chunks: the 7B step's temporaries 8.5 GB
# instead of 7.9 GB, float32, 1 layer, XLA:CPU; both from 33.3 GB unchunked.)
AUTO_CHUNK_BYTES = 2 ** 29


def loss_chunk_size(seq_len: int, rows: int, num_heads: int, vocab: int, chunk: int = 0) -> int:
    """Tokens of every row per chunk of the heads' loss: `chunk` when given (>= 1), else
    the largest power of two whose logits [K, rows, chunk, V] in float32 fit
    `AUTO_CHUNK_BYTES` (`rows`: a device's rows of the batch); never more than `seq_len`
    (then the loss is one block: exactly the unchunked computation)."""
    if chunk < 1:
        per_token = num_heads * max(rows, 1) * vocab * 4
        chunk = 2 ** max(0, int(AUTO_CHUNK_BYTES // per_token).bit_length() - 1)
    return min(chunk, seq_len)


def _chunk_sums(heads: Params, hidden: jax.Array, targets: jax.Array, valid: jax.Array):
    """One chunk: hidden [B, C, H], targets/valid [K, B, C] -> per-head sums [K] of the
    cross-entropy, top-1 and top-5 hits over the valid positions (the ranks as in
    `medusa_loss`; `valid` here: the scored ones)."""
    logits = apply_heads(heads, hidden)  # [K, B, C, V] float32
    tgt_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jax.nn.logsumexp(logits, axis=-1) - tgt_logit
    rank = jnp.sum(logits > tgt_logit[..., None], axis=-1)
    validf = valid.astype(jnp.float32)
    return (jnp.sum(ce * validf, axis=(1, 2)), jnp.sum((rank < 1) * validf, axis=(1, 2)),
            jnp.sum((rank < 5) * validf, axis=(1, 2)))


def _heads_total(ce, top1, top5, own, count, decay: float) -> tuple[jax.Array, dict]:
    """The loss and metrics from per-head sums [K] over the scored positions: means over
    `count` (default `own`, the valid positions), heads weighted decay**k."""
    denom = jnp.maximum(own if count is None else count, 1.0)
    head_loss = ce / denom
    weights = decay ** jnp.arange(1, ce.shape[0] + 1, dtype=jnp.float32)
    loss = jnp.sum(weights * head_loss)
    return loss, {"loss": loss, "head_loss": head_loss, "top1": top1 / denom,
                  "top5": top5 / denom, "count": own}


def chunked_medusa_loss(heads: Params, hidden: jax.Array, targets: jax.Array,
                        valid: jax.Array, decay: float, chunk: int,
                        count: jax.Array | None = None,
                        scored: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """`medusa_loss(apply_heads(heads, hidden), ...)` without the [K, B, T, V] logits: the
    T positions of every row are scored `chunk` at a time in a `lax.scan` whose body is
    under `jax.checkpoint`, so the backward pass recomputes each chunk's logits instead of
    keeping them; at most one chunk's logits (and their gradient) exist at once. Chunks
    cut the sequence, not the batch, so a batch split over devices stays split. hidden
    [B, T, H], targets/valid [K, B, T]; the same loss, gradients (to float rounding) and
    metrics. `count` ([K]): the denominators of the per-head means (default: the valid
    positions here; gradient accumulation passes the whole batch's); `scored` as in
    `medusa_loss`."""
    own = jnp.sum(valid.astype(jnp.float32), axis=(1, 2))
    if scored is not None:
        valid = valid & scored
    k, b, t = targets.shape
    pad = -t % chunk  # padded positions are invalid: they add nothing
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, 0), (0, pad)))
        valid = jnp.pad(valid, ((0, 0), (0, 0), (0, pad)))
    m = (t + pad) // chunk
    xs = (hidden.reshape(b, m, chunk, -1).swapaxes(0, 1),  # [m, B, C, H]
          targets.reshape(k, b, m, chunk).transpose(2, 0, 1, 3),  # [m, K, B, C]
          valid.reshape(k, b, m, chunk).transpose(2, 0, 1, 3))
    body = jax.checkpoint(_chunk_sums, prevent_cse=False)

    def step(acc, x):
        return jax.tree.map(jnp.add, acc, body(heads, *x)), None

    zeros = jnp.zeros((k,), jnp.float32)
    (ce, top1, top5), _ = jax.lax.scan(step, (zeros, zeros, zeros), xs)
    return _heads_total(ce, top1, top5, own, count, decay)


# ----------------------------------------------------------------- the loss over vocab chunks
#
# Chunking the tokens keeps one chunk's logits small, but every chunk's gradient of the
# projection is a whole [K, H, V] array added to the running sum: at Llama 3's 128,256
# words and 5 heads that is two 10.5 GB float32 buffers during the backward pass, besides
# the gradient itself. Chunking the vocabulary instead gives each chunk its own columns of
# the gradient, written in place: the loss is a softmax over all columns through an online
# logsumexp (first pass), and the backward pass (second pass, a custom VJP) recomputes each
# chunk's logits and writes its columns. Chunk j holds the columns j, j + n, j + 2n, ... so
# that a vocabulary split over devices (the `vocab` axis) is split evenly in every chunk.


def vocab_chunks(vocab: int, num_heads: int, tokens: int, limit: int = 0) -> int | None:
    """How many chunks the vocabulary is cut into so that one chunk's logits
    [K, tokens, V / n] float32 fit `limit` bytes (0: `AUTO_CHUNK_BYTES`): the smallest
    divisor n of `vocab` that does, or None when its chunks would hold under a quarter of
    the limit (a vocabulary size without convenient divisors: then the tokens are
    chunked)."""
    limit = limit or AUTO_CHUNK_BYTES
    most = max(1, limit // (num_heads * max(tokens, 1) * 4))  # columns per chunk
    for n in range(-(-vocab // most), vocab + 1):
        if vocab % n == 0:
            return n if 4 * (vocab // n) >= most else None
    return None


def loss_chunking(seq_len: int, rows: int, num_heads: int, vocab: int, chunk: int = 0,
                  proj_heads: int | None = None, train_proj: bool = True,
                  soft: bool = False) -> tuple[str, int]:
    """How the heads' loss is computed for a device's `rows` x `seq_len` tokens:
    ("one", seq_len) in one block when it fits `AUTO_CHUNK_BYTES` (or `chunk` >= seq_len);
    with `chunk` >= 1, ("tokens", chunk); else whichever of ("vocab", n chunks) and
    ("tokens", the automatic size) holds less besides the gradient.

    Token chunks add about one and a half projection-sized gradients (each chunk's
    contribution, then its sum: `proj_heads` (K, or 1 shared) x H x V) when the projection
    trains; vocabulary chunks about six heads' states for every token (K x tokens x H: the
    blocks' activations, the targets' columns, their gradient), all tokens at once. H
    cancels: vocabulary chunks when 4 x K x tokens < proj_heads x V. (XLA:CPU, one layer of
    Llama-2-7B, batch 8 x 2,048, float32: 7.85 GB of temporaries over token chunks against
    15.96 over vocabulary chunks; Llama-3-8B batch 4: 38.98 against 22.36 GB.)

    `soft`: soft targets (`training.targets`): a chunk also holds the backbone's logits and
    each head's target distribution (sized as 2K + 1 heads' logits), and the tokens are
    chunked, never the vocabulary (the target distribution needs every column at once)."""
    if soft:
        size = loss_chunk_size(seq_len, rows, 2 * num_heads + 1, vocab, chunk)
        return ("one", seq_len) if size >= seq_len else ("tokens", size)
    size = loss_chunk_size(seq_len, rows, num_heads, vocab, chunk)
    if size >= seq_len:
        return "one", seq_len
    tokens = max(rows, 1) * seq_len
    proj_heads = num_heads if proj_heads is None else proj_heads
    if chunk < 1 and train_proj and 4 * num_heads * tokens < proj_heads * vocab:
        n = vocab_chunks(vocab, num_heads, tokens)
        if n is not None:
            return "vocab", n
    return "tokens", size


def _chunk_logits(x, w, j):
    """Chunk j's logits [K, N, V/n] float32: x [K, N, H], w [P, H, V/n, n] (P = K or 1)."""
    wj = jax.lax.dynamic_index_in_dim(w, j, axis=3, keepdims=False).astype(x.dtype)
    eq = "knh,hv->knv" if w.shape[0] == 1 and x.shape[0] > 1 else "knh,khv->knv"
    return jnp.einsum(eq, x, wj[0] if eq == "knh,hv->knv" else wj,
                      preferred_element_type=jnp.float32)


def _vocab_ce_forward(x, proj, targets, weight, n):
    p, h, v = proj.shape
    w = proj.reshape(p, h, v // n, n)
    # the target's logit, from its own column (ranks below count the other columns only)
    if p == 1 and x.shape[0] > 1:  # shared: [H, K, N]
        cols = jnp.take(proj[0], targets, axis=1)
        tgt = jnp.einsum("knh,hkn->kn", x, cols.astype(x.dtype),
                         preferred_element_type=jnp.float32)
    else:
        cols = jnp.take_along_axis(proj, targets[:, None, :], axis=2)  # [K, H, N]
        tgt = jnp.einsum("knh,khn->kn", x, cols.astype(x.dtype),
                         preferred_element_type=jnp.float32)
    local, home = targets // n, targets % n
    iota = jnp.arange(v // n)

    def step(carry, j):
        m, s, rank = carry
        logits = _chunk_logits(x, w, j)
        new_m = jnp.maximum(m, jnp.max(logits, axis=-1))
        s = s * jnp.exp(m - new_m) + jnp.sum(jnp.exp(logits - new_m[..., None]), axis=-1)
        own = (home == j)[..., None] & (iota == local[..., None])
        rank = rank + jnp.sum((logits > tgt[..., None]) & ~own, axis=-1)
        return (new_m, s, rank), None

    k, tokens = targets.shape
    init = (jnp.full((k, tokens), -jnp.inf), jnp.zeros((k, tokens)),
            jnp.zeros((k, tokens), jnp.int32))
    (m, s, rank), _ = jax.lax.scan(step, init, jnp.arange(n))
    lse = m + jnp.log(s)
    sums = (jnp.sum((lse - tgt) * weight, axis=1), jnp.sum((rank < 1) * weight, axis=1),
            jnp.sum((rank < 5) * weight, axis=1))
    return sums, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def vocab_chunked_ce(x, proj, targets, weight, n: int, train_proj: bool = True):
    """Per-head sums [K] of the cross-entropy, top-1 and top-5 hits of logits x @ proj over
    the weighted positions, the vocabulary `n` chunks at a time (see above). x [K, N, H];
    proj [K, H, V] or [1, H, V] (shared); targets [K, N] column ids; weight [K, N]. The
    gradient flows to x and (`train_proj`) to proj; the hit counts have none."""
    return _vocab_ce_forward(x, proj, targets, weight, n)[0]


def _vocab_ce_fwd(x, proj, targets, weight, n, train_proj):
    sums, lse = _vocab_ce_forward(x, proj, targets, weight, n)
    return sums, (x, proj, targets, weight, lse)


def _vocab_ce_bwd(n, train_proj, res, cotangents):
    x, proj, targets, weight, lse = res
    p, h, v = proj.shape
    w = proj.reshape(p, h, v // n, n)
    coef = weight * cotangents[0][:, None]  # d loss / d ce at each position [K, N]
    local, home = targets // n, targets % n
    iota = jnp.arange(v // n)
    shared = p == 1 and x.shape[0] > 1

    def step(carry, j):
        dx, dw = carry
        logits = _chunk_logits(x, w, j)
        own = (home == j)[..., None] & (iota == local[..., None])
        dl = (jnp.exp(logits - lse[..., None]) - own) * coef[..., None]  # [K, N, V/n]
        wj = jax.lax.dynamic_index_in_dim(w, j, axis=3, keepdims=False).astype(x.dtype)
        dl_c = dl.astype(x.dtype)
        if shared:
            dx = dx + jnp.einsum("knv,hv->knh", dl_c, wj[0], preferred_element_type=jnp.float32)
        else:
            dx = dx + jnp.einsum("knv,khv->knh", dl_c, wj, preferred_element_type=jnp.float32)
        if train_proj:
            eq = "knh,knv->hv" if shared else "knh,knv->khv"
            g = jnp.einsum(eq, x, dl_c, preferred_element_type=jnp.float32)
            g = g.reshape(p, h, v // n).astype(dw.dtype)
            dw = jax.lax.dynamic_update_index_in_dim(dw, g, j, axis=3)
        return (dx, dw), None

    dw0 = jnp.zeros(w.shape if train_proj else (0,), proj.dtype)
    (dx, dw), _ = jax.lax.scan(step, (jnp.zeros(x.shape, jnp.float32), dw0), jnp.arange(n))
    dproj = dw.reshape(p, h, v) if train_proj else jnp.zeros_like(proj)
    return dx.astype(x.dtype), dproj, None, None


vocab_chunked_ce.defvjp(_vocab_ce_fwd, _vocab_ce_bwd)


def vocab_chunked_medusa_loss(heads: Params, hidden: jax.Array, targets: jax.Array,
                              valid: jax.Array, decay: float, chunks: int,
                              count: jax.Array | None = None,
                              scored: jax.Array | None = None,
                              train_proj: bool = True) -> tuple[jax.Array, dict]:
    """`medusa_loss(apply_heads(heads, hidden), ...)` with the vocabulary in `chunks`
    chunks (`vocab_chunked_ce`): no [K, B, T, V] logits, and no whole-size gradient of the
    projection besides the gradient itself. Arguments as in `chunked_medusa_loss`;
    `train_proj=False`: the projection is frozen (no gradient computed for it)."""
    k, b, t = targets.shape
    own = jnp.sum(valid.astype(jnp.float32), axis=(1, 2))
    weight = (valid if scored is None else valid & scored).astype(jnp.float32)
    x = head_states(heads, hidden).reshape(k, b * t, -1)
    ce, top1, top5 = vocab_chunked_ce(x, heads["proj"], targets.reshape(k, b * t),
                                      weight.reshape(k, b * t), chunks, train_proj)
    return _heads_total(ce, top1, top5, own, count, decay)


def heads_loss(heads: Params, hidden: jax.Array, targets: jax.Array, valid: jax.Array,
               decay: float, chunk: int = 0, count: jax.Array | None = None,
               batch_ways: int = 1, token_index: jax.Array | None = None,
               train_proj: bool = True) -> tuple[jax.Array, dict]:
    """The heads' loss and metrics from the last hidden state [B, T, H], computed as
    `loss_chunking` says (`batch_ways`: the devices the rows are split over): in one block
    (today's computation exactly), over vocabulary chunks (`vocab_chunked_medusa_loss`) or
    over token chunks (`chunked_medusa_loss`). `train_proj=False`: the projection is frozen.

    `token_index` ([1, V] int32, reduced-vocabulary heads being trained: token id -> column
    of the heads' projection, -1 outside): the loss is a softmax over the heads' T columns
    only, and a target outside them is a miss that adds nothing to the loss (the means and
    the accuracies still divide by every valid position, so they compare with full heads')."""
    k, b, t = targets.shape
    scored = None
    if token_index is not None:
        columns = token_index[0][targets]  # [K, B, T]
        scored = columns >= 0
        targets = jnp.where(scored, columns, 0)
    how, size = loss_chunking(t, -(-b // batch_ways), k, heads_vocab(heads), chunk,
                              heads["proj"].shape[0], train_proj)
    if how == "one":
        return medusa_loss(apply_heads(heads, hidden), targets, valid, decay, count, scored)
    if how == "vocab":
        return vocab_chunked_medusa_loss(heads, hidden, targets, valid, decay, size, count,
                                         scored, train_proj)
    return chunked_medusa_loss(heads, hidden, targets, valid, decay, size, count, scored)


def heads_vocab(heads: Params) -> int:
    """The vocabulary the heads' logits cover (token ids: reduced heads too)."""
    if "token_index" in heads:
        return int(heads["token_index"].shape[-1])
    return int(heads["proj"].shape[-1])


def medusa1_loss_fn(cfg: ModelConfig, decay: float = 0.8, chunk: int = 0,
                    batch_ways: int = 1, frozen_proj: bool = False,
                    token_map=None, target: str = "hard",
                    temperature: float = 1.0) -> LossFn:
    """Medusa-1: frozen backbone (stop_gradient), heads on its last hidden state; the heads'
    loss in chunks of `chunk` tokens per row (0: `loss_chunk_size`'s automatic size for rows
    split `batch_ways` ways). `frozen_proj`: no gradient for the heads' projection.
    `token_map` ([T] token ids): the heads' projection has T columns, those tokens (a
    reduced vocabulary; the map is a constant of the loss, not a trained parameter).
    `target` (`training.targets`): hard, or a soft target against the backbone's
    distribution at `temperature` (restricted to the heads' columns, renormalised)."""
    token_index = None if token_map is None else \
        jnp.asarray(reduced_token_index(token_map, cfg.vocab_size))

    def loss_fn(params: Params, batch: Batch):
        hidden = frozen_hidden(params["backbone"], cfg, batch, batch_ways)
        heads = params["heads"]
        if frozen_proj:
            heads = dict(heads, proj=jax.lax.stop_gradient(heads["proj"]))
        targets, valid = medusa_targets(batch, params["heads"]["w"].shape[0])
        count = batch.get("totals", {}).get("heads")
        if target == "hard":
            return heads_loss(heads, hidden, targets, valid, decay, chunk, count, batch_ways,
                              token_index, train_proj=not frozen_proj)
        return soft_loss(cfg, jax.lax.stop_gradient(params["backbone"]), heads, hidden,
                         targets, valid, decay, target, temperature, chunk, count,
                         batch_ways, token_map)

    return loss_fn


def soft_loss(cfg: ModelConfig, backbone: Params, heads: Params, hidden: jax.Array,
              targets: jax.Array, valid: jax.Array, decay: float, target: str,
              temperature: float, chunk: int = 0, count: jax.Array | None = None,
              batch_ways: int = 1, token_map=None) -> tuple[jax.Array, dict]:
    """The heads' loss against soft targets (`targets.soft_heads_loss`): the teacher's logits
    from the frozen `backbone`'s output layer on the same hidden states, over token chunks
    as `loss_chunking(soft=True)` says. `token_map`: reduced-vocabulary heads (their
    columns; the teacher restricted to them, a data target outside them a miss)."""
    from medusa_jax.model.backbone import logits_from_hidden
    from medusa_jax.training import targets as soft_targets

    k, b, t = targets.shape
    scored, columns = None, None
    if token_map is not None:
        columns = jnp.asarray(token_map)
        index = jnp.asarray(reduced_token_index(token_map, cfg.vocab_size))[0][targets]
        scored = index >= 0
        targets = jnp.where(scored, index, 0)

    def teacher(h):
        logits = logits_from_hidden(cfg, backbone, h)
        return logits if columns is None else logits[..., columns]

    _, size = loss_chunking(t, -(-b // batch_ways), k, heads_vocab(heads), chunk, soft=True)
    return soft_targets.soft_heads_loss(lambda h: apply_heads(heads, h), teacher, hidden,
                                        targets, valid, decay, target, temperature, size,
                                        count, scored)


# ----------------------------------------------------------------------------- reduced vocab


def frequent_tokens(tokens: np.ndarray, labels: np.ndarray, vocab: int, size: int
                    ) -> tuple[np.ndarray, float]:
    """The `size` most frequent label tokens (ties: the lower id), as sorted ids [size], and
    the fraction of label tokens they cover. tokens/labels: [N, T] ids and label mask."""
    counts = np.bincount(tokens[labels].ravel(), minlength=vocab)[:vocab]
    top = np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)
    return top, float(counts[top].sum() / max(counts.sum(), 1))


def reduced_token_index(token_map, vocab: int) -> np.ndarray:
    """[1, V] int32: token id -> its column in `token_map`, -1 for the others (the heads'
    `token_index`, the form `heads.apply_heads` and `drafters.formats` read)."""
    index = np.full((1, vocab), -1, np.int32)
    index[0, np.asarray(token_map)] = np.arange(len(token_map), dtype=np.int32)
    return index


def reduce_heads(heads: Params, token_map) -> Params:
    """Heads restricted to the columns `token_map` of their projection (no `token_index`:
    the trainable form; `reduced_token_index` gives the index to decode with)."""
    return dict(heads, proj=heads["proj"][..., jnp.asarray(token_map)])


def medusa1_labels(params: Params, frozen_proj: bool = False) -> dict:
    """Label per top-level subtree (a prefix of the params tree); `frozen_proj`: the heads'
    projection is frozen too (a shared projection: the base model's output layer), only
    their residual blocks train."""
    heads = {n: ("frozen" if n == "proj" else "train") for n in params["heads"]} \
        if frozen_proj else "train"
    return {name: (heads if name == "heads" else "frozen") for name in params}


def medusa_totals(batch: Batch, num_heads: int) -> dict:
    """What the heads' per-head means divide by, over a whole batch: {"heads": [K]}."""
    _, valid = medusa_targets(batch, num_heads)
    return {"heads": jnp.sum(valid.astype(jnp.float32), axis=(1, 2))}
