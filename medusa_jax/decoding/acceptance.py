"""Which tree path to keep: greedy, typical and lossless rejection acceptance.

Every function takes the verification pass's logits for all tree nodes and returns, per row,
the chosen root-to-leaf path (index into `tree.paths`), how many non-root nodes of it were
accepted, and the next root token (the "bonus" token the model emits after the accepted
ones, which is fed at the start of the next step).

Shapes: logits [B, T, V] (T = tree.num_nodes), tokens [B, T] (each node's candidate token).
`valid` [B, T] (optional) marks the nodes each row verified, for dynamic trees: a row's tree
is then the prefix-closed subset of `tree` it selected, and paths stop at its edge.

`accept` applies one static `Sampling`'s rule to every row; `accept_rows`, the decoding
step's, each row's own (`sampling.Rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from medusa_jax.decoding.sampling import MODES, Rows, Sampling, argmax, log_probs  # noqa: F401
from medusa_jax.decoding.tree import Tree


def _path_tokens(tree: Tree, tokens):
    paths = jnp.asarray(tree.paths)
    return tokens[:, paths], paths  # [B, P, D+1]


def _path_valid(tree: Tree, valid):
    """[P, D] (static tree) or [B, P, D]: which non-root path entries are real nodes."""
    static = jnp.asarray(tree.path_valid[:, 1:])
    if valid is None:
        return static
    return static[None] & valid[:, jnp.asarray(tree.paths[:, 1:])]


def node_rows(x: jax.Array, slot: jax.Array | None) -> jax.Array:
    """Values per verified token x [B, F, ...] as values per tree node [B, T, ...]: node i
    of row b was verified as token slot[b, i] (None: node i is token i)."""
    if slot is None:
        return x
    return jnp.take_along_axis(x, slot.reshape(slot.shape + (1,) * (x.ndim - 2)), axis=1)


def greedy(logits, tokens, tree: Tree, valid=None, slot=None):
    """The longest path whose every token equals the model's argmax at its parent."""
    # the argmax of the verified rows only, then spread to the nodes: a dynamic tree verifies
    # a few of its pool's nodes, and gathering [B, T, V] logits for all of them costs more
    pred = node_rows(argmax(logits), slot)  # [B, T]
    path_tok, paths = _path_tokens(tree, tokens)
    parent_pred = pred[:, paths[:, :-1]]  # [B, P, D]
    match = (path_tok[:, :, 1:] == parent_pred) & _path_valid(tree, valid)
    acc = jnp.sum(jnp.cumprod(match, axis=-1), axis=-1)  # [B, P]
    best = jnp.argmax(acc, axis=-1)
    acc_len = jnp.take_along_axis(acc, best[:, None], axis=1)[:, 0]
    last = jnp.take_along_axis(paths[best], acc_len[:, None], axis=1)[:, 0]
    next_root = jnp.take_along_axis(pred, last[:, None], axis=1)[:, 0]
    return best, acc_len, next_root


def _per_row(x, ndim: int) -> jax.Array:
    """A scalar or a [B] array, shaped to broadcast against [B, ...] of `ndim` axes."""
    return jnp.asarray(x, jnp.float32).reshape((-1,) + (1,) * (ndim - 1))


def typical(logits, tokens, tree: Tree, s: Sampling | Rows, valid=None):
    """Accept a candidate while p(token) > min(epsilon, delta * exp(-H(p))) at its parent;
    the longest path wins, ties broken by its log-likelihood; the next root is greedy.
    p is the distribution plain sampling draws from (temperature, then top-k, then top-p),
    so a token those filters remove is never accepted.
    `s`: one Sampling, or `Rows` (each row its own temperature, filters, epsilon and delta;
    a row that follows another rule reads temperature 0 as 1 and stays finite)."""
    logp = s.log_probs(logits) if isinstance(s, Rows) else log_probs(logits, s)  # [B, T, V]
    # a filtered-out token's log-prob is float32's lowest finite value, so its term is 0 * x
    # (not 0 * -inf) and the entropy stays finite
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)  # [B, T]
    threshold = jnp.minimum(_per_row(s.epsilon, 2), _per_row(s.delta, 2) * jnp.exp(-entropy))
    path_tok, paths = _path_tokens(tree, tokens)
    parents = paths[:, :-1]  # [P, D]
    b_idx = jnp.arange(logits.shape[0])[:, None, None]
    tok_logp = logp[b_idx, parents[None], path_tok[:, :, 1:]]  # [B, P, D]
    ok = (jnp.exp(tok_logp) > threshold[:, parents]) & _path_valid(tree, valid)
    run = jnp.cumprod(ok, axis=-1)
    acc = jnp.sum(run, axis=-1)
    likelihood = jnp.sum(jnp.where(run > 0, tok_logp, 0.0), axis=-1)
    # lexicographic (length, likelihood): length dominates because likelihood is finite
    score = jnp.where(acc == jnp.max(acc, axis=-1, keepdims=True), likelihood, -jnp.inf)
    best = jnp.argmax(score, axis=-1)
    acc_len = jnp.take_along_axis(acc, best[:, None], axis=1)[:, 0]
    last = jnp.take_along_axis(paths[best], acc_len[:, None], axis=1)[:, 0]
    pred = argmax(logits)
    next_root = jnp.take_along_axis(pred, last[:, None], axis=1)[:, 0]
    return best, acc_len, next_root


