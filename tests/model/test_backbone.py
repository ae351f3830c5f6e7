"""Backbone parity with transformers' PyTorch models (logits, and the residual stream at
chosen layers: `aux_layers`), and KV-cache consistency."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from medusa_jax.model.backbone import KVCache, causal_mask, forward, init_params
from medusa_jax.model.config import ModelConfig
from medusa_jax.model.weights import default_model_dir, load_pretrained

SMALL = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 500000.0}
ARCHS = {  # keyword arguments override SMALL's
    "llama-gqa-untied": lambda **kw: LlamaConfig(**{**SMALL, **kw}, tie_word_embeddings=False),
    "llama-tied": lambda **kw: LlamaConfig(**{**SMALL, **kw}, tie_word_embeddings=True),
    "llama3-rope-headdim": lambda **kw: LlamaConfig(**{**SMALL, **kw}, head_dim=16,
                                                    rope_scaling=LLAMA3_ROPE),
    "mistral": lambda **kw: MistralConfig(**{**SMALL, **kw}, sliding_window=None),
    "qwen2-bias": lambda **kw: Qwen2Config(**{**SMALL, **kw}, tie_word_embeddings=False),
    "qwen3-qknorm": lambda **kw: Qwen3Config(**{**SMALL, **kw}, head_dim=12,
                                             tie_word_embeddings=False),
}


def _run_ours(cfg, params, ids, capacity=None):
    b, t = ids.shape
    capacity = capacity or t
    cache = KVCache.init(cfg, b, capacity)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, hidden, cache = forward(params, cfg, jnp.asarray(ids), pos,
                                    causal_mask(cache.lengths, t, capacity), cache)
    return np.asarray(logits), cache


def _hf_and_ours(arch, folder, **config):
    """A random transformers model of `arch` (SMALL overridden by `config`) with
    non-trivial norms and biases, so a dropped one shows, and (cfg, params) loaded from it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ARCHS[arch](**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model, *load_pretrained(folder)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logit_parity_with_transformers(arch, tmp_path):
    model, cfg, params = _hf_and_ours(arch, tmp_path)
    if arch == "qwen2-bias":
        assert cfg.attention_bias
    if arch == "qwen3-qknorm":
        assert cfg.qk_norm and cfg.head_dim == 12
    if arch.startswith("llama3"):
        assert cfg.rope_scaling[0] == "llama3"

    lens = [13, 7]  # two prompts, the second right-padded
    ids = np.random.RandomState(1).randint(0, SMALL["vocab_size"], (2, max(lens)))
    attn = np.array([[1] * n + [0] * (max(lens) - n) for n in lens])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(attn)).logits.numpy()
    ours, _ = _run_ours(cfg, params, ids)
    for row, n in enumerate(lens):
        np.testing.assert_allclose(ours[row, :n], ref[row, :n], atol=1e-4, rtol=0)


