"""The decoding step, written once: a plain step and a Medusa step over B rows.

Every row may be live or free (`done`), and follows its own sampling, stop tokens and token
limit (`sampling.Rows`). Two drivers run these steps: the offline decoders (`decode`: a
`while_loop` in cache phases until every row is done) and the serving engine (`serving`:
K steps per call over S slots, requests inserted into free rows).

A row's `root` is its next token, chosen and not yet emitted: a step emits it first, then
the tokens it accepts, and chooses the next root. A Medusa step is five stages, in the
paper's order:
  1. the drafter proposes the tree from its carry and the root (`decoding.drafter`);
  2. `verify`: one backbone pass over root + tree nodes, the tree mask after the prefix;
  3. `acceptance.accept_rows`: each row's rule picks a path and the next root;
  4. `emit` + `commit`: the accepted tokens go out (cut at a stop token or the limit) and
     the accepted path's keys/values to consecutive cache slots;
  5. the drafter's carry advanced along the accepted path (`Drafter.advance`: its hidden
     states, and the inputs of the backbone layers the drafter reads, `aux_layers`).
Each step returns (state, chunk [B, W], n [B]): row b emitted chunk[b, :n[b]].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding import acceptance
from medusa_jax.decoding.drafter import Drafter
from medusa_jax.decoding.sampling import (
    PLAIN_DRAWS,
    ROOT_DRAWS,
    Rows,
    argmax,
    next_keys,
    sample_rows,
    split_rows,
)
from medusa_jax.decoding.tree import DynamicTree, Tree
from medusa_jax.model.backbone import (
    KVCache,
    Params,
    causal_mask,
    forward,
    forward_scratch,
    is_decoding_layout,
    logits_from_hidden,
    tree_mask_after_prefix,
    write_kv,
)
from medusa_jax.model.config import ModelConfig
from medusa_jax.runtime import pytree as struct
from medusa_jax.runtime import sharding


def static_tree(tree: Tree | DynamicTree) -> Tree:
    """The tree acceptance walks: a dynamic tree's pool, else the tree."""
    return tree.pool if isinstance(tree, DynamicTree) else tree


def small_top_k(x: jax.Array, k: int) -> jax.Array:
    """Indices of the k largest entries along the last axis, largest first.

    k rounds of argmax-and-mask: on CPU, XLA's TopK sorts the whole vocabulary and costs
    more than the rest of a Medusa step; trees need k <= 10.
    """
    picks = []
    for _ in range(k):
        idx = argmax(x)
        picks.append(idx)
        x = jnp.where(jnp.arange(x.shape[-1]) == idx[..., None], -jnp.inf, x)
    return jnp.stack(picks, axis=-1)


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
    # sampled drafts (a `DraftSampler` was given): each node's drafts in draw order, its
    # children's tokens among them (`Tree.rank_child`), and the draft distribution they
    # were drawn from, over the target vocabulary; None: each node's top-k, deterministic
    draws: jax.Array | None = None  # [B, N, top_k] int32
    draft_logq: jax.Array | None = None  # [B, N, V] float32 log-probabilities
    # with `draws`: which of a node's drafts are fixed, not drawn (merged n-gram drafts):
    # acceptance offers them first, each with a one-hot q; None: all drawn
    fixed: jax.Array | None = None  # [B, N, top_k] bool

    def fed_index(self, nodes: jax.Array) -> jax.Array:
        """Node indices [B, ...] -> their indices in `fed`."""
        return nodes if self.slot is None else jnp.take_along_axis(self.slot, nodes, axis=1)


