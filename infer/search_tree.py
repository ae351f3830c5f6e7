"""`python -m infer.search_tree` (alias `infer.tree`): search the tree that pays best on
THIS machine, for the drafter --heads names (any kind).

    python -m infer.search_tree                            # embedded model + shipped heads
    python -m infer.search_tree --heads runs/<run>/heads --out my_tree.json --plot tree.png

Measures the drafter's top-k accuracy at each depth (below its own best path) against the
model's own greedy continuation of held-out prompts, grows the best tree of every size from
those accuracies, times a decoding step of each size here, and keeps the size with the best
expected tokens/step / step overhead. The JSON it writes is accepted by `--tree FILE` everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from medusa_jax import cli
from medusa_jax.kernels import flags as kernel_flags
from medusa_jax.model.paths import check_model_paths
from medusa_jax.runtime import compile_cache, options


def build_parser():
    p = argparse.ArgumentParser(prog="python -m infer.search_tree", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model_flags(p)
    p.add_argument("--prompts", help="prompt file (default: held-out TinyStories openings)")
    p.add_argument("--num-prompts", type=options.positive_int, default=16)
    p.add_argument("--max-new-tokens", type=options.positive_int, default=128)
    p.add_argument("--sizes", type=options.int_list(1),
                   default=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 63])
    p.add_argument("--top-k", type=options.positive_int, default=10)
    p.add_argument("--max-depth", type=options.positive_int, default=8,
                   help="deepest tree searched (a drafter with a depth of its own: at most it)")
    p.add_argument("--reps", type=options.positive_int, default=3)
    p.add_argument("--out", default="searched_tree.json", help="where to write the chosen tree")
    p.add_argument("--plot", help="PNG of expected and measured tokens/step and speedup vs size")
    compile_cache.add_flag(p)
    kernel_flags.add_flag(p)
    return p


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        ap.error(f"--out {out}: not a file in an existing directory")
    try:  # paths and hub ids, config.json and the weights' headers, before JAX
        check_model_paths(args.model, args.heads)
        if args.plot:
            options.writable_output("--plot", args.plot)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    kernel_flags.apply_flag(args)
    compile_cache.enable_from_args(args)
    from medusa_jax.decoding.tree import Tree
    from medusa_jax.runtime import timing
    from medusa_jax.tools.bench import compare_decoding, run_decoder
    from medusa_jax.tools.tree_search import expected_tokens_per_step, grow_tree, head_rank_accuracy

    prompts = [p for p, _ in cli.read_prompts(args.prompts, args.num_prompts)]
    model = cli.load_with_heads(args.model, args.heads, heads_dtype=args.heads_dtype)
    ids = [model.encode(p) for p in prompts]
    from medusa_jax.decoding.decode import check_fits

    for n in args.sizes:  # a tree no decode can use is not worth measuring
        try:
            check_fits(model.cfg, max(map(len, ids)), args.max_new_tokens, n + 1)
        except ValueError as e:
            ap.error(f"--sizes {n}: {e}")
    print(f"measuring head accuracies on {len(ids)} prompts ...", file=sys.stderr)
    acc = head_rank_accuracy(model.params, model.cfg, model.heads, ids,
                             max_new_tokens=args.max_new_tokens, top_k=args.top_k, eos=model.eos,
                             max_depth=args.max_depth)
    num_heads = acc.shape[0]  # the depths measured: the drafter's, or --max-depth
    cum = acc.cumsum(1)
    print("head  top-1  top-3  top-5  top-10")
    for d in range(acc.shape[0]):
        print(f"{d + 1:>4} {cum[d, 0]:6.3f} {cum[d, min(2, args.top_k - 1)]:6.3f} "
              f"{cum[d, min(4, args.top_k - 1)]:6.3f} {cum[d, -1]:7.3f}")

    common = dict(max_new_tokens=args.max_new_tokens, eos=model.eos, reps=args.reps, batch_size=1)
    plain = run_decoder(model.params, model.cfg, ids, **common)
    print(f"plain decoding: {timing.speed_line(plain.compile, plain.new_tokens, plain.seconds)}")
    rows = []
    for n in args.sizes:
        paths, _ = grow_tree(acc, n)
        tree = Tree.from_paths(paths, num_heads=num_heads, name=f"searched-{n}")
        print(f"timing a {n}-node tree ...", file=sys.stderr)
        c = compare_decoding(model.params, model.heads, model.cfg, ids, tree, plain=plain,
                             **common)
        expected = expected_tokens_per_step(acc, paths)
        rows.append(dict(nodes=n, depth=tree.depth, expected_tokens_per_step=round(expected, 3),
                         measured_tokens_per_step=round(c.medusa.tokens_per_step, 3),
                         step_overhead=round(c.step_overhead, 3),
                         expected_speedup=round(expected / c.step_overhead, 3),
                         measured_speedup=round(plain.seconds / c.medusa.seconds, 3),
                         compile_seconds=round(c.medusa.compile.seconds, 3),
                         tokens_per_second=round(c.medusa.tokens_per_second, 1),
                         paths=paths))
    best = max(rows, key=lambda r: r["expected_speedup"])
    print(f"{'nodes':>5} {'depth':>5} {'exp tok/step':>12} {'meas tok/step':>13} "
          f"{'overhead':>8} {'exp speedup':>11} {'meas speedup':>12} {'tokens/s':>9} "
          f"{'compiled in':>11}")
    for r in rows:
        mark = "  <- chosen" if r is best else ""
        print(f"{r['nodes']:>5} {r['depth']:>5} {r['expected_tokens_per_step']:>12.2f} "
              f"{r['measured_tokens_per_step']:>13.2f} {r['step_overhead']:>7.2f}x "
              f"{r['expected_speedup']:>10.2f}x {r['measured_speedup']:>11.2f}x "
              f"{r['tokens_per_second']:>9,.0f} {timing.fmt_seconds(r['compile_seconds']):>11}"
              f"{mark}")
    meta = {k: v for k, v in best.items() if k not in ("paths", "compile_seconds")}
    meta["head_top1"] = [round(float(x), 4) for x in acc[:, 0]]
    with open(args.out, "w") as f:
        json.dump({"paths": best["paths"], "meta": meta}, f, indent=1)
    print(f"chosen: {best['nodes']} nodes, expected {best['expected_tokens_per_step']:.2f} "
          f"tokens/step, measured {best['measured_tokens_per_step']:.2f}; written to {args.out}")
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["nodes"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(n, [r["expected_tokens_per_step"] for r in rows], "o-", label="expected")
    a.plot(n, [r["measured_tokens_per_step"] for r in rows], "s--", label="measured")
    a.set_xscale("log", base=2)
    a.set_xlabel("tree nodes")
    a.set_title("tokens per step")
    a.legend()
    b.plot(n, [r["expected_speedup"] for r in rows], "o-", label="expected")
    b.plot(n, [r["measured_speedup"] for r in rows], "s--", label="measured")
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xscale("log", base=2)
    b.set_xlabel("tree nodes")
    b.set_title("speedup vs plain decoding")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