def rejection(logits, tokens, tree: Tree, s: Sampling, keys, valid=None):
    """Lossless recursive rejection sampling over the tree (one key per row).

    At the current node with target distribution p, its children's tokens are tried in rank
    order: token x is accepted with probability p(x); on rejection p <- p without x,
    renormalised. The draft is deterministic (a head's top-k), so this is exactly sampling
    from p. When every child is rejected (or the node is a leaf) the bonus token is drawn
    from what is left of p. The result is distributed exactly as plain sampling.
    """
    return rejection_logp(log_probs(logits, s), tokens, tree, keys, valid)


def rejection_logp(logp, tokens, tree: Tree, keys, valid=None, drafts=None):
    """`rejection` given each node's target distribution: logp [B, T, V] log-probs.
    `drafts`: (draws [B, T, k], draft log-probs [B, T, V][, fixed [B, T, k] or None]) when
    the drafts were sampled (`step.DraftSampler`): then `rejection_drafted`'s rule."""
    if drafts is not None:
        return rejection_drafted(logp, tree, keys, valid, *drafts)
    children = jnp.asarray(tree.children)
    if valid is None:
        valid = jnp.ones(tokens.shape, bool)

    def one_row(logp_row, tok_row, key, valid_row):
        probs = jnp.exp(logp_row)  # [T, V]
        child_valid = jnp.asarray(tree.child_valid) & valid_row[children]

        def try_children(node, key):
            def body(carry, c):
                residual, chosen, key = carry
                key, sub = jax.random.split(key)
                child = children[node, c]
                tok = tok_row[child]
                p = residual[tok] / jnp.maximum(jnp.sum(residual), 1e-30)
                live = child_valid[node, c] & (chosen < 0)
                accept = live & (jax.random.uniform(sub) < p)
                chosen = jnp.where(accept, child, chosen)
                residual = jnp.where(live & ~accept, residual.at[tok].set(0.0), residual)
                return (residual, chosen, key), None

            (residual, chosen, key), _ = jax.lax.scan(
                body, (probs[node], jnp.int32(-1), key), jnp.arange(children.shape[1]))
            return residual, chosen, key

        def try_node(node, key):
            residual, chosen, key = try_children(node, key)
            return residual, chosen, jnp.int32(-1), key

        return _walk(tree, probs, key, try_node)

    return jax.vmap(one_row)(logp, tokens, keys, valid)


def _walk(tree: Tree, probs, key, try_node):
    """One row's descent from the root: `try_node(node, key)` -> (what is left of the
    node's target distribution [V], the child accepted or -1, a token that ends the path
    there or -1, key). Returns (best path, accepted length, next root): the next root is the
    token that ended the path, else a draw from what is left at the last node."""
    paths = jnp.asarray(tree.paths)
    node = jnp.int32(0)
    acc_len = jnp.int32(0)
    active = jnp.bool_(True)
    final = probs[0]
    fixed = jnp.int32(-1)
    visited = [node]
    for _ in range(tree.depth):
        residual, chosen, ends, key = try_node(node, key)
        stop_here = active & (chosen < 0)
        final = jnp.where(stop_here, residual, final)
        fixed = jnp.where(stop_here, ends, fixed)
        go = active & (chosen >= 0)
        node = jnp.where(go, chosen, node)
        acc_len = acc_len + go
        active = go
        visited.append(node)
    final = jnp.where(active, probs[node], final)
    key, sub = jax.random.split(key)
    drawn = jax.random.categorical(sub, jnp.log(jnp.maximum(final, 0.0)))
    bonus = jnp.where(fixed >= 0, fixed, drawn)
    # the chosen path: the leaf-path row whose prefix equals the visited nodes
    visited = jnp.stack(visited)  # [D+1]
    steps = jnp.arange(tree.depth + 1)
    agrees = jnp.all((paths == visited[None]) | (steps[None] > acc_len), axis=-1)
    return jnp.argmax(agrees), acc_len, bonus.astype(jnp.int32)