@struct.dataclass
class DraftSampler:
    """How a drafter picks a node's children for rows that accept by rejection sampling: k
    draws without replacement from its own distribution at the row's temperature, top-k and
    top-p (Gumbel-top-k: the perturbed top k are such draws, in draw order), which is what
    lossless multi-draft acceptance needs them to be (`acceptance.rejection_logp`). Other
    rows keep their k most likely tokens."""

    rows: Rows
    keys: jax.Array  # [B] PRNG keys for this step's drafts
    sampled: jax.Array  # [B] bool: the rows whose drafts are drawn

    def top_k(self, logits: jax.Array, k: int, axis: int, call: int = 0):
        """logits [..., V] with the rows on `axis` -> (k drafts [..., k] in draw order, the
        log-distribution they were drawn from [..., V], float32). `call` tells a drafter's
        calls within one step apart (each draws afresh)."""
        x = jnp.moveaxis(logits, axis, 0)  # [B, ..., V]
        logq = self.rows.log_probs(x)
        keys = jax.vmap(lambda key: jax.random.fold_in(key, call))(self.keys)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, x.shape[1:]))(keys)
        drawn = self.sampled.reshape((-1,) + (1,) * (x.ndim - 1))
        top = small_top_k(jnp.where(drawn, logq + gumbel, x.astype(jnp.float32)), k)
        return jnp.moveaxis(top, 0, axis), jnp.moveaxis(logq, 0, axis)


def propose_candidates(root: jax.Array, head_logits: jax.Array,
                       tree: Tree | DynamicTree, draw: DraftSampler | None = None) -> Proposal:
    """Stage 1 (Medusa heads). root [B], head_logits [K, B, V] -> the tokens to verify: node
    i of the tree takes entry `cand_index[i]` of [root, top-k of head 1, top-k of head 2,
    ...]. A dynamic tree keeps, per row, the `size` pool nodes whose paths are most probable
    under the heads (the sum of each node's rank log-probability along its path). `draw`:
    each head's k drafts drawn (`DraftSampler`) instead of its top-k."""
    static = tree.pool if isinstance(tree, DynamicTree) else tree
    b, depth, k = root.shape[0], static.depth, static.top_k
    drafts = None
    if draw is None:
        top = small_top_k(head_logits[:depth], k)  # [D, B, k]
    else:
        top, logq = draw.top_k(head_logits[:depth], k, axis=1)  # [D, B, k], [D, B, V]
        # a node's children are drafted by the head one deeper than the node (a leaf's
        # entry is never offered)
        below = jnp.asarray(np.minimum(static.node_depth, depth - 1))
        drafts = (jnp.transpose(top[below], (1, 0, 2)).astype(jnp.int32),
                  jnp.transpose(logq[below], (1, 0, 2)))
    flat = jnp.concatenate([root[:, None], jnp.transpose(top, (1, 0, 2)).reshape(b, -1)],
                           axis=1)
    cand_index = jnp.asarray(static.cand_index)
    tokens = flat[:, cand_index].astype(jnp.int32)  # [B, N]
    if not isinstance(tree, DynamicTree):
        return tree_proposal(tokens, None, tree, drafts)
    logp = jax.nn.log_softmax(head_logits[:depth].astype(jnp.float32), axis=-1)
    top_logp = jnp.take_along_axis(logp, top, axis=-1)  # [D, B, k]
    flat_logp = jnp.concatenate([jnp.zeros((b, 1)), jnp.transpose(top_logp, (1, 0, 2))
                                 .reshape(b, -1)], axis=1)
    return tree_proposal(tokens, flat_logp[:, cand_index], tree, drafts)


def tree_proposal(tokens: jax.Array, node_logp: jax.Array | None,
                  tree: Tree | DynamicTree, drafts: tuple | None = None) -> Proposal:
    """Stage 1's common end, for any drafter: every node's token [B, N] (and, for a dynamic
    tree, each node's own log-probability [B, N] at its depth) -> the Proposal. A static tree
    verifies every node; a dynamic one, per row, the `size` pool nodes of highest path
    log-probability (a subtree: a child scores strictly below its parent). `drafts`: sampled
    drafts (each node's draws [B, N, k] and draft log-distribution [B, N, V]), or None."""
    draws, draft_logq = drafts if drafts is not None else (None, None)
    if not isinstance(tree, DynamicTree):
        return Proposal(fed=tokens, fed_depth=jnp.asarray(tree.node_depth),
                        fed_mask=jnp.asarray(tree.mask), tokens=tokens, valid=None, slot=None,
                        draws=draws, draft_logq=draft_logq)
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
                    fed_mask=mask, tokens=tokens, valid=valid, slot=slot, draws=draws,
                    draft_logq=draft_logq)


