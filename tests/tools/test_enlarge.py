"""Enlarging a model (train.enlarge): the same function at a bigger shape, for the backbone
(every architecture, with and without the rotation), in transformers too, and for the heads,
Medusa, Hydra, EAGLE-3 and MTP (same drafts, same tokens, same tokens per step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.model.backbone import KVCache, causal_mask, forward, init_params
from medusa_jax.model.config import ModelConfig
from medusa_jax.tools import bench, enlarge

# from stories260K (hidden 64, MLP 172, 5 layers, 8 query / 4 KV heads, head_dim 8): every
# dimension grows, the KV grouping changes (2 -> 1 query heads per KV head), two identities
TINY = dict(model_type="llama", vocab_size=512, hidden_size=96, intermediate_size=256,
            num_layers=7, num_heads=12, num_kv_heads=12, head_dim=16,
            max_position_embeddings=512)
IDS = np.random.RandomState(0).randint(3, 512, (2, 11))


def _logits(cfg, params, ids=IDS):
    ids = jnp.asarray(ids)
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = KVCache.init(cfg, b, 16)
    return np.asarray(forward(params, cfg, ids, pos, causal_mask(cache.lengths, t, 16),
                              cache)[0])


def _grown(cfg, params, shape, rotate=None):
    dst, big = enlarge.enlarge_backbone(cfg, jax.tree.map(np.asarray, params), shape,
                                        rotate=rotate)
    return dst, jax.tree.map(jnp.asarray, big)


@pytest.mark.slow
@pytest.mark.parametrize("rotate", [None, 7])
def test_embedded_model_keeps_its_logits(stories, rotate):
    cfg, params, _ = stories
    dst, big = _grown(cfg, params, TINY, rotate)
    assert (dst.hidden_size, dst.num_layers, dst.head_dim) == (96, 7, 16)
    np.testing.assert_allclose(_logits(dst, big), _logits(cfg, params), atol=1e-4, rtol=0)
    # zero padding leaves every new residual dimension's row of a projection empty; the
    # rotation fills them (the new heads' and MLP channels' columns stay zero either way)
    lyr = {k: np.asarray(v)[:5] for k, v in big["layers"].items()}  # not the identities
    empty_rows = np.mean(np.all(lyr["wq"] == 0, axis=-1))  # rows: residual dims
    empty_cols = np.mean(np.all(lyr["w_down"] == 0, axis=-2))
    embed_zeros = np.mean(np.asarray(big["embed"]) == 0)
    if rotate is None:
        assert empty_rows == empty_cols == pytest.approx(1 - 64 / 96) and embed_zeros > 0.3
    else:
        assert empty_rows == empty_cols == 0 and embed_zeros < 0.01
        assert np.mean(np.asarray(big["lm_head"]) == 0) < 0.01 and not dst.tie_word_embeddings


ARCHS = {  # source config, target shape
    "llama-gqa-untied": (dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=False),
                         dict(num_heads=8, num_kv_heads=2, head_dim=16)),  # 2 -> 4 per KV
    "llama3-rope": (dict(rope_theta=500000.0, rope_scaling=("llama3", 8.0, 1.0, 4.0, 16)),
                    dict(num_heads=6, num_kv_heads=3, head_dim=24)),
    "qwen2-bias": (dict(model_type="qwen2", attention_bias=True),
                   dict(num_heads=4, num_kv_heads=4, head_dim=16)),
    "qwen3-qknorm": (dict(model_type="qwen3", qk_norm=True),  # H and D both x2
                     dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("rotate", [None, 1])
def test_every_architecture_keeps_its_logits(arch, rotate):
    src_over, dst_over = ARCHS[arch]
    cfg = ModelConfig(**{**dict(model_type="llama", vocab_size=61, hidden_size=32,
                                intermediate_size=48, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                                rms_norm_eps=1e-5), **src_over})
    params = init_params(cfg, jax.random.key(0), std=0.3)
    # norms away from one, so their scaling and folding are exercised
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: a * (1 + 0.5 * jax.random.uniform(jax.random.key(1), a.shape))
        if "norm" in jax.tree_util.keystr(p) else a, params)
    shape = {**dict(hidden_size=48, intermediate_size=64, num_layers=3), **dst_over}
    dst, big = _grown(cfg, params, shape, rotate)
    ids = np.random.RandomState(1).randint(0, 61, (2, 9))
    np.testing.assert_allclose(_logits(dst, big, ids), _logits(cfg, params, ids), atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize("shape, message", [
    (dict(TINY, hidden_size=32), "hidden size 32 is smaller than the source's 64"),
    (dict(TINY, head_dim=12), "head_dim 12 is not a multiple of the source's 8"),
    (dict(TINY, num_heads=16, num_kv_heads=2), "2 KV heads for the source's 4 KV groups"),
    (dict(TINY, num_heads=12, num_kv_heads=5), "12 query heads are not a multiple of its 5"),
])
def test_impossible_shapes_are_one_line_errors(stories, shape, message):
    with pytest.raises(enlarge.EnlargeError, match=message):
        enlarge.target_config(stories[0], shape)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The command's output for the embedded model and its heads, at the TINY shape."""
    from train.enlarge import main

    bench.SHAPES["tiny-test"] = TINY
    try:
        out = tmp_path_factory.mktemp("enlarged") / "model"
        assert main(["--shape", "tiny-test", "--output", str(out)]) == 0
    finally:
        del bench.SHAPES["tiny-test"]
    return out


