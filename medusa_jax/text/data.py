"""Training data: ShareGPT / Alpaca / plain-text files -> packed, fixed-length batches.

Pipeline: read and validate records on the host (exact file:line errors, bad records skipped
and counted) -> a `datasets.Dataset` of conversations -> `map` renders each one with a
template into token ids plus a loss mask (True on assistant tokens only) -> examples are
packed into rows of `seq_len` tokens -> a deterministic, resumable batch iterator.

A conversation is a list of (role, text) with role in system / user / assistant; a plain-text
document is one `text` turn (every token is a label). Templates:

    chat    the tokenizer's own chat template (rendered turn by turn to find the labels)
    vicuna  "<s>{system} USER: {user} ASSISTANT: {answer}</s>USER: ..."
    plain   "<s>{user}{answer}" with nothing in between: for base models such as the
            TinyStories model, where a "prompt" is the start of a story
    auto    chat when the tokenizer has a template, else vicuna

Packed rows carry a segment id per token (0 = padding) so examples sharing a row never
attend to each other and positions restart at 0 for each. The loss mask is its own array:
it is never derived from `token == pad`, so a real EOS (often the pad id too) keeps its label.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from medusa_jax.text.templates import VICUNA_SYSTEM, vicuna_pieces  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

FORMATS = ("auto", "sharegpt", "alpaca", "text")
TEMPLATES = ("auto", "chat", "vicuna", "plain")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "chatgpt": "assistant", "model": "assistant", "system": "system"}
_TEXT_SUFFIXES = (".txt", ".text", ".md")

Conversation = list[tuple[str, str]]  # [(role, text)], role: system | user | assistant | text


class DataError(ValueError):
    """A data file that cannot be used; the message is one line naming the file."""


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass
class LoadReport:
    """What reading the files found: usable records and skipped ones, by reason."""

    records: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    truncated: int = 0  # examples cut to seq_len
    dropped_after_truncation: int = 0  # examples with no label left after the cut
    tokens: int = 0  # real (non-padding) tokens packed
    label_tokens: int = 0
    rows: int = 0

    def summary(self) -> str:
        skipped = sum(self.skipped.values())
        why = ", ".join(f"{n} {r}" for r, n in self.skipped.most_common())
        return (f"{self.records} records ({skipped} skipped{': ' + why if why else ''}), "
                f"{self.truncated} truncated, {self.dropped_after_truncation} dropped as too "
                f"long, {self.rows} packed rows, {self.tokens} tokens ({self.label_tokens} labels)")


def read_text(path: Path) -> str:
    """A file as UTF-8 text (a leading BOM dropped). DataError in one line when it cannot
    be read, is empty (or whitespace only), or is not UTF-8: then the message gives the line
    and byte offset of the first bad byte."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read the file ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                        f"{e.start}: {e.reason})") from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise DataError(f"{path}: the file is empty" + (" (whitespace only)" if raw else ""))
    return text


def _json_records(path: Path) -> Iterable[tuple[int, object]]:
    """(line number, record) from a JSON array file or a JSONL file."""
    text = read_text(path)
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno})") \
                from None
        # a JSON array has no per-record line numbers; report the record index instead
        return [(i + 1, rec) for i, rec in enumerate(data)]
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}, column {e.colno})") \
                from None
    return out


def _sharegpt(rec) -> Conversation | str:
    """A ShareGPT record -> conversation, or the reason it is skipped."""
    if not isinstance(rec, dict):
        return "not an object"
    conv = rec.get("conversations")
    if conv is None:
        return "missing 'conversations'"
    if not isinstance(conv, list) or not conv:
        return "'conversations' not a non-empty list"
    out = []
    for turn in conv:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) \
                or not isinstance(turn.get("from"), str):
            return "turn without string 'from'/'value'"
        role = _ROLES.get(turn["from"].lower())
        if role is None:
            return f"unknown role {turn['from']!r}"
        out.append((role, turn["value"]))
    if not any(r == "assistant" and t.strip() for r, t in out):
        return "no assistant turn"
    return out


def _alpaca(rec) -> Conversation | str:
    if not isinstance(rec, dict):
        return "not an object"
    ins, inp, output = rec.get("instruction"), rec.get("input", ""), rec.get("output")
    if not isinstance(ins, str) or not isinstance(output, str):
        return "missing string 'instruction'/'output'"
    if inp is None:
        inp = ""
    if not isinstance(inp, str):
        return "'input' not a string"
    if not output.strip():
        return "empty 'output'"
    user = ins + ("\n\n" + inp if inp.strip() else "")
    return [("user", user), ("assistant", output)]


