"""Heads metadata that is not what it claims is named in one line."""

import pytest
from safetensors.numpy import save_file

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
