"""Prompt files, read in one place: `read_prompt_file` for the decoding commands
(`infer.generate --prompts-file`, `infer.bench --prompts`, `infer.search_tree --prompts`,
`infer.bench_serve --prompts`), `read_user_turns` for self-distillation's prompts. Stdlib and
`data` only, so a bad file is reported before JAX is imported."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompt_file(path: str | Path) -> list[tuple[str, str | None]]:
    """(prompt, category) pairs: text lines, or JSONL with `prompt` or `turns` (first turn).
    Bad input raises ValueError in one line naming the file and line."""
    from medusa_jax.text.data import read_text  # UTF-8, with file:line errors

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such prompts file")
    out = []
    for n, line in enumerate(read_text(file).splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("["):
            try:
                json.loads(line)
            except json.JSONDecodeError:
                pass
            else:
                raise ValueError(f"{file}:{n}: a JSON array, not a prompt: give text, or an "
                                 f"object with 'prompt' or 'turns' (token ids are not read "
                                 f"from prompt files)")
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{n}: invalid JSON ({e.msg})") from None
            if "prompt" in rec:
                field, text = "prompt", rec["prompt"]
            elif "turns" in rec:
                if not isinstance(rec["turns"], list) or not rec["turns"]:
                    raise ValueError(f"{file}:{n}: 'turns' must be a non-empty list of strings, "
                                     f"got {type(rec['turns']).__name__} {rec['turns']!r:.40}")
                field, text = "turns[0]", rec["turns"][0]
            else:
                raise ValueError(f"{file}:{n}: no 'prompt' or 'turns' field")
            if not isinstance(text, str):
                raise ValueError(f"{file}:{n}: '{field}' must be a string, got "
                                 f"{type(text).__name__} {text!r:.40}")
            if not text.strip():
                raise ValueError(f"{file}:{n}: '{field}' is empty")
            out.append((text, rec.get("category")))
        else:
            out.append((line, None))
    if not out:
        raise ValueError(f"{file}: no prompts in it")
    return out


def read_user_turns(path: str | Path) -> list[str]:
    """One prompt per non-empty line of a text file, or the first user turn of each record
    of a ShareGPT/Alpaca JSON(L) file."""
    from medusa_jax.text import data

    path = Path(path)
    if not path.is_file():
        raise data.DataError(f"{path}: no such prompt file")
    if path.suffix.lower() in (".json", ".jsonl"):
        convs = data.read_file(path)
        prompts = [next((t for r, t in c if r == "user"), "") for c in convs]
    else:
        text = data.read_text(path)
        prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise data.DataError(f"{path}: no prompt in the file")
    return prompts
