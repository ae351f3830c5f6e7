"""The Gemma family (gemma, gemma2, gemma3_text) on tiny random configs: logit parity with
transformers' PyTorch models (prefill and cached decoding, ragged rows, contexts longer than
the sliding window; the residual stream at chosen layers), greedy Medusa == plain greedy with prompts longer than the window,
rejection sampling lossless, tensor-parallel decoding == one device, strict config, weight
and heads errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GemmaConfig

from medusa_jax import api
from medusa_jax.decoding.acceptance import Sampling
from medusa_jax.decoding.decode import generate, medusa_generate, pad_prompts
from medusa_jax.decoding.tree import Tree
from medusa_jax.drafters.formats import load_heads, save_heads
from medusa_jax.drafters.medusa.heads import HeadsConfig, init_heads
from medusa_jax.model.backbone import (
    KVCache,
    causal_mask,
    decoding_layout,
    forward,
    layer_kinds,
    param_shapes,
)
from medusa_jax.model.config import ModelConfig
from medusa_jax.model.weights import WeightsError, load_pretrained
from medusa_jax.runtime import sharding

V, WINDOW, TOTAL = 97, 4, 13
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256)
ARCHS = {
    # multi-query attention (one KV head), tied output layer
    "gemma": lambda: GemmaConfig(**{**SMALL, "num_key_value_heads": 1}),
    # scores and logits soft-capped hard enough to matter; local, global, local
    "gemma2": lambda: Gemma2Config(**SMALL, sliding_window=WINDOW, query_pre_attn_scalar=12,
                                   attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
    # q/k norms, local rope base, linear rope scaling on the global layer
    "gemma3_text": lambda: Gemma3TextConfig(
        **SMALL, sliding_window=WINDOW, query_pre_attn_scalar=20, final_logit_softcapping=4.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=1000.0,
        rope_local_base_freq=50.0),
}


def _np_params(cfg, seed, std):
    """Random backbone from numpy (no per-shape compile of jax's eager RNG): norms at one."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, shape: np.zeros(shape, np.float32) if "norm" in jax.tree_util.keystr(path)
        else (std * rng.standard_normal(shape)).astype(np.float32),
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def _np_heads(cfg, params, k, seed, std):
    """Medusa heads as `init_heads` makes them (zero blocks, copies of the tied output
    layer), plus noise."""
    rng = np.random.default_rng(seed)
    h, v = cfg.hidden_size, cfg.vocab_size
    proj = np.broadcast_to(np.asarray(params["embed"]).T, (k, h, v))
    return {"w": std * rng.standard_normal((k, 1, h, h)).astype(np.float32),
            "b": std * rng.standard_normal((k, 1, h)).astype(np.float32),
            "proj": (proj + std * rng.standard_normal((k, h, v))).astype(np.float32)}


def _hf_model(arch, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(ARCHS[arch]()).eval()
    with torch.no_grad():  # non-trivial norms, large enough weights for the caps to bite
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(5.0)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{arch: (HF model, folder, cfg, params)}."""
    out = {}
    for arch in ARCHS:
        model = _hf_model(arch)
        folder = tmp_path_factory.mktemp(arch)
        model.save_pretrained(folder)
        cfg, params = load_pretrained(folder)
        out[arch] = (model, folder, cfg, params)
    return out


def _hf_logits(model, ids, lens=None):
    attn = None if lens is None else torch.tensor(
        [[1] * n + [0] * (ids.shape[1] - n) for n in lens])
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=attn).logits.numpy()


# one compile per config and layout (eager dispatch of a whole decoder costs more)
_forward = jax.jit(forward, static_argnums=(1,), static_argnames=("empty_cache",))


def _prefill(cfg, params, ids, capacity, per_layer=False, empty=True):
    b, t = ids.shape
    cache = KVCache.init(cfg, b, capacity, per_layer=per_layer)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _, cache = _forward(params, cfg, jnp.asarray(ids), pos,
                                causal_mask(cache.lengths, t, capacity), cache,
                                empty_cache=empty)
    return np.asarray(logits), cache


@pytest.mark.parametrize("arch", list(ARCHS))
def test_config_reads_the_architecture(models, arch):
    cfg = models[arch][2]
    assert cfg.tie_word_embeddings and cfg.embed_scale and cfg.norm_offset == 1.0
    assert cfg.hidden_act == "gelu_tanh" and cfg.head_dim == 16
    if arch == "gemma":
        assert cfg.num_kv_heads == 1 and not cfg.sandwich_norms and not cfg.layer_windows
    else:
        assert cfg.sandwich_norms and layer_kinds(cfg) == (WINDOW, None, WINDOW)
    if arch == "gemma2":
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.query_scale) == (3.0, 5.0, 12 ** -0.5)
    if arch == "gemma3_text":
        assert cfg.qk_norm and cfg.rope_scaling == ("linear", 4.0)
        assert (cfg.rope_theta, cfg.local_rope_theta) == (1000.0, 50.0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_logit_parity_with_ragged_rows(models, arch):
    """Two right-padded prompts (13 and 7 tokens, window 4), both layouts; dropping the
    windows breaks parity (so they are tested)."""
    model, _, cfg, params = models[arch]
    lens = [TOTAL, 7]
    ids = np.random.RandomState(1).randint(0, V, (2, TOTAL))
    ref = _hf_logits(model, ids, lens)
    fast = decoding_layout(cfg, params)
    runs = {"stacked": _prefill(cfg, params, ids, 16)[0],
            "per-layer": _prefill(cfg, fast, ids, 16, per_layer=True)[0]}
    for name, ours in runs.items():
        for row, n in enumerate(lens):
            np.testing.assert_allclose(ours[row, :n], ref[row, :n], atol=1e-4, rtol=0,
                                       err_msg=name)
    if arch == "gemma2":
        no_window = _prefill(cfg.replace(layer_windows=()), params, ids, 16)[0]
        assert np.abs(no_window[0] - ref[0]).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_cached_decoding_matches_transformers_past_the_window(models, arch):
    """Prefill 5 and 3 tokens, then one token a step (rows at different lengths), per-layer
    and stacked caches: each step's logits are transformers' full-sequence ones."""
    model, _, cfg, params = models[arch]
    ids = np.random.RandomState(2).randint(0, V, (2, TOTAL))
    ref = _hf_logits(model, ids)
    fast = decoding_layout(cfg, params)
    prompt = [5, 3]
    for p, per_layer in ((params, False), (fast, True)):
        # the prefill test's compiled shapes; slots past `prompt` are stale, masked, rewritten
        _, cache = _prefill(cfg, p, ids, 16, per_layer=per_layer)
        cache = cache.replace(lengths=jnp.asarray(prompt))
        for _ in range(TOTAL - 5):
            lengths = np.asarray(cache.lengths)
            tok = jnp.asarray(ids[np.arange(2), lengths])[:, None]
            logits, _, cache = _forward(p, cfg, tok, cache.lengths[:, None],
                                        causal_mask(cache.lengths, 1, 16), cache)
            for row in range(2):
                np.testing.assert_allclose(np.asarray(logits[row, 0]), ref[row, lengths[row]],
                                           atol=1e-4, rtol=0)
            cache = cache.advance(jnp.ones(2, jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma", "gemma2"])
def test_aux_layers_are_transformers_hidden_states(models, arch):
    """The inputs of layers (2, 0) (layer 0's: the scaled embedding) are transformers'
    `hidden_states[i]`, past the window: a prefill and one cached step, stacked layout
    (gemma2: the scan that picks each layer's window) and decoding layout."""
    model, _, cfg, params = models[arch]
    aux_layers, prompt, cap = (2, 0), [9, 6], 16
    ids = np.random.RandomState(4).randint(0, V, (2, TOTAL))
    with torch.no_grad():  # causal: position p's states depend on ids[:p + 1] only
        states = model(input_ids=torch.tensor(ids), output_hidden_states=True).hidden_states
    ref = np.concatenate([states[i].numpy() for i in aux_layers], axis=-1)  # [B, T, 2H]
    run = jax.jit(lambda p, t, pos, m, c, empty: forward(
        p, cfg, t, pos, m, c, empty_cache=empty, aux_layers=aux_layers), static_argnames="empty")
    t = max(prompt)
    for name, p in (("stacked", params), ("decoding", decoding_layout(cfg, params))):
        cache = KVCache.init(cfg, 2, cap, per_layer=name == "decoding")
        pos = jnp.broadcast_to(jnp.arange(t), (2, t))
        _, _, cache, aux = run(p, jnp.asarray(ids[:, :t]), pos,
                               causal_mask(cache.lengths, t, cap), cache, empty=True)
        np.testing.assert_allclose(np.asarray(aux), ref[:, :t], atol=1e-4, rtol=0,
                                   err_msg=name)
        cache = cache.replace(lengths=jnp.asarray(prompt))  # slots past a row's length: stale
        tok = jnp.asarray(ids[np.arange(2), prompt])[:, None]
        _, _, _, aux = run(p, tok, cache.lengths[:, None], causal_mask(cache.lengths, 1, cap),
                           cache, empty=False)
        np.testing.assert_allclose(np.asarray(aux[:, 0]), ref[np.arange(2), prompt],
                                   atol=1e-4, rtol=0, err_msg=f"{name} step")


# ----------------------------------------------------------------------------- Medusa

TREE = Tree.load("mc_sim_7b_63:8")  # 9 nodes, depth 3
NEW = 12
MEDUSA_WINDOW = 2  # < the tree's depth: a deep node sees only some of its own ancestors


def _medusa_cfg(models, arch):
    """The parity-tested model with a window narrower than the tree is deep, so the tree
    keys' positions (their depth, not their slot) decide what a local layer sees."""
    _, _, cfg, params = models[arch]
    kinds = tuple(None if w is None else MEDUSA_WINDOW for w in layer_kinds(cfg))
    return cfg.replace(layer_windows=kinds), params
PROMPTS = [[5, 17, 3, 44, 2, 9, 61], [8, 30, 71, 12, 4, 90, 33, 21, 6, 15], [40, 7, 19, 55, 26]]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["stacked", "per-layer"])
def test_tree_verification_sees_each_layers_window(models, layout):
    """One tree pass after a prefix (Gemma 3, window 2 < the tree's depth): every node's
    logits are those of a plain causal pass over prefix + its root-to-node path. So the
    tree mask combines with each local layer's window by position (depth), not by slot."""
    from medusa_jax.model.backbone import forward_scratch, tree_mask_after_prefix

    _scratch = jax.jit(forward_scratch, static_argnums=(1,))
    cfg, params = _medusa_cfg(models, "gemma3_text")
    p = params if layout == "stacked" else decoding_layout(cfg, params)
    per_layer = layout == "per-layer"
    rng = np.random.RandomState(5)
    # node 6 ([2, 0, 0], depth 3) has ancestor node 3 ([2], depth 1): 2 apart by position,
    # outside the window; counted by slot (6 - 3 against position 3) it would be inside
    tree = Tree.from_paths([[0], [1], [2], [0, 0], [2, 0], [2, 0, 0], [2, 0, 1]])
    prefix, n = 7, tree.num_nodes
    ids = rng.randint(0, V, prefix)
    node_tok = rng.randint(0, V, n)
    depth, mask = np.asarray(tree.node_depth), np.asarray(tree.mask)
    # the reference: one causal row per node, prefix + its root-to-node path (right-padded)
    rows = np.zeros((n, prefix + tree.depth + 1), np.int64)
    for i in range(n):
        path = sorted(np.flatnonzero(mask[i]), key=lambda j: depth[j])
        rows[i, :prefix] = ids
        rows[i, prefix: prefix + len(path)] = node_tok[path]
    ref, cache = _prefill(cfg, p, rows, 16, per_layer=per_layer)
    want = ref[np.arange(n), prefix + depth]
    # the tree pass, as decode.verify runs it, on that cache cut back to the prefix (each
    # row verifies the whole tree; the slots past the prefix are rewritten by it)
    cache = cache.replace(lengths=jnp.full((n,), prefix, jnp.int32))
    fed = jnp.broadcast_to(jnp.asarray(node_tok), (n, n))
    logits = _scratch(p, cfg, fed, jnp.broadcast_to(jnp.asarray(prefix + depth), (n, n)),
                      tree_mask_after_prefix(cache.lengths, jnp.asarray(mask), 16), cache)[0]
    np.testing.assert_allclose(np.asarray(logits)[np.arange(n), np.arange(n)], want,
                               atol=1e-4, rtol=0)


def _rows(out):
    out = sharding.to_host(out)
    return [out.tokens[i, : int(out.num_new[i])].tolist() for i in range(len(out.num_new))]


def _noisy_oracle(prompts, plain, seed):
    """Head k proposes the plain greedy token k+1 ahead, or a random one (30% of entries): a
    mix of full, partial and no acceptance."""
    rng = np.random.default_rng(seed)
    width = max(len(p) for p in prompts) + NEW + 16
    table = rng.integers(0, V, (len(prompts), width))
    for i, (p, new) in enumerate(zip(prompts, plain)):
        seq = np.array(p + new)
        keep = rng.random(len(seq)) > 0.3
        table[i, : len(seq)] = np.where(keep, seq, table[i, : len(seq)])
    return {"table": jnp.asarray(table, jnp.int32), "k": jnp.zeros(TREE.depth)}


def _table_head_fn(heads, hidden, lengths):
    k = heads["k"].shape[0]
    idx = lengths[None, :] + jnp.arange(1, k + 1)[:, None]  # [K, B]
    truth = jnp.take_along_axis(heads["table"][None], idx[..., None], axis=2)[..., 0]
    return 10.0 * jax.nn.one_hot(truth, V)


@pytest.fixture(scope="module")
def greedy(models):
    """{arch: plain greedy rows} in the decoding layout (what the API runs); the per-step
    logits these come from are transformers' (the cached-decoding test)."""
    out = {}
    tokens, lengths = pad_prompts(PROMPTS)
    for arch in ("gemma2", "gemma3_text"):
        cfg, params = _medusa_cfg(models, arch)
        out[arch] = _rows(generate(decoding_layout(cfg, params), cfg, tokens, lengths,
                                   jax.random.key(0), max_new_tokens=NEW))
    return out


@pytest.mark.slow
def test_greedy_medusa_equals_plain_greedy_past_the_window(models, greedy):
    """Gemma 2 in the decoding layout (per-layer cache, what the API runs); Gemma 3's Medusa
    runs in the tensor-parallel test below (stacked layout)."""
    arch = "gemma2"
    cfg, params = _medusa_cfg(models, arch)
    fast = decoding_layout(cfg, params)
    heads = _noisy_oracle(PROMPTS, greedy[arch], seed=3)
    tokens, lengths = pad_prompts(PROMPTS)
    out = medusa_generate(fast, heads, cfg, tokens, lengths, jax.random.key(0), tree=TREE,
                          max_new_tokens=NEW, head_fn=_table_head_fn)
    assert _rows(out) == greedy[arch]
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0 and hist[1] > 0  # multi-token steps and single-token ones


@pytest.mark.slow
def test_tensor_parallel_medusa_equals_one_device_plain_greedy(models, greedy):
    """Gemma 3 (local and global layers in one scan; heads, KV heads and MLP split) on
    model=2: greedy Medusa gives the tokens of plain greedy on one device (decoding layout),
    prompts past the window."""
    cfg, params = _medusa_cfg(models, "gemma3_text")
    heads = _noisy_oracle(PROMPTS, greedy["gemma3_text"], seed=4)
    tokens, lengths = pad_prompts(PROMPTS)
    mesh = sharding.make_mesh("model=2")
    sp, _ = api.shard_for_decoding(cfg, params, None, mesh)
    assert sp["layers"]["wq"].sharding.spec[-1] == "model"
    with jax.set_mesh(mesh):
        out = medusa_generate(sp, heads, cfg, tokens, lengths, jax.random.key(0), tree=TREE,
                              max_new_tokens=NEW, head_fn=_table_head_fn)
    assert _rows(out) == greedy["gemma3_text"]
    hist = np.asarray(sharding.to_host(out.accept_hist)).sum(0)
    assert hist[2:].sum() > 0


@pytest.mark.slow
def test_rejection_sampling_is_lossless_on_gemma2(chi_square_ok):
    """A vocabulary of 8, window 2, a 3-token prompt: the (x1, x2) pairs Medusa's rejection
    sampling emits follow plain sampling's exact distribution (chi-square)."""
    v, rows = 8, 10000
    cfg = ModelConfig(model_type="gemma2", vocab_size=v, hidden_size=16, intermediate_size=24,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                      max_position_embeddings=64, tie_word_embeddings=True,
                      hidden_act="gelu_tanh", norm_offset=1.0, embed_scale=True,
                      sandwich_norms=True, query_scale=0.3, attn_softcap=2.0,
                      final_softcap=3.0, layer_windows=(2, None))
    params = _np_params(cfg, 0, std=0.6)
    heads = _np_heads(cfg, params, 2, 1, std=0.3)
    prompt, tree = [1, 3, 5], Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    sampling = Sampling(mode="rejection", temperature=1.0)

    # P(x1, x2) of plain sampling, [V, V], from one pass over prompt + [x] for every x (its
    # logits at the prompt's last position are those after the prompt alone)
    logits, _ = _prefill(cfg, params, np.array([prompt + [x] for x in range(v)]), 4)
    probs = np.exp(np.asarray(jax.nn.log_softmax(logits), np.float64))
    exact = probs[0, 2][:, None] * probs[:, 3]
    tokens, lengths = pad_prompts([prompt] * rows)
    out = medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(42), tree=tree,
                          sampling=sampling, max_new_tokens=3)
    toks = np.asarray(out.tokens)
    assert np.all(np.asarray(out.num_new) >= 2)
    counts = np.zeros((v, v))
    np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    ok, ratio = chi_square_ok(counts.ravel(), exact.ravel())
    assert ok, f"rejection sampling is not lossless on Gemma 2: chi2/critical = {ratio:.2f}"
    hist = np.asarray(out.accept_hist).sum(0)
    assert hist[2:].sum() > 0.1 * hist.sum()  # the tree really was used


# ----------------------------------------------------------------------------- errors


def _write_config(folder, **changes):
    conf = json.loads((folder / "config.json").read_text())
    conf.update(changes)
    (folder / "config.json").write_text(json.dumps(conf))


@pytest.mark.parametrize("change, needles", [
    (dict(hidden_activation="relu"), ("hidden_activation 'relu' is not supported",)),
    (dict(use_bidirectional_attention=True), ("use_bidirectional_attention=true",)),
    (dict(attention_bias=True), ("attention_bias=true is not supported for gemma2",)),
    (dict(layer_types=["sliding_attention"]), ("layer_types must list 3",)),
    (dict(layer_types=["chunked_attention"] * 3), ("layer type 'chunked_attention'",)),
    (dict(final_logit_softcapping="big"), ("final_logit_softcapping='big'",)),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), ("rope type 'yarn'",)),
])
def test_unsupported_config_values_are_one_line_errors(models, tmp_path, change, needles,
                                                        one_line_error):
    import shutil

    shutil.copytree(models["gemma2"][1], tmp_path, dirs_exist_ok=True)
    _write_config(tmp_path, **change)
    one_line_error(ValueError, lambda: load_pretrained(tmp_path), tmp_path / "config.json",
                   *needles)


