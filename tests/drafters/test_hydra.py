"""Hydra heads in the decoders: greedy == plain greedy (random and shipped heads, static and
dynamic trees, batch > 1), rejection sampling lossless, the artifact, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.api import Medusa, shipped_heads_dir
from medusa_jax.decoding.decode import medusa_generate, pad_prompts
from medusa_jax.decoding.tree import DynamicTree, Tree
from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters.hydra import heads as hydra
from medusa_jax.drafters.hydra.drafter import HydraDrafter
from medusa_jax.drafters.medusa import heads as heads_lib
from medusa_jax.model.backbone import init_params

BIG_TREE = Tree.load("mc_sim_7b_63")


@pytest.fixture(scope="module")
def story_heads(stories, noisy_hydra):
    cfg, params, _ = stories
    return jax.jit(lambda p: noisy_hydra(hydra.init_hydra(cfg, p, 5, 2), 0.05, 3))(params)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [BIG_TREE, DynamicTree(Tree.load("mc_sim_7b_63:16"), 6)],
                         ids=["static", "dynamic"])
def test_hydra_greedy_equals_plain_greedy(stories, story_heads, story_plain, tree):
    cfg, params, _ = stories
    tokens, lengths = pad_prompts(story_plain.prompts)
    trained, _ = heads_formats.load_heads(shipped_heads_dir("hydra"), cfg)
    steps = []
    for heads in (story_heads, trained):  # same shapes: one compile
        out = medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0),
                              tree=tree, max_new_tokens=story_plain.max_new, eos=(2,))
        assert story_plain.rows(out) == story_plain.rows_plain
        steps.append(int(np.sum(out.steps)))
    tokens_per_step = sum(len(r) for r in story_plain.rows_plain) / steps[1]
    assert tokens_per_step > 2.0  # the trained heads draft along their paths


@pytest.fixture(scope="module")
def tiny_hydra(toy_lm, noisy_hydra):
    CFG = toy_lm.CFG
    # jitted: one compile instead of one per eager op
    params = jax.jit(lambda k: init_params(CFG, k, std=0.6))(jax.random.key(0))
    return params, jax.jit(lambda p: noisy_hydra(hydra.init_hydra(CFG, p, 2, 2), 0.3, 1))(params)


@pytest.mark.slow
@pytest.mark.parametrize("dynamic, which", [(True, 0), (False, 1)],
                         ids=["dynamic-t1", "static-t0.7-topk-topp"])
def test_hydra_rejection_sampling_is_lossless(toy_lm, tiny_hydra, chi_square_ok, dynamic,
                                              which):
    """Hydra's drafts, drawn per parent node from its heads' distributions: on a dynamic
    tree (its per-path choice of nodes, rejection over the pool with the unchosen nodes
    masked) and on a static one with top-k and top-p filtering the drafts' distribution."""
    CFG, TREE, PROMPT, ROWS = toy_lm.CFG, toy_lm.TREE, toy_lm.PROMPT, toy_lm.ROWS
    SAMPLINGS = toy_lm.SAMPLINGS
    params, heads = tiny_hydra
    tree = DynamicTree(TREE, 3) if dynamic else TREE
    sampling = SAMPLINGS[which]
    exact = toy_lm.exact_pair_distribution(params, sampling)
    tokens, lengths = pad_prompts([PROMPT] * ROWS)
    out = medusa_generate(params, heads, CFG, tokens, lengths, jax.random.key(7), tree=tree,
                          sampling=sampling, max_new_tokens=3)
    ok, ratio = chi_square_ok(toy_lm.pair_counts(out).ravel(), exact.ravel())
    assert ok, f"Hydra rejection sampling is not lossless: chi2/critical = {ratio:.2f}"
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0.05 * hist.sum()  # drafts are accepted, the test has teeth


@pytest.mark.slow
def test_hydra_dynamic_rejection_never_walks_into_an_unverified_node(toy_lm, tiny_hydra,
                                                                      walks_into_unverified):
    """Hydra's dynamic proposal marks the pool nodes it did not choose as unverified; even
    when the target puts almost all mass on such a node's token, rejection never accepts it
    (and does, for some rows, without the proposal's mask)."""
    CFG, TREE = toy_lm.CFG, toy_lm.TREE
    params, heads = tiny_hydra
    rows, tree = 128, DynamicTree(TREE, 2)
    hidden = jax.random.normal(jax.random.key(5), (rows, CFG.hidden_size))
    root = jnp.full((rows,), 3, jnp.int32)
    prop = jax.jit(lambda p, h, x, r: HydraDrafter().propose(p, h, x, r, tree))(
        params, heads, hidden[None], root)
    with_mask, without = walks_into_unverified(tree.pool, prop, toy_lm.V)
    assert not any(with_mask)
    assert any(without)


