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
