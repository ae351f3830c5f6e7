"""Export Medusa heads to the layouts other tools read, or convert between any two layouts.

    python -m train.export_heads runs/medusa1-X --format reference --output out/reference
    python -m train.export_heads runs/medusa1-X --format vllm --output out/vllm
    python -m train.export_heads runs/medusa2-X --format medusa2 --output out/medusa2-model
    python -m train.export_heads runs/eagle-X --format eagle3 --output out/eagle3   # SGLang, vLLM
    python -m train.export_heads ~/hf/medusa-vicuna-7b-v1.3 --model ~/hf/vicuna-7b-v1.3 \\
        --format medusa_jax --output heads/vicuna-7b

SOURCE: a train.medusa1 / train.medusa2 run directory (with heads/), a medusa_jax heads
artifact, or heads in any layout `load_heads` reads (the reference's, a Medusa-2 model
folder, vLLM's, zankner/Hydra's, an EAGLE-3 folder). Formats written: `reference`
(config.json + medusa_lm_head.safetensors, and medusa_lm_head.pt when PyTorch is installed),
`vllm` (config.json + model.safetensors), `medusa_jax` (medusa_heads.safetensors), `medusa2`
(one model folder: backbone + heads), `hydra` (zankner/Hydra's), `eagle3` (config.json +
model.safetensors, SafeAILab/SpecForge's, for EAGLE-3 drafters), `deepseek-mtp` (multi-token
prediction modules in DeepSeek-V3's layout; with a backbone, one model folder: its weights
with the modules as layers N .. N+D-1 and num_nextn_predict_layers in config.json, which
serves its own drafter with `--model DIR --heads DIR`), `mimo-mtp` (MiMo's modules and a
config.json).

    python -m train.export_heads runs/mtp-X --format deepseek-mtp --model M --output out/m

Errors are one line: `error: ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# hydra: zankner/Hydra; eagle3: SafeAILab/EAGLE and SpecForge (what SGLang and vLLM read)
FORMATS = ("reference", "vllm", "medusa_jax", "medusa2", "hydra", "eagle3", "deepseek-mtp",
           "mimo-mtp")
# layouts written as one model folder when the backbone is known: its weights and config
# with the drafter's tensors and fields added (medusa2 has its own writer)
WITH_BACKBONE = ("deepseek-mtp",)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m train.export_heads",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="run directory, heads artifact, or heads in another layout "
                    "(a path or a Hugging Face hub id)")
    ap.add_argument("--format", required=True, choices=FORMATS, help="layout to write")
    ap.add_argument("--output", required=True, help="folder to write into: new or empty")
    ap.add_argument("--force", action="store_true", help="replace an earlier export of the "
                    "same format in --output (a folder of anything else is never replaced)")
    ap.add_argument("--model", help="the backbone the heads belong to: shapes are checked "
                    "against it, and --format medusa2 / deepseek-mtp bundle it (default: the "
                    "run's model, the Medusa-2 folder itself, or the one the artifact "
                    "records)")
    ap.add_argument("--base-model", help="base_model_name_or_path to write (default: the "
                    "source's own, else the backbone's path)")
    return ap.parse_args(argv)


def _run_model(run_dir: Path) -> tuple[bool, str | None]:
    """(found, model) of a training run directory: its fine-tuned model/ (Medusa-2) or the
    `model` of its config.json (None: the embedded stories260K)."""
    if (run_dir / "model" / "config.json").is_file():
        return True, str(run_dir / "model")
    conf = run_dir / "config.json"
    if conf.is_file():
        try:
            data = json.loads(conf.read_text())
        except (OSError, json.JSONDecodeError):
            return False, None
        if isinstance(data, dict) and "model" in data:
            return True, data["model"]
    return False, None


def resolve_model(source: Path, found, meta: dict, given: str | None) -> Path | None:
    """The backbone folder the heads belong to, or None (shapes from the files alone)."""
    from medusa_jax.model.weights import default_model_dir

    if given:
        return Path(given)
    if found.layout == "medusa2":
        return found.root if found.root.is_dir() else found.root.parent
    if source.is_dir() and (source / "heads").is_dir():
        ok, model = _run_model(source)
        if ok:
            return Path(model) if model else default_model_dir()
    if found.layout == "medusa_jax":
        extra = meta.get("extra") or {}
        if extra.get("backbone"):
            return Path(extra["backbone"])
        if isinstance(extra.get("config"), dict) and "model" in extra["config"]:
            model = extra["config"]["model"]
            return Path(model) if model else default_model_dir()
        if extra.get("base_model_name_or_path"):
            p = Path(extra["base_model_name_or_path"])
            return p if (p / "config.json").is_file() else None
        return None
    base = meta.get("base_model_name_or_path")
    if base and (Path(base) / "config.json").is_file():
        return Path(base)
    return None


# the files an export of each format writes (fnmatch patterns): --force replaces a folder
# holding these and nothing else
_HF_MODEL = ("config.json", "generation_config.json", "model.safetensors",
             "model-*-of-*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
             "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")
EXPORT_FILES = {
    "reference": ("config.json", "medusa_lm_head.safetensors", "medusa_lm_head.pt"),
    "vllm": ("config.json", "model.safetensors"),
    "medusa_jax": ("medusa_heads.safetensors",),
    "medusa2": _HF_MODEL,
    "hydra": ("config.json", "hydra_lm_head.safetensors", "hydra_lm_head.pt"),
    "eagle3": ("config.json", "model.safetensors"),
    "deepseek-mtp": _HF_MODEL + ("mtp.safetensors", "medusa_jax.json"),
    "mimo-mtp": ("config.json", "mtp.safetensors"),
}


def earlier_export(fmt: str):
    """`rundir.check_new_folder`'s test for --force: None when the folder holds an export of
    `fmt` and nothing else (EXPORT_FILES), else why not."""
    def check(folder: Path) -> str | None:
        import fnmatch

        from medusa_jax.drafters import formats as hf

        try:
            found = hf.detect(folder)
        except (ValueError, FileNotFoundError) as e:
            return f"it is not an earlier export ({e})"
        if found.layout != fmt:
            return f"it holds the {found.layout} layout, not {fmt}"
        if any(f.parent != folder for f in found.files):  # e.g. a run directory's heads/
            return f"it is not an earlier export (its heads are in {found.files[0].parent})"
        other = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                       if p.is_dir() or not any(fnmatch.fnmatchcase(p.name, pat)
                                                for pat in EXPORT_FILES[fmt]))
        if other:
            shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3
                                            else "")
            return f"it holds files a {fmt} export does not write ({shown})"
        return None
    return check


def export(args: argparse.Namespace) -> list[Path]:
    from medusa_jax.model.config import ModelConfig
    from medusa_jax.runtime import assets, hub
    from medusa_jax.runtime.rundir import check_new_folder

    out = Path(args.output)
    if assets.inside_package(out):
        raise ValueError(f"--output {out}: inside the installed package's assets "
                         f"({assets.root()}), which the shipped model, heads and figures "
                         f"use; write somewhere else (runs/, say)")
    if args.format == "medusa_jax" and out.suffix == ".safetensors":  # a file of its own
        if out.exists() and not (args.force and out.is_file()):
            raise ValueError(f"--output {out}: already exists (--force replaces it)")
    else:
        check_new_folder(out, "--output", args.force, earlier_export(args.format))
    source = Path(hub.local(args.source, "source", hub.HEADS_FILES))  # a path or a hub id
    if not source.exists():  # before JAX (heads_formats) is imported
        raise FileNotFoundError(f"{source}: no Medusa heads artifact here (no such file or "
                                f"folder)")
    if args.model:
        args.model = str(hub.local(args.model, "--model"))
        if not Path(args.model).is_dir():
            raise FileNotFoundError(f"--model {args.model}: no such model folder")
        ModelConfig.from_dir(args.model)  # its config.json's fields, named
    from medusa_jax.drafters import formats as hf

    found = hf.detect(source)
    # a first read without the backbone finds what the heads record about it
    heads, meta = hf.read(found, None)
    hf.check_layout(heads, args.format)  # before the backbone is read
    model = resolve_model(source, found, meta, args.model)
    cfg = ModelConfig.from_dir(model) if model is not None else None
    if cfg is not None:  # strict: the shapes (and an EAGLE-3 embedding) against the backbone's
        embed = None
        if found.layout == "eagle3":
            from medusa_jax.model.weights import read_embedding

            embed = read_embedding(model)
        heads, meta = hf.read(found, cfg, base_model=model, embed=embed)
    base = args.base_model or hf.base_model_of(meta) or (str(model.resolve()) if model else None)
    if args.format == "medusa2":
        from medusa_jax.model.weights import load_pretrained

        if model is None:
            raise ValueError("--format medusa2 bundles the backbone: pass --model DIR")
        cfg, backbone = load_pretrained(model)
        return [hf.write_medusa2_model(out, cfg, backbone, heads, source_dir=model,
                                       base_model=base)]
    if args.format in WITH_BACKBONE and model is not None:
        from medusa_jax.model.weights import load_pretrained, save_pretrained

        cfg, backbone = load_pretrained(model)
        for f in out.glob("*.safetensors*"):  # an earlier export's (--force): not kept
            f.unlink()
        save_pretrained(cfg, backbone, out, source_dir=model)
        return [out / f for f in sorted(p.name for p in out.iterdir())
                if f not in ("config.json", "model.safetensors")] + \
            hf.write(heads, args.format, out, cfg=cfg, base_model=base)
    if args.format == "medusa_jax" and cfg is None:
        cfg = hf.sizes_config(heads)
    extra = {"converted_from": str(source), "source_format": found.layout}
    return hf.write(heads, args.format, out, cfg=cfg, base_model=base, extra=extra)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        written = export(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        text = str(e).strip().splitlines()
        print(f"error: {text[0] if text else type(e).__name__}", file=sys.stderr)
        return 1
    print(f"wrote the {args.format} layout:")
    for f in written:
        print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