def test_stories260k_logit_parity(stories):
    cfg, params, tok = stories
    model = AutoModelForCausalLM.from_pretrained(default_model_dir()).eval()
    ids = np.array([tok.encode("Once upon a time, there was a big dog named Max. He liked")])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).logits.numpy()
    ours, _ = _run_ours(cfg, params, ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("narrow", [False, True], ids=["whole-cache", "window"])
def test_cache_decoding_matches_full_forward_with_ragged_rows(narrow):
    """narrow: each call's mask covers only the cache slots up to its last new token (the
    decoding loops' attention window), not the whole cache."""
    cfg = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    total, cap = 20, 32
    ids = np.random.RandomState(0).randint(0, 61, (2, total))
    full, _ = _run_ours(cfg, params, ids, capacity=cap)

    # prefill 5 tokens, then feed row 0 one token at a time and row 1 three at a time
    cache = KVCache.init(cfg, 2, cap)
    step = jax.jit(lambda p, toks, pos, mask, c: forward(p, cfg, toks, pos, mask, c))
    prefill = 5
    pos = jnp.broadcast_to(jnp.arange(prefill), (2, prefill))
    logits, _, cache = step(params, jnp.asarray(ids[:, :prefill]), pos,
                            causal_mask(cache.lengths, prefill, cap), cache)
    cache = cache.advance(jnp.array([prefill, prefill]))
    got = {0: [np.asarray(logits[0])], 1: [np.asarray(logits[1])]}
    # both rows feed 3 tokens per call; row 0 keeps only the first (advances by 1),
    # row 1 keeps all three: rows advance by different amounts in the same batch
    while int(cache.lengths[1]) + 3 <= total:
        lengths = np.asarray(cache.lengths)
        toks = np.stack([ids[r, lengths[r]:lengths[r] + 3] for r in range(2)])
        pos = jnp.asarray(lengths)[:, None] + jnp.arange(3)[None]
        width = int(lengths.max()) + 3 if narrow else cap
        logits, _, cache = step(params, jnp.asarray(toks), pos,
                                causal_mask(cache.lengths, 3, width), cache)
        got[0].append(np.asarray(logits[0, :1]))
        got[1].append(np.asarray(logits[1]))
        cache = cache.advance(jnp.array([1, 3]))
    for row in range(2):
        seq = np.concatenate(got[row])
        np.testing.assert_allclose(seq, full[row, : len(seq)], atol=1e-5, rtol=0)
    assert int(cache.lengths[0]) != int(cache.lengths[1])


@pytest.mark.slow
def test_bfloat16_compute_runs_and_stays_close(stories):
    cfg, params, tok = stories
    ids = np.array([tok.encode("Once upon a time, there was a little girl")])
    ref, _ = _run_ours(cfg, params, ids)
    cfg16, params16 = load_pretrained(param_dtype="bfloat16", compute_dtype="bfloat16")
    assert params16["embed"].dtype == jnp.bfloat16
    low, _ = _run_ours(cfg16, params16, ids)
    assert np.abs(low - ref).max() < 0.5
    assert (low.argmax(-1) == ref.argmax(-1)).mean() > 0.8


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: llama"):
        load_pretrained(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "deep"])
def test_decoding_layout_gives_the_same_logits_and_round_trips(arch, tmp_path):
    """The decoding layout (per-layer weights, fused q/k/v and gate/up) of a model of any
    depth computes the same function, `standard_layout` restores every parameter exactly,
    and loading a checkpoint straight into it gives the same arrays."""
    from medusa_jax.model.backbone import decoding_layout, param_shapes, standard_layout

    layers = 13 if arch == "deep" else 2
    cfg = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64, attention_bias=arch == "qwen2")
    params = init_params(cfg, jax.random.key(0), std=0.2)
    fast = decoding_layout(cfg, params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(fast)[0]]
    assert any("'wqkv'" in p for p in paths) and not any("'wq'" in p for p in paths)
    assert isinstance(fast["layers"], tuple) and len(fast["layers"]) == layers
    if arch == "deep":  # the same layout read straight from a checkpoint
        from medusa_jax.model.weights import save_pretrained

        save_pretrained(cfg, params, tmp_path)
        (tmp_path / "config.json").write_text(json.dumps(dict(
            model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=64, rms_norm_eps=cfg.rms_norm_eps,
            tie_word_embeddings=cfg.tie_word_embeddings)))
        loaded = load_pretrained(tmp_path, decoding_layout=True)[1]
        assert jax.tree.structure(loaded) == jax.tree.structure(fast)
        assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)),
                                                loaded, fast)))
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 61, (2, 7)))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))

    def logits(p):
        cache = KVCache.init(cfg, 2, 16)
        return forward(p, cfg, ids, pos, causal_mask(cache.lengths, 7, 16), cache)[0]

    np.testing.assert_allclose(logits(fast), logits(params), atol=2e-5, rtol=0)
    back = standard_layout(cfg, fast)
    assert jax.tree.map(jnp.shape, back) == param_shapes(cfg)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), back, params)))


@pytest.mark.slow
@pytest.mark.parametrize("tied, big", [(True, False), (True, True), (False, False)],
                         ids=["small-tied", "large-tied", "untied"])
