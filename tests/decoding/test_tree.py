"""Tree buffers: shapes of the published trees, attention semantics, invalid trees."""

import numpy as np
import pytest

from medusa_jax.decoding.tree import DEEP_BUDGET, Tree, chain_tree, deep_tree, published_trees


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
