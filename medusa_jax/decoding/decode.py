"""Jitted decoding: plain `generate` and speculative `medusa_generate` (Medusa or Hydra heads).

Each is ONE jitted function: prefill, then a `lax.while_loop` that runs until every row is
done. Nothing goes back to the host per token. Shapes are static: prompts are right-padded
to a power-of-two bucket, so a new prompt length only recompiles when it crosses a bucket.

A Medusa step (all rows at once, each row at its own cache length) is five named stages,
in the paper's order:
  1. the drafter proposes: the root (already chosen) and the heads' top-k fill the tree
     (a `decoding.drafter.Drafter`: Medusa heads, `propose_candidates`; Hydra heads
     draft depth by depth);
  2. `verify`: one backbone pass over root + tree nodes, the tree mask after the prefix;
  3. `accept`: the acceptance rule of the sampling mode picks a path and the next root;
  4. `emit` + `commit`: the accepted tokens go to the output (cut at EOS) and the accepted
     path's keys/values to consecutive cache slots;
  5. the drafter's carry from the last accepted node's hidden state only (Medusa: the
     heads run there).
The loop state of each decoder is a typed `flax.struct` dataclass.

Attention reads every cache slot its mask covers, so both loops run in a few phases
(`cache_phases`): each phase is its own `while_loop` whose steps attend over a static
leading window of the cache just wide enough for that phase (one cache buffer throughout;
shapes stay static; the step is compiled once per phase).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from medusa_jax.runtime import pytree as struct  # flax.struct without importing Flax

from medusa_jax.decoding import acceptance
from medusa_jax import kernels
from medusa_jax.runtime import sharding
from medusa_jax.decoding.acceptance import Sampling
from medusa_jax.decoding.drafter import drafter_for
from medusa_jax.model.backbone import (KVCache, Params, causal_mask, forward, forward_scratch,
                                 is_decoding_layout, tree_mask_after_prefix, write_kv)
from medusa_jax.model.config import ModelConfig
from medusa_jax.decoding.tree import DynamicTree, Tree

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
        # tree_tokens=0: plain decoding (its last token is emitted, never fed)
        tree = f" + tree ({tree_tokens} tokens)" if tree_tokens else ""
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}){tree} = {need} "
            f"exceeds the model's context of {cfg.max_position_embeddings}; shorten the "
            f"prompt or lower max_new_tokens")


# Cache phases: each widens the attention window by at least CACHE_BLOCK slots, a decode
# whose cache is at most 2 * CACHE_BLOCK slots past the prompt has one phase, and no decode
# has more than MAX_CACHE_PHASES (each compiles the step once more). On the 2-core CPU,
# stories260K: no gain at 128 new tokens; at 400, plain 1.5x and Medusa 1.2x tokens/s
# (README, Performance).
CACHE_BLOCK = 128
MAX_CACHE_PHASES = 4


def cache_phases(start: int, final: int, per_step: int, block: int | None = None,
                 max_phases: int | None = None) -> tuple[int, ...]:
    """Attention windows (leading cache slots) of the decoding loop's phases, for prompts of
    `start` slots (the bucket) and a cache of `final` slots; a step feeds up to `per_step`
    tokens past the committed ones. Increasing; the last is `final`."""
    block = CACHE_BLOCK if block is None else block
    max_phases = MAX_CACHE_PHASES if max_phases is None else max_phases
    if not (isinstance(max_phases, int) and max_phases >= 1 and block >= 1):
        raise ValueError(f"max_cache_phases must be an int >= 1, got {max_phases!r}")
    span = final - start
    if max_phases == 1 or span <= 2 * block:
        return (final,)
    step = max(block, per_step, -(-span // max_phases))
    caps = list(range(start + step, final, step))
    if caps and final - caps[-1] < step // 2:  # a short last phase is not worth a compile
        caps.pop()
    return tuple(caps) + (final,)


def run_phases(step, state, windows: tuple[int, ...], per_step: int):
    """`while_loop(not all done, step)` in cache phases: phase i calls `step(s, window=
    windows[i])` while every row's next step fits in that many slots (lengths + per_step <=
    window); the last phase (the whole cache) runs until every row is done."""
    s = state
    for i, window in enumerate(windows):
        last = i == len(windows) - 1

        def cond(s, window=window, last=last):
            go = ~jnp.all(s.done)
            return go if last else go & (jnp.max(s.cache.lengths) + per_step <= window)

        s = jax.lax.while_loop(cond, functools.partial(step, window=window), s)
    return s


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
    # the decoding layout (one device) writes a per-layer cache in place
    cache = KVCache.init(cfg, b, capacity, per_layer=is_decoding_layout(params))
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


def _next_keys(keys, used: bool):
    """(carried keys, keys for this step). Greedy choices draw nothing: no PRNG work."""
    return _split_rows(keys) if used else (keys, keys)


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


def plain_capacity(prompt_slots: int, max_new_tokens: int) -> int:
    """KV cache slots a plain decode needs at most."""
    return prompt_slots + max_new_tokens + 1


def plain_init(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
               key: jax.Array, sampling: Sampling, max_new_tokens: int) -> PlainState:
    """Prefill the prompts and choose each row's first token."""
    b, p = tokens.shape
    logits, _, cache = _prefill(params, cfg, tokens, lengths, plain_capacity(p, max_new_tokens))
    keys, sub = _split_rows(_row_keys(key, b))
    zeros = jnp.zeros((b,), jnp.int32)
    return PlainState(cache=cache, next_token=_sample_rows(sub, logits, sampling),
                      out=jnp.zeros((b, max_new_tokens), jnp.int32), count=zeros,
                      done=jnp.zeros((b,), bool), keys=keys)