def detect_format(path: Path, first_record=None) -> str:
    if path.suffix.lower() in _TEXT_SUFFIXES:
        return "text"
    if isinstance(first_record, dict):
        if "conversations" in first_record:
            return "sharegpt"
        if "instruction" in first_record:
            return "alpaca"
    raise DataError(f"{path}: cannot tell the data format from the first record; "
                    f"pass --data-format sharegpt|alpaca|text")


def read_file(path: str | Path, fmt: str = "auto",
              report: LoadReport | None = None) -> list[Conversation]:
    """Read one file into conversations; bad records are skipped and counted in `report`."""
    path = Path(path)
    report = report if report is not None else LoadReport()
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    skipped = collections.Counter()
    if fmt == "text" or (fmt == "auto" and path.suffix.lower() in _TEXT_SUFFIXES):
        text = read_text(path)
        # documents are separated by blank lines; a document keeps its line breaks
        docs = ["\n".join(" ".join(ln.split()) for ln in d.splitlines() if ln.strip())
                for d in re.split(r"\n\s*\n", text)]
        convs = [[("text", d)] for d in docs if d]
    else:
        records = _json_records(path)
        if not records:
            raise DataError(f"{path}: the file holds no records (an empty JSON array)")
        if fmt == "auto":
            fmt = detect_format(path, records[0][1] if records else None)
        parse = _sharegpt if fmt == "sharegpt" else _alpaca
        convs = []
        for lineno, rec in records:
            conv = parse(rec)
            if isinstance(conv, str):
                skipped[conv] += 1
                log.debug("%s:%d: skipped (%s)", path, lineno, conv)
            else:
                convs.append(conv)
    if skipped:
        log.warning("%s: skipped %d bad records (%s)", path, sum(skipped.values()),
                    ", ".join(f"{n} {r}" for r, n in skipped.most_common()))
    if not convs:
        why = f" ({sum(skipped.values())} skipped: " + ", ".join(skipped) + ")" if skipped else ""
        raise DataError(f"{path}: no usable record{why}")
    report.records += len(convs)
    report.skipped.update(skipped)
    return convs


def split_documents(convs: list[Conversation], tokenizer, max_tokens: int
                    ) -> list[Conversation]:
    """Plain documents longer than `max_tokens` (with BOS) cut at line breaks into several,
    so packing keeps all of their text instead of truncating it; a single line too long
    stays whole (and is truncated when packed). Conversations pass unchanged."""
    out: list[Conversation] = []
    for conv in convs:
        if len(conv) != 1 or conv[0][0] != "text":
            out.append(conv)
            continue
        part: list[str] = []
        used = len(_bos(tokenizer))
        for line in conv[0][1].split("\n"):
            n = len(encode(tokenizer, line)) + 1  # the line and its newline
            if part and used + n > max_tokens:
                out.append([("text", "\n".join(part))])
                part, used = [], len(_bos(tokenizer))
            part.append(line)
            used += n
        out.append([("text", "\n".join(part))])
    return out


# ----------------------------------------------------------------------------- templates


