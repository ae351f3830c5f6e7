"""`python -m train.distill`: self-distill a prompt file into ShareGPT JSONL.

    python -m train.distill --prompts FILE --output OUT.jsonl [--num-samples N]
        [--temperature 0.3 | --temperature 0,0.8,1.0] [--max-new-tokens 256]
        [--batch-size 64] [--model DIR]

The backbone answers each prompt (see `medusa_jax.training.distill`); temperature 0 decodes
greedily. Several temperatures split the answers evenly, each over the same prompts.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from medusa_jax.model.paths import check_model_paths
from medusa_jax.runtime import compile_cache, options
from medusa_jax.text import data, prompt_files
from medusa_jax.training.config import float_list


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m train.distill",
                                 description="Self-distill ShareGPT JSONL from a prompt file.")
    ap.add_argument("--prompts", required=True, help="text file (one prompt a line) or JSON(L)")
    ap.add_argument("--output", required=True, help="output JSONL path")
    ap.add_argument("--model", default=None, help="HF model dir or hub id (default: embedded stories260K)")
    ap.add_argument("--template", default="auto", choices=data.TEMPLATES)
    ap.add_argument("--num-samples", type=options.positive_int, default=None,
                    help="answers to generate (default: one per prompt and temperature)")
    ap.add_argument("--temperature", type=float_list, default=(0.3,), metavar="T[,T...]",
                    help="sampling temperature, or several split evenly (e.g. 0,0.8,1.0); "
                         "0 = greedy, at most one answer per prompt (default 0.3)")
    ap.add_argument("--max-new-tokens", type=options.positive_int, default=256)
    ap.add_argument("--batch-size", type=options.positive_int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    compile_cache.add_flag(ap)
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    bad = [t for t in args.temperature if not 0 <= t < math.inf]
    if bad:
        ap.error(f"--temperature must be finite and >= 0, got {bad[0]}")
    if len(set(args.temperature)) < len(args.temperature):
        ap.error("--temperature: a temperature given twice")
    out = Path(args.output)
    if out.is_dir():
        ap.error(f"--output {out}: is a directory; give a file path such as {out / 'answers.jsonl'}")
    if out.parent.exists() and not out.parent.is_dir():
        ap.error(f"--output {out}: {out.parent} is not a directory")
    try:  # --model: a path or hub id, config.json and the weights' headers, before JAX
        check_model_paths(args.model)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    compile_cache.enable_from_args(args)
    from medusa_jax.model import weights
    from medusa_jax.runtime import timing
    from medusa_jax.training import distill

    with options.errors_to_exit():  # DataError, WeightsError: ValueErrors
        prompts = prompt_files.read_user_turns(args.prompts)
        cfg, params = weights.load_pretrained(args.model)
        tokenizer = weights.load_tokenizer(args.model)
        temps = list(args.temperature)
        records, stats = distill.generate_mixed(
            params, cfg, tokenizer, prompts, template=args.template, temperatures=temps,
            num_samples=args.num_samples or len(prompts) * len(temps),
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed)
        distill.write_jsonl(records, args.output)
    speed = timing.speed_line(stats["compile_seconds"], stats["new_tokens"], stats["seconds"])
    by = "" if len(temps) == 1 else " (" + ", ".join(
        f"{p['samples']} at T {p['temperature']:g}" for p in stats["by_temperature"]) + ")"
    print(f"wrote {stats['samples']} answers to {args.output}{by}: {speed}")


if __name__ == "__main__":
    main()
