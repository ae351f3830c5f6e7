"""Hostile input to the notebook API (`Medusa.load`, `Medusa.generate`): every error is one
line that names the argument (and the prompt's index), raised before any work is compiled.
(Data files: text/test_data_bad_input.py; prompt files: text/test_prompt_files.py;
checkpoint, tree and weights cases live beside their modules' tests.)"""

import json
import shutil

import numpy as np
import pytest

from medusa_jax import api
from medusa_jax.api import Medusa
from medusa_jax.drafters.medusa.heads import HeadsConfig, init_heads
from medusa_jax.model.weights import WeightsError, default_model_dir


@pytest.fixture(scope="module")
def model(stories):
    cfg, params, tok = stories
    return Medusa(cfg, params, tok, heads=init_heads(cfg, params, HeadsConfig(num_heads=4)))


@pytest.fixture
def no_decoding(monkeypatch):
    """Fail the test if a decoder is reached: arguments must be checked before that."""
    def boom(*a, **k):
        raise AssertionError("decoding started before the arguments were checked")

    monkeypatch.setattr(api, "generate", boom)
    monkeypatch.setattr(api, "medusa_generate", boom)



@pytest.mark.parametrize("prompts, kwargs, error, message", [
    # prompts
    ([b"Lily"], {}, TypeError, "prompts[0] is bytes (b'Lily'); give text as str (.decode() it) "
                               "or token ids as a list of ints"),
    (b"Lily", {}, TypeError, "prompts is bytes (b'Lily'); give text as str (.decode() it) or "
                             "token ids as a list of ints"),
    ([[1, 99999]], {}, ValueError, "prompts[0][1] = 99999 is not a token id of this model "
                                   "(0..511)"),
    (["Lily", [5, -3]], {}, ValueError, "prompts[1][1] = -3 is not a token id of this model "
                                        "(0..511)"),
    ([[1, 2.0]], {}, TypeError, "prompts[0][1] must be an int token id, got float 2.0"),
    ([[1, True]], {}, TypeError, "prompts[0][1] must be an int token id, got bool True"),
    (42, {}, TypeError, "prompts must be a str or a list of prompts (str, or lists of token "
                        "ids), got int 42"),
    ({"prompt": "Lily"}, {}, TypeError, "prompts must be a str or a list of prompts (str, or "
                                        "lists of token ids), got dict {'prompt': 'Lily'}"),
    (["Lily", None], {}, TypeError, "prompts[1] must be a str or a list of token ids, got "
                                    "NoneType None"),
    ([1, 2, 3], {}, TypeError, "prompts[0] is an int: give one token-id prompt as a list "
                               "inside the list, e.g. [[1, 2, 3]]"),
    ([], {}, ValueError, "prompts is empty: give at least one prompt"),
    ([[]], {}, ValueError, "prompts[0] is an empty list of token ids"),
    # numbers
    (["Lily"], dict(max_new_tokens=8.5), TypeError, "max_new_tokens must be an int, got float "
                                                    "8.5"),
    (["Lily"], dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int, got bool "
                                                     "True"),
    (["Lily"], dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1, got 0"),
    (["Lily"], dict(batch_size=0), ValueError, "batch_size must be >= 1, got 0"),
    (["Lily"], dict(batch_size=-2), ValueError, "batch_size must be >= 1, got -2"),
    (["Lily"], dict(batch_size=2.0), TypeError, "batch_size must be an int, got float 2.0"),
    (["Lily"], dict(seed=0.5), TypeError, "seed must be an int, got float 0.5"),
    (["Lily"], dict(top_k=-1), ValueError, "top_k must be >= 0, got -1"),
    (["Lily"], dict(top_k=100000), ValueError, "top_k must be at most the vocabulary size "
                                               "(512), got 100000"),
    (["Lily"], dict(seed=2**70), ValueError, f"seed must be in -2**63..2**63-1, got {2**70}"),
    (["Lily"], dict(max_new_tokens=511, medusa=False), ValueError,
     "prompt (2 tokens) + max_new_tokens (511) = 513 exceeds the model's context of 512; "
     "shorten the prompt or lower max_new_tokens"),
    (["Lily"], dict(top_p=1.5), ValueError, "top_p must be in (0, 1], got 1.5"),
    (["Lily"], dict(temperature="hot"), TypeError, "temperature must be a number, got str "
                                                   "'hot'"),
    (["Lily"], dict(temperature=float("nan")), ValueError, "temperature must be a finite "
                                                           "number, got nan"),
    (["Lily"], dict(mode="typical", temperature=0), ValueError, "temperature must be > 0 for "
                                                                "mode 'typical', got 0.0"),
    (["Lily"], dict(mode="rejection", temperature=-1.0), ValueError,
     "temperature must be > 0 for mode 'rejection', got -1.0"),
    # choices
    (["Lily"], dict(mode="beam"), ValueError, "mode 'beam' is not one of greedy, typical, "
                                              "rejection"),
    (["Lily"], dict(medusa="yes"), TypeError, "medusa must be True, False or None, got str "
                                              "'yes'"),
    (["Lily"], dict(tree=5), TypeError, "tree must be a tree name, a JSON file path or a Tree, "
                                        "got int 5"),
])
def test_generate_rejects(model, no_decoding, prompts, kwargs, error, message, one_line_error):
    with pytest.raises(error) as e:
        model.generate(prompts, **kwargs)
    assert one_line_error.message(e) == message


@pytest.mark.slow
def test_plain_decoding_may_fill_the_whole_context(model):
    """400 + 112 = 512 tokens (like "Lily" + 510): plain decoding feeds no tree, and its last
    token is emitted, never fed, so nothing more is needed."""
    out = model.generate([[1] + [403] * 399], max_new_tokens=112, medusa=False)
    assert 1 <= out[0].new_tokens <= 112


def test_generate_checks_the_tree_against_the_vocabulary(model, no_decoding, tmp_path,
                                                         one_line_error):
    f = tmp_path / "wide.json"
    f.write_text(json.dumps([[0], [600]]))
    with pytest.raises(ValueError) as e:
        model.generate(["Lily"], tree=f)
    assert one_line_error.message(e) == (f"tree {str(f)!r}: rank 600 is beyond the model's "
                                         f"vocabulary of 512 tokens (ranks must be < 512)")


@pytest.mark.slow
def test_generate_accepts_token_ids_as_arrays_and_tuples(model):
    out = model.generate(np.array([[1, 403], [1, 500]]), max_new_tokens=2, medusa=False,
                         batch_size=np.int64(2))
    assert [g.new_tokens for g in out] == [2, 2]
    assert model.generate([(1, 403)], max_new_tokens=2, medusa=False)[0].token_ids == \
        out[0].token_ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(model=123), "model must be a path (str or Path) or None, got int 123"),
    (dict(heads=3.5), "heads must be a path (str or Path) or None, got float 3.5"),
    (dict(param_dtype=None), "param_dtype must be a str such as 'float32' or 'bfloat16', got "
                             "NoneType None"),
])
def test_load_rejects(kwargs, message, one_line_error):
    with pytest.raises(TypeError) as e:
        Medusa.load(**kwargs)
    assert one_line_error.message(e) == message


