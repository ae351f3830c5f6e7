"""Tree buffers: shapes of the published trees, attention semantics, invalid trees."""

import numpy as np
import pytest

from medusa_jax.decoding.tree import (DEEP_BUDGET, MAX_TREE_DEPTH, MAX_TREE_NODES, MAX_TREE_TOP_K,
                                      Tree, chain_tree, deep_tree, published_trees)


def test_mc_sim_7b_63_buffers():
    t = Tree.load("mc_sim_7b_63")
    assert t.mask.shape == (64, 64)
    assert t.paths.shape == (42, 5) and t.path_valid.shape == (42, 5)
    assert t.depth == 4 and t.num_nodes == 64 and t.top_k == 10
    assert t.node_depth[0] == 0 and t.node_depth.max() == 4


@pytest.mark.parametrize("name", sorted(published_trees()))
def test_buffers_are_consistent(name):
    t = Tree.load(name)
    ranks = (None,) + t.paths_ranks
    for i in range(1, t.num_nodes):
        path = ranks[i]
        # a node sees exactly its ancestors, itself and the root
        ancestors = {0, i} | {ranks.index(path[:d]) for d in range(1, len(path))}
        assert set(np.flatnonzero(t.mask[i])) == ancestors
        assert t.node_depth[i] == len(path)
        assert t.cand_index[i] == 1 + (len(path) - 1) * t.top_k + path[-1]
        assert ranks[t.parent[i]] == (path[:-1] or None)
    # every node lies on some valid root-to-leaf row, padding never marked valid
    on_paths = set(t.paths[t.path_valid].tolist())
    assert on_paths == set(range(t.num_nodes))
    assert not t.path_valid[:, 0].all() or t.paths[:, 0].max() == 0
    for row, valid in zip(t.paths, t.path_valid):
        n = valid.sum()
        assert valid[:n].all() and not valid[n:].any()
        for d in range(1, n):
            assert t.parent[row[d]] == row[d - 1]
    # children tables list each node's children in rank order
    for i in range(t.num_nodes):
        kids = t.children[i][t.child_valid[i]]
        assert all(t.parent[k] == i for k in kids)
        assert [ranks[k][-1] for k in kids] == sorted(ranks[k][-1] for k in kids)


