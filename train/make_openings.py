"""Rebuild medusa_jax/assets/prompts/{train,heldout}_openings.txt from TinyStories text.

The source is plain text with stories separated by blank lines, but paragraphs inside a
story are separated by blank lines too, so a story's start is recognised by its opener
("Once upon a time", "Once there was", "One day, a ...", "There was ...", "Long ago ...").
The opening is the story's first sentence when it has at most 12 words, else its first 10
words (an unfinished sentence is a fine prompt for a story model). Duplicates are dropped
and a stable hash of the text sends about one opening in five to the held-out file.

    python -m train.make_openings [--source FILE] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

DEFAULT_SOURCE = "/work/shared/data/tinystories/train_head.txt"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "medusa_jax" / "assets" / "prompts"

OPENER = re.compile(
    r"^(Once\b|One (sunny |bright |warm |cold |rainy |beautiful )?day, (a|an|there)\b"
    r"|There (once )?(was|were|lived)\b|Long(, long)? ago\b)")
SENTENCE_END = re.compile(r"(?<=[.!?])\s")
MAX_SENTENCE_WORDS = 12
CUT_WORDS = 10
HELDOUT_EVERY = 5


def story_starts(text: str) -> list[str]:
    """The first paragraph of each story (the file's first paragraph always starts one)."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    return [p for i, p in enumerate(paragraphs) if i == 0 or OPENER.match(p)]


def opening(paragraph: str) -> str:
    first = SENTENCE_END.split(paragraph, maxsplit=1)[0]
    words = first.split()
    if len(words) <= MAX_SENTENCE_WORDS:
        return first
    return " ".join(words[:CUT_WORDS])


def is_heldout(line: str) -> bool:
    # a content hash, not a position: editing the source does not reshuffle the split
    return int(hashlib.sha256(line.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def build(source: Path) -> tuple[list[str], list[str]]:
    seen, train, heldout = set(), [], []
    for p in story_starts(source.read_text(encoding="utf-8")):
        line = opening(p)
        if line in seen:
            continue
        seen.add(line)
        (heldout if is_heldout(line) else train).append(line)
    return train, heldout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=DEFAULT_SOURCE)
    ap.add_argument("--out-dir", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    source = Path(args.source)
    if not source.is_file():
        ap.error(f"{source}: no such file")
    train, heldout = build(source)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_openings.txt").write_text("\n".join(train) + "\n", encoding="utf-8")
    (out / "heldout_openings.txt").write_text("\n".join(heldout) + "\n", encoding="utf-8")
    print(f"{len(train)} train and {len(heldout)} held-out openings written to {out}")


if __name__ == "__main__":
    main()
