"""`python -m train.enlarge`: grow a model and its drafter to a bigger shape.

    python -m train.enlarge --shape llama-110m --output big            # embedded model + heads
    python -m train.enlarge --shape llama-110m --heads hydra --output bigh   # + Hydra heads
    python -m train.enlarge --shape llama-110m --layers 32 --output big32
    python -m train.enlarge --shape llama-110m --rotate 0 --output dense   # no heads (see below)
    python -m train.enlarge --model SRC --heads HEADS --shape llama-2-7b --output OUT
    python -m infer.bench --model big --heads big/heads                # Medusa where it pays

The output is a Hugging Face model folder of the target shape (config, model.safetensors,
tokenizer) that computes the source's function, and with heads, their enlarged copy in
OUTPUT/heads. It reads as many bytes per token as a real model of that shape, so decoding it
is bound by memory bandwidth as a real model's is, with the source's acceptance. The
vocabulary stays the source's. See `medusa_jax.tools.enlarge` for the construction; `--rotate
SEED` also turns the residual stream by a random orthogonal matrix, so the embedding and
every projection's residual-stream side are dense, not zero-padded (the heads cannot follow
a rotation: none are written then).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from medusa_jax import cli
from medusa_jax.model.paths import check_model_paths
from medusa_jax.runtime import options

NOTE = """# Enlarged model

Written by `python -m train.enlarge {args}` from `{source}`: the source's function in the
{shape} shape (hidden {hidden}, MLP {mlp}, {layers} layers, {heads} query / {kv} KV heads,
head_dim {head_dim}), zero-padded Net2Net-style (see `medusa_jax/tools/enlarge.py`){rotated}. A
benchmark model: its predictions are the source's. The source's license applies.
"""


def build_parser():
    p = argparse.ArgumentParser(prog="python -m train.enlarge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, help="target shape, one of infer.bench's "
                   "named shapes (llama-110m, llama-2-7b, ...)")
    p.add_argument("--output", required=True, help="new folder to write (must not exist, "
                   "or be empty)")
    p.add_argument("--model", help="source Hugging Face model folder or hub id (default: the "
                   "embedded stories260K)")
    p.add_argument("--heads", help=cli.drafter_help(
        "default: the shipped Medusa heads for the embedded model, none for another model; "
        "'none' for no heads", fileless=False, what="source drafter"))
    p.add_argument("--layers", type=options.positive_int, default=None,
                   help="layer count instead of the shape's (extra layers are identities)")
    p.add_argument("--rotate", type=options.nonnegative_int, default=None, metavar="SEED",
                   help="fold the RMSNorm scales into the projections and rotate the "
                        "residual stream by a random orthogonal matrix (no heads then)")
    return p


def check_output(out: Path) -> None:
    """The output must be a new folder (or an empty one): never write into a folder we do
    not own."""
    if out.exists():
        if not out.is_dir():
            raise SystemExit(f"error: --output {out}: exists and is not a folder")
        if any(out.iterdir()):
            raise SystemExit(f"error: --output {out}: exists and is not empty; give a new "
                             f"folder")
    if out.parent.exists() and not out.parent.is_dir():
        raise SystemExit(f"error: --output {out}: {out.parent} is not a folder")
    from medusa_jax.runtime import assets

    if assets.inside_package(out):
        raise SystemExit(f"error: --output {out}: inside the installed package's assets "
                         f"({assets.root()}); write somewhere else (runs/, say)")
    try:  # a read-only or pseudo filesystem (/proc), before any work
        options.writable_output("--output", str(out), folder=True)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from medusa_jax.model.shapes import SHAPES
    from medusa_jax.runtime import assets

    if args.shape not in SHAPES:
        raise SystemExit(f"error: --shape {args.shape!r} is unknown; known: "
                         f"{', '.join(SHAPES)}")
    out = Path(args.output)
    check_output(out)
    with options.errors_to_exit():  # paths, hub ids, config.json and the weights' headers
        check_model_paths(args.model, args.heads if args.heads != "none" else None)
    from medusa_jax.runtime import hub

    source = Path(hub.local(args.model, "--model")) if args.model else assets.model_dir()
    if args.heads in assets.SHIPPED_HEADS and args.model:
        raise SystemExit(f"error: --heads {args.heads}: the shipped heads are the embedded "
                         f"model's; with --model give a heads path")
    if args.heads in assets.SHIPPED_HEADS:
        heads_path = assets.shipped_heads_dir(args.heads)
    else:
        heads_path = None if args.heads == "none" else \
            (hub.local(args.heads, "--heads", hub.HEADS_FILES) or assets.default_heads(args.model))
    if heads_path is not None and args.rotate is not None:
        if args.heads:
            raise SystemExit("error: --heads with --rotate: a drafter cannot follow a rotation "
                             "of the residual stream (only the model is rotated); drop one "
                             "of them")
        heads_path = None  # the embedded model's heads are only a default

    import jax
    import numpy as np

    from medusa_jax.drafters import formats as heads_formats
    from medusa_jax.model import weights
    from medusa_jax.model.config import ModelConfig
    from medusa_jax.tools import enlarge

    shape = dict(SHAPES[args.shape])
    shape["num_layers"] = args.layers or shape["num_layers"]
    with options.errors_to_exit():
        cfg = ModelConfig.from_dir(source)
        dst = enlarge.target_config(cfg, shape)  # an impossible shape fails before reading
        if dst.num_layers > cfg.num_layers:
            print(f"{dst.num_layers - cfg.num_layers} extra layers are identities "
                  f"(zero output projections)", file=sys.stderr)
        cfg, params = weights.load_pretrained(source)
        head_params = heads_formats.load_heads(heads_path, cfg, base_model=source)[0] \
            if heads_path is not None else None
        params = jax.tree.map(np.asarray, params)
        dst, big = enlarge.enlarge_backbone(cfg, params, shape, rotate=args.rotate)
        big_heads = enlarge.enlarge_heads(jax.tree.map(np.asarray, head_params), cfg, dst) \
            if head_params is not None else None

    # written into a temporary sibling, then renamed: an interrupted run leaves no half folder
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weights.save_pretrained(dst, big, tmp, source_dir=source)
        src_json = json.loads((source / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps(enlarge.hf_config(src_json, dst), indent=2))
        if (source / "LICENSE").is_file():
            shutil.copy(source / "LICENSE", tmp / "LICENSE")
        (tmp / "SOURCE.md").write_text(NOTE.format(
            args=" ".join(argv if argv is not None else sys.argv[1:]), source=source,
            shape=args.shape, hidden=dst.hidden_size, mlp=dst.intermediate_size,
            layers=dst.num_layers, heads=dst.num_heads, kv=dst.num_kv_heads,
            head_dim=dst.head_dim,
            rotated="" if args.rotate is None else
            f", residual stream rotated (seed {args.rotate})"))
        # it accepts exactly as its source: the source's default tree
        (tmp / assets.MODEL_SETTINGS).write_text(json.dumps(
            {"default_tree": assets.default_tree(args.model)}) + "\n")
        if big_heads is not None:
            heads_formats.save_heads(tmp / "heads", big_heads, dst,
                                 extra={"enlarged_from": str(heads_path)})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private; the result is not
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(a.size for a in jax.tree.leaves(big))
    print(f"wrote {out}: {args.shape} shape, {dst.num_layers} layers, {n / 1e6:.1f}M "
          f"parameters ({4 * n / 2**20:.0f} MiB float32)"
          + (f", heads in {out / 'heads'}" if big_heads is not None else ", no heads"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