def rejection_drafted(logp, tree: Tree, keys, valid, draws, draft_logq, fixed=None):
    """Lossless recursive rejection over drafts drawn without replacement from the
    drafter's distribution q (SpecInfer's multi-draft rule, as SafeAILab/EAGLE and vLLM
    verify sampled drafts, with q updated for drawing without replacement).

    At the current node with target p, its drafts x_1, x_2, ... (draws [B, T, k], in draw
    order; q_1 = q, q_{i+1} = q_i without x_i, renormalised) are offered in turn: x_i is
    accepted with probability min(1, p(x_i) / q_i(x_i)); on rejection p <- max(p - q_i, 0),
    renormalised. An accepted draft that is a child of the node (`Tree.rank_child`, and
    verified: `valid`) is walked into; one that is not (a rank the tree skips, or a node a
    dynamic tree left out) ends the path as the next root. A draft outside q's support
    (drawn after it was exhausted) is offered as a deterministic draft (q_i = its one-hot).
    When no draft is accepted the next root is drawn from what is left of p. The emitted
    tokens are distributed exactly as plain sampling's, whatever q is.
    `fixed` [B, T, k] bool (None: none): drafts that were not drawn (merged n-gram drafts);
    each node offers them first, in rank order, as deterministic drafts (q = their one-hot,
    q_i of the drawn ones untouched), then its drawn ones: a fixed draft does not depend on
    the draws, so the drawn ones keep their q_i.
    logp [B, T, V] the target's log-probs per node; draft_logq [B, T, V] the log-probs the
    node's drafts were drawn from."""
    rank_child = jnp.asarray(tree.rank_child)  # [T, k]
    offered = jnp.asarray(tree.rank_offered)  # [T, k]
    k = rank_child.shape[1]
    if valid is None:
        valid = jnp.ones(logp.shape[:2], bool)
    if fixed is None:
        fixed = jnp.zeros(draws.shape, bool)

    def one_row(logp_row, key, valid_row, draws_row, logq_row, fixed_row):
        probs = jnp.exp(logp_row)  # [T, V]

        def try_drafts(node, key):
            order = jnp.argsort(~fixed_row[node], stable=True)  # fixed ones first

            def body(carry, i):
                residual, q_left, chosen, ends, key = carry
                key, sub = jax.random.split(key)
                r = order[i]
                is_fixed = fixed_row[node, r]
                tok = draws_row[node, r]
                child = rank_child[node, r]
                is_child = (child >= 0) & valid_row[jnp.maximum(child, 0)]
                live = offered[node, r] & (chosen < 0) & (ends < 0)
                p = residual / jnp.maximum(jnp.sum(residual), 1e-30)
                q_mass = jnp.sum(q_left)
                one_hot = jax.nn.one_hot(tok, p.shape[-1], dtype=p.dtype)
                q = jnp.where((q_mass > 0) & ~is_fixed,
                              q_left / jnp.maximum(q_mass, 1e-30), one_hot)
                accept = live & (jax.random.uniform(sub) * q[tok] < p[tok])
                chosen = jnp.where(accept & is_child, child, chosen)
                ends = jnp.where(accept & ~is_child, tok, ends)
                rejected = live & ~accept
                residual = jnp.where(rejected, jnp.maximum(p - q, 0.0), residual)
                q_left = jnp.where(rejected & ~is_fixed, q_left.at[tok].set(0.0), q_left)
                return (residual, q_left, chosen, ends, key), None

            init = (probs[node], jnp.exp(logq_row[node]), jnp.int32(-1), jnp.int32(-1), key)
            (residual, _, chosen, ends, key), _ = jax.lax.scan(body, init, jnp.arange(k))
            return residual, chosen, ends, key

        return _walk(tree, probs, key, try_drafts)

    return jax.vmap(one_row)(logp, keys, valid, draws, draft_logq.astype(jnp.float32), fixed)


def accept_rows(logits, tokens, tree: Tree, rows: Rows, keys, valid=None, slot=None,
                live=None, drafts=None):
    """`accept` with each row's own rule and parameters (`rows`): the first of `rows.modes`
    runs for every row; each other one only when some live row follows it (a `cond`), and
    is then taken for its rows. live [B] bool (default all). `drafts`: the rejection rows'
    sampled drafts (`rejection_logp`)."""
    rules = {
        "greedy": lambda: greedy(logits, tokens, tree, valid, slot),
        "typical": lambda: typical(node_rows(logits, slot), tokens, tree, rows, valid),
        "rejection": lambda: rejection_logp(rows.log_probs(node_rows(logits, slot)), tokens,
                                            tree, keys, valid, drafts),
    }
    first, *others = rows.modes
    out = rules[first]()
    for i, mode in enumerate(others, 1):
        use = rows.mode == i
        some = jnp.any(use if live is None else use & live)
        got = jax.lax.cond(some, lambda _, m=mode: rules[m](), lambda _: out, None)
        out = tuple(jnp.where(use, a, b) for a, b in zip(got, out))
    return out


def accept(logits, tokens, tree: Tree, s: Sampling, keys, valid=None, slot=None):
    """The acceptance rule of `s.mode`: (best path [B], accepted non-root nodes [B],
    next root token [B]). keys [B]: one PRNG key per row (used by "rejection" only);
    valid [B, T]: the nodes each row verified (dynamic trees), default all; slot [B, T]:
    which row of `logits` [B, F, V] each node was verified as (default: node i is row i)."""
    return accept_rows(logits, tokens, tree, Rows.of(s, logits.shape[0], 1), keys, valid, slot)