def test_load_rejects_an_unknown_heads_dtype(one_line_error):
    with pytest.raises(ValueError) as e:
        Medusa.load(heads="default", heads_dtype="float16")
    assert one_line_error.message(e) == ("heads_dtype must be one of float32, bfloat16, "
                                         "got 'float16'")


@pytest.mark.slow
def test_heads_in_bfloat16_draft_and_emit_what_plain_decoding_does():
    """heads_dtype="bfloat16": the heads' matrices in bfloat16, their biases as they were;
    greedy decoding still emits plain decoding's tokens, and the heads still draft."""
    import jax.numpy as jnp

    m = Medusa.load(heads="hydra", heads_dtype="bfloat16")
    assert m.heads["in_w"].dtype == m.heads["proj"].dtype == jnp.bfloat16
    assert m.heads["in_b"].dtype == m.heads["proj_b"].dtype == jnp.float32
    prompts = ["Once upon a time", "The little dog"]
    fast = m.generate(prompts, max_new_tokens=32)
    plain = m.generate(prompts, max_new_tokens=32, medusa=False)
    assert [g.token_ids for g in fast] == [g.token_ids for g in plain]
    assert sum(g.tokens_per_step for g in fast) / 2 > 1.5


def test_load_names_an_invalid_model_config_not_the_tokenizer(tmp_path, one_line_error):
    d = tmp_path / "model"
    shutil.copytree(default_model_dir(), d)
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    with pytest.raises(ValueError) as e:
        Medusa.load(d)
    assert "config.json" in one_line_error.message(e) and "tokenizer" not in str(e.value)