def test_a_small_tied_embedding_gets_a_contiguous_output_layer_on_the_cpu(
        tied, big, monkeypatch):
    """The decoding layout on the CPU keeps a small tied embedding's output layer also as a
    contiguous [H, V] copy, which a tree pass's logits read; the logits are those of the
    embedding itself, `standard_layout` drops the copy, and a large or untied output layer
    gets none."""
    from medusa_jax.kernels import fewrow
    from medusa_jax.model.backbone import (CPU_OUTPUT, decoding_layout, standard_layout,
                                           without_cpu_output)

    if big:  # as if the embedding were larger than the kernel's threshold
        monkeypatch.setattr(fewrow, "MIN_BYTES", 64)
    cfg = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64, tie_word_embeddings=tied)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    fast = decoding_layout(cfg, params, cpu_kernels=False)
    assert (CPU_OUTPUT in fast) == (tied and not big)
    assert CPU_OUTPUT not in standard_layout(cfg, fast)
    if CPU_OUTPUT not in fast:
        return
    np.testing.assert_array_equal(fast[CPU_OUTPUT], params["embed"].T)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 61, (2, 5)))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))

    def logits(p):
        cache = KVCache.init(cfg, 2, 16, per_layer=True)
        return forward(p, cfg, ids, pos, causal_mask(cache.lengths, 5, 16), cache)[0]

    np.testing.assert_allclose(logits(fast), logits(without_cpu_output(fast)),
                               atol=1e-5, rtol=0)


@pytest.mark.slow
def test_per_layer_cache_gives_the_same_logits_and_entries():
    """The decoding layout's per-layer cache (written before it is read) against the stacked
    cache: rows at different lengths, a second pass over a window narrower than the cache,
    the same logits and the same keys/values in every slot that was written."""
    from medusa_jax.model.backbone import decoding_layout, forward_scratch

    cfg = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    fast = decoding_layout(cfg, params)
    rng = np.random.RandomState(0)
    caches = {"stacked": KVCache.init(cfg, 2, 32),
              "per-layer": KVCache.init(cfg, 2, 32, per_layer=True)}
    lengths = jnp.asarray([5, 9])
    first = jnp.asarray(rng.randint(0, 61, (2, 9)))
    second = jnp.asarray(rng.randint(0, 61, (2, 3)))
    out = {}
    for name, cache in caches.items():
        p = params if name == "stacked" else fast
        pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
        _, _, cache = forward(p, cfg, first, pos, causal_mask(cache.lengths, 9, 32), cache,
                              empty_cache=True)
        cache = cache.replace(lengths=lengths)
        pos2 = lengths[:, None] + jnp.arange(3)[None]
        logits, _, (k_new, _), cache = forward_scratch(
            p, cfg, second, pos2, causal_mask(cache.lengths, 3, 16), cache)  # window 16 < 32
        k = jnp.stack(cache.k) if name == "per-layer" else cache.k
        out[name] = (np.asarray(logits), np.asarray(k_new), np.asarray(k).reshape(3, 2, 2, 32, 8))
    for a, b in zip(out["stacked"], out["per-layer"]):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)


# ----------------------------------------------------------------------------- aux layers

AUX = (2, 0, 3)  # out of order, layer 0 (the embedding) and the last layer of 4


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama-gqa-untied", "qwen2-bias"])
def test_aux_layers_are_transformers_hidden_states(arch, tmp_path):
    """`aux_layers` returns the inputs of those layers, which are transformers'
    `hidden_states[i]`, concatenated in the order asked: a ragged prefill and one cached
    step per row, stacked layout (one scan) and decoding layout (per-layer cache)."""
    from medusa_jax.model.backbone import decoding_layout

    model, cfg, params = _hf_and_ours(arch, tmp_path, num_hidden_layers=4)
    lens, cap = [9, 6], 16
    ids = np.random.RandomState(3).randint(0, SMALL["vocab_size"], (2, max(lens) + 1))
    with torch.no_grad():  # causal: position p's states depend on ids[:p + 1] only
        states = model(input_ids=torch.tensor(ids), output_hidden_states=True).hidden_states
    ref = np.concatenate([states[i].numpy() for i in AUX], axis=-1)  # [B, T, 3H]
    step = jax.jit(lambda p, t, pos, m, c, empty: forward(p, cfg, t, pos, m, c,
                                                          empty_cache=empty, aux_layers=AUX),
                   static_argnames="empty")
    t = max(lens)
    for name, p in (("stacked", params), ("decoding", decoding_layout(cfg, params))):
        cache = KVCache.init(cfg, 2, cap, per_layer=name == "decoding")
        pos = jnp.broadcast_to(jnp.arange(t), (2, t))
        _, _, cache, aux = step(p, jnp.asarray(ids[:, :t]), pos,
                                causal_mask(cache.lengths, t, cap), cache, empty=True)
        assert aux.shape == (2, t, 3 * SMALL["hidden_size"]) and aux.dtype == jnp.float32
        for row, n in enumerate(lens):
            np.testing.assert_allclose(np.asarray(aux[row, :n]), ref[row, :n], atol=1e-5,
                                       rtol=0, err_msg=name)
        cache = cache.replace(lengths=jnp.asarray(lens))  # slots past a row's length: stale
        tok = jnp.asarray(ids[np.arange(2), lens])[:, None]
        _, _, _, aux = step(p, tok, cache.lengths[:, None], causal_mask(cache.lengths, 1, cap),
                            cache, empty=False)
        for row, n in enumerate(lens):
            np.testing.assert_allclose(np.asarray(aux[row, 0]), ref[row, n], atol=1e-5,
                                       rtol=0, err_msg=f"{name} step")