def plain_step(params: Params, cfg: ModelConfig, sampling: Sampling, eos: tuple[int, ...],
               s: PlainState, window: int | None = None) -> PlainState:
    """Emit each live row's next token, then feed it and choose the one after, attending
    over the first `window` cache slots (default: all)."""
    max_new_tokens = s.out.shape[1]
    live = ~s.done
    at = live[:, None] & (jnp.arange(max_new_tokens)[None] == s.count[:, None])
    out = jnp.where(at, s.next_token[:, None], s.out)
    count = s.count + live
    done = s.done | (live & _eos_mask(s.next_token, eos)) | (count >= max_new_tokens)
    logits, _, cache = forward(params, cfg, s.next_token[:, None], s.cache.lengths[:, None],
                               causal_mask(s.cache.lengths, 1, window or s.cache.capacity),
                               s.cache)
    keys, sub = _next_keys(s.keys, sampling.mode != "greedy")
    new = _sample_rows(sub, logits[:, 0], sampling)
    return PlainState(cache=cache.advance(~done), next_token=jnp.where(done, s.next_token, new),
                      out=out, count=count, done=done, keys=keys)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "max_new_tokens", "eos",
                                             "max_cache_phases"))
def generate(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
             key: jax.Array, *, sampling: Sampling = Sampling(), max_new_tokens: int = 128,
             eos: tuple[int, ...] = (), max_cache_phases: int = MAX_CACHE_PHASES) -> Output:
    """Plain autoregressive decoding. tokens [B, P] right-padded, lengths [B].
    `max_cache_phases`: 1 attends over the whole cache at every step (`cache_phases`)."""
    b, p = tokens.shape
    state = plain_init(params, cfg, tokens, lengths, key, sampling, max_new_tokens)
    s = run_phases(functools.partial(plain_step, params, cfg, sampling, eos), state,
                   cache_phases(p, state.cache.capacity, 1, max_phases=max_cache_phases), 1)
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
    # the drafter's carry: Medusa heads' guesses for the tokens after the root [K, B, V];
    # for Hydra heads the last accepted hidden state [1, B, H] (they draft in stage 1)
    head_logits: jax.Array
    out: jax.Array  # [B, max_new_tokens + D + 1] int32 (a chunk may overshoot, then is cut)
    count: jax.Array  # [B] int32: tokens emitted
    steps: jax.Array  # [B] int32: verification steps taken
    hist: jax.Array  # [B, D + 2] int32: steps that emitted 0 .. D + 1 tokens
    done: jax.Array  # [B] bool
    keys: jax.Array  # [B] PRNG keys, one stream per row


