"""Trees that fit the hardware: drafter accuracies -> best tree of each size -> the size that pays.

1. `head_rank_accuracy`: for each depth d and rank r, how often the drafter's r-th token at
   depth d+1 (below its own best path, which must be right so far) is the token the model
   itself produces there (greedy continuation of held-out prompts). Any kind of drafter:
   it runs through the protocol (`begin`, `propose`).
2. `grow_tree`: from the root, repeatedly add the candidate node (the next sibling rank of a
   node, or the first child of a node) with the largest product of accuracies along its path.
   The expected number of tokens per step is 1 + the sum of those products.
3. The caller times each size on this machine and keeps the best expected speedup.
"""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.decoding import step
from medusa_jax.decoding.decode import generate, pad_prompts
from medusa_jax.drafters.registry import drafter_for
from medusa_jax.decoding.tree import Tree
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig


def probe_tree(depth: int, top_k: int) -> Tree:
    """The drafter's top-1 chain to `depth` with every rank < `top_k` beside it: node
    (0,)*d + (r,) is what the drafter ranks r-th at depth d+1 below its own best path."""
    return Tree.from_paths([[0] * d + [r] for d in range(depth) for r in range(top_k)],
                           name=f"probe-{depth}x{top_k}")


def head_rank_accuracy(params: Params, cfg: ModelConfig, heads: Params,
                       prompts: list[list[int]], *, max_new_tokens: int = 128, top_k: int = 10,
                       eos: tuple[int, ...] = (), batch_size: int = 16, max_depth: int = 8,
                       rows: int = 16) -> np.ndarray:
    """[D, top_k]: P(the drafter's rank-r token at depth d+1 is the greedy token there |
    its rank-0 path above it is), for drafters of any kind (through the protocol:
    `begin` after a teacher-forced prefix, then `propose` on `probe_tree`). D: the
    drafter's depth, at most `max_depth`.

    Measured on the model's own greedy continuations of `prompts` (what greedy decoding
    with the drafter will have to guess), from every position of the generated part
    (`rows` positions at a time).
    """
    drafter = drafter_for(heads)
    depth = min(drafter.depth(heads) or max_depth, max_depth)
    tree = probe_tree(depth, top_k)
    used = drafter.prepare(heads, tree, cpu_kernels=kernels.active(params))
    node = np.array([[tree.paths_ranks.index((0,) * d + (r,)) + 1 for r in range(top_k)]
                     for d in range(depth)])  # [D, top_k] node index of (0,)*d + (r,)
    hits = np.zeros((depth, top_k))
    total = np.zeros(depth)

    @jax.jit
    def guesses(params, used, seq, at):
        """seq [1, W], at [n] positions -> the probe tree's tokens [n, N] drafted after
        seq[:at + 1] with root seq[at + 1]."""
        w = seq.shape[1]
        _, hidden, aux, _ = step._prefill(params, cfg, seq, jnp.array([w], jnp.int32), w,
                                          tuple(drafter.aux_layers))
        n = at.shape[0]
        rep = lambda x: None if x is None else jnp.broadcast_to(x, (n, *x.shape[1:]))  # noqa
        tokens = rep(seq)
        root = seq[0, at + 1]
        carry = drafter.begin(params, used, rep(hidden), rep(aux), tokens, at + 1, root,
                              w + tree.num_nodes + 1)
        return drafter.propose(params, used, carry, root, tree).tokens

    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        tokens, lengths = pad_prompts(chunk)
        gen = jax.device_get(generate(params, cfg, tokens, lengths, jax.random.key(0),
                                      max_new_tokens=max_new_tokens, eos=eos))
        for i, p in enumerate(chunk):
            seq = np.concatenate([p, gen.tokens[i, : gen.num_new[i]]]).astype(np.int32)
            # guesses made from generated positions onwards (the prompt is given), with
            # the root and one token to check inside the sequence
            at = np.arange(len(p) - 1, len(seq) - 2, dtype=np.int32)
            for a in range(0, len(at), rows):
                pos = np.resize(at[a:a + rows], rows)  # a fixed row count: one compile
                got = np.asarray(guesses(params, used, jnp.asarray(seq[None]),
                                         jnp.asarray(pos)))[: len(at[a:a + rows])]
                pos = pos[: len(got)]
                ok = np.ones(len(got), bool)  # the rank-0 path above depth d is right
                for d in range(depth):
                    target = np.where(pos + d + 2 < len(seq),
                                      seq[np.minimum(pos + d + 2, len(seq) - 1)], -1)
                    ok &= pos + d + 2 < len(seq)
                    hits[d] += ((got[:, node[d]] == target[:, None]) & ok[:, None]).sum(0)
                    total[d] += ok.sum()
                    ok &= got[:, node[d, 0]] == target
    return hits / np.maximum(total, 1)[:, None]


def grow_tree(acc: np.ndarray, size: int) -> tuple[list[list[int]], list[float]]:
    """The `size`-node tree maximising expected accepted tokens, grown greedily.

    acc: [K, top_k] rank accuracies. Returns (paths in the order added, each node's
    probability of being accepted = product of accuracies along its path).
    """
    k_heads, top_k = acc.shape
    paths: list[list[int]] = []
    probs: list[float] = []
    # entries: (-probability, path, probability of its parent)
    frontier = [(-float(acc[0, 0]), (0,), 1.0)]
    while frontier and len(paths) < size:
        neg, path, parent = heapq.heappop(frontier)
        prob, depth = -neg, len(path)
        paths.append(list(path))
        probs.append(prob)
        if path[-1] + 1 < top_k:  # its next sibling
            sib = path[:-1] + (path[-1] + 1,)
            heapq.heappush(frontier, (-parent * float(acc[depth - 1, sib[-1]]), sib, parent))
        if depth < k_heads:  # its first child
            heapq.heappush(frontier, (-prob * float(acc[depth, 0]), path + (0,), prob))
    return paths, probs


def expected_tokens_per_step(acc: np.ndarray, paths: list[list[int]]) -> float:
    """1 (the root) + the sum over nodes of the product of accuracies along its path."""
    total = 1.0
    for p in paths:
        total += float(np.prod([acc[d, r] for d, r in enumerate(p)]))
    return total
