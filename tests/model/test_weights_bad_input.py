"""Broken weights are reported from the safetensors headers, before the tokenizer or anything
else loads."""


import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from medusa_jax.model.weights import WeightsError, check_headers
from medusa_jax.text import tokenizer as startup


def test_truncated_and_garbage_headers_are_named_from_the_header_alone(model_folder):
    d = model_folder()
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=r"model\.safetensors: corrupt or truncated "
                                           r"safetensors file \(tensor \S+ ends at byte \d+ "
                                           r"of its data; the file holds \d+: truncated\)"):
        check_headers(d)
    f.write_bytes(b"\x07garbage" * 10)
    with pytest.raises(WeightsError, match="its header claims"):
        check_headers(d)
    f.write_bytes((16).to_bytes(8, "little") + b"{not json}      ")
    with pytest.raises(WeightsError, match="its header is not JSON"):
        check_headers(d)


def test_a_nan_weight_is_refused_before_the_tokenizer_loads(monkeypatch, model_folder):
    from medusa_jax.api import Medusa

    d = model_folder()
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"][3] = np.nan
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})

    def no_tokenizer(path):
        raise AssertionError("the tokenizer was loaded before the weights were checked")

    monkeypatch.setattr(startup, "load_tokenizer", no_tokenizer)
    with pytest.raises(WeightsError, match="tensor model.norm.weight holds 1 non-finite"):
        Medusa.load(d)


@pytest.mark.parametrize("index, says", [
    (b'{"weight_map": {"a": "model\xff.safetensors"}}', "UnicodeDecodeError"),
    (b'{"weight_map": ["model.safetensors"]}', "AttributeError"),
    (b'{"weight_map": {"a": 5}}', "TypeError"),
])
def test_a_bad_index_is_named(model_folder, index, says):
    from medusa_jax.model.weights import weight_files

    d = model_folder()
    (d / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(WeightsError) as e:
        weight_files(d)
    msg = str(e.value)
    assert msg.startswith(f"{d / 'model.safetensors.index.json'}: not a valid safetensors "
                          f"index ({says}: ") and "\n" not in msg
