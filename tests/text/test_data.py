"""Data loading: rendering and labels, packing, error messages, the resumable iterator."""

import copy
import json

import numpy as np
import pytest

from medusa_jax.text import data
from medusa_jax.text.data import DataError


@pytest.fixture(scope="module")
def tok(stories):
    return stories[2]


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sharegpt(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


# ----------------------------------------------------------------------------- rendering


def test_plain_template_labels_only_the_answer(tok):
    conv = [("user", "Once upon a time"), ("assistant", "there was a cat.")]
    ids, mask = data.render(conv, tok, "plain")
    prompt, answer = enc(tok, "Once upon a time"), enc(tok, "there was a cat.")
    assert ids == [tok.bos_token_id] + prompt + answer
    assert mask == [False] * (1 + len(prompt)) + [True] * len(answer)
    assert data.render_prompt(conv, tok, "plain") == [tok.bos_token_id] + prompt


def test_vicuna_template_masks_user_turns_and_labels_eos(tok):
    conv = [("user", "Hi there"), ("assistant", "Hello friend"),
            ("user", "Tell a story"), ("assistant", "Once a dog ran")]
    ids, mask = data.render(conv, tok, "vicuna")
    labelled = [t for t, m in zip(ids, mask) if m]
    eos = tok.eos_token_id
    # exactly the two answers, each closed by a labelled EOS
    assert labelled == enc(tok, " Hello friend") + [eos] + enc(tok, " Once a dog ran") + [eos]
    unlabelled = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert "Hi there" in unlabelled and "Tell a story" in unlabelled
    assert "ASSISTANT:" in unlabelled and data.VICUNA_SYSTEM[:20] in unlabelled
    prompt = data.render_prompt(conv, tok, "vicuna")
    assert prompt == ids[:len(prompt)] and not any(mask[:len(prompt)])
    assert tok.decode(prompt).rstrip().endswith("ASSISTANT:")


def test_chat_template_labels_assistant_content(tok):
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} <END> {% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}")
    assert data.resolve_template("auto", chat_tok) == "chat"
    conv = [("system", "Be nice."), ("user", "Hi"), ("assistant", "Hello you"),
            ("user", "Bye"), ("assistant", "See you")]
    ids, mask = data.render(conv, chat_tok, "chat")
    labelled = chat_tok.decode([t for t, m in zip(ids, mask) if m])
    assert "Hello you" in labelled and "See you" in labelled
    assert "Hi" not in labelled.replace("Hello", "") and "Bye" not in labelled
    assert "[assistant]" not in labelled  # the generation prompt is context, not a label
    prompt = chat_tok.decode(data.render_prompt(conv, chat_tok, "chat"))
    assert prompt.rstrip().endswith("[assistant]") and "Hello you" not in prompt


def test_auto_template_without_chat_template_is_vicuna(tok):
    assert getattr(tok, "chat_template", None) is None
    assert data.resolve_template("auto", tok) == "vicuna"
    with pytest.raises(DataError, match="no chat template"):
        data.resolve_template("chat", tok)


# ----------------------------------------------------------------------------- packing


