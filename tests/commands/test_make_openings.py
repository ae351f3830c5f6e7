"""The TinyStories-derived assets: rebuilt from the source, and a clean train/held-out split."""

from pathlib import Path

import pytest

from train import make_openings as mo

SOURCE = Path(mo.DEFAULT_SOURCE)


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_held_out_stories_never_share_an_opening_with_training():
    train_open = set(_lines(mo.DEFAULT_OUT / "train_openings.txt"))
    held_open = set(_lines(mo.DEFAULT_OUT / "heldout_openings.txt"))
    assert train_open and held_open and not train_open & held_open
    for name, openings in (("tinystories_train.txt", train_open),
                           ("tinystories_heldout.txt", held_open)):
        stories = (mo.DEFAULT_TEXT_OUT / name).read_text(encoding="utf-8").strip().split("\n\n")
        assert stories
        for story in stories:
            assert mo.opening(story.split("\n")[0]) in openings, (name, story[:60])


@pytest.mark.skipif(not SOURCE.is_file(), reason=f"{SOURCE} (the shared TinyStories text) absent")
def test_shipped_assets_are_what_the_script_builds(tmp_path):
    mo.main(["--source", str(SOURCE), "--out-dir", str(tmp_path), "--text-dir", str(tmp_path)])
    for d, name in ((mo.DEFAULT_OUT, "train_openings.txt"), (mo.DEFAULT_OUT, "heldout_openings.txt"),
                    (mo.DEFAULT_TEXT_OUT, "tinystories_train.txt"),
                    (mo.DEFAULT_TEXT_OUT, "tinystories_heldout.txt")):
        assert (tmp_path / name).read_text() == (d / name).read_text(), name


# ---- hostile sources: one line, and nothing written


def _run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        mo.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err)
    return err[-1]


def test_a_source_without_story_openings_is_refused(tmp_path, capsys):
    src = tmp_path / "notes.txt"
    src.write_text("Shopping list: eggs, milk.\n\nCall the plumber on Monday.\n")
    out = tmp_path / "out"
    err = _run(["--source", str(src), "--out-dir", str(out)], capsys)
    assert err.endswith(f"{src}: no story opening in it (a paragraph starting 'Once', "
                        f"'One day, a', 'There was', 'Long ago', ...): not TinyStories text?")
    assert not out.exists()


def test_a_non_utf8_source_is_one_line(tmp_path, capsys):
    src = tmp_path / "s.txt"
    src.write_bytes(b"Once upon a time there was a cat.\n\nOnce \xff there was a dog.\n")
    err = _run(["--source", str(src), "--out-dir", str(tmp_path / "out")], capsys)
    assert err.endswith(f"{src}:3: not UTF-8 text (byte 0xff at offset 40: invalid start byte)")


def test_the_package_assets_are_never_the_default_output(tmp_path, capsys):
    src = tmp_path / "s.txt"
    src.write_text("Once upon a time there was a cat.\n")
    before = {p: p.read_bytes() for d in (mo.DEFAULT_OUT, mo.DEFAULT_TEXT_OUT)
              for p in d.iterdir()}
    err = _run(["--source", str(src)], capsys)
    assert "--out-dir" in err
    assert {p: p.read_bytes() for p in before} == before


def test_text_goes_next_to_the_openings_unless_told(tmp_path):
    src = tmp_path / "s.txt"
    src.write_text("".join(f"Once upon a time there was cat number {i}.\n\n" for i in range(20)))
    mo.main(["--source", str(src), "--out-dir", str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "heldout_openings.txt", "tinystories_heldout.txt", "tinystories_train.txt",
        "train_openings.txt"]