def resolve_template(template: str, tokenizer) -> str:
    if template not in TEMPLATES:
        raise DataError(f"unknown template {template!r}; expected one of {', '.join(TEMPLATES)}")
    if template == "auto":
        return "chat" if getattr(tokenizer, "chat_template", None) else "vicuna"
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError("--template chat: this tokenizer has no chat template")
    return template


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` alone, without BOS/EOS."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def _segments(conv: Conversation, tokenizer, template: str,
              upto_first_answer: bool = False) -> list[tuple[list[int], bool]]:
    """Render a conversation as (token ids, is_label) segments.

    Each segment is tokenized on its own, which is how the text looks at inference: the
    prompt is tokenized, then the model emits the answer token by token.
    `upto_first_answer`: stop where the first assistant answer would start (the prompt).
    """
    if conv and conv[0][0] == "text":  # plain document: every token is a label
        return [(_bos(tokenizer), False), (encode(tokenizer, conv[0][1]), True)]
    if template == "chat":
        return _chat_segments(conv, tokenizer, upto_first_answer)
    segs: list[tuple[list[int], bool]] = [(_bos(tokenizer), False)]
    if template == "plain":
        for role, text in conv:
            if role == "assistant" and upto_first_answer:
                break
            segs.append((encode(tokenizer, text), role == "assistant"))
        return segs
    # vicuna: a trailing prompt (user turns without an answer) only when asked for the prompt
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pieces = vicuna_pieces(conv)
    for i, (text, answer) in enumerate(pieces):
        if answer and upto_first_answer:
            return segs
        if answer:
            segs.append((encode(tokenizer, text) + eos, True))
        elif i + 1 < len(pieces) or upto_first_answer:
            segs.append((encode(tokenizer, text), False))
    return segs


def _chat_segments(conv: Conversation, tokenizer, upto_first_answer: bool):
    """Render turn by turn with the tokenizer's template; the text each assistant message
    adds (after the generation prompt) is labelled. Templates that do not render prefixes
    consistently raise ValueError (the record is then skipped)."""
    msgs = [{"role": r, "content": t} for r, t in conv]

    def render(n, gen):
        return tokenizer.apply_chat_template(msgs[:n], tokenize=False,
                                             add_generation_prompt=gen)

    segs, done = [], ""
    for i, (role, _) in enumerate(conv):
        # a prompt-only conversation ends where the answer would start
        next_is_answer = (conv[i + 1][0] == "assistant" if i + 1 < len(conv)
                          else upto_first_answer)
        text = render(i + 1, role != "assistant" and next_is_answer)
        if not text.startswith(done):
            raise ValueError("chat template does not render conversation prefixes consistently")
        segs.append((encode(tokenizer, text[len(done):]), role == "assistant"))
        done = text
        if upto_first_answer and next_is_answer:
            break
    return segs


def render(conv: Conversation, tokenizer, template: str) -> tuple[list[int], list[bool]]:
    """A conversation -> (token ids, loss mask), the mask True on assistant tokens."""
    ids, mask = [], []
    for seg, label in _segments(conv, tokenizer, template):
        ids += seg
        mask += [label] * len(seg)
    return ids, mask


def render_prompt(conv: Conversation, tokenizer, template: str) -> list[int]:
    """The tokens a model is fed to produce the conversation's first answer."""
    return [t for seg, _ in _segments(conv, tokenizer, template, upto_first_answer=True)
            for t in seg]


def prompt_conversation(text: str) -> Conversation:
    return [("user", text)]


# ----------------------------------------------------------------------------- packing


@dataclasses.dataclass
class Packed:
    """Examples packed into fixed-length rows. Arrays [N, T] (lm_only: [N])."""

    tokens: np.ndarray  # int32
    positions: np.ndarray  # int32, restarting at 0 for each example
    segments: np.ndarray  # int32, 1.. per example in the row, 0 = padding
    loss_mask: np.ndarray  # bool, True where the token is a label (an assistant token)
    # bool per row, True: its labels train the LM term only, never the heads (Medusa-2's
    # anchor text); None: every row trains everything
    lm_only: np.ndarray | None = None

    def __len__(self):
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def rows(self, idx) -> dict[str, np.ndarray]:
        keys = ("tokens", "positions", "segments", "loss_mask")
        if self.lm_only is not None:
            keys += ("lm_only",)
        return {k: getattr(self, k)[idx] for k in keys}


def concat(parts: Sequence[Packed], lm_only: Sequence[bool]) -> Packed:
    """Row sets of one seq_len stacked, each part's rows flagged lm_only or not."""
    if len({p.seq_len for p in parts}) > 1:
        raise DataError(f"cannot mix row lengths {sorted({p.seq_len for p in parts})}")
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return Packed(tokens=cat("tokens"), positions=cat("positions"), segments=cat("segments"),
                  loss_mask=cat("loss_mask"),
                  lm_only=np.concatenate([np.full(len(p), f, bool)
                                          for p, f in zip(parts, lm_only)]))


def pack(examples: Sequence[tuple[Sequence[int], Sequence[bool]]], seq_len: int,
         report: LoadReport | None = None) -> Packed:
    """Greedy in-order packing: an example goes into the current row if it fits, else it
    starts a new row. Examples longer than seq_len are truncated (their tail dropped)."""
    report = report if report is not None else LoadReport()
    rows: list[list[tuple[list[int], list[bool]]]] = []
    used = seq_len  # force a new row for the first example
    for ids, mask in examples:
        ids, mask = list(ids), list(mask)
        if len(ids) > seq_len:
            report.truncated += 1
            ids, mask = ids[:seq_len], mask[:seq_len]
        # a label needs a position before it to be predicted from
        if not any(mask[1:]):
            report.dropped_after_truncation += 1
            continue
        if used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, mask))
        used += len(ids)
    n = len(rows)
    out = Packed(tokens=np.zeros((n, seq_len), np.int32),
                 positions=np.zeros((n, seq_len), np.int32),
                 segments=np.zeros((n, seq_len), np.int32),
                 loss_mask=np.zeros((n, seq_len), bool))
    for r, row in enumerate(rows):
        at = 0
        for s, (ids, mask) in enumerate(row, 1):
            end = at + len(ids)
            out.tokens[r, at:end] = ids
            out.positions[r, at:end] = np.arange(len(ids))
            out.segments[r, at:end] = s
            out.loss_mask[r, at:end] = mask
            at = end
    report.rows += n
    report.tokens += int((out.segments > 0).sum())
    report.label_tokens += int(out.loss_mask.sum())
    return out


def tokenize(convs: list[Conversation], tokenizer, template: str,
             report: LoadReport | None = None) -> list[tuple[list[int], list[bool]]]:
    """Render conversations with `datasets.Dataset.map` (records a template cannot render
    are skipped and counted)."""
    import datasets

    report = report if report is not None else LoadReport()
    template = resolve_template(template, tokenizer)
    ds = datasets.Dataset.from_dict({"roles": [[r for r, _ in c] for c in convs],
                                     "texts": [[t for _, t in c] for c in convs]})

    def fn(rec):
        try:
            ids, mask = render(list(zip(rec["roles"], rec["texts"])), tokenizer, template)
            return {"input_ids": ids, "loss_mask": mask, "error": ""}
        except Exception as e:  # noqa: BLE001 - a template error skips this record only
            return {"input_ids": [], "loss_mask": [], "error": type(e).__name__}

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        # new_fingerprint: skip hashing the tokenizer (slow, and nothing is cached to disk)
        ds = ds.map(fn, remove_columns=["roles", "texts"], keep_in_memory=True,
                    new_fingerprint=f"render-{template}-{len(convs)}")
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
    out = []
    for rec in ds:
        if rec["error"]:
            report.skipped[f"template error ({rec['error']})"] += 1
            report.records -= 1
        else:
            out.append((rec["input_ids"], rec["loss_mask"]))
    return out


def read_files(files: Sequence[str | Path], fmt: str = "auto",
               report: LoadReport | None = None) -> list[Conversation]:
    if not files:
        raise DataError("no data files given")
    convs = []
    for f in files:
        convs += read_file(f, fmt, report)
    return convs


def build(convs: list[Conversation], tokenizer, *, seq_len: int, template: str = "auto",
          seed: int = 0, report: LoadReport | None = None, what: str = "data") -> Packed:
    """Conversations -> packed rows. Examples are shuffled (seeded) before packing so a row
    mixes examples from everywhere; raises DataError when nothing usable is left."""
    if seq_len < 2:
        raise DataError(f"seq_len must be >= 2, got {seq_len}")
    report = report if report is not None else LoadReport()
    examples = tokenize(convs, tokenizer, template, report)
    order = np.random.default_rng(seed).permutation(len(examples))
    packed = pack([examples[i] for i in order], seq_len, report)
    if len(packed) == 0:
        raise DataError(f"{what}: no usable record after rendering ({report.summary()})")
    return packed


def load(files: Sequence[str | Path], tokenizer, *, seq_len: int, fmt: str = "auto",
         template: str = "auto", seed: int = 0,
         report: LoadReport | None = None) -> tuple[Packed, LoadReport]:
    """Files -> (packed rows, report); DataError with a one-line message on unusable input."""
    report = report if report is not None else LoadReport()
    convs = read_files(files, fmt, report)
    packed = build(convs, tokenizer, seq_len=seq_len, template=template, seed=seed,
                   report=report, what=", ".join(map(str, files)))
    return packed, report


# ----------------------------------------------------------------------------- batches


class BatchIterator:
    """Endless, deterministic batches over packed rows, reshuffled every epoch.

    Batch i holds stream entries [i*B, (i+1)*B); entry j is row perm_e[j mod N] of epoch
    e = j // N, perm_e a permutation seeded by (seed, e). So the whole state is one integer,
    `position` (batches consumed), which a checkpoint stores to resume exactly.
    """

    def __init__(self, data: Packed, batch_size: int, seed: int = 0, position: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(data) == 0:
            raise ValueError("no packed rows to iterate over")
        self.data, self.batch_size, self.seed, self.position = data, batch_size, seed, position
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(
                len(self.data))}
        return self._perms[epoch]

    def epoch(self) -> float:
        return self.position * self.batch_size / len(self.data)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        n = len(self.data)
        start = self.position * self.batch_size
        idx = [self._perm(j // n)[j % n] for j in range(start, start + self.batch_size)]
        self.position += 1
        return self.data.rows(np.asarray(idx))


def eval_batches(data: Packed, batch_size: int) -> list[dict[str, np.ndarray]]:
    """Every row once, in order; the last batch is filled with all-padding rows (no labels)."""
    out = []
    for start in range(0, len(data), batch_size):
        batch = data.rows(np.arange(start, min(start + batch_size, len(data))))
        short = batch_size - batch["tokens"].shape[0]
        if short:
            batch = {k: np.concatenate([v, np.zeros((short, *v.shape[1:]), v.dtype)])
                     for k, v in batch.items()}
        out.append(batch)
    return out