def test_defaults_are_transformers_class_defaults():
    """A config.json that leaves fields out reads them as transformers' classes do."""
    for cls, mt in ((GemmaConfig, "gemma"), (Gemma2Config, "gemma2"),
                    (Gemma3TextConfig, "gemma3_text")):
        hf, ours = cls(), ModelConfig.from_hf_dict({"model_type": mt})
        assert (ours.vocab_size, ours.hidden_size, ours.num_layers, ours.num_heads,
                ours.num_kv_heads, ours.head_dim, ours.max_position_embeddings) == (
            hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads,
            hf.num_key_value_heads, hf.head_dim, hf.max_position_embeddings), mt
        kinds = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
        assert [w is not None for w in layer_kinds(ours)] == \
            [t == "sliding_attention" for t in kinds], mt
    # a multimodal Gemma 3 config reads as its text_config
    g3 = ModelConfig.from_hf_dict({"model_type": "gemma3", "eos_token_id": [1, 106],
                                   "text_config": {"hidden_size": 2560, "num_hidden_layers": 34,
                                                   "sliding_window": 1024}})
    assert (g3.model_type, g3.hidden_size, g3.eos_token_id, g3.sliding_window) == (
        "gemma3_text", 2560, (1, 106), 1024)


def test_strict_loading_names_the_missing_or_misshapen_tensor(models, tmp_path, one_line_error):
    from safetensors.numpy import load_file, save_file

    src = models["gemma3_text"][1]
    tensors = load_file(str(src / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    missing = {k: v for k, v in tensors.items()
               if k != "model.layers.1.post_feedforward_layernorm.weight"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    one_line_error(WeightsError, lambda: load_pretrained(tmp_path),
              "missing tensor model.layers.1.post_feedforward_layernorm.weight")
    bad = dict(tensors, **{"model.layers.2.self_attn.q_norm.weight": np.zeros(8, np.float32)})
    save_file(bad, str(tmp_path / "model.safetensors"))
    one_line_error(WeightsError, lambda: load_pretrained(tmp_path),
              "tensor model.layers.2.self_attn.q_norm.weight has shape (8,), expected (16,)")
    # Gemma 1 has no pre-feedforward norm: a Gemma 2 layer's tensors are refused by name
    _write_config(tmp_path, **json.loads((models["gemma"][1] / "config.json").read_text()))
    save_file(load_file(str(models["gemma2"][1] / "model.safetensors")),
              str(tmp_path / "model.safetensors"))
    one_line_error(WeightsError, lambda: load_pretrained(tmp_path), "unexpected tensor",
              "post_feedforward_layernorm")


def test_multimodal_gemma3_folder_loads_its_language_model(models, tmp_path):
    """A `gemma3` folder: text_config, tensors under model.language_model., a vision tower
    that is not read; the same parameters as the text-only folder."""
    from safetensors.numpy import load_file, save_file

    _, src, cfg, params = models["gemma3_text"]
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {"model.language_model." + k[len("model."):]: v for k, v in tensors.items()}
    renamed["model.vision_tower.vision_model.post_layernorm.weight"] = np.ones(4, np.float32)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    text = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]}))
    cfg2, params2 = load_pretrained(tmp_path)
    assert cfg2.replace(eos_token_id=cfg.eos_token_id) == cfg
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), params,
                                            params2)))


def test_heads_with_the_wrong_sizes_are_refused_for_a_gemma_backbone(models, tmp_path):
    from medusa_jax.drafters import formats as heads_formats

    cfg, params = models["gemma2"][2:]
    heads = init_heads(cfg, params, HeadsConfig(num_heads=2))
    save_heads(tmp_path / "ok", heads, cfg)
    assert load_heads(tmp_path / "ok", cfg)[0]["proj"].shape == (2, 32, V)
    other = cfg.replace(vocab_size=V + 3, hidden_size=48)
    wrong = _np_heads(other, _np_params(other, 0, 0.02), 2, 0, 0.0)
    save_heads(tmp_path / "native", wrong, other)
    heads_formats.write_reference(wrong, tmp_path / "reference")
    heads_formats.write_vllm(wrong, tmp_path / "vllm")
    for layout in ("native", "reference", "vllm"):
        with pytest.raises(ValueError) as e:
            load_heads(tmp_path / layout, cfg)
        msg = str(e.value)
        assert "\n" not in msg and ("32" in msg and ("48" in msg or str(V) in msg)), msg
