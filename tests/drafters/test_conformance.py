"""The recipe for a new kind of drafter: a toy fourth kind, defined here and registered with
one call, goes through everything a shipped kind does — offline decoding (greedy equals
plain greedy), our artifact (save, load, its recorded kind), enlarging, the benchmark's
library entry and the tree search — with no code outside its class knowing it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding.drafter import FromLastHidden
from medusa_jax.decoding.step import Proposal, propose_candidates
from medusa_jax.drafters import registry

KIND = "toy"
PATHS = [[0], [1], [0, 0], [0, 0, 0]]  # depth 3: every head drafts


@dataclasses.dataclass(frozen=True)
class ToyFormats:
    """Our artifact only (no foreign layout): the tensor as float32, no fields of its own."""

    kind = KIND
    what = "toy heads"
    layouts = ()

    @staticmethod
    def save(heads, cfg, file):
        return {"toy_proj": np.asarray(heads["toy_proj"], np.float32)}, {}

    @staticmethod
    def load(tensors, meta, cfg, file):
        if tensors["toy_proj"].shape[1:] != (cfg.hidden_size, cfg.vocab_size):
            raise ValueError(f"{file}: toy_proj {tensors['toy_proj'].shape} does not fit")
        return {"toy_proj": jnp.asarray(tensors["toy_proj"])}

    @staticmethod
    def sizes(heads):
        return tuple(int(n) for n in np.shape(heads["toy_proj"])[1:])


@dataclasses.dataclass(frozen=True)
class ToyDrafter(FromLastHidden):
    """K linear heads on the last hidden state: toy_proj [K, H, V]; the carry is their
    logits [K, B, V]."""

    kind = KIND
    formats = ToyFormats
    batch_axis = 1

    @classmethod
    def matches(cls, heads):
        return set(heads) == {"toy_proj"}

    @classmethod
    def axes(cls, heads):
        return {"toy_proj": ("medusa_heads", "embed", "vocab")}

    @classmethod
    def from_head_fn(cls, head_fn):
        return cls()

    @staticmethod
    def enlarge(heads, src, dst, grow):
        k, h, v = np.shape(heads["toy_proj"])
        return {"toy_proj": np.stack([grow.place((dst.hidden_size, v), np.asarray(p))
                                      for p in heads["toy_proj"]]).astype(np.float32)}

    def depth(self, heads):
        return int(np.shape(heads["toy_proj"])[0])

    def prepare(self, heads, tree, cpu_kernels=False):
        return {"toy_proj": heads["toy_proj"][:tree.depth]}

    def start(self, params, heads, hidden, lengths):
        return jnp.einsum("bh,khv->kbv", hidden, heads["toy_proj"].astype(hidden.dtype),
                          preferred_element_type=jnp.float32)

    def propose(self, params, heads, carry, root, tree, draw=None) -> Proposal:
        return propose_candidates(root, carry, tree, draw)


@pytest.fixture(scope="module")
def toy():
    from medusa_jax import Medusa
    from medusa_jax.model.backbone import output_projection

    registry.register(KIND, ToyDrafter)
    try:
        m = Medusa.load()
        proj = output_projection(m.cfg, m.params).astype(jnp.float32)  # [H, V]
        noise = 0.05 * jax.random.normal(jax.random.key(0), (3, *proj.shape))
        yield m, {"toy_proj": proj[None] + noise}
    finally:
        registry.unregister(KIND)


def test_the_kind_is_known_by_its_parameters(toy):
    _, heads = toy
    assert registry.kind_of(heads) == KIND and registry.depth_of(heads) == 3


@pytest.mark.slow
def test_offline_greedy_equals_plain_greedy(toy):
    from medusa_jax import Medusa

    m, heads = toy
    drafted = Medusa(m.cfg, m.params, m.tokenizer, heads=heads)
    assert drafted.drafter_kind == KIND
    prompts = ["Once upon a time", "Lily"]
    from medusa_jax.decoding.tree import Tree

    got = drafted.generate(prompts, max_new_tokens=12, tree=Tree.from_paths(PATHS))
    want = m.generate(prompts, max_new_tokens=12)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert any(g.steps < 12 for g in got)  # some drafts were accepted
    with pytest.raises(ValueError, match="only 3 Toy heads"):
        drafted.tree("mc_sim_7b_63")


def test_artifact_round_trip_records_the_kind(toy, tmp_path):
    from medusa_jax.drafters import formats

    m, heads = toy
    formats.save_heads(tmp_path, heads, m.cfg)
    assert formats.kind_at(tmp_path) == KIND
    loaded, meta = formats.load_heads(tmp_path, m.cfg)
    assert meta["kind"] == KIND
    np.testing.assert_array_equal(loaded["toy_proj"], heads["toy_proj"])
    with pytest.raises(ValueError, match="toy heads; the vllm layout holds only Medusa heads"):
        formats.write(heads, "vllm", tmp_path / "v")


def test_enlarge_pads_the_toy_heads(toy):
    from medusa_jax.tools import enlarge

    m, heads = toy
    big = m.cfg.replace(hidden_size=2 * m.cfg.hidden_size)
    out = enlarge.enlarge_heads(jax.tree.map(np.asarray, heads), m.cfg, big)
    assert out["toy_proj"].shape == (3, big.hidden_size, m.cfg.vocab_size)
    np.testing.assert_array_equal(out["toy_proj"][:, :m.cfg.hidden_size], heads["toy_proj"])


@pytest.mark.slow
def test_bench_and_tree_search(toy):
    from medusa_jax.decoding.tree import Tree
    from medusa_jax.tools import bench, tree_search

    m, heads = toy
    ids = [m.encode(p) for p in ("Once upon a time", "Tom had a dog")]
    c = bench.compare_decoding(m.params, heads, m.cfg, ids, Tree.from_paths(PATHS),
                               max_new_tokens=8, eos=m.eos)
    assert c.identical_rows == len(ids)
    acc = tree_search.head_rank_accuracy(m.params, m.cfg, heads, ids, max_new_tokens=16,
                                         top_k=3, batch_size=2)
    assert acc.shape == (3, 3) and np.all((acc >= 0) & (acc <= 1))
    paths, _ = tree_search.grow_tree(acc, 4)
    Tree.from_paths(paths, num_heads=registry.depth_of(heads))
