"""Heads metadata that is not what it claims is named in one line."""

import pytest
from safetensors.numpy import save_file

from medusa_jax.drafters.io import HeadsFormatError
from medusa_jax.model.config import ModelConfig
from medusa_jax.model.weights import default_model_dir
from medusa_jax.runtime import assets


def test_heads_metadata_that_is_not_a_count_is_named(tmp_path):
    from medusa_jax.drafters.formats import HEADS_FILE, HeadsFormatError, load_heads

    src = assets.heads_dir() / HEADS_FILE
    out = tmp_path / HEADS_FILE
    from safetensors import safe_open

    with safe_open(str(src), framework="numpy") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    cfg = ModelConfig.from_dir(default_model_dir())
    for key, value in (("num_layers", "abc"), ("num_heads", "-3"), ("extra", "{oops")):
        save_file(tensors, out, metadata=dict(meta, **{key: value}))
        with pytest.raises(HeadsFormatError) as e:
            load_heads(out, cfg)
        assert str(e.value).startswith(f"{out}: metadata {key}=") and "\n" not in str(e.value)


@pytest.mark.parametrize("field, value, says", [
    ("rms_norm_eps", -1, "rms_norm_eps=-1 is not a finite number > 0"),
    ("rope_theta", "big", "rope_theta='big' is not a finite number > 0"),
    ("max_position_embeddings", 0, "max_position_embeddings=0 is not an integer >= 1"),
    ("rope_scaling", ["linear", -2.0], "rope_scaling=-2.0 is not a finite number > 0"),
])
def test_an_eagle3_artifacts_config_values_are_named(tmp_path, field, value, says):
    import json

    from safetensors import safe_open

    from medusa_jax.drafters.formats import HEADS_FILE, HeadsFormatError, load_heads

    with safe_open(str(assets.shipped_heads_dir("eagle") / HEADS_FILE), framework="numpy") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    conf = dict(json.loads(meta["eagle3_config"]), **{field: value})
    out = tmp_path / HEADS_FILE
    save_file(tensors, out, metadata=dict(meta, eagle3_config=json.dumps(conf)))
    with pytest.raises(HeadsFormatError) as e:
        load_heads(out, ModelConfig.from_dir(default_model_dir()))
    assert str(e.value) == f"{out}: metadata eagle3_config.{says}"


def test_an_eagle3_folder_with_another_embedding_is_refused_by_load(tmp_path):
    import numpy as np
    from safetensors.numpy import load_file

    from medusa_jax.api import Medusa
    from medusa_jax.drafters import formats

    cfg = ModelConfig.from_dir(default_model_dir())
    heads, _ = formats.load_heads(assets.shipped_heads_dir("eagle"), cfg)
    formats.write(heads, "eagle3", tmp_path / "d", cfg=cfg)
    st = tmp_path / "d" / "model.safetensors"
    tensors = load_file(str(st))
    table = np.asarray(Medusa.load().params["embed"], np.float32)
    save_file({**tensors, "embed_tokens.weight": table}, str(st))
    assert Medusa.load(heads=str(tmp_path / "d")).drafter_kind == "eagle3"  # the same table
    save_file({**tensors, "embed_tokens.weight": table[::-1].copy()}, str(st))
    with pytest.raises(HeadsFormatError) as e:
        Medusa.load(heads=str(tmp_path / "d"))
    assert str(e.value).startswith(f"{st}: tensor embed_tokens.weight is not the backbone's "
                                   f"embedding (max abs difference ") and "\n" not in str(e.value)