@struct.dataclass
class Proposal:
    """What stage 1 hands to the others: the tokens to verify and, for acceptance, the tree
    they form. A static tree verifies every node; a dynamic tree a per-row subset of its
    pool, and acceptance then works on the pool with the unverified nodes masked out."""

    fed: jax.Array  # [B, T] int32: the tokens verified, root first
    fed_depth: jax.Array  # [T] or [B, T] int32: each one's position after the root
    fed_mask: jax.Array  # [T, T] or [B, T, T] bool: which fed tokens each one attends
    tokens: jax.Array  # [B, N] int32: every node's token (N = tree or pool nodes)
    valid: jax.Array | None  # [B, N] bool: the nodes verified (None: all)
    slot: jax.Array | None  # [B, N] int32: each node's index in `fed` (None: the same)

    def fed_index(self, nodes: jax.Array) -> jax.Array:
        """Node indices [B, ...] -> their indices in `fed`."""
        return nodes if self.slot is None else jnp.take_along_axis(self.slot, nodes, axis=1)


def propose_candidates(root: jax.Array, head_logits: jax.Array,
                       tree: Tree | DynamicTree) -> Proposal:
    """Stage 1 (Medusa heads). root [B], head_logits [K, B, V] -> the tokens to verify: node
    i of the tree takes entry `cand_index[i]` of [root, top-k of head 1, top-k of head 2,
    ...]. A dynamic tree keeps, per row, the `size` pool nodes whose paths are most probable
    under the heads (the sum of each node's rank log-probability along its path)."""
    static = tree.pool if isinstance(tree, DynamicTree) else tree
    b, depth, k = root.shape[0], static.depth, static.top_k
    top = small_top_k(head_logits[:depth], k)  # [D, B, k]
    flat = jnp.concatenate([root[:, None], jnp.transpose(top, (1, 0, 2)).reshape(b, -1)],
                           axis=1)
    cand_index = jnp.asarray(static.cand_index)
    tokens = flat[:, cand_index].astype(jnp.int32)  # [B, N]
    if not isinstance(tree, DynamicTree):
        return tree_proposal(tokens, None, tree)
    logp = jax.nn.log_softmax(head_logits[:depth].astype(jnp.float32), axis=-1)
    top_logp = jnp.take_along_axis(logp, top, axis=-1)  # [D, B, k]
    flat_logp = jnp.concatenate([jnp.zeros((b, 1)), jnp.transpose(top_logp, (1, 0, 2))
                                 .reshape(b, -1)], axis=1)
    return tree_proposal(tokens, flat_logp[:, cand_index], tree)