def verify(params: Params, cfg: ModelConfig, prop: Proposal, cache: KVCache,
           window: int | None = None, aux_layers: tuple = ()):
    """Stage 2. One backbone pass over the proposed tokens [B, T], each at position
    length + its depth, attending the prefix (within the first `window` cache slots,
    default all) and its own ancestors. Returns (logits [B, T, V], hidden [B, T, H], the new
    keys/values [L, B, KVH, T, D] each, and the cache with them written in the scratch
    slots past the context, uncommitted: `commit` keeps the accepted path), and with
    `aux_layers` the inputs of those layers [B, T, A] last."""
    depth = prop.fed_depth if prop.fed_depth.ndim == 2 else prop.fed_depth[None, :]
    positions = cache.lengths[:, None] + depth
    mask = tree_mask_after_prefix(cache.lengths, prop.fed_mask, window or cache.capacity)
    return forward_scratch(params, cfg, prop.fed, positions, mask, cache,
                           aux_layers=aux_layers)


def commit(cache: KVCache, k_new: jax.Array, v_new: jax.Array, path: jax.Array,
           advance: jax.Array) -> KVCache:
    """Stage 4b. Keep only the accepted path's keys/values: node path[b, j] of the verify
    pass goes to slot lengths[b] + j; then each row's length grows by advance [B]."""
    sel = path[None, :, None, :, None]  # [1, B, 1, D+1, 1]
    cache = write_kv(cache, jnp.take_along_axis(k_new, sel, axis=3),
                     jnp.take_along_axis(v_new, sel, axis=3))
    return cache.advance(advance)


def _prefill(params, cfg, tokens, lengths, capacity, aux_layers=()):
    """Prompts tokens [B, P] -> (the last prompt token's logits [B, V], every prompt
    token's hidden state [B, P, H] and the inputs of `aux_layers` [B, P, A] (None without
    any), the cache with the prompts in it)."""
    b, p = tokens.shape
    tokens = sharding.constrain_rows(tokens)  # under `jax.set_mesh`: rows over data axes
    # the decoding layout (one device) writes a per-layer cache in place
    cache = KVCache.init(cfg, b, capacity, per_layer=is_decoding_layout(params))
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, hidden, cache, *aux = forward(params, cfg, tokens, positions,
                                          causal_mask(cache.lengths, p, capacity), cache,
                                          empty_cache=True, aux_layers=aux_layers)
    rows = jnp.arange(b)
    return (logits[rows, lengths - 1], hidden, aux[0] if aux else None,
            cache.replace(lengths=lengths))


@struct.dataclass
class DecodeState:
    """The rows being decoded (B rows; W tokens a step emits at most: D + 1, or 1 plain)."""

    cache: KVCache
    root: jax.Array  # [B] int32: the next token, chosen, not yet emitted nor fed
    # the drafter's carry (any pytree, batch on `batch_axis(drafter)`; None: plain), e.g.
    # Medusa heads' logits for the tokens after the root [K, B, V]
    draft: object
    count: jax.Array  # [B] int32: tokens emitted
    steps: jax.Array  # [B] int32: steps taken while live
    hist: jax.Array  # [B, W + 1] int32: steps that emitted 0 .. W tokens
    done: jax.Array  # [B] bool: finished, or a free row
    keys: jax.Array  # [B] PRNG keys, one stream per row
    rows: Rows


def batch_axis(drafter: Drafter | None) -> int:
    """The axis of a drafter's carry leaves that holds the rows (plain decoding: no carry,
    any axis)."""
    return 1 if drafter is None else drafter.batch_axis


def follows_plain_steps(drafter: Drafter | None) -> bool:
    """Whether plain steps keep a drafter's carry complete (`Drafter.context`)."""
    return drafter is not None and drafter.follows_plain_steps


def rebuilds_from_tokens(drafter: Drafter | None) -> bool:
    """Whether a drafter is begun on the whole prompt after a cached prefix
    (`Drafter.context`)."""
    return drafter is not None and drafter.rebuilds_from_tokens