@pytest.mark.parametrize("paths, message", [
    ([], "is empty"),
    ([[0], [0]], r"duplicate path \[0\]"),
    ([[0], [1, 0], [1]][:2], r"path \[1, 0\] has no parent path \[1\]"),
    ([[0], [-1]], "not a non-empty list of ranks"),
    ([[0], []], "not a non-empty list of ranks"),
])
def test_invalid_trees(paths, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_paths(paths)


def test_depth_and_rank_limits():
    with pytest.raises(ValueError, match="depth 3 but there are only 2 Medusa heads"):
        Tree.from_paths([[0], [0, 0], [0, 0, 0]], num_heads=2)
    with pytest.raises(ValueError, match="rank 4 >= top_k 4"):
        Tree.from_paths([[0], [4]], top_k=4)


def test_tree_from_file_and_unknown_name(tmp_path):
    f = tmp_path / "t.json"
    f.write_text("[[0], [1], [0, 0]]")
    t = Tree.load(f)
    assert t.num_nodes == 4 and t.depth == 2
    assert Tree.load(f) == Tree.from_paths([[1], [0], [0, 0]])
    with pytest.raises(ValueError, match="neither a file nor a known tree"):
        Tree.load("no_such_tree")
    (tmp_path / "bad.json").write_text("[[0],")
    with pytest.raises(ValueError, match="bad.json: invalid JSON"):
        Tree.load(tmp_path / "bad.json")


def test_chain_tree():
    t = chain_tree(3)
    assert t.num_nodes == 4 and t.paths.tolist() == [[0, 1, 2, 3]]
    assert np.array_equal(t.mask, np.tril(np.ones((4, 4), bool)))


def test_chain_by_name(tmp_path, monkeypatch):
    assert Tree.load("chain3") == chain_tree(3)
    assert Tree.load("chain3").name == "chain3"
    with pytest.raises(ValueError, match="at least 1 node"):
        Tree.load("chain0")
    with pytest.raises(ValueError, match="depth 5 but there are only 4"):
        Tree.load("chain5", num_heads=4)
    monkeypatch.chdir(tmp_path)  # a file of that name is the user's tree, not the chain
    (tmp_path / "chain2").write_text("[[0], [1]]")
    assert Tree.load("chain2") == Tree.from_paths([[0], [1]])


def test_deep_pool_by_name(tmp_path, monkeypatch):
    t = Tree.load("deep9")
    assert t == deep_tree(9) and t.name == "deep9" and t.depth == 9
    paths = {tuple(p) for p in t.paths_ranks}
    # exactly the rank paths within the budget, counted here independently of deep_tree
    want = {p for d in range(1, 10) for p in np.ndindex(*(5,) * d)
            if d - 1 + 2 * sum(p) <= DEEP_BUDGET}
    assert paths == want
    assert (0,) * 9 in paths and (1,) * 4 not in paths  # the chain runs deepest
    assert {p for p in paths if len(p) <= 5} == {tuple(p) for p in deep_tree(5).paths_ranks}
    with pytest.raises(ValueError, match="depth at least 1"):
        Tree.load("deep0")
    with pytest.raises(ValueError, match="at most 9"):  # the budget ends paths at depth 9
        Tree.load("deep10")
    with pytest.raises(ValueError, match="depth 6 but there are only 5"):
        Tree.load("deep6", num_heads=5)
    dyn = Tree.load("dynamic:16:deep5", num_heads=5)
    assert dyn.size == 16 and dyn.depth == 5
    monkeypatch.chdir(tmp_path)  # a file of that name is the user's tree
    (tmp_path / "deep2").write_text("[[0], [1]]")
    assert Tree.load("deep2") == Tree.from_paths([[0], [1]])


def test_hostile_tree_files(tmp_path):
    f = tmp_path / "str.json"
    f.write_text('{"paths": "abc"}')
    with pytest.raises(ValueError) as e:
        Tree.load(f)
    assert str(e.value) == (f"tree {str(f)!r}: paths must be a list of lists of ranks like "
                            f"[[0], [1], [0, 0]], got str")
    f = tmp_path / "nopaths.json"
    f.write_text('{"path": [[0]]}')
    with pytest.raises(ValueError, match=r"nopaths\.json'?: the JSON object has no \"paths\""):
        Tree.load(f)
    f = tmp_path / "bool.json"
    f.write_text("[[0], [true]]")
    with pytest.raises(ValueError, match=r"bool\.json'?: path \[True\] is not a non-empty list"):
        Tree.load(f)
    f = tmp_path / "latin1.json"
    f.write_bytes(b"[[0], \xff]")
    with pytest.raises(ValueError, match=r"latin1\.json: tree file is not UTF-8 text \(byte 6\)"):
        Tree.load(f)
    with pytest.raises(ValueError) as e:
        Tree.load("mc_sim_7b_36")  # a typo: the message lists the known names
    assert "neither a file nor a known tree; known: mc_sim_7b_63, " in str(e.value)


def test_rank_beyond_the_vocabulary():
    with pytest.raises(ValueError, match=r"tree 'custom': rank 600 is beyond the model's "
                                         r"vocabulary of 512 tokens"):
        Tree.from_paths([[0], [600]], vocab_size=512)
    with pytest.raises(ValueError, match=r"tree 'mc_sim_7b_63': rank 9 is beyond the model's "
                                         r"vocabulary of 8 tokens"):
        Tree.load("mc_sim_7b_63", vocab_size=8)
    with pytest.raises(ValueError, match="top_k 20 exceeds the model's vocabulary of 8"):
        Tree.from_paths([[0]], top_k=20, vocab_size=8)
    assert Tree.load("mc_sim_7b_63", vocab_size=10) == Tree.load("mc_sim_7b_63")


@pytest.fixture
def no_chain_building(monkeypatch):
    """chain_tree and deep_tree fail if called past the depth cap: a refused spec is refused
    before it is built."""
    from medusa_jax.decoding import tree as tree_module

    def guard(build):
        def checked(depth, *args, **kwargs):
            if depth > MAX_TREE_DEPTH:
                raise AssertionError(f"a tree of depth {depth} was built before it was checked")
            return build(depth, *args, **kwargs)
        return checked

    monkeypatch.setattr(tree_module, "chain_tree", guard(chain_tree))
    monkeypatch.setattr(tree_module, "deep_tree", guard(deep_tree))


def test_a_huge_chain_is_refused_before_it_is_built(no_chain_building, one_line_error):
    """chainN builds N paths of up to N ranks: N is checked first (the drafter's depth, the
    context, the absolute cap), so chain100000 costs nothing."""
    one_line_error(ValueError, lambda: Tree.load("chain100000", num_heads=4),
                   "tree 'chain100000' has depth 100000 but there are only 4 Medusa heads")
    one_line_error(ValueError, lambda: Tree.load("chain100000"),
                   "tree 'chain100000'", f"at most {MAX_TREE_DEPTH} levels")
    one_line_error(ValueError, lambda: Tree.load("chain60", context=32),
                   "tree 'chain60'", "61 tokens", "context of 32")
    one_line_error(ValueError, lambda: Tree.load("chain" + "9" * 5000),
                   "tree 'chain9999", f"{MAX_TREE_DEPTH} levels")


def test_every_spec_is_bounded_before_work(one_line_error):
    """dynamic:N, name:N and tree files: sizes are checked against the caps before anything
    allocates in proportion to them."""
    one_line_error(ValueError, lambda: Tree.load("dynamic:100000000000"),
                   "tree 'dynamic:100000000000'", "1 .. 63 nodes")
    one_line_error(ValueError, lambda: Tree.load("dynamic:" + "9" * 5000), "tree 'dynamic:999")
    one_line_error(ValueError, lambda: Tree.load("dynamic:600:deep9", context=512),
                   "601 tokens", "context of 512")
    one_line_error(ValueError, lambda: Tree.load("mc_sim_7b_63:" + "9" * 5000),
                   "size must be 1..63")
    one_line_error(ValueError, lambda: Tree.load("x" * 5000), "neither a file nor a known tree")
    many = [[r] for r in range(MAX_TREE_NODES + 1)]
    one_line_error(ValueError, lambda: Tree.from_paths(many),
                   f"{MAX_TREE_NODES + 1} nodes", f"at most {MAX_TREE_NODES}")
    one_line_error(ValueError, lambda: Tree.from_paths([[0] * d for d in range(1, 40)],
                                                       context=16),
                   "40 tokens", "context of 16")
    deep = [[0] * (MAX_TREE_DEPTH + 1)]
    one_line_error(ValueError, lambda: Tree.from_paths(deep),
                   f"at most {MAX_TREE_DEPTH} levels")
    # a rank sizes top_k, and top_k sizes the per-node buffers (rank_child: nodes x top_k)
    one_line_error(ValueError, lambda: Tree.from_paths([[0], [10**12]]),
                   "rank 1000000000000", f"at most {MAX_TREE_TOP_K - 1}")
    one_line_error(ValueError, lambda: Tree.from_paths([[0]], top_k=10**12),
                   "top_k 1000000000000", f"at most {MAX_TREE_TOP_K}")
    # within the caps, nothing changes
    assert Tree.load("chain16", context=32).depth == 16
    assert Tree.from_paths([[r] for r in range(MAX_TREE_NODES)]).num_nodes == MAX_TREE_NODES + 1


def test_the_api_checks_the_spec_against_the_context_first(no_chain_building, one_line_error):
    """`Medusa.tree` (generate, the server): a drafter of any depth (n-gram, EAGLE-3) still
    has the model's context to bound a chain."""
    from medusa_jax.api import Medusa

    model = Medusa.load(heads="ngram")
    one_line_error(ValueError, lambda: model.tree("chain100000"),
                   "tree 'chain100000'", "context of 512")
