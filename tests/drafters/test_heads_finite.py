"""A heads artifact is never written with non-finite weights (ours and every export)."""

import jax
import jax.numpy as jnp
import pytest

from medusa_jax.drafters import formats
from medusa_jax.drafters.medusa import heads as heads_lib
from medusa_jax.model import backbone
from medusa_jax.model.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=24,
                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4,
                  max_position_embeddings=128)


@pytest.fixture(scope="module")
def nan_heads():
    bb = backbone.init_params(CFG, jax.random.key(0), std=0.2)
    heads = heads_lib.init_heads(CFG, bb, heads_lib.HeadsConfig(2, 1))
    return dict(heads, proj=heads["proj"].at[1, 2, 3].set(jnp.nan))


@pytest.mark.parametrize("layout, tensor", [("medusa_jax", "proj"),
                                            ("reference", "1.1.weight"),  # head 1's projection
                                            ("vllm", "lm_heads.1.weight")])
def test_non_finite_heads_are_not_written(nan_heads, layout, tensor, tmp_path, one_line_error):
    out = tmp_path / "heads"
    one_line_error(ValueError, lambda: formats.write(nan_heads, layout, out, cfg=CFG),
                   f"tensor {tensor} has non-finite values (NaN or inf)")
    assert not out.exists() or not any(p.is_file() for p in out.rglob("*"))
