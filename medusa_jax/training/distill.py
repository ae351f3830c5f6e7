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
                     progress: bool = True, desc: str = "distill",
                     stream: int = 0) -> tuple[list[dict], dict]:
    """Answer `num_samples` prompts (round-robin over `prompts`). Returns (ShareGPT records,
    stats). Every batch has the same shape (the last one is padded), so it compiles once;
    stats["compile_seconds"] is that compile, stats["seconds"] the answering after it.
    `stream` > 0: draws independent of stream 0's with the same seed (several temperatures
    answering the same prompts)."""
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
    if stream:
        key = jax.random.fold_in(key, stream)
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


def split_samples(num_samples: int, temperatures, num_prompts: int) -> list[int]:
    """How many of `num_samples` answers each temperature draws: an even split (the first
    ones take the remainder), greedy (0) at most one answer per prompt (more would repeat
    it)."""
    n = len(temperatures)
    share = [num_samples // n + (j < num_samples % n) for j in range(n)]
    return [min(k, num_prompts) if t == 0 else k for k, t in zip(share, temperatures)]


def generate_mixed(params, cfg, tokenizer, prompts: list[str], *, temperatures,
                   num_samples: int, desc: str = "distill", **kw) -> tuple[list[dict], dict]:
    """`generate_answers` at each of `temperatures` (`split_samples`' share each, over the
    same prompts from the first on; temperature j draws on stream j, so one temperature
    alone is `generate_answers` itself). Returns (records, stats: the totals and
    stats["by_temperature"], each temperature's samples and new tokens)."""
    records, parts = [], []
    counts = split_samples(num_samples, temperatures, len(prompts))
    for j, (t, n) in enumerate(zip(temperatures, counts)):
        if n == 0:
            continue
        recs, st = generate_answers(params, cfg, tokenizer, prompts, num_samples=n,
                                    temperature=t, desc=f"{desc} T={t:g}", stream=j, **kw)
        for r in recs:
            r["id"] = f"{desc}-{len(records)}"
            records.append(r)
        parts.append(dict(st, temperature=t))
    stats = {k: round(sum(p[k] for p in parts), 2) for k in
             ("samples", "new_tokens", "retokenize_mismatch", "compile_seconds", "seconds")}
    stats["by_temperature"] = [{k: p[k] for k in ("temperature", "samples", "new_tokens")}
                               for p in parts]
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


def self_distill(ctx) -> tuple[Path, Path]:
    """The training run's data (`trainer.Context` ctx): the backbone's answers to the
    shipped TinyStories openings (training: at --distill-temperature, or at each of
    --distill-temperatures) and its greedy answers to the held-out ones (greedy: that is
    how the benchmark decodes), cached in <run>/distill/ next to the settings that drew them
    (`<file>.meta.json`: the settings, and the samples and tokens each temperature drew)."""
    from medusa_jax.runtime import assets, distributed
    from medusa_jax.text import prompt_files

    cfg = ctx.cfg

    def settings(**kw):
        return dict(model=cfg.model or assets.EMBEDDED_MODEL, template=ctx.template,
                    max_new_tokens=cfg.distill_max_new_tokens, seed=cfg.seed, **kw)

    common = dict(template=ctx.template, max_new_tokens=cfg.distill_max_new_tokens,
                  batch_size=cfg.distill_batch_size, seed=cfg.seed)

    def answers(prompts, n, temperature, desc):
        return lambda: generate_answers(ctx.backbone, ctx.model_cfg, ctx.tokenizer, prompts,
                                        num_samples=n, temperature=temperature, desc=desc,
                                        **common)

    if not distributed.is_writer():  # process 0 distills and writes; the others read
        distributed.barrier("distilled")
    train_prompts = prompt_files.read_user_turns(assets.prompts_file("train"))
    held_prompts = prompt_files.read_user_turns(assets.prompts_file("heldout"))
    temps = [float(t) for t in cfg.distill_temperatures]
    if temps:  # (one temperature keeps the settings it always had: cached answers stay valid)
        train_settings = settings(samples=cfg.distill_samples, temperatures=temps)
        make = lambda: generate_mixed(  # noqa: E731
            ctx.backbone, ctx.model_cfg, ctx.tokenizer, train_prompts, temperatures=temps,
            num_samples=cfg.distill_samples, **common)
    else:
        train_settings = settings(samples=cfg.distill_samples,
                                  temperature=cfg.distill_temperature)
        make = answers(train_prompts, cfg.distill_samples, cfg.distill_temperature, "distill")
    train_file, stats = distill_cached(ctx.run_dir / "distill" / "train.jsonl",
                                       train_settings, make)
    print(f"distilled training data: {train_file}" + (f" ({stats})" if stats else " (cached)"),
          flush=True)
    held_file, _ = distill_cached(
        ctx.run_dir / "distill" / "heldout.jsonl", settings(samples=len(held_prompts)),
        answers(held_prompts, len(held_prompts), 0.0, "heldout"))
    if distributed.is_writer():
        distributed.barrier("distilled")
    return train_file, held_file
