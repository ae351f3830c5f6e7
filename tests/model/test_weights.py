"""Strict Hugging Face weight loading: sharded files, and one clear error per bad input."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from medusa_jax.model.weights import (
    WeightsError,
    default_model_dir,
    load_pretrained,
    save_pretrained,
)


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("small")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit(folder, fn):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_embedded_default_loads(stories):
    cfg, params, _ = stories
    assert (cfg.model_type, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 5, 8, 4)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    n = sum(int(np.prod(a.shape)) for a in __import__("jax").tree.leaves(params))
    assert n == 260_032
    assert (default_model_dir() / "LICENSE").is_file()


@pytest.mark.slow
def test_sharded_checkpoint_equals_single_file(small_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(small_model_dir)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, single = load_pretrained(small_model_dir)
    _, sharded = load_pretrained(tmp_path)
    for a, b in zip(__import__("jax").tree.leaves(single), __import__("jax").tree.leaves(sharded)):
        np.testing.assert_array_equal(a, b)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_pretrained(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nope")


def test_missing_tensor(small_model_dir, tmp_path):
    d = _copy(small_model_dir, tmp_path / "m")
    _edit(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(d)


def test_unexpected_tensor(small_model_dir, tmp_path):
    d = _copy(small_model_dir, tmp_path / "m")
    _edit(d, lambda t: t.update({"model.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(WeightsError, match=r"unexpected tensor model\.extra\.weight"):
        load_pretrained(d)


def test_wrong_shape(small_model_dir, tmp_path):
    d = _copy(small_model_dir, tmp_path / "m")
    _edit(d, lambda t: t.update({"model.norm.weight": np.ones(31, np.float32)}))
    with pytest.raises(WeightsError, match=r"model\.norm\.weight has shape \(31,\), expected \(32,\)"):
        load_pretrained(d)


def test_truncated_file(small_model_dir, tmp_path):
    d = _copy(small_model_dir, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(WeightsError, match="model.safetensors: corrupt or truncated"):
        load_pretrained(d)


def test_corrupt_file(small_model_dir, tmp_path):
    d = _copy(small_model_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x07garbage" * 10)
    with pytest.raises(WeightsError, match="corrupt or truncated"):
        load_pretrained(d)


def test_missing_shard(small_model_dir, tmp_path):
    AutoModelForCausalLM.from_pretrained(small_model_dir).save_pretrained(tmp_path,
                                                                         max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / victim).unlink()
    with pytest.raises(WeightsError, match=f"shard {victim} is missing"):
        load_pretrained(tmp_path)


def test_no_weights(small_model_dir, tmp_path):
    d = _copy(small_model_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no model.safetensors"):
        load_pretrained(d)


def test_unsupported_rope(small_model_dir, tmp_path):
    d = _copy(small_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        load_pretrained(d)


def test_export_round_trip_loads_in_transformers(small_model_dir, tmp_path):
    cfg, params = load_pretrained(small_model_dir)
    params = dict(params, final_norm=params["final_norm"] * 1.5)  # a visible change
    save_pretrained(cfg, params, tmp_path, source_dir=small_model_dir)
    _, again = load_pretrained(tmp_path)
    np.testing.assert_array_equal(again["final_norm"], params["final_norm"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    np.testing.assert_allclose(model.model.norm.weight.detach().numpy(),
                               np.asarray(params["final_norm"], np.float32))
    assert jnp.all(again["layers"]["wq"] == params["layers"]["wq"])


def test_wrong_shape_of_a_matrix_is_reported_as_stored(small_model_dir, tmp_path):
    # HF stores up_proj as [out, in] = [40, 32] here (ours is [in, out]); give it [16, 32]
    d = _copy(small_model_dir, tmp_path / "m")
    _edit(d, lambda t: t.update({"model.layers.0.mlp.up_proj.weight":
                                 np.zeros((16, 32), np.float32)}))
    with pytest.raises(WeightsError) as e:
        load_pretrained(d)
    msg = str(e.value)
    assert msg == (f"{d / 'model.safetensors'}: tensor model.layers.0.mlp.up_proj.weight has "
                   f"shape (16, 32), expected (40, 32) ([out_features, in_features], as the "
                   f"file stores it)")


def test_load_tokenizer(small_model_dir, tmp_path):
    from medusa_jax.model.weights import load_tokenizer

    assert load_tokenizer().encode("Lily")  # the embedded model's
    d = _copy(small_model_dir, tmp_path / "m")  # weights and config, no tokenizer files
    with pytest.raises(WeightsError) as e:
        load_tokenizer(d)
    assert str(e.value) == (f"{d}: no tokenizer in this folder (looked for tokenizer.json, "
                            f"tokenizer.model, tokenizer_config.json)")
    (d / "tokenizer.json").write_text("{ not json")
    with pytest.raises(WeightsError, match=r"m: cannot load the tokenizer from tokenizer\.json "
                                           r"\(") as e:
        load_tokenizer(d)
    assert "\n" not in str(e.value)
    with pytest.raises(WeightsError, match="no such model folder"):
        load_tokenizer(tmp_path / "nope")


# ---- corrupted weights and tokenizers that say less than the model


def _random_data(file, seed=0):
    """Keep the safetensors header, replace every data byte with random ones."""
    raw = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start:] = np.random.default_rng(seed).integers(0, 256, len(raw) - start, np.uint8).tobytes()
    file.write_bytes(bytes(raw))


def test_random_bytes_under_an_intact_header_are_refused_at_load(tmp_path, capsys):
    from infer import generate

    d = _copy(default_model_dir(), tmp_path / "M2")
    _random_data(d / "model.safetensors")
    with pytest.raises(WeightsError, match=r"model\.safetensors: tensor \S+ holds \d+ non-finite "
                                           r"values \(NaN or inf\) of \d+; the file is corrupt"):
        load_pretrained(d)
    assert generate.main(["--model", str(d), "--prompt", "Lily", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "non-finite values" in err[0]


def test_one_nan_is_named_with_its_tensor(small_model_dir, tmp_path):
    d = _copy(small_model_dir, tmp_path / "m")

    def poison(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 4] = np.nan

    _edit(d, poison)
    with pytest.raises(WeightsError) as e:
        load_pretrained(d)
    assert str(e.value) == (f"{d / 'model.safetensors'}: tensor model.layers.1.mlp.up_proj."
                            f"weight holds 1 non-finite values (NaN or inf) of 1280; the file is "
                            f"corrupt")


def test_a_tokenizer_that_adds_no_bos_gets_the_models_bos(tmp_path, stories):
    """Without tokenizer_config.json nothing says whether to add BOS: config.json's
    bos_token_id decides, so prompts encode as the model was trained ("Lily" -> [1, 317])."""
    from medusa_jax.model.weights import load_tokenizer

    _, _, reference = stories
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(default_model_dir() / "config.json", d)
    tok = json.loads((default_model_dir() / "tokenizer.json").read_text())
    tok["post_processor"] = None  # a tokenizer file that adds no special tokens itself
    (d / "tokenizer.json").write_text(json.dumps(tok))
    loaded = load_tokenizer(d)
    assert loaded.encode("Lily") == reference.encode("Lily") == [1, 317]
    assert loaded.bos_token_id == 1


def test_a_sentencepiece_model_alone_loads_with_bos_or_is_one_line(tmp_path):
    from medusa_jax.model.weights import load_tokenizer

    d = tmp_path / "m"
    d.mkdir()
    for f in ("config.json", "tokenizer.model"):
        shutil.copy(default_model_dir() / f, d)
    try:
        tok = load_tokenizer(d)
    except WeightsError as e:  # no sentencepiece installed here: cannot be read at all
        assert "\n" not in str(e) and "cannot load the tokenizer" in str(e)
    else:
        assert tok.encode("Lily")[0] == 1
