"""Conformance: every registered kind of drafter, built through its own `init`, goes through
the doors a shipped kind does — the declared protocol, offline decoding on static and
dynamic trees (greedy equals plain greedy), drawn drafts and typical acceptance, bfloat16
weights, the serving engine, our artifact (save, load, its recorded kind), `axes` under a
mesh, enlarging, the benchmark's library entry and the tree search. A toy kind, defined here
and registered with one call, is run through the same harness: a new kind adds zero test
code, only its folder and its registry line."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding.drafter import Context, Drafter, FromLastHidden
from medusa_jax.decoding.step import Proposal, propose_candidates
from medusa_jax.decoding.tree import DynamicTree, Tree
from medusa_jax.drafters import registry
from medusa_jax.drafters.kind import Formats, Kind

TOY = "toy"
PATHS = [[0], [1], [0, 0], [0, 0, 0]]  # depth 3: every head drafts
POOL = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]
DEPTH = 3  # what each kind is built with (`init`)
PROMPTS = ["Once upon a time", "Lily"]
NEW = 12


@dataclasses.dataclass(frozen=True)
class ToyFormats(Formats):
    """Our artifact only (no foreign layout): the tensor as float32, no fields of its own."""

    kind = TOY
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
class ToyDrafter(FromLastHidden, Kind):
    """K linear heads on the last hidden state: toy_proj [K, H, V]; the carry is their
    logits [K, B, V]."""

    kind = TOY
    formats = ToyFormats
    batch_axis = 1

    @classmethod
    def matches(cls, heads):
        return set(heads) == {"toy_proj"}

    @classmethod
    def axes(cls, heads):
        return {"toy_proj": ("medusa_heads", "embed", "vocab")}

    @classmethod
    def shape_of(cls, heads):
        return int(np.shape(heads["toy_proj"])[0]), 1

    @classmethod
    def init(cls, cfg, backbone, key, depth):
        from medusa_jax.model.backbone import output_projection

        proj = output_projection(cfg, backbone).astype(jnp.float32)  # [H, V]
        return {"toy_proj": proj[None] + 0.05 * jax.random.normal(key, (depth, *proj.shape))}

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


# every registered kind, and a throwaway one (registered for this module only)
KINDS = tuple(k for k in registry.kinds() if k != TOY) + (TOY,)


@pytest.fixture(scope="module", autouse=True)
def toy_registered():
    registry.register(TOY, ToyDrafter)
    try:
        yield
    finally:
        registry.unregister(TOY)


@pytest.fixture(scope="module")
def model():
    from medusa_jax import Medusa

    return Medusa.load()


@pytest.fixture(scope="module")
def built(model):
    """kind -> its parameters, built by the kind's own `init`."""
    return {k: registry.drafter_class(k).init(model.cfg, model.params, jax.random.key(0), DEPTH)
            for k in KINDS}


@pytest.fixture(scope="module")
def plain(model):
    return [g.token_ids for g in model.generate(PROMPTS, max_new_tokens=NEW)]


def drafting(model, heads):
    from medusa_jax import Medusa

    return Medusa(model.cfg, model.params, model.tokenizer, heads=heads,
                  model_dir=model.model_dir, default_tree=model.default_tree)


@pytest.mark.parametrize("kind", KINDS)
def test_the_kind_declares_the_protocol(kind, built):
    cls = registry.drafter_class(kind)
    heads = built[kind]
    assert issubclass(cls, Kind) and cls.kind == kind
    assert registry.kind_of(heads) == kind
    drafter = registry.drafter_for(heads)
    assert isinstance(drafter, Drafter) and isinstance(drafter.context, Context)
    assert drafter.batch_axis in (0, 1)
    assert registry.depth_of(heads) in (None, DEPTH)
    axes = registry.axes_of(heads)
    assert set(axes) <= set(heads)
    for name, a in axes.items():  # each dimension named, or () for a replicated tensor
        assert len(a) in (0, np.ndim(heads[name])), name


@pytest.mark.parametrize("kind", KINDS)
def test_the_formats_read_the_backbone_sizes_off_the_parameters(kind, model, built):
    from medusa_jax.drafters.artifact import formats_of

    if registry.drafter_class(kind).formats is None:
        pytest.skip(f"{kind}: a kind without files")
    assert tuple(formats_of(kind).sizes(built[kind])) == (model.cfg.hidden_size,
                                                          model.cfg.vocab_size)


def test_a_missing_capability_is_refused_in_one_line():
    from medusa_jax.drafters.eagle3.drafter import Eagle3Drafter

    with pytest.raises(ValueError, match="is read from files: give its folder"):
        registry.without_files(TOY)
    with pytest.raises(ValueError, match="does not follow plain steps"):
        Eagle3Drafter().append(None, None, None)
    assert Eagle3Drafter().shared_pool(8) is None