def test_pack_segments_positions_and_truncation():
    rep = data.LoadReport()
    examples = [([1, 5, 6, 7], [False, False, True, True]),
                ([1, 8, 9], [False, True, True]),
                ([1, 2, 3, 4, 5, 6, 7, 8, 9], [False, True] * 4 + [True]),  # too long
                (list(range(1, 11)), [False] * 9 + [True])]  # its only label is cut off
    p = data.pack(examples, seq_len=8, report=rep)
    assert rep.truncated == 2 and rep.dropped_after_truncation == 1
    np.testing.assert_array_equal(p.segments[0], [1, 1, 1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(p.positions[0], [0, 1, 2, 3, 0, 1, 2, 0])
    np.testing.assert_array_equal(p.tokens[0, :7], [1, 5, 6, 7, 1, 8, 9])
    np.testing.assert_array_equal(p.segments[1], [1] * 8)
    assert len(p) == 2
    assert not p.loss_mask[p.segments == 0].any()


def test_padding_never_masks_a_real_eos_or_pad_valued_token():
    # token 0 is also the padding value and here is a real label (e.g. an EOS = pad id)
    p = data.pack([([1, 4, 0], [False, True, True])], seq_len=6)
    np.testing.assert_array_equal(p.tokens[0], [1, 4, 0, 0, 0, 0])
    np.testing.assert_array_equal(p.loss_mask[0], [False, True, True, False, False, False])


def test_eos_label_survives_packing(tok):
    ids, mask = data.render([("user", "Hi"), ("assistant", "Yo")], tok, "vicuna")
    p = data.pack([(ids, mask)], seq_len=len(ids) + 5)
    eos_at = len(ids) - 1
    assert p.tokens[0, eos_at] == tok.eos_token_id and p.loss_mask[0, eos_at]


# ----------------------------------------------------------------------------- files


@pytest.mark.slow
def test_sharegpt_alpaca_text_and_skipped_counts(tmp_path, tok):
    f1 = write_jsonl(tmp_path / "a.jsonl", [
        sharegpt(("human", "Tell me"), ("gpt", "A story.")),
        {"conversations": "oops"},  # wrong type
        {"no": "conversations"},  # missing field
        sharegpt(("human", "Hi"), ("alien", "?")),  # unknown role
        sharegpt(("system", "Be brief."), ("human", "Q"), ("gpt", "A")),
    ])
    f2 = tmp_path / "b.json"
    f2.write_text(json.dumps([{"instruction": "Add", "input": "1 and 2", "output": "3"},
                              {"instruction": "No output"}]))
    f3 = tmp_path / "c.txt"
    f3.write_text("First doc line one.\nline two.\n\n  \nSecond doc.\n")
    rep = data.LoadReport()
    convs = data.read_files([f1, f2, f3], "auto", rep)
    assert rep.records == len(convs) == 2 + 1 + 2
    assert sum(rep.skipped.values()) == 4
    assert convs[2] == [("user", "Add\n\n1 and 2"), ("assistant", "3")]
    assert convs[3] == [("text", "First doc line one.\nline two.")]  # line breaks kept
    ids, mask = data.render(convs[3], tok, "vicuna")  # text documents: all labels but BOS
    assert ids[0] == tok.bos_token_id and not mask[0] and all(mask[1:])
    packed, rep2 = data.load([f1], tok, seq_len=64, template="plain")
    assert rep2.records == 2 and len(packed) == 1


def test_missing_file_error(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such data file"):
        data.read_file(tmp_path / "nope.jsonl")


def test_jsonl_error_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(sharegpt(("human", "a"), ("gpt", "b"))) + "\n\n{broken\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON") as e:
        data.read_file(f)
    assert "\n" not in str(e.value)


def test_json_array_error_names_line(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('[\n{"instruction": "a", "output": "b"},\n{"instruction": }\n]')
    with pytest.raises(DataError, match=r"bad\.json:3: invalid JSON"):
        data.read_file(f)


def test_file_without_usable_records(tmp_path):
    f = write_jsonl(tmp_path / "empty.jsonl", [{"conversations": []}, {"x": 1}])
    with pytest.raises(DataError, match=r"empty\.jsonl: no usable record \(2 skipped"):
        data.read_file(f, "sharegpt")
    g = tmp_path / "blank.jsonl"
    g.write_text("\n\n")
    with pytest.raises(DataError, match=r"blank\.jsonl: the file is empty"):
        data.read_file(g)
    h = tmp_path / "spaces.txt"
    h.write_text("  \n\n \n")
    with pytest.raises(DataError, match=r"spaces\.txt: the file is empty"):
        data.read_file(h)


def test_unknown_format_and_template(tmp_path):
    f = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match="--data-format"):
        data.read_file(f)
    with pytest.raises(DataError, match="unknown data format"):
        data.read_file(f, "csv")


# ----------------------------------------------------------------------------- iterator


def toy_packed(n=7, t=4):
    tokens = np.arange(n * t, dtype=np.int32).reshape(n, t)
    return data.Packed(tokens=tokens, positions=np.zeros_like(tokens),
                       segments=np.ones_like(tokens), loss_mask=np.ones((n, t), bool))


def test_iterator_is_deterministic_and_resumable():
    p = toy_packed()
    straight = [next(it)["tokens"] for it in [data.BatchIterator(p, 3, seed=1)] for _ in range(9)]
    again = data.BatchIterator(p, 3, seed=1)
    first = [next(again)["tokens"] for _ in range(4)]
    resumed = data.BatchIterator(p, 3, seed=1, position=again.position)
    rest = [next(resumed)["tokens"] for _ in range(5)]
    for a, b in zip(straight, first + rest):
        np.testing.assert_array_equal(a, b)
    other_seed = [next(it)["tokens"] for it in [data.BatchIterator(p, 3, seed=2)] for _ in range(9)]
    assert not all(np.array_equal(a, b) for a, b in zip(straight, other_seed))


def test_iterator_visits_every_row_once_per_epoch():
    p = toy_packed(n=6)
    it = data.BatchIterator(p, 2, seed=0)
    rows = np.concatenate([next(it)["tokens"][:, 0] for _ in range(6)])  # two epochs
    for epoch in (rows[:6], rows[6:]):
        assert sorted(epoch.tolist()) == sorted(p.tokens[:, 0].tolist())
    assert not np.array_equal(rows[:6], rows[6:])  # reshuffled


def test_eval_batches_pad_with_label_free_rows():
    batches = data.eval_batches(toy_packed(n=5), 2)
    assert len(batches) == 3
    last = batches[-1]
    assert last["tokens"].shape == (2, 4)
    assert not last["loss_mask"][1].any() and not last["segments"][1].any()


def test_concat_flags_rows_and_batches_carry_the_flag():
    a = data.pack([([1, 2, 3], [False, True, True])] * 3, seq_len=4)
    b = data.pack([([4, 5, 6, 7], [True] * 4)] * 2, seq_len=4)
    both = data.concat([a, b], lm_only=[False, True])
    assert len(both) == 5 and both.lm_only.tolist() == [False, False, False, True, True]
    np.testing.assert_array_equal(both.tokens[3:], b.tokens)
    batch = next(data.BatchIterator(both, batch_size=5))
    assert batch["lm_only"].shape == (5,)
    # each row keeps its own flag through the shuffle
    assert batch["lm_only"].tolist() == [t == 4 for t in batch["tokens"][:, 0]]
    assert "lm_only" not in a.rows(np.arange(2))
    with pytest.raises(DataError, match="row lengths"):
        data.concat([a, data.pack([([1, 2], [False, True])], seq_len=3)], [False, True])


def test_text_documents_keep_line_breaks_and_split_at_them(tmp_path, tok):
    f = tmp_path / "t.txt"
    f.write_text("First line of  one.\nSecond line of one.\n\n\nDoc two.\n")
    convs = data.read_file(f, "text")
    assert convs == [[("text", "First line of one.\nSecond line of one.")],
                     [("text", "Doc two.")]]
    lines = [f"Line number {i} of a long story about a cat." for i in range(40)]
    long_doc = [("text", "\n".join(lines))]
    parts = data.split_documents([long_doc, [("user", "hi"), ("assistant", "yo")]], tok, 64)
    assert parts[-1] == [("user", "hi"), ("assistant", "yo")]
    texts = [p[0][1] for p in parts[:-1]]
    assert len(texts) > 2 and "\n".join(texts) == long_doc[0][1]  # nothing lost or reordered
    for t in texts:
        assert len(data.render([("text", t)], tok, "plain")[0]) <= 64
