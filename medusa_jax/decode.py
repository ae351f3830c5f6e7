"""Jitted decoding: plain `generate` and Medusa `medusa_generate`.

Each is ONE jitted function: prefill, then a `lax.while_loop` that runs until every row is
done. Nothing goes back to the host per token. Shapes are static: prompts are right-padded
to a power-of-two bucket, so a new prompt length only recompiles when it crosses a bucket.

A Medusa step (all rows at once, each row at its own cache length) is five named stages,
in the paper's order:
  1. `propose_candidates`: the root (already chosen) and each head's top-k fill the tree;
  2. `verify`: one backbone pass over root + tree nodes, the tree mask after the prefix;
  3. `accept`: the acceptance rule of the sampling mode picks a path and the next root;
  4. `emit` + `commit`: the accepted tokens go to the output (cut at EOS) and the accepted
     path's keys/values to consecutive cache slots;
  5. the heads (`head_fn`) run on the last accepted node's hidden state only.
The loop state of each decoder is a typed `flax.struct` dataclass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from medusa_jax import acceptance, sharding
from medusa_jax.acceptance import Sampling
from medusa_jax.backbone import (KVCache, Params, causal_mask, forward, forward_uncommitted,
                                 tree_mask_after_prefix, write_kv)
from medusa_jax.config import ModelConfig
from medusa_jax.heads import apply_heads
from medusa_jax.tree import Tree

MIN_BUCKET = 16


def prompt_bucket(length: int) -> int:
    """Pad prompts to the next power of two (at least 16): few distinct compiled shapes."""
    return max(MIN_BUCKET, 1 << (max(1, length) - 1).bit_length())


def pad_prompts(prompts: list[list[int]], bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to a bucket. Returns (tokens [B, bucket], lengths [B])."""
    if not prompts:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError(f"prompt {int(np.argmin(lengths))} is empty: give at least one token")
    bucket = bucket or prompt_bucket(int(lengths.max()))
    tokens = np.zeros((len(prompts), bucket), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def check_fits(cfg: ModelConfig, prompt_len: int, max_new_tokens: int, tree_tokens: int = 1):
    """Raise before compiling when prompt + new tokens + tree overflow the context."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    need = prompt_len + max_new_tokens + tree_tokens
    if need > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + tree "
            f"({tree_tokens} tokens) = {need} exceeds the model's context of "
            f"{cfg.max_position_embeddings}; shorten the prompt or lower max_new_tokens")


@struct.dataclass
class Output:
    """Per-row results (device arrays). `tokens[b, :num_new[b]]` are row b's new tokens."""

    tokens: jax.Array  # [B, max_new_tokens] int32
    num_new: jax.Array  # [B] int32
    steps: jax.Array  # [B] int32: decoding steps (forward passes after prefill)
    accept_hist: jax.Array  # [B, D+2] int32: how many steps emitted 0 .. D+1 tokens


def _eos_mask(tokens: jax.Array, eos: tuple[int, ...]) -> jax.Array:
    if not eos:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos, jnp.int32))


def _prefill(params, cfg, tokens, lengths, capacity):
    b, p = tokens.shape
    tokens = sharding.constrain_rows(tokens)  # under `jax.set_mesh`: rows over data axes
    cache = KVCache.init(cfg, b, capacity)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, hidden, cache = forward(params, cfg, tokens, positions,
                                    causal_mask(cache.lengths, p, capacity), cache,
                                    empty_cache=True)
    last = lengths - 1
    rows = jnp.arange(b)
    return logits[rows, last], hidden[rows, last], cache.replace(lengths=lengths)


def _row_keys(key, b):
    return jax.random.split(key, b)


def _split_rows(keys):
    """Per-row keys [B] -> (carried [B], for use now [B])."""
    both = jax.vmap(jax.random.split)(keys)
    return both[:, 0], both[:, 1]


@struct.dataclass
class PlainState:
    """The plain loop's carry (per row: B)."""

    cache: KVCache
    next_token: jax.Array  # [B] int32: sampled, not yet emitted
    out: jax.Array  # [B, max_new_tokens] int32
    count: jax.Array  # [B] int32: tokens emitted
    done: jax.Array  # [B] bool
    keys: jax.Array  # [B] PRNG keys, one stream per row


def _sample_rows(keys, logits, sampling):
    return jax.vmap(lambda k, l: acceptance.sample(k, l, sampling))(keys, logits)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "max_new_tokens", "eos"))
