"""MTP modules' file layouts: our artifact, DeepSeek-V3's and MiMo's (`MtpFormats`, which
`drafters.formats` loops over with every kind's).

layout        files                                   tensors (module k of D, torch [out, in])
------------  --------------------------------------  -----------------------------------------
deepseek-mtp  config.json (num_hidden_layers N,       model.layers.{N+k}.enorm.weight [H]
              num_nextn_predict_layers D, the         .hnorm.weight [H], .eh_proj.weight [H, 2H]
              backbone's sizes) + *.safetensors       .shared_head.norm.weight [H]
              (the modules beside the backbone's      .<the backbone's layer tensors>
              tensors, or alone)                      optional: .shared_head.head.weight [V, H],
                                                      .embed_tokens.weight [V, H] (copies of
                                                      the backbone's; shape-checked, unused)
mimo-mtp      config.json (model_type mimo,           model.mtp_layers.{k}.token_layernorm /
              num_nextn_predict_layers D) +           hidden_layernorm / final_layernorm.weight
              *.safetensors                           [H], .input_proj.weight [H, 2H] (hidden
                                                      first), .<the backbone's layer tensors>

The decoder layer's tensors are named as the backbone's own layers are
(`model.weights.layer_map`: input_layernorm, self_attn.q_proj, ...). Only the modules'
tensors are read (a whole model folder's backbone is left to the model loader). The shared
output head and embedding are the backbone's: we write neither, so a written folder is the
modules and a config.json (the backbone's, from `base_model`'s folder when given, with
num_nextn_predict_layers), to sit beside a backbone.

Reading is strict, before anything compiles: num_nextn_predict_layers a positive integer,
the hidden size and vocabulary the backbone's, every module tensor present with its shape,
finite, and no tensor of a module left over; one-line `HeadsFormatError`s naming the file
and tensor.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from medusa_jax.drafters.io import (
    Expect,
    Found,
    HeadsFormatError,
    Layout,
    contiguous,
    read_files,
    read_json,
    write_json,
    write_safetensors,
)
from medusa_jax.drafters.kind import Formats
from medusa_jax.drafters.mtp import heads as mtp
from medusa_jax.model import weights
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig

NEXTN = "num_nextn_predict_layers"
# our name -> the layout's, per layout style
OWN_NAMES = {
    "deepseek": {"enorm": "enorm.weight", "hnorm": "hnorm.weight",
                 "eh_proj": "eh_proj.weight", "final_norm": "shared_head.norm.weight"},
    "mimo": {"enorm": "token_layernorm.weight", "hnorm": "hidden_layernorm.weight",
             "eh_proj": "input_proj.weight", "final_norm": "final_layernorm.weight"},
}
SHARED = ("shared_head.head.weight", "embed_tokens.weight")  # DeepSeek-V3's copies
LAYOUTS = {"deepseek-mtp": "deepseek", "mimo-mtp": "mimo"}
WEIGHTS_FILE = "mtp.safetensors"


def prefix(style: str, first: int, k: int) -> str:
    """The name prefix of module k (`first`: the backbone's layer count N)."""
    return f"model.layers.{first + k}." if style == "deepseek" else f"model.mtp_layers.{k}."


def _module_of(style: str, first: int, name: str) -> int | None:
    """The module a tensor name belongs to (None: not a module's)."""
    pat = r"model\.layers\.(\d+)\." if style == "deepseek" else r"model\.mtp_layers\.(\d+)\."
    m = re.match(pat, name)
    if m is None:
        return None
    k = int(m.group(1)) - (first if style == "deepseek" else 0)
    return k if k >= 0 else None


def _layer_names(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """HF layer tensor name -> (our key, transposed?) for the keys this backbone's layer has."""
    specs = mtp.layer_specs(cfg)
    return {hf: (key, t) for hf, (key, t) in weights.layer_map(cfg).items() if key in specs}


def _count(conf: dict, config: Path) -> int:
    v = conf.get(NEXTN)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise HeadsFormatError(f"{config}: {NEXTN}={v!r}: the checkpoint holds no MTP module "
                               f"(a positive integer is needed)")
    return v


def _backbone_cfg(conf: dict, config: Path, cfg: ModelConfig | None) -> ModelConfig:
    if cfg is None:
        try:
            return ModelConfig.from_hf_dict(conf, str(config))
        except ValueError as e:
            raise HeadsFormatError(str(e).splitlines()[0]) from None
    for key, ours in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
        if key in conf and conf[key] != ours:
            raise HeadsFormatError(f"{config}: {key}={conf[key]!r}, but the backbone's is "
                                   f"{ours}: these modules belong to another model")
    return cfg


def read_mtp(found: Found, cfg: ModelConfig | None) -> tuple[Params, ModelConfig, dict]:
    """(the modules as numpy [D, ...] tensors, the backbone config, metadata) of a
    deepseek-mtp or mimo-mtp folder, strictly."""
    style = LAYOUTS[found.layout]
    config = found.config or found.root / "config.json"
    conf = read_json(config)
    d = _count(conf, config)
    cfg = _backbone_cfg(conf, config, cfg)
    first = conf.get("num_hidden_layers", cfg.num_layers)
    files = sorted(found.root.glob("*.safetensors"))
    if not files:
        raise HeadsFormatError(f"{found.root}: no *.safetensors file holds the MTP modules")
    tensors = read_files(files, keep=lambda n: _module_of(style, first, n) is not None)
    found = Found(found.layout, found.root, tuple(files), config)
    what = f"{d} MTP modules in the {found.layout} layout"
    ex = Expect(tensors, found, what)
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes = mtp.param_shapes(cfg, d)
    per: dict[str, list] = {n: [] for n in shapes}
    for k in range(d):
        pre = prefix(style, first, k)
        for ours, theirs in OWN_NAMES[style].items():
            shape = (h, 2 * h) if ours == "eh_proj" else (h,)
            a = ex.get(pre + theirs, shape, f"module {k}'s {ours}")
            per[ours].append(a.T if ours == "eh_proj" else a)
        for hf, (key, transposed) in _layer_names(cfg).items():
            shape = shapes[mtp.LAYER + key][1:]
            a = ex.get(pre + hf, shape[::-1] if transposed else shape,
                       f"module {k}'s decoder layer")
            per[mtp.LAYER + key].append(a.T if transposed else a)
        if style == "deepseek":
            for name in SHARED:
                if pre + name in tensors:
                    ex.get(pre + name, (v, h), "a copy of the backbone's")
    ex.done()
    for name, (a, file) in tensors.items():
        if not np.all(np.isfinite(np.asarray(a, np.float32))):
            raise HeadsFormatError(f"{file}: tensor {name} has non-finite values (NaN or inf)")
    heads = {n: np.ascontiguousarray(np.stack(a).astype(np.float32)) for n, a in per.items()}
    meta = {"format": found.layout, "num_heads": str(d), "num_layers": "1",
            "hidden_size": str(h), "vocab_size": str(v),
            "extra": {"source": str(found.root), "files": [str(f) for f in files]}}
    return heads, cfg, meta


def write_mtp(heads: Params, out_dir, cfg: ModelConfig, style: str,
              base_model: str | None = None) -> list[Path]:
    """The modules in the `style` layout under `out_dir`: config.json (`base_model`'s when
    it is a folder with one, else the backbone's sizes; with num_nextn_predict_layers) and
    mtp.safetensors. Into a model folder (`out_dir` holding the backbone's config.json and
    model.safetensors, DeepSeek-V3's layout only) the modules join the model's weights as
    layers N .. N+D-1 and its config.json gains num_nextn_predict_layers: the folder is then
    a model that carries its own drafter."""
    mtp.check(heads, cfg, f"writing the {style} MTP layout")
    out = Path(out_dir)
    model_file = out / "model.safetensors"
    into_model = style == "deepseek" and model_file.is_file() and (out / "config.json").is_file()
    out.mkdir(parents=True, exist_ok=True)
    d = mtp.num_modules(heads)
    source = Path(base_model) / "config.json" if base_model else None
    if into_model:
        conf = read_json(out / "config.json")
        if conf.get("num_hidden_layers") != cfg.num_layers:
            raise HeadsFormatError(f"{out / 'config.json'}: num_hidden_layers="
                                   f"{conf.get('num_hidden_layers')!r}, but these modules' "
                                   f"backbone has {cfg.num_layers} layers")
    elif source is not None and source.is_file():
        conf = read_json(source)
    else:
        conf = {"model_type": "mimo" if style == "mimo" else cfg.model_type,
                "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
                "rope_theta": cfg.rope_theta,
                "max_position_embeddings": cfg.max_position_embeddings,
                "tie_word_embeddings": cfg.tie_word_embeddings}
    conf[NEXTN] = d
    tensors = {}
    for k in range(d):
        pre = prefix(style, cfg.num_layers, k)
        for ours, theirs in OWN_NAMES[style].items():
            a = np.asarray(heads[ours][k], np.float32)
            tensors[pre + theirs] = contiguous(a.T if ours == "eh_proj" else a)
        for hf, (key, transposed) in _layer_names(cfg).items():
            a = np.asarray(heads[mtp.LAYER + key][k], np.float32)
            tensors[pre + hf] = contiguous(a.T if transposed else a)
    file = out / WEIGHTS_FILE
    if into_model:  # the model's tensors, less any earlier modules', then these
        kept = read_files([model_file], keep=lambda n: _module_of(style, cfg.num_layers, n)
                          is None)
        tensors = {**{n: a for n, (a, _) in kept.items()}, **tensors}
        file = model_file
    write_json(out / "config.json", conf)
    write_safetensors(file, tensors, {"format": "pt"})
    return [out / "config.json", file]


def _has_backbone(folder) -> bool:
    """Whether a folder of DeepSeek-V3's layout holds a backbone beside its modules (then it
    is the model too, when none is named)."""
    p = Path(folder)
    try:
        conf = json.loads((p / "config.json").read_text())
        files = weights.weight_files(p)
        return isinstance(conf, dict) and NEXTN in conf and any(
            "model.embed_tokens.weight" in weights.read_header(f) for f in files)
    except (OSError, ValueError):
        return False


def _style_of(conf: dict) -> str:
    return "mimo-mtp" if conf.get("model_type") == "mimo" or any(
        "MiMo" in str(a) for a in conf.get("architectures") or ()) else "deepseek-mtp"


def _detect_dir(p: Path, conf: dict | None, config: Path | None) -> Found | None:
    if conf is None or NEXTN not in conf:
        return None
    return Found(_style_of(conf), p, (), config)


def _detect_file(p: Path, conf: dict, config: Path | None, names, meta) -> Found | None:
    if config is not None and NEXTN in conf and p.suffix == ".safetensors":
        return Found(_style_of(conf), p.parent, (), config)
    return None


def _bound(heads: Params, what: str):
    bound = getattr(heads, "drafter", None)
    if bound is None or getattr(bound, "model_cfg", None) is None:
        raise HeadsFormatError(f"{what}: these MTP modules carry no backbone config; bind "
                               f"them first (drafters.mtp.drafter.bind(heads, model_cfg))")
    return bound


def _read(found: Found, cfg: ModelConfig | None, embed):
    from medusa_jax.drafters.mtp.drafter import bind

    heads, cfg, meta = read_mtp(found, cfg)
    return bind(heads, cfg, LAYOUTS[found.layout]), meta


def _writer(layout: str):
    def write(heads: Params, out_dir, cfg: ModelConfig | None, base_model):
        bound = _bound(heads, f"the {layout} layout")
        style = LAYOUTS[layout]
        if bound.style != style:
            raise HeadsFormatError(f"these MTP modules follow the {bound.style} style; the "
                                   f"{layout} layout holds {style}-style modules")
        return write_mtp(dict(heads), out_dir, cfg or bound.model_cfg, style, base_model)
    return write


class MtpFormats(Formats):
    """What `drafters.formats` asks of a kind: its layouts, and its fields of our artifact
    (the style and the reuse; the backbone's config is the one it is loaded with)."""

    kind = mtp.KIND
    what = "MTP modules"
    layouts = tuple(
        Layout(name, f"{name} (config.json with {NEXTN}"
               + (", model_type mimo" if style == "mimo" else "") + ", + *.safetensors)",
               _detect_dir, _detect_file, _read, _writer(name),
               bundles_model=_has_backbone if style == "deepseek" else None)
        for name, style in LAYOUTS.items())

    @staticmethod
    def wrong_layout(layout: str) -> str:
        return (f"MTP modules are written in the {', '.join(LAYOUTS)} or medusa_jax layout, "
                f"not {layout!r}")

    @staticmethod
    def save(heads: Params, cfg: ModelConfig, file: Path) -> tuple[dict, dict]:
        bound = _bound(heads, "save_heads")
        mtp.check(dict(heads), cfg, f"save_heads({file})")
        tensors = {k: contiguous(np.asarray(a, np.float32)) for k, a in heads.items()}
        backbone = {k: v for k, v in dataclasses.asdict(bound.model_cfg).items()
                    if k not in ("param_dtype", "compute_dtype")}
        return tensors, {"num_heads": str(mtp.num_modules(heads)), "num_layers": "1",
                         "mtp": json.dumps({"style": bound.style,
                                            "reuse_last": bool(bound.reuse_last),
                                            "backbone": backbone})}

    @staticmethod
    def native_cfg(meta: dict, file: Path, cfg: ModelConfig) -> ModelConfig:
        """The backbone config the artifact records (its modules' layer is one of its
        layers), so the modules read without the backbone's folder."""
        try:
            recorded = json.loads(meta.get("mtp") or "{}").get("backbone")
        except (ValueError, AttributeError):
            recorded = None
        if not isinstance(recorded, dict):
            raise HeadsFormatError(f"{file}: these MTP modules record no backbone config: "
                                   f"read them with their backbone's (--model)")
        try:
            return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in recorded.items()})
        except (TypeError, ValueError) as e:
            raise HeadsFormatError(f"{file}: metadata mtp.backbone is not a model config "
                                   f"({str(e).splitlines()[0]})") from None

    @staticmethod
    def load(tensors: dict, meta: dict, cfg: ModelConfig | None, file: Path) -> Params:
        from medusa_jax.drafters.mtp.drafter import bind

        try:
            fields = json.loads(meta.get("mtp") or "")
            style, reuse = fields["style"], fields["reuse_last"]
            if style not in mtp.STYLES or not isinstance(reuse, bool):
                raise ValueError(style)
        except (ValueError, TypeError, KeyError):
            raise HeadsFormatError(f"{file}: metadata mtp={meta.get('mtp')!r} is not an MTP "
                                   f"drafter's style and reuse") from None
        if cfg is None:
            raise HeadsFormatError(f"{file}: MTP modules are read with their backbone's config")
        for key, ours in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
            if key in meta and meta[key] != str(ours):
                raise HeadsFormatError(f"{file}: metadata {key}={meta[key]}, but the "
                                       f"backbone's is {ours}: these modules belong to another "
                                       f"model")
        try:
            mtp.check(tensors, cfg, str(file))
        except ValueError as e:
            raise HeadsFormatError(str(e)) from None
        return bind({n: jnp.asarray(a) for n, a in tensors.items()}, cfg, style, reuse)

    @staticmethod
    def sizes(heads: Params) -> tuple[int, int]:
        c = _bound(heads, "sizes").model_cfg
        return c.hidden_size, c.vocab_size
