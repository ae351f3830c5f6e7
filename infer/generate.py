"""`python -m infer.generate`: generate text with plain or Medusa decoding.

    python -m infer.generate --prompt "Once upon a time"                 # embedded model
    python -m infer.generate --heads runs/medusa1-X/heads --prompt "Lily" --json
    python -m infer.generate --heads default --mesh data=2,model=4 --prompt "Lily"  # sharded
    python -m infer.generate --heads ngram --prompt "Lily"     # n-gram drafts, no files
    python -m infer.generate --heads hydra --ngram --prompt "Lily"   # merged into Hydra's tree
"""

from __future__ import annotations

import argparse
import json
import sys

from medusa_jax import cli
from medusa_jax.decoding.config import DecodeConfig
from medusa_jax.kernels import flags as kernel_flags
from medusa_jax.model.paths import check_model_paths
from medusa_jax.runtime import compile_cache, options, quiet


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model_flags(p, heads_help=cli.drafter_help("omit for plain decoding"), mesh=True)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="text lines, or JSONL with 'prompt' or 'turns'")
    options.add_config_flags(p, DecodeConfig)  # --mode, --tree, --max-new-tokens, ...
    cli.add_ngram_flags(p)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    compile_cache.add_flag(p)
    kernel_flags.add_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:  # validated once, here
        cfg = options.config_from_flags(DecodeConfig, args)
    except ValueError as e:
        ap.error(str(e))
    if cfg.tree and not args.heads:
        ap.error("--tree needs --heads (without heads, decoding is plain and uses no tree)")
    cli.check_ngram_flags(ap, args)
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [p for p, _ in cli.read_prompts(args.prompts_file, flag="--prompts-file")]
    if not prompts:
        prompts = ["Once upon a time"]
    try:  # paths (and hub ids) before JAX: a wrong one fails at once
        check_model_paths(args.model, cli.heads_to_check(args.heads))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    quiet.imports()
    kernel_flags.apply_flag(args)
    compile_cache.enable_from_args(args)  # after argument errors: importing jax takes a moment
    from medusa_jax.api import Medusa

    try:
        model = Medusa.load(args.model, args.heads, param_dtype=cfg.dtype,
                            compute_dtype=cfg.dtype, heads_dtype=args.heads_dtype,
                            mesh=args.mesh, ngram=args.ngram, ngram_max=args.ngram_max,
                            ngram_min=args.ngram_min)
        results = model.generate(prompts, **cfg.generate_args())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, r in zip(prompts, results):  # one result per prompt, in order
        if args.json:
            print(json.dumps(dict(r.to_json(), prompt=prompt)))
        else:
            print(f"### {r.prompt}\n{r.prompt}{r.text}\n")
    # "1 prompt, medusa stories260K_cpu greedy: compiled in ...; N tokens/step (S steps)"
    print(model.last_timing.line(), file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
