"""Medusa heads: exact base logits at init, independent blocks, strict artifact I/O."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.drafters.formats import load_heads, save_heads
from medusa_jax.drafters.medusa.heads import HeadsConfig, apply_heads, init_heads
from medusa_jax.model.backbone import KVCache, causal_mask, forward, init_params
from medusa_jax.model.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=40, hidden_size=16, intermediate_size=24,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                  max_position_embeddings=32)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_heads_start_as_exact_copies_of_the_base_logits(tied):
    cfg = CFG.replace(tie_word_embeddings=tied)
    params = init_params(cfg, jax.random.key(0), std=0.3)
    heads = init_heads(cfg, params, HeadsConfig(num_heads=4, num_layers=2))
    ids = jnp.array([[3, 5, 7, 9, 11]])
    cache = KVCache.init(cfg, 1, 5)
    logits, hidden, _ = forward(params, cfg, ids, jnp.arange(5)[None], causal_mask(cache.lengths, 5, 5), cache)
    head_logits = apply_heads(heads, hidden)
    assert head_logits.shape == (4, 1, 5, 40)
    for k in range(4):
        np.testing.assert_array_equal(head_logits[k], logits)


@pytest.mark.slow
def test_blocks_of_a_head_get_their_own_parameters():
    params = init_params(CFG, jax.random.key(0), std=0.3)
    heads = init_heads(CFG, params, HeadsConfig(num_heads=2, num_layers=2))
    # give both blocks the SAME non-zero weights: an implementation that shares one block
    # would keep them equal forever; separate blocks see different inputs and part ways
    w = 0.3 * jax.random.normal(jax.random.key(3), (2, 1, 16, 16))
    heads = dict(heads, w=jnp.concatenate([w, w], axis=1), b=jnp.full((2, 2, 16), 0.1))
    hidden = jax.random.normal(jax.random.key(1), (8, 16))
    targets = jax.random.randint(jax.random.key(2), (2, 8), 0, 40)

    def loss(h):
        logp = jax.nn.log_softmax(apply_heads(h, hidden))
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    grads = jax.grad(loss)(heads)
    new = jax.tree.map(lambda p, g: p - 0.1 * g, heads, grads)
    assert np.array_equal(heads["w"][:, 0], heads["w"][:, 1])
    assert not np.allclose(new["w"][:, 0], new["w"][:, 1], atol=1e-6)
    assert not np.allclose(new["b"][:, 0], new["b"][:, 1], atol=1e-6)


def test_save_load_round_trip_and_strict_mismatch(tmp_path):
    params = init_params(CFG, jax.random.key(0))
    heads = init_heads(CFG, params, HeadsConfig(num_heads=3, num_layers=2))
    heads = jax.tree.map(lambda a: a + 0.01, heads)
    save_heads(tmp_path, heads, CFG, extra={"note": "x"})
    loaded, meta = load_heads(tmp_path, CFG)
    assert meta["extra"] == {"note": "x"} and meta["num_heads"] == "3"
    for name in heads:
        np.testing.assert_array_equal(loaded[name], heads[name])
    with pytest.raises(ValueError, match="tensor w has shape .* expected .*hidden 32"):
        load_heads(tmp_path, CFG.replace(hidden_size=32))
    with pytest.raises(FileNotFoundError, match="no Medusa heads artifact"):
        load_heads(tmp_path / "nowhere", CFG)
    (tmp_path / "medusa_heads.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="corrupt or truncated heads file"):
        load_heads(tmp_path, CFG)


@pytest.mark.parametrize("bad, message", [
    ("nan-proj", "tensor proj holds 1 non-finite values (NaN or inf) of 1280; the file is corrupt"),
    ("int-w", "tensor w has dtype int32, expected floating point"),
])
def test_corrupt_heads_are_refused_at_load(tmp_path, bad, message):
    import json

    from safetensors.numpy import save_file

    params = init_params(CFG, jax.random.key(0))
    heads = {k: np.array(v) for k, v in init_heads(CFG, params, HeadsConfig(2)).items()}
    if bad == "nan-proj":
        heads["proj"][1, 2, 3] = np.nan
    else:
        heads["w"] = heads["w"].astype(np.int32)
    file = tmp_path / "medusa_heads.safetensors"
    save_file(heads, str(file), metadata={
        "format": "medusa_jax.heads/1", "num_heads": "2", "num_layers": "1",
        "hidden_size": "16", "vocab_size": "40", "extra": json.dumps({})})
    with pytest.raises(ValueError) as e:
        load_heads(tmp_path, CFG)
    assert str(e.value) == f"{file}: {message}"