def test_hydra_artifact_round_trip_and_strict_load(toy_lm, tmp_path, tiny_hydra):
    V, CFG = toy_lm.V, toy_lm.CFG
    _, heads = tiny_hydra
    file = heads_formats.save_heads(tmp_path / "h", heads, CFG)
    loaded, meta = heads_formats.load_heads(tmp_path / "h", CFG)
    assert meta["kind"] == "hydra" and set(loaded) == set(hydra.NAMES)
    for n in hydra.NAMES:
        np.testing.assert_array_equal(np.asarray(loaded[n]), np.asarray(heads[n]))
    assert heads_lib.heads_config_of(loaded) == heads_lib.HeadsConfig(2, 2)
    # another backbone: hidden size / vocabulary named with the tensor
    wrong = CFG.__class__(**{**CFG.__dict__, "vocab_size": V + 1})
    with pytest.raises(ValueError, match=r"tensor proj has shape .* vocab 9"):
        heads_formats.load_heads(file, wrong)
    wrong = CFG.__class__(**{**CFG.__dict__, "hidden_size": 32, "head_dim": 16})
    with pytest.raises(ValueError, match=r"tensor in_w has shape .* hidden 32"):
        heads_formats.load_heads(file, wrong)
    # a half-written file
    cut = tmp_path / "cut" / "medusa_heads.safetensors"
    cut.parent.mkdir()
    cut.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        heads_formats.load_heads(cut, CFG)
    # a head reading a slot it must not
    bad = dict(heads, in_w=heads["in_w"].at[0, 2].set(1.0))
    heads_formats.save_heads(tmp_path / "bad", bad, CFG)
    with pytest.raises(ValueError, match="non-zero weights in input slots"):
        heads_formats.load_heads(tmp_path / "bad", CFG)
    # Medusa-only layouts refuse Hydra heads
    with pytest.raises(ValueError, match="Hydra heads; the vllm layout"):
        heads_formats.write(heads, "vllm", tmp_path / "v")


def test_hydra_bad_input_is_a_one_line_error(toy_lm, tiny_hydra):
    CFG, TREE, PROMPT = toy_lm.CFG, toy_lm.TREE, toy_lm.PROMPT
    params, heads = tiny_hydra
    tokens, lengths = pad_prompts([PROMPT])
    deep = Tree.from_paths([[0], [0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="depth 3 but there are only 2 Hydra heads"):
        medusa_generate(params, heads, CFG, tokens, lengths, jax.random.key(0), tree=deep,
                        max_new_tokens=4)
    with pytest.raises(ValueError, match="head_fn is a Medusa head function"):
        medusa_generate(params, heads, CFG, tokens, lengths, jax.random.key(0), tree=TREE,
                        max_new_tokens=4, head_fn=lambda h, x, n: None)
    with pytest.raises(ValueError, match="apply_heads computes Medusa heads"):
        heads_lib.apply_heads(heads, jnp.zeros((1, CFG.hidden_size)))


def test_medusa_load_detects_hydra_heads(stories):
    m = Medusa.load(heads=shipped_heads_dir("hydra"))
    assert hydra.is_hydra(m.heads) and m.drafter_kind == "hydra"
    assert m.tree("mc_sim_7b_63").depth == 4
    with pytest.raises(ValueError, match="depth 6 but there are only 5 Hydra heads"):
        m.tree(Tree.from_paths([[0] * d for d in range(1, 7)]))


def test_zankner_hydra_layout_round_trip_and_strict_read(toy_lm, tmp_path, tiny_hydra):
    V, CFG = toy_lm.V, toy_lm.CFG
    _, heads = tiny_hydra
    heads = jax.tree.map(np.asarray, heads)
    files = heads_formats.write(heads, "hydra", tmp_path / "z", base_model="tiny")
    names = {f.name for f in files}
    assert {"config.json", "hydra_lm_head.safetensors"} <= names
    # the reference's names and shapes: [out, in] with the path concatenated after h
    from safetensors.numpy import load_file

    t = load_file(str(tmp_path / "z" / "hydra_lm_head.safetensors"))
    assert t["hydra_mlp.1.0.linear.weight"].shape == (CFG.hidden_size, 3 * CFG.hidden_size)
    np.testing.assert_array_equal(t["hydra_mlp.1.0.linear.weight"][:, CFG.hidden_size:
                                                                   2 * CFG.hidden_size],
                                  heads["in_w"][1, 1].T)
    assert t["hydra_lm_head.0.bias"].shape == (V,)
    loaded, meta = heads_formats.load_heads(tmp_path / "z", CFG)
    assert meta["format"] == "hydra" and meta["kind"] == "hydra"
    for n in hydra.NAMES:
        np.testing.assert_allclose(np.asarray(loaded[n]), heads[n])
    # strict: a missing tensor, an unsupported architecture
    del t["hydra_lm_head.1.bias"]
    from safetensors.numpy import save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "z" / "config.json").read_text())
    save_file(t, str(bad / "hydra_lm_head.safetensors"))
    with pytest.raises(ValueError, match="missing tensor hydra_lm_head.1.bias"):
        heads_formats.load_heads(bad, CFG)
    (bad / "config.json").write_text('{"hydra_num_heads": 2, "hydra_num_layers": 2, '
                                     '"hydra_head_arch": "prefix-mlp"}')
    with pytest.raises(ValueError, match="prefix-mlp"):
        heads_formats.load_heads(bad, CFG)
    with pytest.raises(ValueError, match="these are Medusa heads"):
        heads_formats.write({"w": heads["w"], "b": heads["b"], "proj": heads["proj"]},
                            "hydra", tmp_path / "m")
