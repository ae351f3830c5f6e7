"""Tensor-parallel decoding on 8 simulated CPU devices.

Plain, Medusa and EAGLE-3 decoding under `data x model` meshes give the tokens of the 1-device
run (greedy, and rejection/typical with the same key), on the embedded model and on random small
configs of every architecture (GQA whose KV heads do not divide the axis included); the
compiled decoder's parameter and KV-cache buffers per device are 1/model of the whole.
"""

import contextlib
import math
import re

import jax
import numpy as np
import pytest

from medusa_jax import api
from medusa_jax.decoding.acceptance import Sampling
from medusa_jax.decoding.decode import generate, medusa_generate, pad_prompts
from medusa_jax.decoding.tree import Tree
from medusa_jax.drafters.medusa.heads import HeadsConfig, init_heads
from medusa_jax.model.backbone import init_params
from medusa_jax.model.config import ModelConfig
from medusa_jax.runtime import sharding

TREE = Tree.load("mc_sim_7b_63:8")
NEW = 10


def _rows(out):
    out = sharding.to_host(out)
    return [out.tokens[i, : int(out.num_new[i])].tolist() for i in range(len(out.num_new))]


def _heads(cfg, params, seed=7, scale=0.05):
    heads = init_heads(cfg, params, HeadsConfig(num_heads=4))
    keys = jax.random.split(jax.random.key(seed), 3)
    return {k: v + scale * jax.random.normal(kk, v.shape)
            for (k, v), kk in zip(heads.items(), keys)}


def _decode(cfg, params, heads, prompts, mesh=None, sampling=Sampling(), seed=0,
            plain=True, medusa=True, compiled=False):
    """{"plain": rows, "medusa": rows[, "compiled": the compiled Medusa decoder]}, on `mesh`
    (sharded params and cache) or one device."""
    tokens, lengths = pad_prompts(prompts)
    key = jax.random.key(seed)
    kw = dict(sampling=sampling, max_new_tokens=NEW, eos=(2,))
    out = {}
    if mesh is not None:
        params, heads = api.shard_for_decoding(cfg, params, heads, mesh)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        if plain:
            out["plain"] = _rows(generate(params, cfg, tokens, lengths, key, **kw))
        if medusa:
            fn = medusa_generate.lower(params, heads, cfg, tokens, lengths, key, tree=TREE,
                                       **kw).compile()
            out["medusa"] = _rows(fn(params, heads, tokens, lengths, key))
            if compiled:
                out["compiled"], out["params"], out["heads"] = fn, params, heads
    return out


# ----------------------------------------------------------------------------- embedded model


@pytest.fixture(scope="module")
def embedded(stories):
    """The embedded model, perturbed heads, prompts, and the 1-device plain greedy rows (Medusa
    greedy must give exactly these: it is lossless)."""
    cfg, params, tok = stories
    prompts = [tok.encode(p) for p in ["Once upon a time", "Lily", "Tom had a red ball.",
                                       "The cat"]]
    heads = _heads(cfg, params)
    return cfg, params, heads, prompts, _decode(cfg, params, heads, prompts, medusa=False)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["model=2", "data=2,model=4", "model=8"])
def test_embedded_greedy_matches_one_device(embedded, mesh_spec):
    cfg, params, heads, prompts, want = embedded
    got = _decode(cfg, params, heads, prompts, sharding.make_mesh(mesh_spec))
    assert got["plain"] == want["plain"]
    assert got["medusa"] == want["plain"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rejection", "typical"])
def test_sampling_modes_match_one_device_with_the_same_key(embedded, mode):
    cfg, params, heads, prompts, _ = embedded
    s = Sampling(mode=mode, temperature=0.8)
    want = _decode(cfg, params, heads, prompts, sampling=s, seed=3, plain=False)
    got = _decode(cfg, params, heads, prompts, sharding.make_mesh("data=2,model=4"),
                  sampling=s, seed=3, plain=False)
    assert got["medusa"] == want["medusa"]


def _eagle3(cfg):
    """A random EAGLE-3 drafter over the 256 first ids, bound to its configuration."""
    from medusa_jax.drafters.eagle3 import heads as eagle3
    from medusa_jax.drafters.eagle3.drafter import bind

    c = eagle3.default_config(cfg, 256, aux_layers=(1, 2, 4))
    return bind(eagle3.init_eagle3(jax.random.key(3), c, np.arange(cfg.vocab_size), std=0.2),
                c, cfg)


@pytest.mark.slow
def test_eagle3_drafter_greedy_matches_one_device(embedded):
    """An EAGLE-3 drafter (replicated; its parameters bound to their drafter) on a sharded
    backbone: the aux features it reads come from the sharded layers. Its cache writes must
    not become collectives: on the simulated CPU devices those can wait on the backbone's
    for every thread of XLA's pool (an abort after 40 s, in some runs only)."""
    cfg, params, _, prompts, want = embedded
    got = _decode(cfg, params, _eagle3(cfg), prompts, sharding.make_mesh("data=2,model=4"),
                  plain=False, compiled=True)
    assert got["medusa"] == want["plain"]
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(got["heads"]))
    hlo = got["compiled"].as_text()
    assert "all-gather" not in "".join(line for line in hlo.splitlines() if "scatter" in line)