def select_rows(which: jax.Array, new, old, axis: int):
    """Per row, `new` where which [B], else `old`: two pytrees with rows on `axis`."""
    def pick(a, b):
        shape = [1] * a.ndim
        shape[axis] = -1
        return jnp.where(which.reshape(shape), a, b)
    return jax.tree.map(pick, new, old)


def emit(s: DecodeState, chunk: jax.Array, n_valid: jax.Array):
    """Stage 4a. chunk [B, C], of which the first n_valid [B] are this step's tokens: each
    live row keeps them up to its first stop token (kept) and its token limit. Returns
    (tokens kept [B], count [B], done [B])."""
    live = ~s.done
    j = jnp.arange(chunk.shape[1])[None]
    is_stop = s.rows.is_stop(chunk) & (j < n_valid[:, None])
    hit = jnp.any(is_stop, axis=1)
    first = jnp.argmax(is_stop, axis=1)
    n = jnp.where(hit, first + 1, n_valid)
    n = jnp.where(live, jnp.minimum(n, s.rows.max_tokens - s.count), 0)
    count = s.count + n
    done = s.done | (live & ((hit & (first < n)) | (count >= s.rows.max_tokens)))
    return n, count, done


def append(buf: jax.Array, chunk: jax.Array, at: jax.Array, live: jax.Array) -> jax.Array:
    """Write chunk [B, C] into buf [B, N] at column at [B], in live rows only."""
    out = jax.vmap(lambda o, c, i: jax.lax.dynamic_update_slice(o, c, (i,)))(buf, chunk, at)
    return jnp.where(live[:, None], out, buf)


def start(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
          keys: jax.Array, rows: Rows, capacity: int, drafter=None, heads: Params = None,
          width: int = 1, draft_capacity: int | None = None) -> DecodeState:
    """Prefill prompts tokens [B, P] (right-padded, lengths [B]) into a cache of `capacity`
    slots, choose each row's root with its own rule (keys [B]: the rows' streams) and begin
    the drafter (None: plain decoding). `heads`: the drafter's prepared parameters; `width`:
    the tokens a step emits at most; `draft_capacity`: the slots the drafter's carry may
    fill (default `capacity`; the serving engine's slots are longer than a prefill)."""
    aux_layers = () if drafter is None else tuple(drafter.aux_layers)
    logits, hidden, aux, cache = _prefill(params, cfg, tokens, lengths, capacity, aux_layers)
    return _begin(params, cache, logits, hidden, aux, tokens, lengths, keys, rows, drafter,
                  heads, width, draft_capacity or capacity)


def start_after_prefix(params: Params, cfg: ModelConfig, cache: KVCache, tokens: jax.Array,
                       lengths: jax.Array, keys: jax.Array, rows: Rows, drafter=None,
                       heads: Params = None, width: int = 1,
                       draft_capacity: int | None = None,
                       prompt: jax.Array | None = None) -> DecodeState:
    """`start` for prompts whose first `cache.lengths[b]` tokens are in the cache already (a
    cached prefix): tokens [B, Q] are the rest of each prompt (right-padded; the cache must
    hold lengths + Q slots), lengths [B] the whole prompts' lengths. The drafter begins
    from the tokens fed here (`begin` sees them as a prompt of that many tokens: a drafter
    that reads only the last hidden state starts as after the whole prompt); one that reads
    that keeps state of every committed token (`keeps_context`) starts here only when it
    rebuilds that state from tokens (`rebuilds_from_tokens`): it is begun on `prompt` [B, P]
    (the whole prompts, right-padded to lengths; P >= every length), with the hidden states
    of the tokens fed here at their positions."""
    rebuild = drafter is not None and drafter.keeps_context
    if rebuild and not (rebuilds_from_tokens(drafter) and prompt is not None):
        raise ValueError(f"a {drafter.kind} drafter keeps state of every prompt token, "
                         f"so it cannot start after a cached prefix"
                         + (" without the whole prompt" if rebuilds_from_tokens(drafter)
                            else ""))
    b, q = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(q, dtype=jnp.int32)[None]
    _, hidden, cache = forward(params, cfg, tokens, positions,
                               causal_mask(cache.lengths, q, cache.capacity), cache,
                               return_logits=False)
    new = lengths - cache.lengths  # [B] prompt tokens fed here
    logits = logits_from_hidden(cfg, params, hidden[jnp.arange(b), new - 1])
    if rebuild:  # the fed tokens' hidden states at their places in the whole prompt
        at = jnp.minimum(positions, prompt.shape[1])  # past the prompt: dropped
        whole = jnp.zeros((b, prompt.shape[1], hidden.shape[-1]), hidden.dtype)
        whole = whole.at[jnp.arange(b)[:, None], at].set(hidden, mode="drop")
        return _begin(params, cache.replace(lengths=lengths), logits, whole, None, prompt,
                      lengths, keys, rows, drafter, heads, width,
                      draft_capacity or cache.capacity)
    return _begin(params, cache.replace(lengths=lengths), logits, hidden, None, tokens, new,
                  keys, rows, drafter, heads, width, draft_capacity or cache.capacity)


