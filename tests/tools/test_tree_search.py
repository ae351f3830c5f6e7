"""Tree search: greedy growth from head accuracies."""

import itertools

import numpy as np
import pytest

from medusa_jax.decoding.tree import Tree
from medusa_jax.tools.tree_search import expected_tokens_per_step, grow_tree

ACC = np.array([[0.6, 0.2, 0.1, 0.05],
                [0.4, 0.2, 0.1, 0.05],
                [0.3, 0.1, 0.05, 0.02]])


def _all_trees(size, acc):
    """Every valid tree of `size` nodes (brute force, small cases only)."""
    k, top = acc.shape
    nodes = [p for d in range(1, k + 1) for p in itertools.product(range(top), repeat=d)]
    for combo in itertools.combinations(nodes, size):
        s = set(combo)
        if all(len(p) == 1 or p[:-1] in s for p in combo) and \
                all(p[-1] == 0 or p[:-1] + (p[-1] - 1,) in s for p in combo):
            yield [list(p) for p in combo]


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_greedy_growth_is_optimal_on_small_cases(size):
    acc = ACC[:, :3]
    paths, probs = grow_tree(acc, size)
    Tree.from_paths(paths, num_heads=3)  # valid
    assert len(paths) == size and probs == sorted(probs, reverse=True)
    best = max(expected_tokens_per_step(acc, t) for t in _all_trees(size, acc))
    assert expected_tokens_per_step(acc, paths) == pytest.approx(best)


def test_expected_tokens_formula():
    assert expected_tokens_per_step(ACC, [[0]]) == pytest.approx(1.6)
    assert expected_tokens_per_step(ACC, [[0], [0, 0], [1]]) == pytest.approx(1 + 0.6 + 0.24 + 0.2)


def test_growth_stops_at_the_head_count_and_rank_limit():
    paths, _ = grow_tree(ACC, 100)
    assert len(paths) == 4 + 16 + 64  # every node of a depth-3, rank-4 tree
    assert max(map(len, paths)) == 3
