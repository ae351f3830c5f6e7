"""Static tree buffers for Medusa verification, built once on the host with numpy.

A tree is a list of paths; a path lists the top-k rank chosen at depths 1, 2, ... (depth d is
read from head d). Node 0 is the root (the token the base model already chose); nodes
1..N are the paths sorted by (depth, ranks). Every buffer has a static shape, so the decode
loop compiles once per tree.

    mask        [N+1, N+1] bool   node i attends node j (its ancestors and itself)
    cand_index  [N+1] int         index of each node's token in the flat candidate vector
                                  [root, top-k of head 1, top-k of head 2, ...]
    depth       [N+1] int         position offset of each node from the root
    paths       [P, D+1] int      root-to-leaf node indices, padded with 0 ...
    path_valid  [P, D+1] bool     ... and this mask says which entries are real
    children    [N+1, C] int      each node's children in rank order, padded with 0 ...
    child_valid [N+1, C] bool     ... and this mask says which entries are real
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import numpy as np

from medusa_jax.runtime import assets

DEFAULT_TREE = assets.PUBLISHED_DEFAULT_TREE

# Caps on every tree, checked before anything is built from a spec's numbers: a step
# verifies every node, a drafter runs once per level (an unrolled loop), and the per-node
# buffers are nodes x top_k. Far past any tree worth verifying, far below a costly one.
MAX_TREE_NODES = 1024
MAX_TREE_DEPTH = 64
MAX_TREE_TOP_K = 1024


def _clip(text, limit: int = 48) -> str:
    text = str(text)
    return text if len(text) <= limit else f"{text[:40]}...({len(text)} chars)"


def _count(spec, digits: str) -> int:
    """A spec's number; one far past every cap is refused here (int() refuses 4300+ digits)."""
    if len(digits) > 18:
        raise ValueError(f"tree {_clip(spec)!r}: {_clip(digits)} is far past any tree's size "
                         f"(at most {MAX_TREE_NODES} nodes and {MAX_TREE_DEPTH} levels)")
    return int(digits)


def check_size(name: str, nodes: int, depth: int, num_heads: int | None = None,
               context: int | None = None) -> None:
    """Refuse a tree of `nodes` nodes (besides the root) and `depth` levels before it is
    built: deeper than the drafter's `num_heads`, a step of more tokens than the model's
    `context` holds beside a prompt token and a new one, or past the caps."""
    if num_heads is not None and depth > num_heads:
        raise ValueError(
            f"tree {_clip(name)!r} has depth {depth} but there are only {num_heads} Medusa heads")
    if context is not None and nodes + 3 > context:
        raise ValueError(f"tree {_clip(name)!r}: a step feeds its {nodes} nodes and the root "
                         f"({nodes + 1} tokens), more than the model's context of {context} "
                         f"holds beside a prompt")
    if depth > MAX_TREE_DEPTH:
        raise ValueError(f"tree {_clip(name)!r} has depth {depth}: a tree has at most "
                         f"{MAX_TREE_DEPTH} levels")
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"tree {_clip(name)!r} has {nodes} nodes: a tree has at most "
                         f"{MAX_TREE_NODES}")


def _is_file(spec) -> bool:
    try:
        return Path(spec).is_file()
    except OSError:  # a name too long for a file is not one
        return False


@functools.cache
def published_trees() -> dict[str, list[list[int]]]:
    """The trees shipped with the package, by name (the published Medusa trees and ours)."""
    root = assets.trees_dir()
    trees = {}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            data = json.loads(entry.read_text())
            if isinstance(data, dict) and "paths" in data:  # a single searched tree
                trees[entry.name[:-5]] = data["paths"]
            else:
                trees.update(data)
    return trees


