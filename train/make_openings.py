"""Rebuild the TinyStories-derived assets from TinyStories text: story openings
(medusa_jax/assets/prompts/{train,heldout}_openings.txt) and the stories themselves
(medusa_jax/assets/text/tinystories_{train,heldout}.txt).

The source is plain text with stories separated by blank lines, but paragraphs inside a
story are separated by blank lines too, so a story's start is recognised by its opener
("Once upon a time", "Once there was", "One day, a ...", "There was ...", "Long ago ...").
The opening is the story's first sentence when it has at most 12 words, else its first 10
words (an unfinished sentence is a fine prompt for a story model). Duplicates are dropped
and a stable hash of the text sends about one opening in five to the held-out file. A story
goes where its opening goes: held-out stories are only ever evaluated on (perplexity), the
training stories anchor Medusa-2's self-distillation (train.medusa2 --anchor-text).

    python -m train.make_openings --out-dir DIR [--source FILE] [--text-dir DIR]
    # the shipped ones:
    python -m train.make_openings --out-dir medusa_jax/assets/prompts \
        --text-dir medusa_jax/assets/text

The output folder is always given (the package's own assets are never a default), the text
goes next to the openings unless --text-dir says otherwise, and a source that holds no story
opening (or is not UTF-8 text) is refused in one line before anything is written.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

from medusa_jax.runtime import assets
from medusa_jax.text.data import DataError, read_text

DEFAULT_SOURCE = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories"
                     / "train_head.txt")  # ../shared next to the project
# where the shipped files live (rebuilt only when given as --out-dir / --text-dir)
DEFAULT_OUT = assets.prompts_file("train").parent
DEFAULT_TEXT_OUT = assets.text_file("train").parent

OPENER = re.compile(
    r"^(Once\b|One (sunny |bright |warm |cold |rainy |beautiful )?day, (a|an|there)\b"
    r"|There (once )?(was|were|lived)\b|Long(, long)? ago\b)")
SENTENCE_END = re.compile(r"(?<=[.!?])\s")
MAX_SENTENCE_WORDS = 12
CUT_WORDS = 10
HELDOUT_EVERY = 5


def stories(text: str) -> list[list[str]]:
    """The stories as lists of paragraphs (whitespace normalised): a story is an opener
    paragraph and the paragraphs up to the next one (the file's first paragraph always
    starts one)."""
    out: list[list[str]] = []
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    for i, p in enumerate(paragraphs):
        if i == 0 or OPENER.match(p):
            out.append([p])
        else:
            out[-1].append(p)
    return out


def story_starts(text: str) -> list[str]:
    """The first paragraph of each story."""
    return [s[0] for s in stories(text)]


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
    for p in story_starts(read_text(source)):
        line = opening(p)
        if line in seen:
            continue
        seen.add(line)
        (heldout if is_heldout(line) else train).append(line)
    return train, heldout


def split_stories(source: Path) -> tuple[list[str], list[str]]:
    """(train, held-out) stories, each one string with its paragraphs joined by newlines; a
    story is held out exactly when its opening is."""
    train, heldout = [], []
    for s in stories(read_text(source)):
        (heldout if is_heldout(opening(s[0])) else train).append("\n".join(s))
    return train, heldout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=DEFAULT_SOURCE)
    ap.add_argument("--out-dir", required=True,
                    help=f"folder for the openings (the shipped ones: {DEFAULT_OUT})")
    ap.add_argument("--text-dir", help=f"folder for the stories (default: --out-dir; the "
                                        f"shipped ones: {DEFAULT_TEXT_OUT})")
    args = ap.parse_args(argv)
    source = Path(args.source)
    if not source.is_file():
        ap.error(f"{source}: no such file")
    try:
        text = read_text(source)
    except DataError as e:
        ap.error(str(e))
    if not any(OPENER.match(p) for p in story_starts(text)):
        ap.error(f"{source}: no story opening in it (a paragraph starting 'Once', 'One day, "
                 f"a', 'There was', 'Long ago', ...): not TinyStories text?")
    train, heldout = build(source)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_openings.txt").write_text("\n".join(train) + "\n", encoding="utf-8")
    (out / "heldout_openings.txt").write_text("\n".join(heldout) + "\n", encoding="utf-8")
    print(f"{len(train)} train and {len(heldout)} held-out openings written to {out}")
    train_s, heldout_s = split_stories(source)
    text_out = Path(args.text_dir or args.out_dir)
    text_out.mkdir(parents=True, exist_ok=True)
    # one story per document: stories separated by blank lines (data's plain-text format)
    for name, rows in (("tinystories_train.txt", train_s), ("tinystories_heldout.txt", heldout_s)):
        (text_out / name).write_text("\n\n".join(rows) + "\n", encoding="utf-8")
    print(f"{len(train_s)} train and {len(heldout_s)} held-out stories written to {text_out}")


if __name__ == "__main__":
    main()