@pytest.mark.slow
def test_transformers_reads_the_written_model_with_the_same_logits(stories, written):
    import torch
    from transformers import AutoModelForCausalLM

    cfg, params, _ = stories
    hf = AutoModelForCausalLM.from_pretrained(written, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = hf(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(ours, _logits(cfg, params), atol=1e-4, rtol=0)
    assert (written / "LICENSE").is_file() and (written / "tokenizer.json").is_file()


@pytest.mark.slow
def test_enlarged_model_and_heads_decode_the_same_tokens_per_step(written, medusa_default):
    """Plain greedy and Medusa greedy (the enlarged heads) give the original's tokens, and
    Medusa the same accepted lengths step by step."""
    from medusa_jax.api import Medusa

    prompts = ["Once upon a time", "Lily", "Tom had a red ball.", "The cat"]
    small = medusa_default  # Medusa.load(heads="default")
    big = Medusa.load(written, written / "heads")
    assert big.cfg.hidden_size == 96 and big.cfg.num_layers == 7
    assert big.default_tree == small.default_tree == "stories260K_cpu"  # the source's
    for medusa in (False, True):
        kw = dict(max_new_tokens=40, tree="stories260K_cpu", medusa=medusa)
        a, b = small.generate(prompts, **kw), big.generate(prompts, **kw)
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        assert [g.accept_hist for g in a] == [g.accept_hist for g in b]
        assert [g.steps for g in a] == [g.steps for g in b]
    assert sum(g.steps for g in b) < sum(g.new_tokens for g in b)  # the heads accept


def test_command_refuses_bad_input_before_any_work(tmp_path, written):
    from train.enlarge import main

    def error(*argv):
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        return str(e.value)

    assert "--shape 'nope' is unknown" in error("--shape", "nope", "--output", str(tmp_path / "a"))
    assert "exists and is not empty" in error("--shape", "llama-110m", "--output", str(written))
    assert "smaller than the source's" in error("--shape", "llama-15m", "--model",
                                                str(written), "--output", str(tmp_path / "b"))
    assert "cannot follow a rotation" in error("--shape", "llama-110m", "--heads", "default",
                                               "--rotate", "0", "--output", str(tmp_path / "c"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_enlarged_hydra_heads_draft_and_decode_as_the_source(noisy_hydra):
    """Random backbone + random Hydra heads, both enlarged: the same draft log-probabilities
    on a tree, and greedy Hydra decoding with the same tokens and the same steps."""
    from medusa_jax.decoding.decode import medusa_generate, pad_prompts
    from medusa_jax.decoding.tree import Tree
    from medusa_jax.drafters.hydra import heads as hydra

    cfg = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64, rms_norm_eps=1e-5)
    params = jax.jit(lambda k: init_params(cfg, k, std=0.3))(jax.random.key(0))
    # from the base model's output layer (so some drafts are accepted), then perturbed
    heads = jax.jit(lambda p: noisy_hydra(hydra.init_hydra(cfg, p, 3, 2), 0.2, 5))(params)
    dst, big = _grown(cfg, params, dict(hidden_size=48, intermediate_size=64, num_layers=3,
                                        num_heads=4, num_kv_heads=2, head_dim=16))
    big_heads = jax.tree.map(jnp.asarray, enlarge.enlarge_heads(
        jax.tree.map(np.asarray, heads), cfg, dst))
    hydra.check(big_heads, dst, "enlarged")  # shapes, unused input slots still zero

    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    hidden = jax.random.normal(jax.random.key(2), (3, 32))
    root = jnp.array([5, 17, 60])
    draft = jax.jit(lambda h, e, x: hydra.draft_tree(  # one compile per size, not per op
        h, e, x, root, tree.paths_ranks, tree.num_nodes, lambda lg, k: jax.lax.top_k(lg, k)[1]))
    small_tok, small_lp, _ = draft(heads, params["embed"], hidden)
    big_tok, big_lp, _ = draft(big_heads, big["embed"], jnp.pad(hidden, ((0, 0), (0, 16))))
    np.testing.assert_array_equal(big_tok, small_tok)
    np.testing.assert_allclose(big_lp, small_lp, atol=1e-5, rtol=0)

    tokens, lengths = pad_prompts([[1, 40, 3], [1, 9, 9, 20, 7]])
    a, b = (medusa_generate(p, h, c, tokens, lengths, jax.random.key(0), tree=tree,
                            max_new_tokens=24)
            for p, h, c in ((params, heads, cfg), (big, big_heads, dst)))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.steps, b.steps)
    assert int(np.sum(a.steps)) < int(np.sum(a.num_new))  # some drafts were accepted


@pytest.mark.slow
def test_enlarged_eagle3_drafter_drafts_and_decodes_as_the_source():
    """Random backbone + a random EAGLE-3 drafter (its layer shaped like the backbone's),
    both enlarged: the same tree drafted after prefill, the same draft log-probabilities, and
    greedy decoding with the same tokens and the same steps."""
    from medusa_jax.decoding import step
    from medusa_jax.decoding.decode import medusa_generate, pad_prompts
    from medusa_jax.decoding.sampling import Rows, Sampling
    from medusa_jax.decoding.tree import DynamicTree, Tree
    from medusa_jax.drafters.eagle3 import heads as eagle3
    from medusa_jax.drafters.eagle3.drafter import bind

    cfg = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64, rms_norm_eps=1e-5)
    params = jax.jit(lambda k: init_params(cfg, k, std=0.3))(jax.random.key(0))
    c = eagle3.default_config(cfg, 40, aux_layers=(0, 1, 2))
    heads = bind(jax.jit(lambda k: eagle3.init_eagle3(k, c, np.arange(61), std=0.3))(
        jax.random.key(4)), c, cfg)
    dst, big = _grown(cfg, params, dict(hidden_size=48, intermediate_size=64, num_layers=4,
                                        num_heads=8, num_kv_heads=2, head_dim=16))
    big_heads = jax.tree.map(jnp.asarray, enlarge.enlarge_heads(
        jax.tree.map(np.asarray, heads), cfg, dst))
    bc = big_heads.drafter.config
    eagle3.check(big_heads, dst, bc, "enlarged")
    assert (bc.hidden_size, bc.num_heads, bc.head_dim, bc.intermediate_size) == (48, 8, 16, 64)
    assert bc.aux_layers == c.aux_layers

    tree = DynamicTree(Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]), 4)
    tokens, lengths = pad_prompts([[1, 40, 3], [1, 9, 9, 20, 7]])

    def proposal(p, h, model_cfg):
        d = h.drafter
        s = step.start(p, model_cfg, tokens, lengths, jax.random.split(jax.random.key(0), 2),
                       Rows.of(Sampling(), 2, 8, ()), 32, d, h, width=4)
        prop = d.propose(p, h, s.draft, s.root, tree)
        logp = jax.nn.log_softmax(eagle3.draft_logits(h, d.config, s.draft.out), axis=-1)
        return prop.tokens, prop.valid, logp

    small = jax.jit(lambda p, h: proposal(p, h, cfg))(params, heads)
    large = jax.jit(lambda p, h: proposal(p, h, dst))(big, big_heads)
    np.testing.assert_array_equal(large[0], small[0])
    np.testing.assert_array_equal(large[1], small[1])
    np.testing.assert_allclose(large[2], small[2], atol=1e-4, rtol=0)

    a, b = (medusa_generate(p, h, m, tokens, lengths, jax.random.key(0), tree=tree,
                            max_new_tokens=24)
            for p, h, m in ((params, heads, cfg), (big, big_heads, dst)))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.steps, b.steps)
    assert int(np.sum(a.steps)) < int(np.sum(a.num_new))  # some drafts were accepted