@pytest.mark.slow
def test_aux_layers_on_the_training_path_with_remat():
    """`forward_uncommitted` as training calls it (empty cache, rematerialised layers, no
    logits) returns the same features as `forward`, and they carry gradients."""
    from medusa_jax.model.backbone import forward_uncommitted

    cfg = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 61, (2, 7)))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    cache = KVCache.init(cfg, 2, 7)
    mask = causal_mask(cache.lengths, 7, 7)

    def features(p, **kw):
        return forward_uncommitted(p, cfg, ids, pos, mask, cache, return_logits=False,
                                   empty_cache=True, aux_layers=AUX, **kw)[3]

    want = jax.jit(lambda p: forward(p, cfg, ids, pos, mask, cache, aux_layers=AUX)[3])(params)

    def loss(p):
        f = features(p, remat=True)
        return jnp.sum(f ** 2), f

    (_, got), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    # layer 3 feeds the features (its input, from layers 0-2), the last layer does not
    assert float(jnp.abs(grads["layers"]["wq"][2]).max()) > 0
    assert float(jnp.abs(grads["layers"]["wq"][3]).max()) == 0


@pytest.mark.slow
def test_no_aux_layers_lowers_to_the_same_program():
    """aux_layers=() is the plain forward pass: the same lowered program, both layouts, for
    `forward`, `forward_scratch` and `forward_uncommitted`."""
    from medusa_jax.model.backbone import decoding_layout, forward_scratch, forward_uncommitted

    cfg = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    ids = jnp.zeros((2, 3), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(3), (2, 3))

    def program(fn, p, cache, **kw):
        def run(p, ids, pos, cache):
            return fn(p, cfg, ids, pos, causal_mask(cache.lengths, 3, 8), cache, **kw)

        return jax.jit(run).lower(p, ids, pos, cache).as_text()

    for per_layer, p in ((False, params), (True, decoding_layout(cfg, params))):
        cache = KVCache.init(cfg, 2, 8, per_layer=per_layer)
        for fn in (forward, forward_scratch, forward_uncommitted):
            plain = program(fn, p, cache)
            assert program(fn, p, cache, aux_layers=()) == plain
            assert program(fn, p, cache, aux_layers=(1,)) != plain


def test_aux_layer_choices_are_checked():
    from medusa_jax.drafters.eagle3.heads import eagle3_layers
    from medusa_jax.model.backbone import check_aux_layers

    assert eagle3_layers(32) == (2, 16, 29)  # Llama 3.1 8B: the inputs of layers 2, 16, 29
    assert eagle3_layers(7) == (2, 3, 4)
    for tiny in (6, 4, 2):
        with pytest.raises(ValueError, match=f"this backbone has {tiny} layers$"):
            eagle3_layers(tiny)
    cfg = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64)
    assert check_aux_layers(cfg, [np.int64(3), 0]) == (3, 0)
    for bad, needle in ((4, "4 is not a layer index of this 4-layer"), (-1, "-1 is not"),
                        (1.0, "1.0 is not"), (True, "True is not")):
        with pytest.raises(ValueError, match=needle):
            check_aux_layers(cfg, (0, bad))
    with pytest.raises(ValueError, match=r"layer 2 appears more than once in \(2, 1, 2\)"):
        check_aux_layers(cfg, (2, 1, 2))
    params = init_params(cfg, jax.random.key(0))
    cache = KVCache.init(cfg, 1, 4)
    with pytest.raises(ValueError, match="aux_layers: 9 is not"):  # before any tracing
        forward(params, cfg, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                causal_mask(cache.lengths, 2, 4), cache, aux_layers=(9,))
