"""config.json's values are checked and named before any work: type, range, finiteness, in
one line naming the file and the field."""


import pytest

from medusa_jax.model.config import ModelConfig
from medusa_jax.model.weights import default_model_dir



GEMMA2 = dict(model_type="gemma2", hidden_activation="gelu_pytorch_tanh",
              query_pre_attn_scalar=8)


@pytest.mark.parametrize("changes, message", [
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0, got nan"),
    (dict(rms_norm_eps=0), "rms_norm_eps must be a finite number > 0, got 0"),
    (dict(rope_theta=-10000), "rope_theta must be a finite number > 0, got -10000"),
    (dict(rope_theta=float("inf")), "rope_theta must be a finite number > 0, got inf"),
    (dict(hidden_size="64"), "hidden_size must be an integer >= 1, got str '64'"),
    (dict(hidden_size=-64), "hidden_size must be an integer >= 1, got -64"),
    (dict(hidden_size=64.0), "hidden_size must be an integer >= 1, got float 64.0"),
    (dict(max_position_embeddings=-1), "max_position_embeddings must be an integer >= 1, "
                                       "got -1"),
    (dict(num_hidden_layers=True), "num_hidden_layers must be an integer >= 1, got bool True"),
    (dict(vocab_size=0), "vocab_size must be an integer >= 1, got 0"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got str "
                                        "'false'"),
    (dict(eos_token_id=-2), "eos_token_id must be an integer >= 0, got -2"),
    (dict(head_dim=None, hidden_size=60), "hidden_size=60 is not a multiple of "
                                          "num_attention_heads=8 (and no head_dim is given)"),
    (dict(rope_scaling={"rope_type": "linear", "factor": float("nan")}),
     "rope_scaling.factor must be a finite number > 0, got nan"),
    (dict(GEMMA2, sliding_window="4096"), "sliding_window must be an integer >= 1, got str "
                                          "'4096'"),
    (dict(model_type="mistral", sliding_window=-4), "sliding_window must be an integer >= 1, "
                                                    "got -4"),
])
def test_config_values_are_checked_and_named(changes, message, model_folder):
    d = model_folder(**changes)
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dir(d)
    assert str(e.value) == f"{d / 'config.json'}: {message}"


def test_the_embedded_and_shipped_configs_still_pass():
    cfg = ModelConfig.from_dir(default_model_dir())
    assert (cfg.hidden_size, cfg.rms_norm_eps, cfg.rope_theta) == (64, 1e-5, 10000.0)
