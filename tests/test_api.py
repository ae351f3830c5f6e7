"""Hostile input to the notebook API, data files and prompt files: every error is one line
that names the argument (and the prompt's index) or the file (and line), raised before any
work is compiled. (Checkpoint, tree and weights cases live in their own test files.)"""

import json
import shutil

import numpy as np
import pytest

from medusa_jax import api
from medusa_jax.text import data
from medusa_jax.api import Medusa
from medusa_jax.tools.bench import read_prompt_file
from medusa_jax.text.data import DataError
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


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


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
def test_generate_rejects(model, no_decoding, prompts, kwargs, error, message):
    with pytest.raises(error) as e:
        model.generate(prompts, **kwargs)
    assert one_line(e) == message


def test_plain_decoding_may_fill_the_whole_context(model):
    """400 + 112 = 512 tokens (like "Lily" + 510): plain decoding feeds no tree, and its last
    token is emitted, never fed, so nothing more is needed."""
    out = model.generate([[1] + [403] * 399], max_new_tokens=112, medusa=False)
    assert 1 <= out[0].new_tokens <= 112


def test_generate_checks_the_tree_against_the_vocabulary(model, no_decoding, tmp_path):
    f = tmp_path / "wide.json"
    f.write_text(json.dumps([[0], [600]]))
    with pytest.raises(ValueError) as e:
        model.generate(["Lily"], tree=f)
    assert one_line(e) == (f"tree {str(f)!r}: rank 600 is beyond the model's vocabulary of "
                           f"512 tokens (ranks must be < 512)")


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
def test_load_rejects(kwargs, message):
    with pytest.raises(TypeError) as e:
        Medusa.load(**kwargs)
    assert one_line(e) == message


def test_load_names_an_invalid_model_config_not_the_tokenizer(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(default_model_dir(), d)
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    with pytest.raises(ValueError) as e:
        Medusa.load(d)
    assert "config.json" in one_line(e) and "tokenizer" not in str(e.value)


def test_load_model_without_tokenizer(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(default_model_dir(), d,
                    ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(WeightsError) as e:
        Medusa.load(d)
    assert one_line(e) == (f"{d}: no tokenizer in this folder (looked for tokenizer.json, "
                           f"tokenizer.model, tokenizer_config.json)")


# ---- data files


@pytest.mark.parametrize("name, content, message", [
    ("zero.jsonl", b"", "the file is empty"),
    ("blank.json", b" \n\t\n", "the file is empty (whitespace only)"),
    ("zero.txt", b"", "the file is empty"),
    ("blank.txt", b"\n\n  \n", "the file is empty (whitespace only)"),
    ("array.json", b"[]", "the file holds no records (an empty JSON array)"),
])
@pytest.mark.parametrize("fmt", ["auto", "sharegpt"])
def test_empty_data_file(tmp_path, name, content, message, fmt):
    f = tmp_path / name
    f.write_bytes(content)
    if fmt == "sharegpt" and name.endswith(".txt"):
        fmt = "text"
    with pytest.raises(DataError) as e:
        data.read_file(f, fmt)
    assert one_line(e) == f"{f}: {message}"


@pytest.mark.parametrize("name", ["chats.jsonl", "stories.txt"])
def test_non_utf8_data_file_names_the_line(tmp_path, name):
    f = tmp_path / name
    good = json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                         {"from": "gpt", "value": "hello"}]}).encode()
    f.write_bytes(good + b"\n" + good + b"\n" + b'{"x": "caf\xe9"}\n')
    with pytest.raises(DataError) as e:
        data.read_file(f)
    offset = 2 * (len(good) + 1) + 10
    assert one_line(e) == (f"{f}:3: not UTF-8 text (byte 0xe9 at offset {offset}: invalid "
                           f"continuation byte)")


def test_data_file_with_a_byte_order_mark(tmp_path):
    f = tmp_path / "bom.jsonl"
    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(rec).encode() + b"\n")
    assert data.read_file(f) == [[("user", "hi"), ("assistant", "yo")]]


# ---- prompt files (infer.generate --prompts-file, infer.bench --prompts)


@pytest.mark.parametrize("content, message", [
    (b"Once upon a time\nLily \xff\n", "2: not UTF-8 text (byte 0xff at offset 22: invalid "
                                       "start byte)"),
    (b'{"prompt": "a"}\n{"prompt": 5}\n', "2: 'prompt' must be a string, got int 5"),
    (b'{"prompt": null}\n', "1: 'prompt' must be a string, got NoneType None"),
    (b'{"turns": [["a"]]}\n', "1: 'turns[0]' must be a string, got list ['a']"),
    (b'{"turns": "abc"}\n', "1: 'turns' must be a non-empty list of strings, got str 'abc'"),
    (b'{"turns": []}\n', "1: 'turns' must be a non-empty list of strings, got list []"),
    (b'{"prompt": "  "}\n', "1: 'prompt' is empty"),
    (b'{"text": "a"}\n', "1: no 'prompt' or 'turns' field"),
    (b'{"prompt": "a"\n', "1: invalid JSON (Expecting ',' delimiter)"),
    (b'{"prompt": "a"}\n[1,2,3]\n', "2: a JSON array, not a prompt: give text, or an object "
                                     "with 'prompt' or 'turns' (token ids are not read from "
                                     "prompt files)"),
    (b"", " the file is empty"),
    (b"\n \n", " the file is empty (whitespace only)"),
])
def test_bad_prompt_files(tmp_path, content, message):
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_prompt_file(f)
    assert one_line(e) == f"{f}:{message}"


def test_good_prompt_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "category": "c"}\n{"turns": ["b", "x"]}\nplain\n')
    assert read_prompt_file(f) == [("a", "c"), ("b", None), ("plain", None)]
