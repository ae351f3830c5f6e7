"""Medusa heads in the layouts other tools use: the reference's (FasterDecoding/Medusa),
a Medusa-2 model folder, vLLM's; strict readers and writers, the checks of our own
layout's tensors, and `MedusaFormats` (what `drafters.formats` asks of a kind). The table
of every layout is in `drafters.formats`."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from medusa_jax.drafters.artifact import HEADS_FILE, check_kind
from medusa_jax.drafters.io import (
    PICKLES,
    Expect,
    Found,
    HeadsFormatError,
    Layout,
    as_float32,
    config_count,
    contiguous,
    file_of,
    heads_meta,
    meta_count,
    names_counts,
    read_files,
    read_json,
    tensor_sizes,
    write_json,
    write_safetensors,
    write_tensors,
)
from medusa_jax.drafters.kind import Formats
from medusa_jax.model import weights
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig

KIND = "medusa"
REFERENCE_ST = "medusa_lm_head.safetensors"


REFERENCE_PT = "medusa_lm_head.pt"


VLLM_FILE = "model.safetensors"


MEDUSA2_PREFIX = "medusa_head."


VLLM_PREFIX = "medusa_heads."


def model_shards(folder: Path) -> list[Path] | None:
    """A model folder's safetensors files (as `weights` reads them), None when it has none."""
    if not any((folder / f).is_file() for f in ("model.safetensors",
                                                "model.safetensors.index.json")):
        return None
    try:
        return weights.weight_files(folder)
    except weights.WeightsError as e:
        raise HeadsFormatError(str(e)) from None