def tree_proposal(tokens: jax.Array, node_logp: jax.Array | None,
                  tree: Tree | DynamicTree) -> Proposal:
    """Stage 1's common end, for any drafter: every node's token [B, N] (and, for a dynamic
    tree, each node's own log-probability [B, N] at its depth) -> the Proposal. A static tree
    verifies every node; a dynamic one, per row, the `size` pool nodes of highest path
    log-probability (a subtree: a child scores strictly below its parent)."""
    if not isinstance(tree, DynamicTree):
        return Proposal(fed=tokens, fed_depth=jnp.asarray(tree.node_depth),
                        fed_mask=jnp.asarray(tree.mask), tokens=tokens, valid=None, slot=None)
    static = tree.pool
    b = tokens.shape[0]
    ancestors = jnp.asarray(static.mask, jnp.float32)  # [N, N]: ancestors and itself
    depth_of = jnp.asarray(static.node_depth)
    # a child scores strictly below its parent (ties included): the choice is a subtree
    score = node_logp @ ancestors.T - 1e-4 * depth_of[None]
    chosen = jax.lax.top_k(score[:, 1:], tree.size)[1] + 1  # [B, size], the root apart
    nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                             jnp.sort(chosen, axis=1).astype(jnp.int32)], axis=1)  # [B, T]
    rows = jnp.arange(b)[:, None]
    valid = jnp.zeros(tokens.shape, bool).at[rows, nodes].set(True)
    slot = jnp.zeros(tokens.shape, jnp.int32).at[rows, nodes].set(
        jnp.arange(tree.num_nodes, dtype=jnp.int32)[None])
    mask = jnp.asarray(static.mask)[nodes[:, :, None], nodes[:, None, :]]  # [B, T, T]
    return Proposal(fed=jnp.take_along_axis(tokens, nodes, axis=1), fed_depth=depth_of[nodes],
                    fed_mask=mask, tokens=tokens, valid=valid, slot=slot)


def verify(params: Params, cfg: ModelConfig, prop: Proposal, cache: KVCache,
           window: int | None = None):
    """Stage 2. One backbone pass over the proposed tokens [B, T], each at position
    length + its depth, attending the prefix (within the first `window` cache slots,
    default all) and its own ancestors. Returns (logits [B, T, V], hidden [B, T, H], the new
    keys/values [L, B, KVH, T, D] each, and the cache with them written in the scratch
    slots past the context, uncommitted: `commit` keeps the accepted path)."""
    depth = prop.fed_depth if prop.fed_depth.ndim == 2 else prop.fed_depth[None, :]
    positions = cache.lengths[:, None] + depth
    mask = tree_mask_after_prefix(cache.lengths, prop.fed_mask, window or cache.capacity)
    return forward_scratch(params, cfg, prop.fed, positions, mask, cache)


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


def medusa_capacity(prompt_slots: int, max_new_tokens: int, tree: Tree | DynamicTree) -> int:
    """KV cache slots a Medusa decode needs at most (the last step verifies a whole tree)."""
    return prompt_slots + max_new_tokens + tree.num_nodes + 1


def medusa_init(params: Params, heads: Params, cfg: ModelConfig, tokens: jax.Array,
                lengths: jax.Array, key: jax.Array, tree: Tree, sampling: Sampling,
                max_new_tokens: int, head_fn=None) -> tuple[MedusaState, Params]:
    """Prefill, choose each row's root and run the heads once. Returns (state, the heads the
    tree uses: those deeper than the tree never propose a candidate and are not run)."""
    drafter = drafter_for(heads, head_fn)
    b, p = tokens.shape
    depth = tree.depth
    base_logits, hidden, cache = _prefill(params, cfg, tokens, lengths,
                                          medusa_capacity(p, max_new_tokens, tree))
    keys, sub = _split_rows(_row_keys(key, b))
    # typical acceptance keeps the first token greedy (the paper's rule)
    root_rule = sampling if sampling.mode == "rejection" else Sampling()
    root = _sample_rows(sub, base_logits, root_rule)
    heads = drafter.prepare(heads, tree, cpu_kernels=kernels.active(params))
    head_logits = drafter.start(params, heads, hidden, lengths)  # the drafter's carry
    if drafter.num_heads(heads, head_logits) < depth:
        raise ValueError(f"tree {tree.name!r} has depth {depth} but there are only "
                         f"{drafter.num_heads(heads, head_logits)} {drafter.kind.title()} "
                         f"heads")
    zeros = jnp.zeros((b,), jnp.int32)
    state = MedusaState(cache=cache, root=root, head_logits=head_logits,
                        out=jnp.zeros((b, max_new_tokens + depth + 1), jnp.int32), count=zeros,
                        steps=zeros, hist=jnp.zeros((b, depth + 2), jnp.int32),
                        done=jnp.zeros((b,), bool), keys=keys)
    return state, heads


