"""Hostile prompt files (`infer.generate --prompts-file`, `infer.bench --prompts`, read by
`read_prompt_file`): every error is one line naming the file and line."""

import pytest

from medusa_jax.tools.bench import read_prompt_file


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
def test_bad_prompt_files(tmp_path, content, message, one_line_error):
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_prompt_file(f)
    assert one_line_error.message(e) == f"{f}:{message}"


def test_good_prompt_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "category": "c"}\n{"turns": ["b", "x"]}\nplain\n')
    assert read_prompt_file(f) == [("a", "c"), ("b", None), ("plain", None)]