@pytest.mark.slow
@pytest.mark.parametrize("style", ["deepseek", "mimo"])
def test_enlarged_mtp_modules_draft_and_decode_as_the_source(style):
    """Random backbone + two random MTP modules (the hidden half of eh_proj near the
    identity, so some drafts are accepted), both enlarged: the same tree drafted after
    prefill, every module's log-probabilities the same, and greedy decoding with the same
    tokens as plain decoding and the same steps as the source's (so the same drafts
    accepted), on a tree deeper than the modules (the last one reused)."""
    from medusa_jax.decoding import step
    from medusa_jax.decoding.decode import generate, medusa_generate, pad_prompts
    from medusa_jax.decoding.sampling import Rows, Sampling
    from medusa_jax.decoding.tree import Tree
    from medusa_jax.drafters.mtp import heads as mtp
    from medusa_jax.drafters.mtp.drafter import bind

    cfg = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64, rms_norm_eps=1e-5)
    params = jax.jit(lambda k: init_params(cfg, k, std=0.3))(jax.random.key(0))
    raw = mtp.init_mtp(jax.random.key(3), cfg, 2, std=0.05)
    half = slice(0, 32) if style == "mimo" else slice(32, 64)  # the hidden state's rows
    raw["eh_proj"] = raw["eh_proj"].at[:, half].add(jnp.eye(32))
    raw = {n: a * (1 + 0.5 * jax.random.uniform(jax.random.key(1), a.shape))
           if n.endswith("norm") else a for n, a in raw.items()}  # norms away from one
    heads = bind(raw, cfg, style)
    dst, big = _grown(cfg, params, dict(hidden_size=48, intermediate_size=64, num_layers=3,
                                        num_heads=8, num_kv_heads=2, head_dim=16))
    big_heads = enlarge.enlarge_heads(jax.tree.map(np.asarray, heads), cfg, dst)
    assert big_heads.drafter.model_cfg == dst and big_heads.drafter.style == style
    mtp.check(dict(big_heads), dst, "enlarged")
    big_heads = jax.tree.map(jnp.asarray, big_heads)

    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])
    tokens, lengths = pad_prompts([[1, 40, 3], [1, 9, 9, 20, 7]])

    def proposal(p, h, model_cfg):  # the drafted tree and each module's log-probabilities
        d = h.drafter
        s = step.start(p, model_cfg, tokens, lengths, jax.random.split(jax.random.key(0), 2),
                       Rows.of(Sampling(), 2, 8, ()), 32, d, h, width=5)
        prop = d.propose(p, h, s.draft, s.root, tree)
        logp = [jax.nn.log_softmax(mtp.logits(p, model_cfg, h, m, c.out), axis=-1)
                for m, c in enumerate(s.draft)]
        return prop.tokens, prop.valid, logp

    small = jax.jit(lambda p, h: proposal(p, h, cfg))(params, heads)
    large = jax.jit(lambda p, h: proposal(p, h, dst))(big, big_heads)
    np.testing.assert_array_equal(large[0], small[0])
    np.testing.assert_array_equal(large[1], small[1])
    np.testing.assert_allclose(large[2], small[2], atol=1e-4, rtol=0)

    plain = generate(params, cfg, tokens, lengths, jax.random.key(0), max_new_tokens=24)
    a, b = (medusa_generate(p, h, m, tokens, lengths, jax.random.key(0), tree=tree,
                            max_new_tokens=24)
            for p, h, m in ((params, heads, cfg), (big, big_heads, dst)))
    np.testing.assert_array_equal(a.tokens, plain.tokens)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.steps, a.steps)
    assert int(np.sum(a.steps)) < int(np.sum(a.num_new))  # some drafts were accepted


def test_the_enlarged_config_claims_no_mtp_layers(stories):
    """A source carrying its own MTP layers: the enlarged weights do not (the drafter goes
    to heads/), so its config.json must not declare them."""
    cfg = stories[0]
    out = enlarge.hf_config({"model_type": "llama", "num_nextn_predict_layers": 2}, cfg)
    assert "num_nextn_predict_layers" not in out and out["num_hidden_layers"] == cfg.num_layers