def test_load_model_without_tokenizer(tmp_path, one_line_error):
    d = tmp_path / "model"
    shutil.copytree(default_model_dir(), d,
                    ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(WeightsError) as e:
        Medusa.load(d)
    assert one_line_error.message(e) == (f"{d}: no tokenizer in this folder (looked for "
                                         f"tokenizer.json, tokenizer.model, "
                                         f"tokenizer_config.json)")


# ---- the first minutes


@pytest.mark.slow
def test_the_notebook_api_says_when_it_compiles_and_explains_its_results(capsys):
    from medusa_jax.api import Medusa

    m = Medusa.load(heads="default")
    capsys.readouterr()
    first = m.generate(["Once upon a time", "Lily"], max_new_tokens=20, batch_size=2)
    err = capsys.readouterr().err
    assert err.startswith("compiling the decoder (first call) ...") and err.count("\n") == 1
    line = m.last_timing.line()
    assert line.startswith("2 prompts, medusa stories260K_cpu greedy: compiled in ")
    steps = sum(g.steps for g in first)
    assert line.endswith(f"tokens/step ({steps} steps)")
    m.generate(["Once upon a time", "Lily"], max_new_tokens=20, batch_size=2)
    assert capsys.readouterr().err == ""  # compiled already: no line
    for g in first:
        assert sum(g.accept_hist) == g.steps
        assert sum(n * c for n, c in enumerate(g.accept_hist)) == g.new_tokens
        assert not g.text.startswith(g.prompt)  # the continuation only
    plain = m.generate(["Lily"], max_new_tokens=8, medusa=False)[0]
    assert plain.accept_hist == [0, plain.steps, 0]
    assert m.last_timing.line().startswith("1 prompt, plain greedy: compiled in ")


# ---- what ends a row, and what a prompt's text means


def test_text_prompts_are_text_as_the_server_reads_them(model):
    from medusa_jax.serving.server import TextEncoder as ServerEncoder

    assert ServerEncoder.__module__ == "medusa_jax.text.encoder"  # one rule, not a copy

    ids = model.encode("A</s>B")
    assert ids == ServerEncoder(model.tokenizer).prompt("A</s>B")
    eos = model.tokenizer.eos_token_id
    assert eos not in ids and model.tokenizer.decode(ids, skip_special_tokens=True) == "A</s>B"
    assert model.encode([1, eos, 5]) == [1, eos, 5]  # a control token: given as its id


@pytest.mark.slow
def test_infer_generate_reads_a_prompt_as_text(model, monkeypatch, capsys):
    from infer import generate as cli

    want, seen, encode = model.encode("A</s>B"), [], Medusa.encode
    monkeypatch.setattr(Medusa, "encode",
                        lambda self, p, where="prompt": seen.append(encode(self, p, where))
                        or seen[-1])
    assert cli.main(["--prompt", "A</s>B", "--max-new-tokens", "1", "--json"]) == 0
    assert seen == [want]


@pytest.mark.slow
def test_eos_ids_of_generation_config_end_decoding(model_folder):
    d = model_folder()
    plain = Medusa.load(d).generate("Once upon a time", max_new_tokens=24)[0].token_ids
    at = next(i for i, t in enumerate(plain) if i >= 3 and t not in plain[:i])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, plain[at]]}))
    m = Medusa.load(d)
    assert plain[at] in m.eos  # the server's stop tokens are these too (`Engine.eos`)
    assert m.generate("Once upon a time", max_new_tokens=24)[0].token_ids == plain[:at + 1]
