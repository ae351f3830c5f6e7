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
    (dict(rope_scaling="linear"), "rope_scaling must be a JSON object (e.g. {\"rope_type\": "
                                  "\"linear\", \"factor\": 2.0}) or null, got str 'linear'"),
    (dict(rope_scaling=["linear", 2.0]), "rope_scaling must be a JSON object (e.g. "
                                         "{\"rope_type\": \"linear\", \"factor\": 2.0}) or "
                                         "null, got list ['linear', 2.0]"),
    (dict(rope_parameters="default"), "rope_parameters must be a JSON object (e.g. "
                                      "{\"rope_type\": \"linear\", \"factor\": 2.0}) or "
                                      "null, got str 'default'"),
    (dict(GEMMA2, model_type="gemma3_text", rope_parameters={"full_attention": "default"}),
     "rope_parameters.full_attention must be a JSON object (e.g. {\"rope_type\": \"linear\", "
     "\"factor\": 2.0}) or null, got str 'default'"),
])
def test_config_values_are_checked_and_named(changes, message, model_folder):
    d = model_folder(**changes)
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dir(d)
    assert str(e.value) == f"{d / 'config.json'}: {message}"


def test_the_embedded_and_shipped_configs_still_pass():
    cfg = ModelConfig.from_dir(default_model_dir())
    assert (cfg.hidden_size, cfg.rms_norm_eps, cfg.rope_theta) == (64, 1e-5, 10000.0)


def test_a_null_rope_theta_is_the_default(model_folder):
    assert ModelConfig.from_dir(model_folder(rope_theta=None)).rope_theta == 10000.0


def test_a_config_that_is_not_utf8_is_named(model_folder):
    d = model_folder()
    (d / "config.json").write_bytes(b'{"model_type": "llama\xff"}')
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dir(d)
    assert str(e.value) == f"{d / 'config.json'}: not UTF-8 text (byte 21: b'\\xff')"


def test_generation_config_eos_ids_join_the_configs(model_folder):
    d = model_folder()
    (d / "generation_config.json").write_text('{"eos_token_id": [2, 13, 2]}')
    assert ModelConfig.from_dir(d).eos_token_id == (2, 13)
    (d / "generation_config.json").write_text('{"eos_token_id": 7, "bos_token_id": 1}')
    assert ModelConfig.from_dir(d).eos_token_id == (2, 7)
    (d / "generation_config.json").write_text('{"do_sample": true}')
    assert ModelConfig.from_dir(d).eos_token_id == (2,)


@pytest.mark.parametrize("text, message", [
    ('{"eos_token_id": [2, 1', "invalid JSON (Expecting ',' delimiter: line 1 column 23 "
                               "(char 22))"),
    ("[2, 13]", "expected a JSON object, got list"),
    ('{"eos_token_id": [2, "13"]}', "eos_token_id must be an integer >= 0, got str '13'"),
    ('{"eos_token_id": -1}', "eos_token_id must be an integer >= 0, got -1"),
    ('{"eos_token_id": 512}', "eos_token_id 512 is not a token id of this model "
                              "(vocab_size 512)"),
])
def test_a_corrupt_generation_config_is_named(text, message, model_folder):
    d = model_folder()
    (d / "generation_config.json").write_text(text)
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dir(d)
    assert str(e.value) == f"{d / 'generation_config.json'}: {message}"