def is_medusa2_model(path: str | Path) -> bool:
    """A folder holding a backbone and its Medusa heads (the reference's Medusa-2 layout)."""
    p = Path(path)
    cfg = p / "config.json"
    if not p.is_dir() or not cfg.is_file() or any(
            (p / f).is_file() for f in (HEADS_FILE, REFERENCE_ST, REFERENCE_PT)):
        return False  # `detect` reads those first: the folder is heads, not a model
    try:
        conf = json.loads(cfg.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(conf, dict) and "medusa_num_heads" in conf and \
        conf.get("model_type") != "medusa" and model_shards(p) is not None


def read_reference(found: Found, cfg: ModelConfig | None, prefix: str) -> tuple[Params, dict]:
    keep = (lambda n: n.startswith(prefix)) if prefix else None
    tensors = read_files(found.files, keep)
    conf = read_json(found.config) if found.config is not None else {}
    pattern = re.escape(prefix) + r"(\d+)\.(\d+)\.(linear\.)?"
    k_t, l_t = names_counts(tensors, pattern)
    if k_t == 0:
        raise HeadsFormatError(f"{found.root}: no {prefix + '* ' if prefix else ''}heads "
                               f"tensors ({prefix}{{i}}.{{j}}.linear.weight, ...)")
    k = config_count(conf, ("medusa_num_heads",), found.config)
    lyr = config_count(conf, ("medusa_num_layers",), found.config)
    if conf.get("medusa_num_layers") == 0:
        raise HeadsFormatError(f"{found.config}: medusa_num_layers=0 is not supported")
    k, lyr = k or k_t, lyr or max(l_t, 1)
    if (k, lyr) != (k_t, max(l_t, 1)):
        raise HeadsFormatError(
            f"{found.config}: medusa_num_heads={k}, medusa_num_layers={lyr} but the tensors "
            f"({', '.join(f.name for f in found.files)}) hold {k_t} heads x {l_t} blocks")
    h, v = tensor_sizes(cfg, tensors, f"{prefix}0.{lyr}.weight", found)
    what = f"{k} heads x {lyr} blocks, hidden {h}, vocab {v}"
    ex = Expect(tensors, found, what)
    w = np.empty((k, lyr, h, h), np.float32)
    b = np.empty((k, lyr, h), np.float32)
    proj = np.empty((k, h, v), np.float32)
    for i in range(k):
        for j in range(lyr):
            w[i, j] = ex.get(f"{prefix}{i}.{j}.linear.weight", (h, h),
                             f"head {i} block {j} Linear weight [out, in]").T
            b[i, j] = ex.get(f"{prefix}{i}.{j}.linear.bias", (h,), f"head {i} block {j} bias")
        proj[i] = ex.get(f"{prefix}{i}.{lyr}.weight", (v, h),
                         f"head {i} projection [vocab, hidden]").T
    ex.done()
    base = conf.get("base_model_name_or_path")
    if found.layout == "medusa2":
        base = str(found.root if found.root.is_dir() else found.root.parent)
    meta = heads_meta(found, k, lyr, h, v, base)
    return {"w": w, "b": b, "proj": proj}, meta


def read_vllm(found: Found, cfg: ModelConfig | None) -> tuple[Params, dict]:
    raw = read_files(found.files)
    tensors: dict = {}
    for name, val in raw.items():
        short = name[len(VLLM_PREFIX):] if name.startswith(VLLM_PREFIX) else name
        if short in tensors:
            raise HeadsFormatError(f"{val[1]}: tensor {name} duplicates {short}")
        tensors[short] = val
    if found.config is None:
        raise HeadsFormatError(f"{found.root}: vLLM Medusa heads need their config.json "
                               f"(model_type medusa, num_heads, num_hidden_layers, ...)")
    conf, cf = read_json(found.config), found.config
    k = config_count(conf, ("num_heads", "medusa_num_heads"), cf)
    lyr = config_count(conf, ("num_hidden_layers", "medusa_num_layers"), cf)
    if k is None or lyr is None:
        raise HeadsFormatError(f"{cf}: needs num_heads and num_hidden_layers "
                               f"(or medusa_num_heads, medusa_num_layers)")
    for key in ("hidden_size", "vocab_size"):
        if not isinstance(conf.get(key), int):
            raise HeadsFormatError(f"{cf}: required field {key!r} is missing")
    h, v = conf["hidden_size"], conf["vocab_size"]
    if cfg is not None and (h, v) != (cfg.hidden_size, cfg.vocab_size):
        raise HeadsFormatError(f"{cf}: hidden_size={h}, vocab_size={v} but the backbone has "
                               f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    if float(conf.get("logit_scale", 1.0)) != 1.0:
        raise HeadsFormatError(f"{cf}: logit_scale={conf['logit_scale']} is not supported")
    t = conf.get("truncated_vocab_size") or v
    if not isinstance(t, int) or not 1 <= t <= v:
        raise HeadsFormatError(f"{cf}: truncated_vocab_size={t!r}, expected 1..{v}")
    bias = bool(conf.get("medusa_fc_bias", False))
    shared = bool(conf.get("original_lm_head", False))
    k_t, l_t = names_counts(tensors, r"blocks\.(\d+)\.layers\.(\d+)(\.)")
    if (k_t, l_t) != (k, lyr):
        raise HeadsFormatError(f"{cf}: num_heads={k}, num_hidden_layers={lyr} but the tensors "
                               f"({', '.join(f.name for f in found.files)}) hold {k_t} heads "
                               f"x {l_t} layers")
    what = f"{cf.name}: {k} heads x {lyr} layers, hidden {h}, vocab {v}" + \
        (f", truncated_vocab_size {t}" if t < v else "") + \
        (", medusa_fc_bias" if bias else ", no medusa_fc_bias") + \
        (", original_lm_head" if shared else "")
    ex = Expect(tensors, found, what)
    token_map = None
    if t < v:
        token_map = ex.get("token_map", (t,), "token ids of the reduced vocabulary")
        if not np.issubdtype(token_map.dtype, np.integer):
            raise HeadsFormatError(f"{file_of(tensors, 'token_map', found)}: tensor token_map "
                                   f"has dtype {token_map.dtype}, expected integers")
        if token_map.min() < 0 or token_map.max() >= v or len(np.unique(token_map)) != t:
            raise HeadsFormatError(f"{file_of(tensors, 'token_map', found)}: tensor token_map "
                                   f"must hold {t} distinct token ids in 0..{v - 1}")
    elif "token_map" in tensors:
        ex.used.add("token_map")  # vLLM ignores it when truncated_vocab_size == vocab_size
    w = np.empty((k, lyr, h, h), np.float32)
    b = np.zeros((k, lyr, h), np.float32)
    for i in range(k):
        for j in range(lyr):
            w[i, j] = ex.get(f"blocks.{i}.layers.{j}.weight", (h, h),
                             f"head {i} layer {j} Linear weight [out, in]").T
            if bias:
                b[i, j] = ex.get(f"blocks.{i}.layers.{j}.bias", (h,), f"head {i} layer {j} bias")
    rows = v if token_map is None else None

    def lm(name, role):
        a = tensors.get(name, (None,))[0]
        r = rows if rows is not None else (v if a is not None and a.shape[0] == v else t)
        a = ex.get(name, (r, h), role + (" [vocab or truncated_vocab_size, hidden]"
                                          if token_map is not None else " [vocab, hidden]"))
        if token_map is not None and r == v:  # vLLM keeps the rows of token_map
            a = a[token_map]
        return np.ascontiguousarray(a.T)

    if shared:
        names = [n for n in ("lm_head.weight", "lm_heads.0.weight") if n in tensors]
        if len(names) > 1:
            raise HeadsFormatError(f"{tensors[names[1]][1]}: both lm_head.weight and "
                                   f"lm_heads.0.weight ({what}: one projection)")
        proj = lm(names[0] if names else "lm_head.weight", "the shared projection")[None]
    else:
        proj = np.stack([lm(f"lm_heads.{i}.weight", f"head {i} projection") for i in range(k)])
    ex.done()
    params = {"w": w, "b": b, "proj": proj}
    if token_map is not None:
        index = np.full((1, v), -1, np.int32)
        index[0, token_map] = np.arange(t, dtype=np.int32)
        params["token_index"] = index
    meta = heads_meta(found, k, lyr, h, v, conf.get("base_model_name_or_path"))
    meta.update(shared_proj=str(shared).lower(), truncated_vocab_size=str(t),
                medusa_fc_bias=str(bias).lower())
    return params, meta


def check_heads(tensors: dict, cfg: ModelConfig | None, file, k: int, lyr: int):
    """Our layout: w [K, L, H, H], b [K, L, H], proj [K or 1, H, V] or, with token_index
    [K or 1, V] (each of proj's T columns used by exactly one token id), [K or 1, H, T]."""
    names = set(tensors)
    if not {"w", "b", "proj"} <= names or names - {"w", "b", "proj", "token_index"}:
        raise HeadsFormatError(f"{file}: expected tensors w, b, proj (and optionally "
                               f"token_index); found {sorted(names)}")
    h = cfg.hidden_size if cfg is not None else int(tensors["w"].shape[-1])
    v = cfg.vocab_size if cfg is not None else int(
        tensors["token_index"].shape[-1] if "token_index" in names else tensors["proj"].shape[-1])
    shape = {n: tuple(a.shape) for n, a in tensors.items()}
    reduced = "token_index" in names
    kp = shape["proj"][0] if len(shape["proj"]) == 3 and shape["proj"][0] in (1, k) else k
    t = shape["proj"][2] if reduced and len(shape["proj"]) == 3 else v
    want = {"w": (k, lyr, h, h), "b": (k, lyr, h), "proj": (kp, h, t)}
    if reduced:
        ki = shape["token_index"][0] if shape["token_index"][:1] in ((1,), (k,)) else k
        want["token_index"] = (ki, v)
    for name, s in want.items():
        if shape[name] != s:
            raise HeadsFormatError(
                f"{file}: tensor {name} has shape {shape[name]}, expected {s} for {k} heads x "
                f"{lyr} layers on a backbone with hidden {h}, vocab {v}")
    for name in ("w", "b", "proj"):  # corrupt or mislabelled heads would decode silently
        a = np.asarray(tensors[name])
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise HeadsFormatError(f"{file}: tensor {name} has dtype {a.dtype}, expected "
                                   f"floating point")
        try:
            weights.check_finite(a, name, file)
        except weights.WeightsError as e:
            raise HeadsFormatError(str(e)) from None
    if reduced:
        index = np.asarray(tensors["token_index"])
        if not np.issubdtype(index.dtype, np.integer):
            raise HeadsFormatError(f"{file}: tensor token_index has dtype {index.dtype}, "
                                   f"expected int32")
        for row in index:
            used = np.sort(row[row >= 0])
            if row.min() < -1 or not np.array_equal(used, np.arange(t)):
                raise HeadsFormatError(
                    f"{file}: tensor token_index must give each of proj's {t} columns to "
                    f"exactly one token id (-1 elsewhere)")


def medusa_only(heads: Params, layout: str):
    """A one-line HeadsFormatError unless `heads` are Medusa heads (`layout` holds no other)."""
    check_kind(heads, KIND, layout)


def _full_proj(heads: Params, layout: str) -> np.ndarray:
    """proj as [K, H, V] for layouts without shared or reduced projections."""
    if "token_index" in heads:
        raise HeadsFormatError(f"the {layout} layout has no reduced vocabulary (these heads "
                               f"carry token_index); export them with --format vllm or "
                               f"medusa_jax")
    k = int(np.shape(heads["w"])[0])
    proj = as_float32(heads["proj"])
    return np.broadcast_to(proj, (k, *proj.shape[1:])) if proj.shape[0] == 1 else proj


def reference_tensors(heads: Params, prefix: str = "") -> dict[str, np.ndarray]:
    """Our heads under the reference's names ({prefix}{i}.{j}.linear.weight, ...)."""
    medusa_only(heads, "reference")
    w, b = as_float32(heads["w"]), as_float32(heads["b"])
    proj = _full_proj(heads, "reference")
    k, lyr = w.shape[:2]
    out = {}
    for i in range(k):
        for j in range(lyr):
            out[f"{prefix}{i}.{j}.linear.weight"] = contiguous(w[i, j].T)
            out[f"{prefix}{i}.{j}.linear.bias"] = contiguous(b[i, j])
        out[f"{prefix}{i}.{lyr}.weight"] = contiguous(proj[i].T)
    return out


def _blocks_differ(heads: Params) -> bool:
    w, b = as_float32(heads["w"]), as_float32(heads["b"])
    return w.shape[1] > 1 and not (np.all(w == w[:, :1]) and np.all(b == b[:, :1]))


def write_reference(heads: Params, out_dir: str | Path, *, base_model: str | None = None,
                    pickle: bool | None = None) -> list[Path]:
    """The reference's Medusa-1 heads folder: config.json + medusa_lm_head.safetensors, and
    medusa_lm_head.pt (the file the reference's own loader opens) when `pickle` is true or,
    with None, when PyTorch is installed. Returns the files written."""
    tensors = reference_tensors(heads)
    k, lyr = np.shape(heads["w"])[:2]
    if _blocks_differ(heads):
        warnings.warn(f"{lyr} different blocks per head: the reference's own MedusaModel "
                      f"repeats one block object ([ResBlock] * medusa_num_layers) and will load "
                      f"only the last; vLLM and TensorRT-LLM read the blocks separately",
                      UserWarning, stacklevel=3)
    out = Path(out_dir)
    written = write_tensors(out, REFERENCE_ST, REFERENCE_PT, tensors, pickle)
    conf = {"medusa_num_heads": int(k), "medusa_num_layers": int(lyr)}
    if base_model:
        conf["base_model_name_or_path"] = str(base_model)
    write_json(out / "config.json", conf)
    return [out / "config.json", *written]


def vllm_tensors(heads: Params) -> tuple[dict[str, np.ndarray], dict]:
    """Our heads under vLLM's names, and the config fields that describe them."""
    medusa_only(heads, "vllm")
    w, b, proj = as_float32(heads["w"]), as_float32(heads["b"]), as_float32(heads["proj"])
    k, lyr, h = w.shape[:3]
    bias = bool(np.any(b != 0))
    out = {}
    for i in range(k):
        for j in range(lyr):
            out[f"blocks.{i}.layers.{j}.weight"] = contiguous(w[i, j].T)
            if bias:
                out[f"blocks.{i}.layers.{j}.bias"] = contiguous(b[i, j])
    shared = proj.shape[0] == 1 and k > 1
    if shared:
        out["lm_head.weight"] = contiguous(proj[0].T)
    else:
        for i in range(k):
            out[f"lm_heads.{i}.weight"] = contiguous(proj[i].T)
    v = proj.shape[2]
    conf = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": int(h),
            "vocab_size": int(v), "num_heads": int(k), "num_hidden_layers": int(lyr),
            "medusa_fc_bias": bias}
    if shared:
        conf["original_lm_head"] = True
    if "token_index" in heads:
        index = np.asarray(heads["token_index"])
        if not np.all(index == index[:1]):
            raise HeadsFormatError("vLLM has one token_map for all heads; these heads' "
                                   "token_index rows differ")
        row = index[0]
        t = int(proj.shape[2])
        token_map = np.empty(t, np.int64)
        token_map[row[row >= 0]] = np.nonzero(row >= 0)[0]
        out["token_map"] = token_map
        conf["vocab_size"] = int(row.shape[0])
        conf["truncated_vocab_size"] = t
    return out, conf


def write_vllm(heads: Params, out_dir: str | Path, *, base_model: str | None = None) \
        -> list[Path]:
    """vLLM's Medusa draft-model folder: config.json + model.safetensors."""
    tensors, conf = vllm_tensors(heads)
    if base_model:
        conf["base_model_name_or_path"] = str(base_model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / VLLM_FILE, tensors, {"format": "pt"})
    write_json(out / "config.json", conf)
    return [out / "config.json", out / VLLM_FILE]


def write_medusa2_model(out_dir: str | Path, cfg: ModelConfig, backbone: Params,
                        heads: Params, *, source_dir: str | Path,
                        base_model: str | None = None) -> Path:
    """One Medusa-2 model folder in the reference's layout: the backbone in the Hugging Face
    layout (config, tokenizer files from `source_dir`) in shard 1, the heads as
    medusa_head.{i}.{j}.linear.weight ... in shard 2, model.safetensors.index.json over both,
    and medusa_num_heads / medusa_num_layers in config.json. It loads in transformers as the
    plain backbone (the heads are ignored there), in the reference's MedusaModel, and here
    with `Medusa.load(heads=out_dir)` / `--model out_dir --heads out_dir`."""
    from medusa_jax.model.weights import save_pretrained

    medusa_only(heads, "medusa2")
    head_tensors = reference_tensors(heads, MEDUSA2_PREFIX)
    k, lyr = np.shape(heads["w"])[:2]
    out = Path(out_dir)
    save_pretrained(cfg, backbone, out, source_dir=source_dir)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        backbone_names = list(f.keys())
    os.replace(out / "model.safetensors", out / first)
    write_safetensors(out / second, head_tensors, {"format": "pt"})
    with safe_open(str(out / first), framework="numpy") as f:  # save_pretrained: float32
        sizes = sum(4 * int(np.prod(f.get_slice(n).get_shape())) for n in backbone_names)
    sizes += sum(a.nbytes for a in head_tensors.values())
    weight_map = {**{n: first for n in backbone_names}, **{n: second for n in head_tensors}}
    write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": int(sizes)}, "weight_map": weight_map})
    conf = read_json(out / "config.json")
    conf.update(medusa_num_heads=int(k), medusa_num_layers=int(lyr))
    if base_model:
        conf["base_model_name_or_path"] = str(base_model)
    write_json(out / "config.json", conf)
    return out


# ----------------------------------------------------------------------------- the kind's formats


def _vllm_dir(p: Path, conf: dict | None, config: Path | None) -> Found | None:
    if conf is None or conf.get("model_type") != "medusa":
        return None
    files = sorted(f for f in p.glob("*.safetensors"))
    if not files:
        files = sorted(f for f in p.iterdir() if f.suffix in PICKLES and f.is_file())
    if not files:
        raise HeadsFormatError(f"{p}: config.json says model_type medusa (vLLM) but there "
                               f"is no *.safetensors (or .pt/.bin) file with the heads")
    return Found("vllm", p, tuple(files), config)


def _vllm_file(p: Path, conf: dict, config: Path | None, names, meta) -> Found | None:
    if names is None:  # a pickle
        return Found("vllm", p, (p,), config) if conf.get("model_type") == "medusa" else None
    if conf.get("model_type") == "medusa" or any(
            n.startswith(("blocks.", "lm_heads.", VLLM_PREFIX)) for n in names):
        return Found("vllm", p, (p,), config if conf.get("model_type") == "medusa" else None)
    return None


def _reference_dir(p: Path, conf: dict | None, config: Path | None) -> Found | None:
    for name in (REFERENCE_ST, REFERENCE_PT):
        if (p / name).is_file():
            return Found("reference", p, (p / name,), config)
    return None


def _reference_file(p: Path, conf: dict, config: Path | None, names, meta) -> Found | None:
    if names is None or (names and all(re.match(r"\d+\.\d+\.", n) for n in names)):
        return Found("reference", p, (p,), config)
    return None


def _medusa2_dir(p: Path, conf: dict | None, config: Path | None) -> Found | None:
    if conf is None or "medusa_num_heads" not in conf:
        return None
    shards = model_shards(p)
    if shards is not None:
        return Found("medusa2", p, tuple(shards), config)
    raise HeadsFormatError(f"{config}: has medusa_num_heads but the folder has neither "
                           f"{REFERENCE_ST}/{REFERENCE_PT} nor model.safetensors[.index.json]")


def _medusa2_file(p: Path, conf: dict, config: Path | None, names, meta) -> Found | None:
    if names is not None and any(n.startswith(MEDUSA2_PREFIX) for n in names):
        return Found("medusa2", p, (p,), config)
    return None


def _checked(heads: Params, meta: dict, found: Found, cfg: ModelConfig | None):
    check_heads(heads, cfg, found.root, int(meta["num_heads"]), int(meta["num_layers"]))
    return heads, meta


class MedusaFormats(Formats):
    """What `drafters.formats` asks of a kind: its layouts, and its fields of our artifact."""

    kind = KIND
    what = "Medusa heads"
    layouts = (
        Layout("vllm", "vLLM (config.json with model_type medusa + *.safetensors)",
               _vllm_dir, _vllm_file,
               lambda found, cfg, embed: _checked(*read_vllm(found, cfg), found, cfg),
               lambda heads, out, cfg, base: write_vllm(heads, out, base_model=base)),
        Layout("reference", f"reference (config.json + {REFERENCE_ST} or {REFERENCE_PT})",
               _reference_dir, _reference_file,
               lambda found, cfg, embed: _checked(*read_reference(found, cfg, ""), found, cfg),
               lambda heads, out, cfg, base: write_reference(heads, out, base_model=base)),
        Layout("medusa2", "Medusa-2 model (config.json with medusa_num_heads + "
               "model.safetensors[.index.json] holding medusa_head.* tensors)",
               _medusa2_dir, _medusa2_file,
               lambda found, cfg, embed: _checked(*read_reference(found, cfg, MEDUSA2_PREFIX),
                                                  found, cfg),
               None, is_medusa2_model),  # written with the backbone: write_medusa2_model
    )

    @staticmethod
    def save(heads: Params, cfg: ModelConfig, file: Path) -> tuple[dict, dict]:
        """(tensors, metadata fields) of our artifact: float32 weights, token_index int32."""
        k, lyr = np.shape(heads["w"])[:2]
        tensors = {n: contiguous(np.asarray(a, np.int32 if n == "token_index" else np.float32))
                   for n, a in heads.items()}
        return tensors, {"num_heads": str(k), "num_layers": str(lyr)}

    @staticmethod
    def load(tensors: dict, meta: dict, cfg: ModelConfig | None, file: Path) -> Params:
        check_heads(tensors, cfg, file, meta_count(meta, "num_heads", file),
                    meta_count(meta, "num_layers", file))
        return {n: jnp.asarray(a, jnp.int32 if n == "token_index" else jnp.float32)
                for n, a in tensors.items()}

    @staticmethod
    def sizes(heads: Params) -> tuple[int, int]:
        """(hidden, vocab) of the heads themselves."""
        v = np.shape(heads["token_index"] if "token_index" in heads else heads["proj"])[-1]
        return int(np.shape(heads["w"])[-1]), int(v)
