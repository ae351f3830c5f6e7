"""`python -m infer.bench`: plain vs Medusa decoding, side by side, in one process.

    python -m infer.bench                                   # embedded model + default heads
    python -m infer.bench --modes greedy,typical,rejection --batch-sizes 1,4,16 --plot b.png
    python -m infer.bench --prompts ../shared/data/mt_bench/question.jsonl --json
    python -m infer.bench --random-weights --shape llama-110m --tree-sizes 0,16,32,64,128
    python -m infer.bench --max-new-tokens 400 --cache-phases 1,4   # attention windows
    python -m infer.bench --step-curve --model big             # pass time vs the bound
    python -m infer.bench --hardware-report --shape llama-2-7b --dtype bfloat16 \
        --json report.json --plot report.png                   # does Medusa pay here?
    python -m infer.bench --mesh data=2,model=4                # tensor-parallel decoding
    python -m infer.bench --heads default --also-heads hydra   # Medusa and Hydra heads
    python -m infer.bench --also-heads hydra,eagle,ngram --ngram   # each alone and merged
    python -m infer.bench --random-weights --shape llama-2-70b --layers 1 --mesh model=8 \
        --dtype bfloat16                                       # per-device memory, sizing

Timings exclude compilation (every configuration runs once before the clock starts) and are
the median of --reps repetitions. Speedup is wall-clock tokens/s against our own plain jitted
decoding at the same batch size, measured in the same run; `step/plain` is a step's time over
a plain decoding step's (what verifying a tree costs per step). With --ngram, every
drafter's row is followed by a row of the same drafter with n-gram drafts merged into its
tree (`+ngram`, tree `NAME+ngramN`). Progress goes to standard error: a line per
configuration, then one per compile, warm-up and repetition.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections import defaultdict

from medusa_jax import cli
from medusa_jax.drafters import registry, shipped
from medusa_jax.kernels.flags import add_flag as kernels_flag
from medusa_jax.kernels.flags import apply_flag as kernels_apply
from medusa_jax.model.paths import check_model_paths
from medusa_jax.runtime import assets, compile_cache, options, quiet
from medusa_jax.tools.bench_config import BenchConfig


def build_parser():
    p = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model_flags(p, heads_help=cli.drafter_help("default: the shipped Medusa heads"),
                        mesh=True)
    # everything else as `BenchConfig` declares it (help and checks written once)
    options.add_config_flags(p, BenchConfig)
    cli.add_ngram_flags(p)
    kernels_flag(p)
    compile_cache.add_flag(p)
    return p


def heads_cost(args) -> int:
    from medusa_jax.tools.bench import SHAPES
    from medusa_jax.tools.bench import heads_cost as measure

    if args.shape not in SHAPES:
        raise SystemExit(f"error: unknown shape {args.shape!r}; known: {', '.join(SHAPES)}")
    h, v = SHAPES[args.shape]["hidden_size"], SHAPES[args.shape]["vocab_size"]
    times = measure(h, v, reps=max(args.reps, 10))
    if args.json is not None:
        return _write_json(args.json, {"shape": args.shape, "hidden": h, "vocab": v,
                                       "ms": {k: 1e3 * t for k, t in times.items()}})
    print(f"Medusa heads (5 heads x 1 block) of {args.shape}: hidden {h}, vocabulary {v}, "
          f"one token, float32")
    base = times["per-head"]
    for name, t in times.items():
        print(f"  {name:<16}{1e3 * t:9.3f} ms  {t / base:6.2f}x")
    return 0


def sizing(args) -> int:
    import jax

    from medusa_jax.tools.bench import size_model

    trees = args.trees.split(",") if args.trees else [None]
    with options.errors_to_exit():
        from medusa_jax.decoding.tree import Tree

        tree = Tree.load(trees[0]) if trees[0] else None
        r = size_model(args.shape, args.layers, args.mesh or "1,1", dtype=args.dtype,
                       batch=args.batch_sizes[0], context=args.context, tree=tree)
    if args.json is not None:
        return _write_json(args.json, r)
    g = r["per_device_gib"]
    print(f"{r['shape']} ({r['layers']} layers, measured with {r['layers_measured']}), "
          f"{r['dtype']}, mesh {r['mesh']} ({r['devices']} {r['platform']} devices), batch "
          f"{r['batch']}, context {r['context']}, tree {r['tree_nodes']} nodes, "
          f"{r['heads']} heads (float32)")
    print(f"per device, GiB: params {g['params']:.2f}  heads {g['heads']:.2f}  KV cache "
          f"{g['kv_cache']:.2f}  temporaries {g['temporaries']:.2f}  total "
          f"{r['total_per_device_gib']:.2f}")
    print(f"(compiled with {r['layers_measured']} layers: arguments "
          f"{r['compiled_argument_bytes'] / 2**30:.2f} GiB, temporaries incl. KV cache "
          f"{r['compiled_temp_bytes'] / 2**30:.2f} GiB; {r['new_tokens']} tokens decoded in "
          f"{r['run_seconds']:.1f}s on {jax.devices()[0].platform})")
    return 0


def step_curve(args) -> int:
    import jax

    from medusa_jax.model.weights import load_pretrained
    from medusa_jax.tools.bench import (
        bound_seconds,
        measure_bandwidth,
        measure_peak,
        pass_cost,
        random_backbone,
        step_time_curve,
    )

    with options.errors_to_exit():
        if args.random_weights:
            cfg, params = random_backbone(args.shape, args.dtype)
            label = f"{args.shape} (random weights, {args.dtype})"
        else:
            cfg, params = load_pretrained(args.model, param_dtype=args.dtype,
                                          compute_dtype=args.dtype, decoding_layout=True)
            label = str(args.model or "stories260K")
    sizes = sorted({0, *args.tree_sizes})
    print("measuring bandwidth and matrix peak ...", file=sys.stderr)
    bandwidth, peak = measure_bandwidth(dtype=args.dtype), measure_peak(dtype=args.dtype)
    from medusa_jax import kernels

    print("timing the passes ...", file=sys.stderr)
    products = {kernels.describe(params): params}
    if args.compare_kernels:
        if not kernels.active(params):
            raise SystemExit("error: --compare-kernels: the CPU kernel is not in use for this "
                             "model (off, unavailable, or no weight of 1 MiB or more)")
        products["XLA's products"] = kernels.unwrap(params)
    curves = {name: {} for name in products}
    for _ in range(args.reps):  # alternating: each rep times every configuration once
        for name, p in products.items():
            for n, sec in step_time_curve(cfg, p, sizes, prefix=args.prefix, reps=1).items():
                curves[name].setdefault(n, []).append(sec)
    weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    rows = []
    for name, curve in curves.items():
        curve = {n: statistics.median(v) for n, v in curve.items()}
        for n, sec in curve.items():
            nbytes, _ = pass_cost(cfg, n + 1, args.prefix)
            bound = bound_seconds(cfg, n + 1, args.prefix, bandwidth, peak)
            rows.append({"products": name, "tree_nodes": n, "tokens_fed": n + 1,
                         "ms": 1e3 * sec, "vs_one_token": sec / curve[0],
                         "bound_ms": 1e3 * bound, "vs_bound": sec / bound,
                         "gb_per_s": nbytes / sec / 1e9})
    if args.json is not None:
        return _write_json(args.json, {
            "model": label, "device": str(jax.devices()[0]), "weight_bytes": weight_bytes,
            "prefix": args.prefix, "bandwidth_gb_per_s": bandwidth / 1e9,
            "peak_gflop_per_s": peak / 1e9, "rows": rows})
    print(f"{label} on {jax.devices()[0].platform}: {weight_bytes / 2**20:.1f} MiB of weights, "
          f"context {args.prefix}; measured bandwidth {bandwidth / 1e9:.1f} GB/s, matrix peak "
          f"{peak / 1e9:.0f} GFLOP/s ({args.dtype}); passes in a loop, the decoder's layout")
    print(f"{'products':<22} {'tree nodes':>10} {'tokens fed':>10} {'ms/pass':>9} "
          f"{'vs 1 token':>10} {'bound ms':>9} {'vs bound':>9} {'GB/s':>7}")
    for r in rows:
        print(f"{r['products']:<22} {r['tree_nodes']:>10} {r['tokens_fed']:>10} "
              f"{r['ms']:>9.3f} {r['vs_one_token']:>9.2f}x {r['bound_ms']:>9.3f} "
              f"{r['vs_bound']:>8.2f}x {r['gb_per_s']:>7.1f}")
    return 0


def hardware_report(args) -> int:
    """--hardware-report: does Medusa pay on this device, at --shape?"""
    from medusa_jax.tools.bench import hardware_report as measure
    from medusa_jax.tools.bench import predicted_speedups, shipped_tokens_per_step

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with options.errors_to_exit():
        r = measure(args.shape, dtype=args.dtype, layers=args.report_layers,
                    contexts=args.report_contexts, token_counts=args.report_tokens,
                    reps=args.reps, progress=say)
    say(f"tokens/step of the shipped heads (embedded model, {args.num_prompts} held-out "
        f"openings, {args.max_new_tokens} new tokens) ...")
    tps = shipped_tokens_per_step(args.num_prompts, args.max_new_tokens,
                                  max_nodes=max(args.report_tokens) - 1)
    r["predicted"] = predicted_speedups(r, tps)
    if args.plot:
        _plot_report(r, args.plot)
    if args.json is not None:
        return _write_json(args.json, r)
    depth = (f"{r['layers']} layers, extrapolated linearly from {r['layers_measured']}"
             if r["extrapolated"] else f"{r['layers']} layers")
    print(f"{r['shape']} ({depth}), {r['dtype']}, random weights, batch 1, on "
          f"{r['platform']} ({r['device']})")
    print(f"measured: bandwidth {r['bandwidth_gb_per_s']:.1f} GB/s, matrix peak "
          f"{r['peak_tflop_per_s']:.2f} TFLOP/s, loop iteration {r['loop_iteration_us']:.1f} "
          f"us; compile " + ", ".join(f"T={t}: {s:.1f} s" for t, s in
                                      r["compile_seconds"].items()))
    print(f"{'context':>8} {'T':>4} {'ms':>9} {'vs T=1':>7} {'GB/s':>8} {'bound ms':>9} "
          f"{'vs bound':>9}")
    for x in r["rows"]:
        print(f"{x['context']:>8} {x['tokens']:>4} {x['ms']:>9.3f} {x['vs_one_token']:>6.2f}x "
              f"{x['gb_per_s']:>8.1f} {x['bound_ms']:>9.3f} {x['vs_bound']:>8.2f}x")
    print("predicted Medusa speedup (shipped heads' tokens/step / step ratio; heads' cost "
          "left out):")
    for p in r["predicted"]:
        print(f"  context {p['context']:>5}, {p['tree_nodes']:>2} nodes (T={p['tokens_fed']}): "
              f"{p['tokens_per_step']:.2f} tokens/step / {p['step_vs_plain']:.2f}x = "
              f"{p['predicted_speedup']:.2f}x")
    return 0


def compare_layouts(args) -> int:
    from medusa_jax.model.weights import load_pretrained, load_tokenizer
    from medusa_jax.tools.bench import compare_layouts as measure

    prompts = cli.read_prompts(args.prompts, args.num_prompts)
    with options.errors_to_exit():
        cfg, params = load_pretrained(args.model)
        tok = load_tokenizer(args.model)
    from medusa_jax.model.config import stop_tokens

    print("timing both layouts, alternating ...", file=sys.stderr)
    r = measure(cfg, params, [tok.encode(p) for p, _ in prompts],
                max_new_tokens=args.max_new_tokens, eos=stop_tokens(cfg, tok), reps=args.reps)
    if args.json is not None:
        return _write_json(args.json, r)
    print(f"{args.model or 'stories260K'}: {r['layers']} layers, plain greedy, batch 1, "
          f"{r['new_tokens']} new tokens over {len(prompts)} prompts, median of {args.reps}")
    for name, x in r["rows"].items():
        print(f"  {name:<16} {x['ms_per_token']:8.2f} ms/token  {x['ms_per_layer']:7.3f} "
              f"ms/layer")
    print(f"  decoding layout {r['speedup']:.2f}x faster; identical tokens: "
          f"{'yes' if r['identical'] else 'NO'}")
    return 0 if r["identical"] else 1


def _write_json(dest: str, obj) -> int:
    text = json.dumps(obj, indent=1)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")
        print(f"wrote {dest}", file=sys.stderr)
    return 0


def _plot_report(r, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for context in sorted({x["context"] for x in r["rows"]}):
        rows = [x for x in r["rows"] if x["context"] == context]
        ax.plot([x["tokens"] for x in rows], [x["ms"] for x in rows], "o-",
                label=f"measured, context {context}")
        ax.plot([x["tokens"] for x in rows], [x["bound_ms"] for x in rows], "--",
                label=f"bound, context {context}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per pass (T)")
    ax.set_ylabel("ms per pass")
    ax.set_title(f"{r['shape']} {r['dtype']} on {r['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}", file=sys.stderr)


def breakdown(args) -> int:
    from medusa_jax.tools.bench import step_breakdown

    prompts = cli.read_prompts(args.prompts, 1)
    model = cli.load_with_heads(args.model, args.heads, heads_dtype=args.heads_dtype)
    with options.errors_to_exit():
        trees = [model.tree(t) for t in (args.trees.split(",") if args.trees else [None])]
    print("timing each stage of a decoding step ...", file=sys.stderr)
    rows = step_breakdown(model.params, model.heads, model.cfg, model.encode(prompts[0][0]),
                          trees, max_new_tokens=args.max_new_tokens, eos=model.eos,
                          reps=max(args.reps, 3))
    if args.json is not None:
        return _write_json(args.json, rows)
    print("'- stage': the step without it; 'stage ms': what the whole step costs more")
    print(f"{'step':<36}{'stage':<26}{'kernels':>8}{'ms':>9}{'stage ms':>10}{'vs plain':>10}")
    for r in rows:
        print(f"{r['config']:<36}{r['stage']:<26}{r['kernels']:>8}{r['ms']:>9.3f}"
              f"{r['stage_ms']:>10.3f}{r['vs_plain_step']:>9.2f}x")
    return 0


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """Everything that can be checked before JAX is imported and any work starts: the
    config (`BenchConfig`: --modes, --temperature, ...), the --json and --plot outputs,
    --model and --heads (paths or hub ids, config.json, the weights' headers). Errors are
    one line, exit status 2. `args` then holds the config's values (lists as tuples)."""
    try:
        cfg = options.config_from_flags(BenchConfig, args)
    except ValueError as e:
        ap.error(str(e))
    vars(args).update(dataclasses.asdict(cfg), mode_list=cfg.mode_list)
    try:
        if args.prompts:  # read again when the prompts are used; a bad file fails here
            from medusa_jax.text.prompt_files import read_prompt_file

            read_prompt_file(args.prompts)
        if args.json not in (None, "-"):
            options.writable_output("--json", args.json)
        if args.plot:
            options.writable_output("--plot", args.plot)
        cli.check_ngram_flags(ap, _ngram_view(args))
        if not args.random_weights:
            check_model_paths(args.model, cli.heads_to_check(args.heads),
                              tokenizer=not args.step_curve)
    except (ValueError, OSError) as e:
        ap.error(str(e))


def _ngram_view(args):
    """The flags as the n-gram check sees them: --heads (default: the shipped heads, a
    drafter) or an n-gram one among --also-heads, so --ngram-max applies to it."""
    names = (args.also_heads or "").split(",")
    fileless = next((n for n in names if shipped.fileless(n)), None)
    heads = args.heads if args.heads or args.random_weights else shipped.MEDUSA
    if fileless is not None and args.ngram is None:
        heads = fileless  # the sizes are its
    return argparse.Namespace(heads=heads, ngram=args.ngram, ngram_max=args.ngram_max,
                              ngram_min=args.ngram_min)


def say(text: str) -> None:
    """A progress line on standard error (the results go to standard output)."""
    print(text, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    quiet.imports()
    compile_cache.enable_from_args(args)
    kernels_apply(args)
    if args.layers is not None:
        if not args.random_weights:
            raise SystemExit("error: --layers needs --random-weights and --shape")
        return sizing(args)
    if args.heads_cost:
        if not args.random_weights:
            raise SystemExit("error: --heads-cost needs --random-weights and --shape")
        return heads_cost(args)
    if args.hardware_report:
        return hardware_report(args)
    if args.compare_layouts:
        return compare_layouts(args)
    if args.random_weights or args.step_curve:
        return step_curve(args)
    if args.breakdown:
        return breakdown(args)
    from medusa_jax.decoding.decode import check_fits

    modes = args.mode_list  # checked: check_args
    prompts = cli.read_prompts(args.prompts, args.num_prompts)
    model = cli.load_with_heads(args.model, args.heads, args.mesh, args.heads_dtype,
                                ngram_max=args.ngram_max, ngram_min=args.ngram_min)
    from medusa_jax import kernels

    print(f"matrix products: {kernels.describe(model.params)}; heads' weights in "
          f"{args.heads_dtype}", file=sys.stderr)
    ids = [model.encode(p) for p, _ in prompts]
    with options.errors_to_exit():
        trees = [model.tree(t) for t in (args.trees.split(",") if args.trees else [None])]
        model.head_sets = _merged_sets(args, [(model.drafter_kind, model.heads, trees)]
                                       + _also_heads(args, model, trees))
        for _, _, set_trees in model.head_sets:
            for t in set_trees:
                check_fits(model.cfg, max(map(len, ids)), args.max_new_tokens, t.num_nodes)
    common = dict(max_new_tokens=args.max_new_tokens, eos=model.eos, reps=args.reps)

    results = []
    with model.under_mesh():  # --mesh: decoding runs sharded (the transformers baseline not)
        _bench(args, model, ids, prompts, modes, trees, common, results)
    return _report(args, results)


def _merged_sets(args, sets):
    """--ngram: after each drafter's (label, heads, trees), the same merged with n-gram
    drafts (a drafter that is n-grams already gets no merged row)."""
    if args.ngram is None:
        return sets
    from medusa_jax.drafters import resolve

    out = []
    for label, heads, trees in sets:
        out.append((label, heads, trees))
        try:
            merged = [resolve.resolve(heads, t, args.ngram, (args.ngram_max, args.ngram_min))
                      for t in trees]
        except ValueError:  # the n-gram drafter: its drafts are n-grams already
            continue
        out.append((f"{label}+ngram", merged[0].heads, [m.tree for m in merged]))
    return out


def _also_heads(args, model, trees) -> list[tuple[str, object, list]]:
    """--also-heads: (label, heads, trees) of each, checked against the model and the trees
    (a kind with a tree of its own, the n-gram drafter, decodes that one unless --trees)."""
    if not args.also_heads:
        return []
    if args.mesh:
        raise ValueError("--also-heads runs on one device: leave out --mesh")
    from medusa_jax.drafters import formats as heads_formats

    out = []
    for name in args.also_heads.split(","):
        if shipped.fileless(name):
            heads = registry.without_files(name, max_n=args.ngram_max, min_n=args.ngram_min)
            own = [model.tree(t) for t in args.trees.split(",")] if args.trees else \
                [registry.default_tree_of(heads)]
            out.append((f"{registry.kind_of(heads)} ({name})", heads, own))
            continue
        path = assets.shipped_heads_dir(name) if name in assets.SHIPPED_HEADS else name
        heads, _ = heads_formats.load_heads(path, model.cfg, base_model=model.model_dir)
        if args.heads_dtype != "float32":
            heads = registry.with_weight_dtype(heads, args.heads_dtype)
        kind = registry.kind_of(heads)
        k = registry.depth_of(heads)
        for t in trees:
            static = getattr(t, "pool", t)
            if k is not None and static.depth > k:
                raise ValueError(f"--also-heads {name}: tree {t.name!r} has depth "
                                 f"{static.depth} but there are only {k} {kind.title()} heads")
        out.append((f"{kind} ({name})", heads, trees))
    return out


def _bench(args, model, ids, prompts, modes, trees, common, results):
    for bs in args.batch_sizes:
        for phases in args.cache_phases or [None]:
            _bench_batch(args, model, ids, prompts, modes, trees, common, results, bs, phases)


def _bench_batch(args, model, ids, prompts, modes, trees, common, results, bs, phases):
    """Plain decoding at batch size `bs` (and transformers, once), then Medusa in every mode
    and tree; `phases`: the decoders' --cache-phases (None: their default)."""
    from medusa_jax.decoding.acceptance import Sampling
    from medusa_jax.tools.bench import compare_decoding, run_decoder, run_transformers

    suffix = "" if phases is None else f" ({phases} ph.)"
    common = dict(common, max_cache_phases=phases)
    def progress(what):  # one line per compile, warm-up and repetition
        return lambda text: say(f"batch size {bs}: {what}: {text}")

    say(f"batch size {bs}: timing plain decoding{suffix} ({args.reps} reps) ...")
    plain = run_decoder(model.params, model.cfg, ids, batch_size=bs, name="plain",
                        progress=progress(f"plain{suffix}"), **common)
    first = next((r for r in results if r["config"].startswith("plain jax")
                  and r["batch_size"] == bs), None)
    row = _row(plain, plain, "plain jax" + suffix, "greedy", "-", None)
    if first is not None:  # later --cache-phases values: speedup against the first
        row["speedup"] = round(plain.tokens_per_second / first["tokens_per_second"], 3)
    results.append(row)
    if args.transformers and bs == args.batch_sizes[0] and first is None:
        # transformers is slow on this model: time it on the first --hf-prompts prompts,
        # against our plain decoding of the same prompts
        sub = ids[: args.hf_prompts]
        say(f"batch size {bs}: timing transformers on {len(sub)} prompts ({args.hf_reps} "
            f"reps) ...")
        hf = run_transformers(model.model_dir, sub, batch_size=bs,
                              max_new_tokens=args.max_new_tokens, eos=model.eos,
                              reps=args.hf_reps, progress=progress("transformers"))
        if hf is not None:
            ours = run_decoder(model.params, model.cfg, sub, batch_size=bs, name="plain",
                               progress=progress(f"plain, {len(sub)} prompts"), **common)
            row = _row(hf, ours, f"transformers ({len(sub)} prompts)", "greedy", "-",
                       hf.rows == ours.rows)
            row["jax_plain_tokens_per_second"] = round(ours.tokens_per_second, 1)
            results.append(row)
    for mode in modes:
        sampling = Sampling(mode=mode, temperature=1.0 if mode == "greedy" else args.temperature)
        base = plain
        if mode != "greedy":  # compare against plain sampling at the same temperature
            say(f"batch size {bs}: timing plain {mode}{suffix} ({args.reps} reps) ...")
            base = run_decoder(model.params, model.cfg, ids, batch_size=bs, sampling=sampling,
                               name="plain-sample", progress=progress(f"plain {mode}"),
                               **common)
        sets = getattr(model, "head_sets", [(model.drafter_kind, model.heads, trees)])
        for label, heads, set_trees in sets:
            for tree in set_trees:
                what = f"{label} {mode} {tree.name}{suffix}"
                say(f"batch size {bs}: timing {what} ({args.reps} reps) ...")
                c = compare_decoding(model.params, heads, model.cfg, ids, tree,
                                     batch_size=bs, sampling=sampling, plain=base,
                                     progress=progress(what), **common)
                same = c.identical_rows == len(ids) if mode == "greedy" else None
                results.append(_row(c.medusa, base, label + suffix, mode, tree.name, same,
                                    by_category=_by_category(c.medusa, prompts)))


def _report(args, results) -> int:
    if args.json is not None:
        _write_json(args.json, results)
    else:
        _print_table(results)
    if args.plot:
        _plot(results, args.plot)
    bad = [r for r in results if r["identical_to_plain"] is False and _drafted(r)]
    if bad:
        print(f"error: {bad[0]['config']} greedy output differs from plain greedy output",
              file=sys.stderr)
        return 1
    return 0


NOT_SPECULATIVE = ("plain", "transformers")  # the rows of decoding without a drafter


def _drafted(row) -> bool:
    return row["tree"] != "-" and not row["config"].startswith(NOT_SPECULATIVE)


def _row(run, base, config, mode, tree, identical, by_category=None):
    return {
        "config": config, "mode": mode, "tree": tree, "batch_size": run.batch_size,
        "tokens_per_step": round(run.tokens_per_step, 3),
        "step_ms": round(1e3 * run.step_seconds, 4),
        # a step's time over a plain step's (the cost of verifying a tree per step)
        "step_vs_plain": round(run.step_seconds / base.step_seconds, 3),
        "tokens_per_second": round(run.tokens_per_second, 1),
        "speedup": round(run.tokens_per_second / base.tokens_per_second, 3),
        "new_tokens": run.new_tokens, "seconds": round(run.seconds, 4),
        "identical_to_plain": identical, "by_category": by_category,
    }


def _by_category(run, prompts):
    cats = defaultdict(lambda: [0, 0])
    for (_, cat), row, steps in zip(prompts, run.rows, run.per_row_steps):
        if cat is not None:
            cats[cat][0] += len(row)
            cats[cat][1] += steps
    return {c: round(n / max(s, 1), 3) for c, (n, s) in sorted(cats.items())} or None


def _print_table(results):
    # "step/plain": a step's time over a plain decoding step's, same batch and mode
    head = (f"{'config':<28}{'mode':<10}{'tree':<24}{'batch':>5}{'tok/step':>9}{'step ms':>9}"
            f"{'step/plain':>11}{'tok/s':>9}{'speedup':>9}  identical")
    print(head)
    print("-" * len(head))
    for r in results:
        same = {True: "yes", False: "NO", None: "-"}[r["identical_to_plain"]]
        print(f"{r['config']:<28}{r['mode']:<10}{r['tree']:<24}{r['batch_size']:>5}"
              f"{r['tokens_per_step']:>9.2f}{r['step_ms']:>9.3f}{r['step_vs_plain']:>10.2f}x"
              f"{r['tokens_per_second']:>9.0f}{r['speedup']:>8.2f}x  {same}")
        if r["by_category"]:
            print("    tokens/step by category: " +
                  ", ".join(f"{c} {v:.2f}" for c, v in r["by_category"].items()))


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = [r for r in results if _drafted(r)]
    labels = [f"{r['mode']}\n{r['tree']}\nbs{r['batch_size']}\n{r['config']}"
              for r in med]  # "medusa (4 ph.)": the --cache-phases value too
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(med)), 4))
    axes[0].bar(labels, [r["tokens_per_step"] for r in med])
    axes[0].set_title("tokens per step")
    axes[1].bar(labels, [r["speedup"] for r in med])
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_title("wall-clock speedup vs plain")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
