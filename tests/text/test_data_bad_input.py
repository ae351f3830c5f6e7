"""Hostile data files (`medusa_jax.text.data.read_file`): empty, not UTF-8, a byte order
mark; every error is one line naming the file (and line)."""

import json

import pytest

from medusa_jax.text import data
from medusa_jax.text.data import DataError


@pytest.mark.parametrize("name, content, message", [
    ("zero.jsonl", b"", "the file is empty"),
    ("blank.json", b" \n\t\n", "the file is empty (whitespace only)"),
    ("zero.txt", b"", "the file is empty"),
    ("blank.txt", b"\n\n  \n", "the file is empty (whitespace only)"),
    ("array.json", b"[]", "the file holds no records (an empty JSON array)"),
])
@pytest.mark.parametrize("fmt", ["auto", "sharegpt"])
def test_empty_data_file(tmp_path, name, content, message, fmt, one_line_error):
    f = tmp_path / name
    f.write_bytes(content)
    if fmt == "sharegpt" and name.endswith(".txt"):
        fmt = "text"
    with pytest.raises(DataError) as e:
        data.read_file(f, fmt)
    assert one_line_error.message(e) == f"{f}: {message}"


@pytest.mark.parametrize("name", ["chats.jsonl", "stories.txt"])
def test_non_utf8_data_file_names_the_line(tmp_path, name, one_line_error):
    f = tmp_path / name
    good = json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                         {"from": "gpt", "value": "hello"}]}).encode()
    f.write_bytes(good + b"\n" + good + b"\n" + b'{"x": "caf\xe9"}\n')
    with pytest.raises(DataError) as e:
        data.read_file(f)
    offset = 2 * (len(good) + 1) + 10
    assert one_line_error.message(e) == (f"{f}:3: not UTF-8 text (byte 0xe9 at offset "
                                         f"{offset}: invalid continuation byte)")


def test_data_file_with_a_byte_order_mark(tmp_path):
    f = tmp_path / "bom.jsonl"
    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(rec).encode() + b"\n")
    assert data.read_file(f) == [[("user", "hi"), ("assistant", "yo")]]