@dataclasses.dataclass(frozen=True)
class Tree:
    """A validated sparse tree. Hashable, so it is a static argument of the jitted decoders."""

    paths_ranks: tuple[tuple[int, ...], ...]
    top_k: int
    name: str = dataclasses.field(default="custom", compare=False)

    @classmethod
    def from_paths(cls, paths, num_heads: int | None = None, top_k: int | None = None,
                   name: str = "custom", *, vocab_size: int | None = None,
                   context: int | None = None) -> "Tree":
        """Validate `paths` and build the tree; raises ValueError naming the bad path.
        `vocab_size`: the model's vocabulary; a rank (or top_k) beyond it is rejected.
        `context`: the model's; a tree whose step does not fit in it is rejected (`check_size`,
        as are trees past the caps, before any path is copied)."""
        if not isinstance(paths, (list, tuple)):
            raise ValueError(f"tree {name!r}: paths must be a list of lists of ranks like "
                             f"[[0], [1], [0, 0]], got {type(paths).__name__}")
        if len(paths) == 0:
            raise ValueError(f"tree {name!r} is empty: give at least one path like [0]")
        check_size(name, len(paths), 1, None, context)
        clean = []
        for p in paths:
            if isinstance(p, (list, tuple)) and len(p) > MAX_TREE_DEPTH:
                check_size(name, len(paths), len(p))
            if (not isinstance(p, (list, tuple)) or len(p) == 0
                    or not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool)
                               and r >= 0 for r in p)):
                raise ValueError(f"tree {name!r}: path {p!r} is not a non-empty list of ranks >= 0")
            clean.append(tuple(int(r) for r in p))
        seen = set()
        for p in clean:
            if p in seen:
                raise ValueError(f"tree {name!r}: duplicate path {list(p)}")
            seen.add(p)
        for p in clean:
            if len(p) > 1 and p[:-1] not in seen:
                raise ValueError(f"tree {name!r}: path {list(p)} has no parent path {list(p[:-1])}")
        depth = max(len(p) for p in clean)
        if num_heads is not None and depth > num_heads:
            raise ValueError(
                f"tree {name!r} has depth {depth} but there are only {num_heads} Medusa heads")
        max_rank = max(max(p) for p in clean)
        if max_rank >= MAX_TREE_TOP_K:
            raise ValueError(f"tree {name!r}: rank {max_rank} is past the cap on ranks: "
                             f"at most {MAX_TREE_TOP_K - 1}")
        if top_k is not None and top_k > MAX_TREE_TOP_K:
            raise ValueError(f"tree {name!r}: top_k {top_k} is past the cap: at most "
                             f"{MAX_TREE_TOP_K}")
        if top_k is None:
            top_k = max_rank + 1
        elif max_rank >= top_k:
            raise ValueError(f"tree {name!r}: rank {max_rank} >= top_k {top_k}")
        if vocab_size is not None and max_rank >= vocab_size:
            raise ValueError(f"tree {name!r}: rank {max_rank} is beyond the model's vocabulary "
                             f"of {vocab_size} tokens (ranks must be < {vocab_size})")
        if vocab_size is not None and top_k > vocab_size:
            raise ValueError(f"tree {name!r}: top_k {top_k} exceeds the model's vocabulary "
                             f"of {vocab_size} tokens")
        return cls(tuple(sorted(clean, key=lambda p: (len(p), p))), int(top_k), name)

    def choosable(self, size: int) -> "Tree":
        """The nodes that can be among the `size` most probable of this tree under any head
        distributions (what a `DynamicTree` of that size chooses): a node scores below its
        ancestors and below each lower-ranked sibling of itself or of an ancestor, so one
        with `size` or more of those in the tree never makes the cut. Prefix-closed."""
        nodes = set(self.paths_ranks)

        def above(p):  # nodes of this tree that always score higher than p
            return len(p) - 1 + sum(p[:d] + (r,) in nodes for d in range(len(p))
                                    for r in range(p[d]))

        keep = [list(p) for p in self.paths_ranks if above(p) < size]
        if len(keep) == len(self.paths_ranks):
            return self
        return Tree.from_paths(keep, name=f"{self.name}[{size}]")

    @classmethod
    def load(cls, spec: str | Path, num_heads: int | None = None, *,
             vocab_size: int | None = None, context: int | None = None) -> "Tree":
        """A published tree by name, "chainN" (the top-1 chain of N nodes), "deepD" (a pool
        for dynamic trees, `deep_tree`), or a JSON file holding a list of paths
        (or an object with a "paths" field), or "dynamic:N[:POOL]" (a `DynamicTree`).
        `vocab_size`, `context`: see `from_paths`; a spec's numbers are checked against the
        heads, the context and the caps before anything is built from them."""
        if str(spec).startswith(DynamicTree.PREFIX):
            return DynamicTree.parse(str(spec), num_heads, vocab_size, context)
        trees = published_trees()
        if str(spec) in trees:
            return cls.from_paths(trees[str(spec)], num_heads, name=str(spec),
                                  vocab_size=vocab_size, context=context)
        named = re.fullmatch(r"(chain|deep)(\d+)", str(spec))
        if named and not _is_file(spec):
            # "chain4": the top-1 chain of 4 nodes (the shape an autoregressive drafter
            # drafts best at a small verification budget); "deep7": a dynamic tree's pool
            depth = _count(spec, named.group(2))
            if named.group(1) == "deep":
                return deep_tree(depth, num_heads, vocab_size=vocab_size, context=context)
            if depth < 1:
                raise ValueError(f"tree {spec!r}: a chain has at least 1 node")
            check_size(str(spec), depth, depth, num_heads, context)  # it holds depth² ranks
            return chain_tree(depth, num_heads, vocab_size=vocab_size)
        name, _, size = str(spec).rpartition(":")
        if name in trees and size.isdigit():
            # "mc_sim_7b_63:16": the first 16 paths. Published trees list paths in the order
            # they were grown (best first), so every prefix is itself a valid tree.
            n = int(size) if len(size) <= 18 else 0
            if not 1 <= n <= len(trees[name]):
                raise ValueError(f"tree {_clip(spec)!r}: size must be 1..{len(trees[name])}")
            return cls.from_paths(trees[name][:n], num_heads, name=str(spec),
                                  vocab_size=vocab_size, context=context)
        path = Path(spec)
        if not _is_file(path):
            raise ValueError(f"tree {_clip(spec)!r} is neither a file nor a known tree; known: "
                             f"{', '.join(trees)}, chainN, deepD, dynamic:N")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON in tree file ({e})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: tree file is not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise ValueError(f"{path}: cannot read the tree file ({e.strerror})") from None
        if isinstance(data, dict):
            if "paths" not in data:
                raise ValueError(f"tree {str(path)!r}: the JSON object has no \"paths\" field; "
                                 f"give a list of paths or {{\"paths\": [[0], [0, 0]]}}")
            data = data["paths"]
        return cls.from_paths(data, num_heads, name=str(path), vocab_size=vocab_size,
                              context=context)

    def to_json(self) -> list[list[int]]:
        return [list(p) for p in self.paths_ranks]

    # ---- buffers (numpy; cached because the dataclass is immutable)

    @property
    def num_nodes(self) -> int:
        """Tokens fed per verification step: root + tree nodes."""
        return len(self.paths_ranks) + 1

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths_ranks)

    @functools.cached_property
    def _index(self) -> dict[tuple[int, ...], int]:
        return {(): 0, **{p: i + 1 for i, p in enumerate(self.paths_ranks)}}

    @functools.cached_property
    def node_depth(self) -> np.ndarray:
        return np.array([0] + [len(p) for p in self.paths_ranks], np.int32)

    @functools.cached_property
    def cand_index(self) -> np.ndarray:
        return np.array([0] + [1 + (len(p) - 1) * self.top_k + p[-1] for p in self.paths_ranks],
                         np.int32)

    @functools.cached_property
    def parent(self) -> np.ndarray:
        return np.array([0] + [self._index[p[:-1]] for p in self.paths_ranks], np.int32)

    @functools.cached_property
    def mask(self) -> np.ndarray:
        n = self.num_nodes
        m = np.eye(n, dtype=bool)
        m[:, 0] = True
        for p, i in self._index.items():
            for d in range(1, len(p)):
                m[i, self._index[p[:d]]] = True
        return m

    @functools.cached_property
    def _leaves(self) -> list[tuple[int, ...]]:
        prefixes = {p[:-1] for p in self.paths_ranks}
        return [p for p in self.paths_ranks if p not in prefixes]

    @functools.cached_property
    def paths(self) -> np.ndarray:
        out = np.zeros((len(self._leaves), self.depth + 1), np.int32)
        for row, leaf in enumerate(self._leaves):
            for d in range(1, len(leaf) + 1):
                out[row, d] = self._index[leaf[:d]]
        return out

    @functools.cached_property
    def path_valid(self) -> np.ndarray:
        lengths = np.array([len(p) for p in self._leaves])
        return np.arange(self.depth + 1)[None, :] <= lengths[:, None]

    @functools.cached_property
    def _children_lists(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for p in self.paths_ranks:  # sorted by rank within a depth, so children come in rank order
            kids[self._index[p[:-1]]].append(self._index[p])
        return kids

    @functools.cached_property
    def children(self) -> np.ndarray:
        width = max(1, max(len(k) for k in self._children_lists))
        out = np.zeros((self.num_nodes, width), np.int32)
        for i, k in enumerate(self._children_lists):
            out[i, : len(k)] = k
        return out

    @functools.cached_property
    def child_valid(self) -> np.ndarray:
        width = self.children.shape[1]
        lengths = np.array([len(k) for k in self._children_lists])
        return np.arange(width)[None, :] < lengths[:, None]

    @functools.cached_property
    def rank_child(self) -> np.ndarray:
        """[N+1, top_k] int: the child of each node that takes its parent's r-th draft, or
        -1 where the tree has no such child (sampled drafts: acceptance offers every draft up
        to a node's last child in draw order, `rank_offered`)."""
        out = np.full((self.num_nodes, self.top_k), -1, np.int32)
        for p in self.paths_ranks:
            out[self._index[p[:-1]], p[-1]] = self._index[p]
        return out

    @functools.cached_property
    def rank_offered(self) -> np.ndarray:
        """[N+1, top_k] bool: the drafts acceptance offers at each node, ranks 0 .. its last
        child's (none at a leaf)."""
        last = np.max(np.where(self.rank_child >= 0, np.arange(self.top_k)[None], -1), axis=1)
        return np.arange(self.top_k)[None, :] <= last[:, None]


def chain_tree(depth: int, num_heads: int | None = None, *,
               vocab_size: int | None = None) -> Tree:
    """The top-1 chain of the given depth ("chainN"): the smallest useful tree."""
    return Tree.from_paths([[0] * d for d in range(1, depth + 1)], num_heads,
                           name=f"chain{depth}", vocab_size=vocab_size)


# deep_tree's cost of a node: its depth below the first level plus twice its rank sum
DEEP_BUDGET = 8


def deep_tree(depth: int, num_heads: int | None = None, *,
              vocab_size: int | None = None, context: int | None = None) -> Tree:
    """"deepD": a pool for dynamic trees ("dynamic:N:deepD") down to depth D: the rank
    paths r_1 .. r_d (d <= D) with (d - 1) + 2 (r_1 + ... + r_d) <= `DEEP_BUDGET`, so the
    top-1 chain runs to depth D and a side branch is shorter the lower its ranks. Shaped for
    drafters that stay accurate deep down (EAGLE-3, Hydra): the published Medusa pool
    `mc_sim_7b_63` stops at depth 4. Prefix-closed by construction (a parent costs less).
    The budget ends every path by depth `DEEP_BUDGET` + 1, so D is at most that."""
    if not 1 <= depth <= DEEP_BUDGET + 1:
        raise ValueError(f"tree 'deep{depth}': a deep pool has depth at least 1 and at most "
                         f"{DEEP_BUDGET + 1} (its budget ends every path there)")
    paths, level = [], [[]]
    while level:  # depth by depth (no recursion: a chain may run deep)
        level = [p + [r] for p in level for r in range(DEEP_BUDGET // 2 + 1)
                 if len(p) < depth and len(p) + 2 * (sum(p) + r) <= DEEP_BUDGET]
        paths += level
    paths.sort(key=lambda p: (len(p), p))
    return Tree.from_paths(paths, num_heads, name=f"deep{depth}", vocab_size=vocab_size,
                           context=context)


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A tree chosen afresh every step, per row (what EAGLE-2 does for its drafter): the
    `size` nodes of `pool` whose paths have the highest joint probability under the heads'
    current distributions. Path probabilities only shrink with depth, so the chosen set is
    always a subtree of the pool (every node's parent is chosen too). Shapes stay static:
    a step verifies `size` + 1 tokens whatever is chosen.

    "dynamic:N" uses the published 64-node pool `mc_sim_7b_63`; "dynamic:N:POOL" any tree
    that `Tree.load` reads. Only the pool's nodes that can be among the N best are kept
    (`Tree.choosable`): the same choice, with fewer head ranks to find."""

    pool: Tree
    size: int
    name: str = dataclasses.field(default="dynamic", compare=False)

    PREFIX = "dynamic:"
    DEFAULT_POOL = assets.PUBLISHED_DEFAULT_TREE

    def __post_init__(self):
        if not 1 <= self.size <= self.pool.num_nodes - 1:
            raise ValueError(f"tree {self.name!r}: a dynamic tree chooses 1 .. "
                             f"{self.pool.num_nodes - 1} nodes of its pool {self.pool.name!r}, "
                             f"got {self.size}")
        # only the nodes that can ever be chosen: the same choice from a smaller pool, with
        # fewer head ranks to find (top-k costs a pass over the vocabulary per rank on CPU)
        object.__setattr__(self, "pool", self.pool.choosable(self.size))

    @classmethod
    def parse(cls, spec: str, num_heads: int | None = None, vocab_size: int | None = None,
              context: int | None = None) -> "DynamicTree":
        """"dynamic:N[:POOL]"; N is checked against the `context` (a step feeds N + 1 tokens)
        before the pool is read (which is checked against the caps, not the context)."""
        size, _, pool = spec[len(cls.PREFIX):].partition(":")
        if not size.strip().isdigit():
            raise ValueError(f"tree {_clip(spec)!r}: expected dynamic:N or dynamic:N:POOL with "
                             f"N a number of nodes >= 1")
        if pool.startswith(cls.PREFIX):
            raise ValueError(f"tree {_clip(spec)!r}: the pool of a dynamic tree must be a "
                             f"static tree")
        n = _count(spec, size.strip())
        if context is not None:
            check_size(spec, n, 1, None, context)
        return cls(Tree.load(pool or cls.DEFAULT_POOL, num_heads, vocab_size=vocab_size),
                   n, name=spec)

    @property
    def num_nodes(self) -> int:
        """Tokens fed per verification step: root + chosen nodes."""
        return self.size + 1

    @property
    def depth(self) -> int:
        return self.pool.depth

    @property
    def top_k(self) -> int:
        return self.pool.top_k


@functools.lru_cache(maxsize=64)
def tree_plan(paths_ranks: tuple[tuple[int, ...], ...]):
    """Per depth d = 1..D of a static tree (its `paths_ranks`, node i+1 = paths_ranks[i]):
    (the nodes at depth d-1 that have children [E], their root-to-node paths [E, d],
    the nodes at depth d [M], each one's parent's position in the first list [M], its rank
    [M], top-k needed). Host numpy, cached."""
    index = {(): 0, **{p: i + 1 for i, p in enumerate(paths_ranks)}}
    depth = max(len(p) for p in paths_ranks)
    plan = []
    for d in range(1, depth + 1):
        nodes = [p for p in paths_ranks if len(p) == d]
        parents = sorted({p[:-1] for p in nodes}, key=lambda p: index[p])
        pos = {p: j for j, p in enumerate(parents)}
        anc = np.array([[index[p[:m]] for m in range(d)] for p in parents], np.int32)
        plan.append((anc, np.array([index[p] for p in nodes], np.int32),
                     np.array([pos[p[:-1]] for p in nodes], np.int32),
                     np.array([p[-1] for p in nodes], np.int32),
                     max(p[-1] for p in nodes) + 1))
    return tuple(plan)
