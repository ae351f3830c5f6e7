"""Trees that fit the hardware: head accuracies -> best tree of each size -> the size that pays.

1. `head_rank_accuracy`: for each head d and rank r, how often the r-th candidate of head d
   is the token the model itself produces d+1 positions later (greedy continuation of
   held-out prompts).
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

from medusa_jax.decoding.decode import generate, pad_prompts
from medusa_jax.drafters.medusa.heads import apply_heads
from medusa_jax.model.backbone import KVCache, Params, causal_mask, forward
from medusa_jax.model.config import ModelConfig


def head_rank_accuracy(params: Params, cfg: ModelConfig, heads: Params,
                       prompts: list[list[int]], *, max_new_tokens: int = 128, top_k: int = 10,
                       eos: tuple[int, ...] = (), batch_size: int = 16) -> np.ndarray:
    """[K, top_k]: P(head d's rank-r candidate == the greedy token d+1 positions later).

    Measured on the model's own greedy continuations of `prompts` (what greedy Medusa
    decoding will have to guess), over the generated part only.
    """
    k_heads = heads["w"].shape[0]
    hits = np.zeros((k_heads, top_k))
    total = np.zeros(k_heads)

    @jax.jit
    def ranks(params, heads, seq, valid):
        b, t = seq.shape
        cache = KVCache.init(cfg, b, t)
        _, hidden, _ = forward(params, cfg, seq, jnp.broadcast_to(jnp.arange(t), (b, t)),
                               causal_mask(cache.lengths, t, t), cache, return_logits=False,
                               empty_cache=True)
        top = jax.lax.top_k(apply_heads(heads, hidden), top_k)[1]  # [K, B, T, k]
        out = []
        for d in range(k_heads):  # head d (0-based) at position i guesses token i + d + 2
            shift = d + 2
            target = seq[:, shift:]  # [B, T - shift]
            guess = top[d, :, : t - shift]
            ok = valid[:, shift:] & valid[:, : t - shift]
            out.append(((guess == target[..., None]) & ok[..., None]).sum((0, 1)))
            out.append(ok.sum())
        return out

    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        tokens, lengths = pad_prompts(chunk)
        gen = jax.device_get(generate(params, cfg, tokens, lengths, jax.random.key(0),
                                      max_new_tokens=max_new_tokens, eos=eos))
        width = tokens.shape[1] + max_new_tokens
        seq = np.zeros((len(chunk), width), np.int32)
        valid = np.zeros((len(chunk), width), bool)
        for i, p in enumerate(chunk):
            new = gen.tokens[i, : gen.num_new[i]]
            seq[i, : len(p) + len(new)] = np.concatenate([p, new])
            # score guesses made from generated positions onwards (the prompt is given)
            valid[i, len(p) - 1: len(p) + len(new)] = True
        res = jax.device_get(ranks(params, heads, jnp.asarray(seq), jnp.asarray(valid)))
        for d in range(k_heads):
            hits[d] += res[2 * d]
            total[d] += res[2 * d + 1]
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