@pytest.mark.slow
def test_eagle3_rejection_sampling_matches_one_device_with_the_same_key(embedded):
    """Rejection sampling is the one mode in which the drafter itself samples (its drafts
    and their q); under typical acceptance it drafts as under greedy (the test above) and
    the rule is the one the Medusa heads' sampling test runs sharded."""
    cfg, params, _, prompts, _ = embedded
    s = Sampling(mode="rejection", temperature=0.8)
    drafter = _eagle3(cfg)
    want = _decode(cfg, params, drafter, prompts, sampling=s, seed=3, plain=False)
    got = _decode(cfg, params, drafter, prompts, sharding.make_mesh("data=2,model=4"),
                  sampling=s, seed=3, plain=False)
    assert got["medusa"] == want["medusa"]


# ----------------------------------------------------------------------------- architectures

ARCHS = {
    # Llama and Mistral share the layout: MHA, untied output projection
    "mistral": (dict(model_type="mistral", num_heads=4, num_kv_heads=4), "data=4,model=2"),
    # GQA with 2 KV heads on model=4 (they do not divide), q/k/v biases
    "qwen2": (dict(model_type="qwen2", num_heads=8, num_kv_heads=2, attention_bias=True),
              "data=2,model=4"),
    # q/k norms, tied embeddings, model=8
    "qwen3": (dict(model_type="qwen3", num_heads=8, num_kv_heads=8, qk_norm=True,
                   tie_word_embeddings=True), "model=8"),
}


def random_config(arch: str) -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                       head_dim=8, max_position_embeddings=128, **ARCHS[arch][0])


def _bytes(shape, dtype):
    return math.prod(shape) * np.dtype(dtype).itemsize


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_random_architectures_match_one_device_on_a_model_share(arch):
    """Tokens as on one device; and the compiled decoder's parameters and KV cache per device
    are 1/model of the whole (read from its input shardings and its optimized HLO)."""
    cfg = random_config(arch)
    mesh = sharding.make_mesh(ARCHS[arch][1])
    m, d = mesh.shape["model"], mesh.shape["data"]
    params = init_params(cfg, jax.random.key(1), std=0.3)
    heads = _heads(cfg, params, scale=0.02)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 9, 3, 7)]
    want = _decode(cfg, params, heads, prompts, medusa=False)
    got = _decode(cfg, params, heads, prompts, mesh, compiled=True)
    assert got["plain"] == want["plain"]
    assert got["medusa"] == want["plain"]

    compiled = got["compiled"]
    in_params, in_heads = compiled.input_shardings[0][:2]
    kv_split = cfg.num_kv_heads % m == 0
    for tree, shardings in ((params, in_params), (heads, in_heads)):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        for (path, x), s in zip(flat, jax.tree.leaves(shardings)):
            name = jax.tree_util.keystr(path)
            per_device = _bytes(s.shard_shape(x.shape), x.dtype)
            if "norm" in name or (not kv_split and path[-1].key in ("wk", "wv", "bk", "bv")):
                assert per_device == _bytes(x.shape, x.dtype), name
            else:
                assert per_device * m == _bytes(x.shape, x.dtype), (name, s.spec)
    # the KV cache carried by the compiled loop: [L, B/data, KVH/model, S, D] per device
    b, p = pad_prompts(prompts)[0].shape
    cap = p + NEW + TREE.num_nodes + 1
    hlo = compiled.as_text()
    shapes = set(re.findall(rf"f32\[{cfg.num_layers},(\d+),(\d+),{cap},{cfg.head_dim}\]",
                            hlo))
    assert (str(b), str(cfg.num_kv_heads)) not in shapes  # never the whole cache
    if kv_split:
        assert shapes == {(str(b // d), str(cfg.num_kv_heads // m))}
    else:  # XLA splits what it can (here 2 KV heads over 2 of the 4 model shards)
        assert {int(r) for r, _ in shapes} == {b // d}
        assert all(int(h) < cfg.num_kv_heads for _, h in shapes)


def test_bad_meshes():
    with pytest.raises(ValueError, match="needs 16 devices, only 8"):
        sharding.make_mesh("data=2,model=8")
    with pytest.raises(ValueError, match="unknown axis 'tensor'"):
        sharding.parse_mesh_spec("data=2,tensor=4")
    assert sharding.parse_mesh_spec("2,4") == {"data": 2, "fsdp": 4, "model": 1}
    assert sharding.parse_mesh_spec("1,2,4") == {"data": 1, "fsdp": 2, "model": 4}
    # a model axis that divides nothing useful is refused in one line
    cfg = random_config("qwen2").replace(vocab_size=127, intermediate_size=63, num_heads=4)
    with pytest.raises(ValueError, match="model=8 splits none of"):
        api.check_model_axis(cfg, sharding.make_mesh("model=8"))
    api.check_model_axis(cfg, sharding.make_mesh("model=4"))  # the attention heads divide