def medusa_step(params: Params, heads: Params, cfg: ModelConfig, tree: Tree,
                sampling: Sampling, eos: tuple[int, ...], max_new_tokens: int, head_fn,
                s: MedusaState, window: int | None = None) -> MedusaState:
    """One Medusa step for every row, the five stages in order (attending over the first
    `window` cache slots, default all)."""
    rows = jnp.arange(s.root.shape[0])
    live = ~s.done
    static = tree.pool if isinstance(tree, DynamicTree) else tree
    drafter = drafter_for(heads, head_fn)
    prop = drafter.propose(params, heads, s.head_logits, s.root, tree)  # 1
    logits, hidden, (k_new, v_new), cache = verify(params, cfg, prop, s.cache, window)  # 2
    keys, sub = _next_keys(s.keys, sampling.mode == "rejection")
    best, acc_len, next_root = acceptance.accept(logits, prop.tokens, static, sampling, sub,
                                                 prop.valid, prop.slot)  # 3
    path = jnp.asarray(static.paths)[best]  # [B, D+1] node indices, root first
    chunk = jnp.take_along_axis(prop.tokens, path, axis=1)
    out, count, done, kept = emit(s, chunk, acc_len, eos, max_new_tokens)  # 4
    fed_path = prop.fed_index(path)
    cache = commit(cache, k_new, v_new, fed_path, jnp.where(live, acc_len + 1, 0))
    new_head_logits = drafter.start(params, heads, hidden[rows, fed_path[rows, acc_len]],
                                    cache.lengths)  # 5
    return MedusaState(
        cache=cache, root=jnp.where(live, next_root, s.root),
        head_logits=jnp.where(live[None, :, None], new_head_logits, s.head_logits),
        out=out, count=count, steps=s.steps + live,
        hist=s.hist.at[rows, jnp.clip(kept, 0, tree.depth + 1)].add(live.astype(jnp.int32)),
        done=done, keys=keys)


@functools.partial(jax.jit,
                   static_argnames=("cfg", "tree", "sampling", "max_new_tokens", "eos", "head_fn",
                                    "max_cache_phases"))
def medusa_generate(params: Params, heads: Params, cfg: ModelConfig, tokens: jax.Array,
                    lengths: jax.Array, key: jax.Array, *, tree: Tree,
                    sampling: Sampling = Sampling(), max_new_tokens: int = 128,
                    eos: tuple[int, ...] = (), head_fn=None,
                    max_cache_phases: int = MAX_CACHE_PHASES) -> Output:
    """Medusa decoding with tree verification. tokens [B, P] right-padded, lengths [B].
    `max_cache_phases`: 1 attends over the whole cache at every step (`cache_phases`).

    `heads`: Medusa heads or Hydra heads (`drafters/`); the drafter is chosen from
    them (`drafter_for`). `head_fn(heads, hidden [B, H], lengths [B]) -> [K, B, V]` turns
    the hidden state of the last committed token (at slot lengths - 1) into Medusa head
    logits; the default applies the Medusa heads. Tests plug in oracle heads here. A
    drafter (`MedusaDrafter`, `HydraDrafter`) may be given as `head_fn` too.
    """
    state, heads = medusa_init(params, heads, cfg, tokens, lengths, key, tree, sampling,
                               max_new_tokens, head_fn)
    step = functools.partial(medusa_step, params, heads, cfg, tree, sampling, eos,
                             max_new_tokens, head_fn)
    windows = cache_phases(tokens.shape[1], state.cache.capacity, tree.num_nodes,
                           max_phases=max_cache_phases)
    s = run_phases(step, state, windows, tree.num_nodes)
    count = jnp.minimum(s.count, max_new_tokens)
    return Output(tokens=s.out[:, :max_new_tokens], num_new=count, steps=s.steps,
                  accept_hist=s.hist)