def _begin(params, cache, logits, hidden, aux, tokens, lengths, keys, rows, drafter, heads,
           width, draft_capacity) -> DecodeState:
    """The rows' first state after their prompts are in `cache`: logits [B, V] of each last
    prompt token, hidden [B, P, H] of the tokens fed, `lengths` [B] counted in them."""
    b = tokens.shape[0]
    keys, sub = split_rows(keys)
    root = sample_rows(sub, logits, rows, PLAIN_DRAWS if drafter is None else ROOT_DRAWS)
    draft = None if drafter is None else drafter.begin(
        params, heads, hidden, aux, tokens, lengths, root, draft_capacity)
    zeros = jnp.zeros((b,), jnp.int32)
    return DecodeState(cache=cache, root=root, draft=draft, count=zeros, steps=zeros,
                       hist=jnp.zeros((b, width + 1), jnp.int32), done=jnp.zeros((b,), bool),
                       keys=keys, rows=rows)


def plain_step(params: Params, cfg: ModelConfig, s: DecodeState, window: int | None = None,
               drafter=None):
    """Emit each live row's root, feed it and choose the next, attending over the first
    `window` cache slots (default all). `drafter`: one that follows plain steps
    (`follows_plain_steps`) is handed each live row's committed token (`append`); any other
    carry is left as it is. Returns (state, chunk [B, 1], n [B])."""
    live = ~s.done
    chunk = s.root[:, None]
    n, count, done = emit(s, chunk, jnp.ones_like(s.count))
    logits, _, cache = forward(params, cfg, chunk, s.cache.lengths[:, None],
                               causal_mask(s.cache.lengths, 1, window or s.cache.capacity),
                               s.cache)
    keys, sub = next_keys(s.keys, s.rows.draws(PLAIN_DRAWS))
    new = sample_rows(sub, logits[:, 0], s.rows, PLAIN_DRAWS, live)
    draft = s.draft
    if follows_plain_steps(drafter):
        draft = select_rows(live, drafter.append(s.draft, s.root, live), s.draft,
                            batch_axis(drafter))
    s = s.replace(cache=cache.advance(~done), root=jnp.where(done, s.root, new), count=count,
                  steps=s.steps + live, done=done, keys=keys, draft=draft)
    return s, chunk, n


# The stages of a step `medusa_step` can leave out (`infer.bench --breakdown` times the step
# without each): "candidates" the drafter's proposal, "acceptance", "commit" the accepted
# keys/values, "heads" the drafter's advance, "bookkeeping" emitting tokens and the
# per-row state; the backbone's verification pass always runs.
STAGES = ("heads", "candidates", "acceptance", "commit", "bookkeeping")
ALL_STAGES = frozenset(STAGES)


def _stand_in_proposal(root: jax.Array, tree, vocab: int) -> Proposal:
    """For a step without "candidates": the tree's first T nodes (a subtree), with tokens
    that follow the root (so the loop still depends on the proposal)."""
    static = static_tree(tree)
    n, t = static.num_nodes, tree.num_nodes
    tokens = (root[:, None] + jnp.arange(n)[None]) % vocab
    first = jnp.arange(n) < t
    return Proposal(
        fed=tokens[:, :t], fed_depth=jnp.asarray(static.node_depth[:t]),
        fed_mask=jnp.asarray(static.mask[:t, :t]), tokens=tokens,
        valid=None if t == n else jnp.broadcast_to(first, tokens.shape),
        slot=None if t == n else jnp.broadcast_to(jnp.minimum(jnp.arange(n), t - 1),
                                                  tokens.shape))