def test_formats_that_are_not_a_formats_subclass_are_refused_in_one_line():
    from medusa_jax.drafters.artifact import formats_of

    class Bare(ToyDrafter):
        formats = object()  # what the formats would have to be probed for

    registry.register("bare", Bare)
    try:
        with pytest.raises(ValueError, match="'bare'.* must be a drafters.kind.Formats subclass"):
            formats_of("bare")
    finally:
        registry.unregister("bare")


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_greedy(kind, tree, model, built, plain):
    m = drafting(model, built[kind])
    assert m.drafter_kind == kind
    t = Tree.from_paths(PATHS) if tree == "static" else \
        DynamicTree(Tree.from_paths(POOL), 4, "dynamic:4")
    got = m.generate(PROMPTS, max_new_tokens=NEW, tree=t)
    assert [g.token_ids for g in got] == plain


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_weights_keep_plain_greedy(kind, model, built, plain):
    heads = registry.with_weight_dtype(built[kind], "bfloat16")
    got = drafting(model, heads).generate(PROMPTS, max_new_tokens=NEW,
                                          tree=Tree.from_paths(PATHS))
    assert [g.token_ids for g in got] == plain


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rejection", "typical"])
@pytest.mark.parametrize("kind", KINDS)
def test_drawn_drafts_and_typical_acceptance_decode(kind, mode, model, built):
    """Drawn drafts (rejection sampling) and typical acceptance: each row's tokens are
    in the vocabulary, at most NEW of them, and the same for the same seed."""
    m = drafting(model, built[kind])
    run = lambda: [g.token_ids for g in m.generate(  # noqa: E731
        PROMPTS, max_new_tokens=NEW, mode=mode, temperature=0.8, seed=3,
        tree=Tree.from_paths(PATHS))]
    first = run()
    assert all(0 < len(t) <= NEW and max(t) < model.cfg.vocab_size for t in first)
    assert run() == first


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_the_serving_engine_keeps_plain_greedy(kind, model, built, plain):
    from medusa_jax.serving.engine import Engine, Request

    e = Engine(drafting(model, built[kind]), slots=2, max_context=128, buckets=(16, 64),
               window_block=64, prefill_batch=1, slot_buckets=(2,),
               tree=Tree.from_paths(PATHS)).start("lazy")
    try:
        for prompt, want in zip(PROMPTS, plain):
            out, done = [], threading.Event()

            def on_event(tokens, finish, error, out=out, done=done):
                out.extend(tokens)
                if finish is not None:
                    done.set()

            e.submit(Request(prompt=model.encode(prompt), max_tokens=NEW, on_event=on_event))
            assert done.wait(180)
            assert out == want
    finally:
        e.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_artifact_round_trip_records_the_kind(kind, model, built, tmp_path):
    from medusa_jax.drafters import formats

    if registry.drafter_class(kind).formats is None:
        pytest.skip(f"{kind}: a kind without files")
    heads = built[kind]
    formats.save_heads(tmp_path, heads, model.cfg)
    assert formats.kind_at(tmp_path) == kind
    loaded, meta = formats.load_heads(tmp_path, model.cfg)
    assert meta["kind"] == kind and registry.kind_of(loaded) == kind
    for name in heads:
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(heads[name]))


def test_the_toy_kinds_artifact_is_refused_by_a_foreign_layout(model, built, tmp_path):
    from medusa_jax.drafters import formats

    with pytest.raises(ValueError, match="toy heads; the vllm layout holds only Medusa heads"):
        formats.write(built[TOY], "vllm", tmp_path / "v")


def test_enlarge_pads_the_toy_heads(model, built):
    from medusa_jax.tools import enlarge

    heads = built[TOY]
    big = model.cfg.replace(hidden_size=2 * model.cfg.hidden_size)
    out = enlarge.enlarge_heads(jax.tree.map(np.asarray, heads), model.cfg, big)
    assert out["toy_proj"].shape == (DEPTH, big.hidden_size, model.cfg.vocab_size)
    np.testing.assert_array_equal(out["toy_proj"][:, :model.cfg.hidden_size],
                                  heads["toy_proj"])


@pytest.mark.slow
def test_bench_and_tree_search(model, built):
    from medusa_jax.tools import bench, tree_search

    heads = built[TOY]
    ids = [model.encode(p) for p in ("Once upon a time", "Tom had a dog")]
    c = bench.compare_decoding(model.params, heads, model.cfg, ids, Tree.from_paths(PATHS),
                               max_new_tokens=8, eos=model.eos)
    assert c.identical_rows == len(ids)
    acc = tree_search.head_rank_accuracy(model.params, model.cfg, heads, ids,
                                         max_new_tokens=16, top_k=3, batch_size=2)
    assert acc.shape == (3, 3) and np.all((acc >= 0) & (acc <= 1))
    paths, _ = tree_search.grow_tree(acc, 4)
    Tree.from_paths(paths, num_heads=registry.depth_of(heads))