def generate(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
             key: jax.Array, *, sampling: Sampling = Sampling(), max_new_tokens: int = 128,
             eos: tuple[int, ...] = ()) -> Output:
    """Plain autoregressive decoding. tokens [B, P] right-padded, lengths [B]."""
    b, p = tokens.shape
    capacity = p + max_new_tokens + 1
    logits, _, cache = _prefill(params, cfg, tokens, lengths, capacity)
    keys, sub = _split_rows(_row_keys(key, b))
    zeros = jnp.zeros((b,), jnp.int32)
    state = PlainState(cache=cache, next_token=_sample_rows(sub, logits, sampling),
                       out=jnp.zeros((b, max_new_tokens), jnp.int32), count=zeros,
                       done=jnp.zeros((b,), bool), keys=keys)

    def body(s: PlainState) -> PlainState:
        live = ~s.done
        at = live[:, None] & (jnp.arange(max_new_tokens)[None] == s.count[:, None])
        out = jnp.where(at, s.next_token[:, None], s.out)
        count = s.count + live
        done = s.done | (live & _eos_mask(s.next_token, eos)) | (count >= max_new_tokens)
        logits, _, cache = forward(params, cfg, s.next_token[:, None], s.cache.lengths[:, None],
                                   causal_mask(s.cache.lengths, 1, capacity), s.cache)
        keys, sub = _split_rows(s.keys)
        new = _sample_rows(sub, logits[:, 0], sampling)
        return PlainState(cache=cache.advance(~done),
                          next_token=jnp.where(done, s.next_token, new), out=out, count=count,
                          done=done, keys=keys)

    s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    hist = jnp.zeros((b, 3), jnp.int32).at[:, 1].set(s.count)
    return Output(tokens=s.out, num_new=s.count, steps=s.count, accept_hist=hist)


def small_top_k(x: jax.Array, k: int) -> jax.Array:
    """Indices of the k largest entries along the last axis, largest first.

    k rounds of argmax-and-mask: on CPU, XLA's TopK sorts the whole vocabulary and costs
    more than the rest of a Medusa step; trees need k <= 10.
    """
    picks = []
    for _ in range(k):
        idx = jnp.argmax(x, axis=-1)
        picks.append(idx)
        x = jnp.where(jnp.arange(x.shape[-1]) == idx[..., None], -jnp.inf, x)
    return jnp.stack(picks, axis=-1).astype(jnp.int32)


@struct.dataclass
class MedusaState:
    """The Medusa loop's carry (per row: B; K heads, D tree depth)."""

    cache: KVCache
    root: jax.Array  # [B] int32: the next token, already chosen by the model
    head_logits: jax.Array  # [K, B, V]: the heads' guesses for the tokens after the root
    out: jax.Array  # [B, max_new_tokens + D + 1] int32 (a chunk may overshoot, then is cut)
    count: jax.Array  # [B] int32: tokens emitted
    steps: jax.Array  # [B] int32: verification steps taken
    hist: jax.Array  # [B, D + 2] int32: steps that emitted 0 .. D + 1 tokens
    done: jax.Array  # [B] bool
    keys: jax.Array  # [B] PRNG keys, one stream per row


def propose_candidates(root: jax.Array, head_logits: jax.Array, tree: Tree) -> jax.Array:
    """Stage 1. root [B], head_logits [K, B, V] -> each tree node's token [B, T]: node i
    takes entry `tree.cand_index[i]` of [root, top-k of head 1, top-k of head 2, ...]."""
    b = root.shape[0]
    top = small_top_k(head_logits[:tree.depth], tree.top_k)  # [D, B, k]
    flat = jnp.concatenate([root[:, None], jnp.transpose(top, (1, 0, 2)).reshape(b, -1)],
                           axis=1)
    return flat[:, jnp.asarray(tree.cand_index)].astype(jnp.int32)


def verify(params: Params, cfg: ModelConfig, cand: jax.Array, cache: KVCache, tree: Tree):
    """Stage 2. One backbone pass over the tree's tokens cand [B, T], each at position
    length + its depth, attending the prefix and its own ancestors. Returns (logits
    [B, T, V], hidden [B, T, H], the new keys/values [L, B, KVH, T, D] each, uncommitted)."""
    positions = cache.lengths[:, None] + jnp.asarray(tree.node_depth)[None, :]
    mask = tree_mask_after_prefix(cache.lengths, jnp.asarray(tree.mask), cache.capacity)
    return forward_uncommitted(params, cfg, cand, positions, mask, cache)