def medusa_step(params: Params, cfg: ModelConfig, drafter, heads: Params,
                tree: Tree | DynamicTree, s: DecodeState, window: int | None = None,
                stages: frozenset = ALL_STAGES):
    """One Medusa step for every row, the five stages in order (attending over the first
    `window` cache slots, default all). `heads`: the drafter's prepared parameters.
    `stages`: the ones to run (`STAGES`); each left out is replaced by the cheapest
    stand-in that keeps shapes and loop dependences, so XLA can neither drop nor hoist the
    stages that stay (for `--breakdown`: decoders run them all).
    Returns (state, chunk [B, D+1], n [B])."""
    static = static_tree(tree)
    rows = jnp.arange(s.root.shape[0])
    live = ~s.done
    keys, sub = next_keys(s.keys, s.rows.draws(ROOT_DRAWS))
    if "candidates" not in stages:
        prop = _stand_in_proposal(s.root, tree, cfg.vocab_size)
    elif s.rows.draws(ROOT_DRAWS):  # rejection rows draw their drafts (`DraftSampler`)
        sub, drafting = split_rows(sub)
        sampled = jnp.broadcast_to(s.rows.follows(ROOT_DRAWS), s.root.shape)
        draw = DraftSampler(rows=s.rows, keys=drafting, sampled=sampled)
        prop = drafter.propose(params, heads, s.draft, s.root, tree, draw)  # 1
    else:
        prop = drafter.propose(params, heads, s.draft, s.root, tree)  # 1
    logits, hidden, (k_new, v_new), cache, *aux = verify(
        params, cfg, prop, s.cache, window, tuple(drafter.aux_layers))  # 2
    if "acceptance" in stages:
        drafts = None if prop.draws is None else (prop.draws, prop.draft_logq, prop.fixed)
        best, acc_len, next_root = acceptance.accept_rows(
            logits, prop.tokens, static, s.rows, sub, prop.valid, prop.slot, live,
            drafts)  # 3
    else:
        best, acc_len = jnp.zeros_like(s.count), jnp.ones_like(s.count)
        next_root = (s.root + (logits[:, 0, 0] > 0)) % cfg.vocab_size
    path = jnp.asarray(static.paths)[best]  # [B, D+1] node indices, root first
    chunk = jnp.take_along_axis(prop.tokens, path, axis=1)
    advance = jnp.where(live, acc_len + 1, 0)
    if "bookkeeping" in stages:
        n, count, done = emit(s, chunk, acc_len + 1)  # 4
    fed_path = prop.fed_index(path)
    if "commit" in stages:
        cache = commit(cache, k_new, v_new, fed_path, advance)
    else:
        cache = cache.advance(advance)
    if "heads" in stages:
        along = fed_path[:, :, None]  # [B, D+1, 1]: the kept path's entries of the verify pass
        draft = drafter.advance(params, heads, s.draft,
                                jnp.take_along_axis(hidden, along, axis=1),
                                jnp.take_along_axis(aux[0], along, axis=1) if aux else None,
                                chunk, acc_len, next_root, cache.lengths, live)  # 5
    else:
        draft = jax.tree.map(lambda x: x + hidden[:, 0, :1].sum().astype(x.dtype) * 0,
                             s.draft)
    if "bookkeeping" not in stages:
        return s.replace(cache=cache, root=next_root, draft=draft,
                         count=s.count + advance), chunk, advance
    s = s.replace(cache=cache, root=jnp.where(live, next_root, s.root),
                  draft=select_rows(live, draft, s.draft, batch_axis(drafter)), count=count,
                  steps=s.steps + live,
                  hist=s.hist.at[rows, jnp.clip(n, 0, static.depth + 1)].add(
                      live.astype(jnp.int32)),
                  done=done, keys=keys)
    return s, chunk, n
