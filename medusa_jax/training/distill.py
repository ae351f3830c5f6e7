"""Self-distillation: the backbone answers prompts; the answers become training data.

Medusa heads should predict what the backbone itself will say, so the best training data is
the backbone's own output. Prompts are rendered with the training template, answered in
batches by the jitted `decode.generate`, and written as ShareGPT JSONL:

    {"id": "distill-0", "conversations": [{"from": "human", "value": PROMPT},
                                          {"from": "gpt", "value": ANSWER}]}

Temperature 0 decodes greedily (one answer per prompt); above 0, prompts are reused
round-robin for `num_samples` different samples. `distill_cached` keeps the answers next to
the settings that made them, so a run (or a resumed one) reuses them when nothing changed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from medusa_jax.decoding import decode
from medusa_jax.decoding.acceptance import Sampling
from medusa_jax.model.config import stop_tokens
from medusa_jax.runtime import timing
from medusa_jax.text import data


def sampling_for(temperature: float) -> Sampling:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return Sampling() if temperature == 0 else Sampling(mode="rejection", temperature=temperature)


def generate_answers(params, cfg, tokenizer, prompts: list[str], *, template: str,
                     num_samples: int | None = None, temperature: float = 0.3,
                     max_new_tokens: int = 256, batch_size: int = 64, seed: int = 0,
                     progress: bool = True, desc: str = "distill") -> tuple[list[dict], dict]:
    """Answer `num_samples` prompts (round-robin over `prompts`). Returns (ShareGPT records,
    stats). Every batch has the same shape (the last one is padded), so it compiles once;
    stats["compile_seconds"] is that compile, stats["seconds"] the answering after it."""
    num_samples = len(prompts) if num_samples is None else int(num_samples)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    template = data.resolve_template(template, tokenizer)
    stops = stop_tokens(cfg, tokenizer)
    sampling = sampling_for(temperature)
    ids = [data.render_prompt(data.prompt_conversation(p), tokenizer, template) for p in prompts]
    longest = max(len(i) for i in ids)
    bucket = decode.prompt_bucket(longest)
    decode.check_fits(cfg, longest, max_new_tokens, 0)  # the prompt's tokens, not the bucket's
    batch_size = min(batch_size, num_samples)
    records, new_tokens, mismatched, t0 = [], 0, 0, time.perf_counter()
    key = jax.random.key(seed)
    bar = tqdm(total=num_samples, desc=desc, unit="sample", disable=not progress,
               file=sys.stdout, dynamic_ncols=True)
    for b, start in enumerate(range(0, num_samples, batch_size)):
        which = list(range(start, min(start + batch_size, num_samples)))
        rows = [ids[i % len(ids)] for i in which]
        rows += [rows[0]] * (batch_size - len(rows))  # fixed batch shape: one compile
        tokens, lengths = decode.pad_prompts(rows, bucket)
        args = (params, cfg, tokens, lengths, jax.random.fold_in(key, b))
        kw = dict(sampling=sampling, max_new_tokens=max_new_tokens, eos=stops)
        if b == 0:  # the one compile, timed apart: the clock starts after it
            compiled = timing.precompile(decode.generate, *args, **kw)
            t0 = time.perf_counter()
        out = decode.generate(*args, **kw)
        out_tokens, num_new = np.asarray(out.tokens), np.asarray(out.num_new)
        for r, i in enumerate(which):
            answer = [int(t) for t in out_tokens[r, :num_new[r]]]
            cut = next((j for j, t in enumerate(answer) if t in stops), len(answer))
            answer = answer[:cut]
            text = tokenizer.decode(answer, skip_special_tokens=True)
            # the trainer re-tokenizes the text: count answers that do not round-trip
            mismatched += data.encode(tokenizer, text) != answer
            new_tokens += len(answer)
            records.append({"id": f"{desc}-{i}", "conversations": [
                {"from": "human", "value": prompts[i % len(prompts)]},
                {"from": "gpt", "value": text}]})
        bar.update(len(which))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    stats = {"samples": len(records), "new_tokens": new_tokens, "retokenize_mismatch": mismatched,
             "compile_seconds": round(compiled.seconds, 2),
             "seconds": round(time.perf_counter() - t0, 2)}  # answering, compile excluded
    return records, stats


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    """Atomically (temp file + rename): a killed run never leaves a half file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def distill_cached(path: str | Path, settings: dict, make) -> tuple[Path, dict | None]:
    """Reuse `path` when its sidecar `<path>.meta.json` records the same settings; else
    call make() -> (records, stats), write both. Returns (path, stats or None if cached)."""
    path = Path(path)
    meta = path.with_name(path.name + ".meta.json")
    if path.is_file() and meta.is_file():
        try:
            if json.loads(meta.read_text()).get("settings") == settings:
                return path, None
        except json.JSONDecodeError:
            pass
    records, stats = make()
    write_jsonl(records, path)
    meta.write_text(json.dumps({"settings": settings, "stats": stats}, indent=2))
    return path, stats