def emit(s: MedusaState, chunk: jax.Array, acc_len: jax.Array, eos: tuple[int, ...],
         max_new_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Stage 4a. Append the accepted chunk [B, D+1] (root + acc_len accepted nodes) to the
    output, stopping at its first EOS. Returns (out, count, done, tokens kept this step)."""
    live = ~s.done
    in_chunk = jnp.arange(chunk.shape[1])[None] <= acc_len[:, None]
    is_eos = _eos_mask(chunk, eos) & in_chunk
    hit_eos = jnp.any(is_eos, axis=1)
    n_emit = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, acc_len + 1)
    out = jax.vmap(lambda o, c, i: jax.lax.dynamic_update_slice(o, c, (i,)))(
        s.out, chunk, s.count)
    out = jnp.where(live[:, None], out, s.out)
    count = jnp.where(live, s.count + n_emit, s.count)
    done = s.done | (live & hit_eos) | (count >= max_new_tokens)
    # what the histogram counts: the last step may be cut by max_new_tokens
    kept = jnp.where(live, jnp.minimum(n_emit, max_new_tokens - s.count), 0)
    return out, count, done, kept


def commit(cache: KVCache, k_new: jax.Array, v_new: jax.Array, path: jax.Array,
           advance: jax.Array) -> KVCache:
    """Stage 4b. Keep only the accepted path's keys/values: node path[b, j] of the verify
    pass goes to slot lengths[b] + j; then each row's length grows by advance [B]."""
    sel = path[None, :, None, :, None]  # [1, B, 1, D+1, 1]
    cache = write_kv(cache, jnp.take_along_axis(k_new, sel, axis=3),
                     jnp.take_along_axis(v_new, sel, axis=3))
    return cache.advance(advance)


def standard_heads(heads: Params, hidden: jax.Array, lengths: jax.Array) -> jax.Array:
    """The head function of Medusa: hidden [B, H] -> logits [K, B, V] (lengths unused)."""
    del lengths
    return apply_heads(heads, hidden)


@functools.partial(jax.jit,
                   static_argnames=("cfg", "tree", "sampling", "max_new_tokens", "eos", "head_fn"))
def medusa_generate(params: Params, heads: Params, cfg: ModelConfig, tokens: jax.Array,
                    lengths: jax.Array, key: jax.Array, *, tree: Tree,
                    sampling: Sampling = Sampling(), max_new_tokens: int = 128,
                    eos: tuple[int, ...] = (), head_fn=standard_heads) -> Output:
    """Medusa decoding with tree verification. tokens [B, P] right-padded, lengths [B].

    `head_fn(heads, hidden [B, H], lengths [B]) -> [K, B, V]` turns the hidden state of the
    last committed token (at slot lengths - 1) into head logits; the default applies the
    Medusa heads. Tests plug in oracle heads here.
    """
    b, p = tokens.shape
    depth = tree.depth
    capacity = p + max_new_tokens + tree.num_nodes + 1
    paths = jnp.asarray(tree.paths)
    rows = jnp.arange(b)

    base_logits, hidden, cache = _prefill(params, cfg, tokens, lengths, capacity)
    keys, sub = _split_rows(_row_keys(key, b))
    # typical acceptance keeps the first token greedy (the paper's rule)
    root_rule = sampling if sampling.mode == "rejection" else Sampling()
    root = _sample_rows(sub, base_logits, root_rule)
    if head_fn is standard_heads:
        # heads deeper than the tree never propose a candidate: do not run them
        heads = jax.tree.map(lambda x: x[:depth], heads)
    head_logits = head_fn(heads, hidden, lengths)  # [K, B, V]
    if head_logits.shape[0] < depth:
        raise ValueError(f"tree {tree.name!r} has depth {depth} but there are only "
                         f"{head_logits.shape[0]} Medusa heads")
    zeros = jnp.zeros((b,), jnp.int32)
    state = MedusaState(cache=cache, root=root, head_logits=head_logits,
                        out=jnp.zeros((b, max_new_tokens + depth + 1), jnp.int32), count=zeros,
                        steps=zeros, hist=jnp.zeros((b, depth + 2), jnp.int32),
                        done=jnp.zeros((b,), bool), keys=keys)

    def body(s: MedusaState) -> MedusaState:
        live = ~s.done
        cand = propose_candidates(s.root, s.head_logits, tree)  # 1
        logits, hidden, (k_new, v_new) = verify(params, cfg, cand, s.cache, tree)  # 2
        keys, sub = _split_rows(s.keys)
        best, acc_len, next_root = acceptance.accept(logits, cand, tree, sampling, sub)  # 3
        path = paths[best]  # [B, D+1] node indices, root first
        chunk = jnp.take_along_axis(cand, path, axis=1)
        out, count, done, kept = emit(s, chunk, acc_len, eos, max_new_tokens)  # 4
        cache = commit(s.cache, k_new, v_new, path, jnp.where(live, acc_len + 1, 0))
        new_head_logits = head_fn(heads, hidden[rows, path[rows, acc_len]], cache.lengths)  # 5
        return MedusaState(
            cache=cache, root=jnp.where(live, next_root, s.root),
            head_logits=jnp.where(live[None, :, None], new_head_logits, s.head_logits),
            out=out, count=count, steps=s.steps + live,
            hist=s.hist.at[rows, jnp.clip(kept, 0, depth + 1)].add(live.astype(jnp.int32)),
            done=done, keys=keys)

    s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    count = jnp.minimum(s.count, max_new_tokens)
    return Output(tokens=s.out[:, :max_new_tokens], num_new=count, steps=s.steps,
                  accept_hist=s.hist)
