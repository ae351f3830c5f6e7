"""Heads in the layouts other tools use: detection, strict readers, writers, and our own
artifact (`save_heads`, `load_heads`). This module imports `heads` (computing heads), never
the reverse.

K heads, L residual blocks each, hidden size H, vocabulary V (T < V: a reduced vocabulary).
Per head i and block j; torch `Linear` weights are [out, in], ours are [in, out] (y = x @ w):

layout      files                                  tensors
----------  -------------------------------------  --------------------------------------------
medusa_jax  medusa_heads.safetensors (metadata     w [K, L, H, H], b [K, L, H], proj [K, H, V];
  (ours)    format medusa_jax.heads/1), or a run   or proj [1, H, V] (one, shared); or proj
            directory holding heads/               [K or 1, H, T] + token_index [K or 1, V] int32
reference   config.json (medusa_num_heads,         {i}.{j}.linear.weight [H, H]
            medusa_num_layers,                     {i}.{j}.linear.bias [H]
            base_model_name_or_path) +             {i}.{L}.weight [V, H]
            medusa_lm_head.safetensors or .pt
medusa2     the backbone's config.json + medusa_   the backbone's tensors, and the reference's
            num_heads, medusa_num_layers;          names under medusa_head.:
            model.safetensors or shards + index    medusa_head.{i}.{j}.linear.weight ...
vllm        config.json (model_type medusa,        blocks.{i}.layers.{j}.weight [H, H]
            num_heads, num_hidden_layers,          blocks.{i}.layers.{j}.bias [H] (medusa_fc_bias)
            hidden_size, vocab_size; optional      lm_heads.{i}.weight [V or T, H], or one
            medusa_fc_bias, original_lm_head,      lm_head.weight (original_lm_head: shared)
            truncated_vocab_size) + *.safetensors  token_map [T] (truncated_vocab_size T < V);
                                                   any name may start with medusa_heads.
hydra       config.json (hydra_num_heads,          hydra_mlp.{i}.0.linear.weight [H, (i+2)H]
  (zankner/ hydra_num_layers, hydra_head_arch      hydra_mlp.{i}.0.linear.bias [H]
  Hydra)    "mlp", grounded_heads true,            hydra_mlp.{i}.0.res_connection.weight/.bias
            hidden_state_offset 0) +               hydra_mlp.{i}.{j}.linear.weight/.bias, j >= 1
            hydra_lm_head.pt or .safetensors       hydra_lm_head.{i}.weight [V, H], .bias [V]

Hydra heads (`hydra`) are read and written only in our layout and zankner/Hydra's; the other
layouts hold Medusa heads. Hydra++'s prefix-attention heads (hydra_head_arch "prefix-mlp")
and ungrounded heads are refused with a one-line error.

Reading is strict: every tensor must be present with its shape, every tensor in the files must
be used, counts in the config must match the tensors, and any problem raises one one-line
`HeadsFormatError` (a ValueError) naming the file and tensor. vLLM's shared projection becomes
our `proj` [1, H, V]; its reduced vocabulary stays reduced (`proj` [., H, T] + `token_index`),
which gives exactly vLLM's logits: -inf for the token ids outside `token_map`.

The reference builds a head as `[ResBlock(hidden)] * medusa_num_layers`: ONE block object
repeated, so with L > 1 its own loader puts the last block's weights in every position. Files
with L > 1 are read here as L independent blocks (as vLLM and TensorRT-LLM read them).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from medusa_jax.drafters.hydra import heads as hydra
from medusa_jax.model import weights
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig
from medusa_jax.drafters.medusa.heads import HEADS_FILE, heads_config_of

LAYOUTS = ("medusa_jax", "reference", "medusa2", "vllm", "hydra")
REFERENCE_ST = "medusa_lm_head.safetensors"
HYDRA_PT, HYDRA_ST = "hydra_lm_head.pt", "hydra_lm_head.safetensors"  # zankner/Hydra
REFERENCE_PT = "medusa_lm_head.pt"
VLLM_FILE = "model.safetensors"
MEDUSA2_PREFIX = "medusa_head."
VLLM_PREFIX = "medusa_heads."
_PICKLES = (".pt", ".bin", ".pth")

LOOKED_FOR = (
    f"medusa_jax ({HEADS_FILE}, or heads/{HEADS_FILE} in a run directory); "
    f"reference (config.json + {REFERENCE_ST} or {REFERENCE_PT}); "
    "Medusa-2 model (config.json with medusa_num_heads + model.safetensors[.index.json] "
    "holding medusa_head.* tensors); "
    "vLLM (config.json with model_type medusa + *.safetensors); "
    f"zankner/Hydra (config.json with hydra_num_heads + {HYDRA_PT} or {HYDRA_ST})")


class HeadsFormatError(ValueError):
    """Heads that cannot be read or written exactly as asked (a one-line message)."""


def _line(e: BaseException | str) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ----------------------------------------------------------------------------- detection


@dataclasses.dataclass(frozen=True)
class Found:
    layout: str  # one of LAYOUTS
    root: Path  # the path given
    files: tuple[Path, ...]  # the files holding the tensors
    config: Path | None = None  # config.json with the head counts (None: counts from names)


def _json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadsFormatError(f"{file}: not valid JSON ({_line(e)})") from None
    if not isinstance(data, dict):
        raise HeadsFormatError(f"{file}: expected a JSON object")
    return data


def _safetensors_names(file: Path) -> tuple[list[str], dict]:
    try:
        with safe_open(str(file), framework="numpy") as f:
            return list(f.keys()), dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        raise HeadsFormatError(f"{file}: corrupt or truncated heads file ({_line(e)})") from None


def _model_shards(folder: Path) -> list[Path] | None:
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
        conf.get("model_type") != "medusa" and _model_shards(p) is not None


def detect(path: str | Path) -> Found:
    """Which layout `path` (a file or a folder) holds; one-line errors otherwise."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no Medusa heads artifact here (no such file or folder)")
    if p.is_file():
        return _detect_file(p)
    if (p / HEADS_FILE).is_file():
        return Found("medusa_jax", p, (p / HEADS_FILE,))
    if (p / "heads" / HEADS_FILE).is_file():
        return Found("medusa_jax", p, (p / "heads" / HEADS_FILE,))
    cfg_file = p / "config.json"
    conf = _json(cfg_file) if cfg_file.is_file() else None
    config = cfg_file if conf is not None else None
    if conf is not None and conf.get("model_type") == "medusa":
        files = sorted(f for f in p.glob("*.safetensors"))
        if not files:
            files = sorted(f for f in p.iterdir() if f.suffix in _PICKLES and f.is_file())
        if not files:
            raise HeadsFormatError(f"{p}: config.json says model_type medusa (vLLM) but there "
                                   f"is no *.safetensors (or .pt/.bin) file with the heads")
        return Found("vllm", p, tuple(files), config)
    for name in (REFERENCE_ST, REFERENCE_PT):
        if (p / name).is_file():
            return Found("reference", p, (p / name,), config)
    for name in (HYDRA_ST, HYDRA_PT):
        if (p / name).is_file():
            if config is None:
                raise HeadsFormatError(f"{p / name}: zankner/Hydra heads need their "
                                       f"config.json (hydra_num_heads, hydra_num_layers, ...)")
            return Found("hydra", p, (p / name,), config)
    if conf is not None and "medusa_num_heads" in conf:
        shards = _model_shards(p)
        if shards is not None:
            return Found("medusa2", p, tuple(shards), config)
        raise HeadsFormatError(f"{cfg_file}: has medusa_num_heads but the folder has neither "
                               f"{REFERENCE_ST}/{REFERENCE_PT} nor model.safetensors[.index.json]")
    raise HeadsFormatError(f"{p}: no Medusa heads in any known layout; looked for: {LOOKED_FOR}")


def _detect_file(p: Path) -> Found:
    sibling = p.parent / "config.json"
    conf = _json(sibling) if sibling.is_file() else {}
    config = sibling if sibling.is_file() else None
    if p.name in (HYDRA_PT, HYDRA_ST) and "hydra_num_heads" in conf:
        return Found("hydra", p, (p,), config)
    if p.suffix in _PICKLES:
        layout = "vllm" if conf.get("model_type") == "medusa" else "reference"
        return Found(layout, p, (p,), config)
    if p.suffix != ".safetensors":
        raise HeadsFormatError(f"{p}: not a heads file (.safetensors, or a .pt/.bin pickle); "
                               f"looked for: {LOOKED_FOR}")
    names, meta = _safetensors_names(p)
    if meta.get("format") == "medusa_jax.heads/1":
        return Found("medusa_jax", p, (p,))
    if conf.get("model_type") == "medusa" or any(
            n.startswith(("blocks.", "lm_heads.", VLLM_PREFIX)) for n in names):
        return Found("vllm", p, (p,), config if conf.get("model_type") == "medusa" else None)
    if any(n.startswith(MEDUSA2_PREFIX) for n in names):
        return Found("medusa2", p, (p,), config)
    if names and all(re.match(r"\d+\.\d+\.", n) for n in names):
        return Found("reference", p, (p,), config)
    if p.name == HEADS_FILE:  # our name, but not our metadata
        raise HeadsFormatError(f"{p}: not a medusa_jax heads artifact "
                               f"(format={meta.get('format')!r})")
    raise HeadsFormatError(f"{p}: no Medusa heads in any known layout (tensors "
                           f"{', '.join(sorted(names)[:4]) or 'none'}...); "
                           f"looked for: {LOOKED_FOR}")


# ----------------------------------------------------------------------------- our artifact


def save_heads(path: str | Path, heads: Params, cfg: ModelConfig, extra: dict | None = None) -> Path:
    """Write heads as a standalone safetensors artifact (atomically: temp file, then rename).

    `path` is a directory (the file goes inside as medusa_heads.safetensors) or a file path.
    The backbone's hidden and vocab sizes are recorded so a mismatch is caught at load time.
    """
    path = Path(path)
    file = path if path.suffix == ".safetensors" else path / HEADS_FILE
    file.parent.mkdir(parents=True, exist_ok=True)
    hc = heads_config_of(heads)
    meta = {
        "format": "medusa_jax.heads/1",
        "kind": hydra.KIND if hydra.is_hydra(heads) else "medusa",
        "num_heads": str(hc.num_heads),
        "num_layers": str(hc.num_layers),
        "hidden_size": str(cfg.hidden_size),
        "vocab_size": str(cfg.vocab_size),
        "extra": json.dumps(extra or {}),
    }
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.int32 if k == "token_index" else
                                                  np.float32)) for k, v in heads.items()}
    return weights.save_safetensors(tensors, file, metadata=meta)


def load_heads(path: str | Path, cfg: ModelConfig, *,
               base_model: str | Path | None = None) -> tuple[Params, dict]:
    """Load Medusa heads strictly against the backbone config `cfg`.

    `path`: this package's artifact (file, directory or run directory), or any layout
    `heads_formats` reads (the reference's Medusa-1 heads, a Medusa-2 model folder, vLLM's).
    Returns (heads, metadata). Head count and depth come from the files; files that do not
    match the backbone (hidden size, vocab) or are incomplete raise ValueError.
    `base_model`: the backbone loaded (name or folder); a heads config naming another base
    model gives a warning with both names.
    """
    found = detect(Path(path))
    if found.layout != "medusa_jax":
        heads, meta = read(found, cfg, base_model)
        return {n: jnp.asarray(a) for n, a in heads.items()}, meta
    file = found.files[0]
    try:
        with safe_open(str(file), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: corrupt or truncated heads file ({e})") from None
    if meta.get("format") != "medusa_jax.heads/1":
        raise ValueError(f"{file}: not a medusa_jax heads artifact (format={meta.get('format')!r})")
    k, lyr = meta_count(meta, "num_heads", file), meta_count(meta, "num_layers", file)
    kind = meta.get("kind", "medusa")  # artifacts written before Hydra have no kind
    if kind == hydra.KIND:
        try:
            hydra.check(tensors, cfg, file, k, lyr)
        except ValueError as e:
            raise HeadsFormatError(str(e)) from None
    elif kind == "medusa":
        check_heads(tensors, cfg, file, k, lyr)
    else:
        raise ValueError(f"{file}: unknown heads kind {kind!r} (medusa or hydra)")
    heads = {name: jnp.asarray(a, jnp.int32 if name == "token_index" else jnp.float32)
             for name, a in tensors.items()}
    try:
        meta["extra"] = json.loads(meta.get("extra") or "{}")
    except json.JSONDecodeError:
        raise HeadsFormatError(f"{file}: metadata extra={_clip(meta.get('extra'))} is not "
                               f"JSON") from None
    warn_base_model(meta, base_model, file)
    return heads, meta


# ----------------------------------------------------------------------------- reading


def _read_safetensors(file: Path, keep=None) -> dict[str, np.ndarray]:
    out, bf16 = {}, []
    try:
        with safe_open(str(file), framework="numpy") as f:
            for n in f.keys():
                if keep is not None and not keep(n):
                    continue
                if f.get_slice(n).get_dtype() == "BF16":
                    bf16.append(n)
                else:
                    out[n] = _as_np(f.get_tensor(n))
        if bf16:  # numpy's reader has no bfloat16; flax's has
            with safe_open(str(file), framework="flax") as f:
                out.update({n: _as_np(np.asarray(f.get_tensor(n))) for n in bf16})
    except (SafetensorError, OSError) as e:
        raise HeadsFormatError(f"{file}: corrupt or truncated safetensors file ({_line(e)})") \
            from None
    return out


def _as_np(a: np.ndarray) -> np.ndarray:
    return a if np.issubdtype(a.dtype, np.integer) else np.asarray(a, np.float32)


def pickle_help(file: Path) -> str:
    st = file.with_suffix(".safetensors").name
    return (f"{file}: a PyTorch pickle, and PyTorch is not installed; pip install torch, or "
            f"convert it where PyTorch is: python -c \"import torch; from safetensors.torch "
            f"import save_file; sd = torch.load('{file.name}', map_location='cpu'); "
            f"save_file({{k: v.contiguous() for k, v in sd.items()}}, '{st}')\"")


def _read_pickle(file: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise HeadsFormatError(pickle_help(file)) from None
    try:
        sd = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad pickle
        raise HeadsFormatError(f"{file}: corrupt or truncated PyTorch file ({_line(e)})") \
            from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise HeadsFormatError(f"{file}: expected a state dict (names -> tensors)")
    out = {}
    for name, t in sd.items():
        t = t.detach().cpu()
        out[str(name)] = t.numpy() if not t.is_floating_point() else \
            t.to(torch.float32).numpy()
    return out


def _read_files(files, keep=None) -> dict[str, tuple[np.ndarray, Path]]:
    tensors: dict[str, tuple[np.ndarray, Path]] = {}
    for file in files:
        part = _read_pickle(file) if file.suffix in _PICKLES else _read_safetensors(file, keep)
        for name, a in part.items():
            if keep is not None and not keep(name):
                continue
            if name in tensors:
                raise HeadsFormatError(f"{file}: tensor {name} also in {tensors[name][1]}")
            tensors[name] = (a, file)
    return tensors


def _count(conf: dict, keys: tuple[str, ...], config: Path) -> int | None:
    for key in keys:
        if key in conf:
            v = conf[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HeadsFormatError(f"{config}: {key}={v!r} is not a positive integer")
            return v
    return None


def _where(tensors, name, found: Found) -> Path:
    return tensors[name][1] if name in tensors else (
        found.files[0] if len(found.files) == 1 else found.root)


class _Expect:
    """Checks the tensors of one file set against a list of expected names and shapes."""

    def __init__(self, tensors: dict, found: Found, what: str):
        self.tensors, self.found, self.what, self.used = tensors, found, what, set()

    def get(self, name: str, shape: tuple, role: str) -> np.ndarray:
        if name not in self.tensors:
            raise HeadsFormatError(f"{_where(self.tensors, name, self.found)}: missing tensor "
                                   f"{name} ({role}, expected shape {shape}; {self.what})")
        a, file = self.tensors[name]
        if tuple(a.shape) != tuple(shape):
            raise HeadsFormatError(f"{file}: tensor {name} has shape {tuple(a.shape)}, expected "
                                   f"{tuple(shape)} ({role}; {self.what})")
        self.used.add(name)
        return a

    def done(self):
        extra = sorted(set(self.tensors) - self.used)
        if extra:
            a, file = self.tensors[extra[0]]
            more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
            raise HeadsFormatError(f"{file}: unexpected tensor {extra[0]}{more} ({self.what})")


def _sizes(cfg: ModelConfig | None, tensors: dict, name: str, found: Found) -> tuple[int, int]:
    """(hidden, vocab): the backbone's, or read off the projection `name` [V, H] without one."""
    if cfg is not None:
        return cfg.hidden_size, cfg.vocab_size
    if name not in tensors or tensors[name][0].ndim != 2:
        raise HeadsFormatError(f"{_where(tensors, name, found)}: missing tensor {name} "
                               f"(a head's projection [vocab, hidden])")
    v, h = tensors[name][0].shape
    return int(h), int(v)


def _names_counts(names, pattern: str) -> tuple[int, int]:
    """(heads, blocks) implied by names like {i}.{j}.linear.weight under a prefix."""
    heads, blocks = set(), set()
    for n in names:
        m = re.match(pattern, n)
        if m:
            heads.add(int(m.group(1)))
            if m.group(3):
                blocks.add(int(m.group(2)))
    return (max(heads) + 1 if heads else 0), (max(blocks) + 1 if blocks else 0)


def _read_reference(found: Found, cfg: ModelConfig | None, prefix: str) -> tuple[Params, dict]:
    keep = (lambda n: n.startswith(prefix)) if prefix else None
    tensors = _read_files(found.files, keep)
    conf = _json(found.config) if found.config is not None else {}
    pattern = re.escape(prefix) + r"(\d+)\.(\d+)\.(linear\.)?"
    k_t, l_t = _names_counts(tensors, pattern)
    if k_t == 0:
        raise HeadsFormatError(f"{found.root}: no {prefix + '* ' if prefix else ''}heads "
                               f"tensors ({prefix}{{i}}.{{j}}.linear.weight, ...); looked for: "
                               f"{LOOKED_FOR}")
    k = _count(conf, ("medusa_num_heads",), found.config)
    lyr = _count(conf, ("medusa_num_layers",), found.config)
    if conf.get("medusa_num_layers") == 0:
        raise HeadsFormatError(f"{found.config}: medusa_num_layers=0 is not supported")
    k, lyr = k or k_t, lyr or max(l_t, 1)
    if (k, lyr) != (k_t, max(l_t, 1)):
        raise HeadsFormatError(
            f"{found.config}: medusa_num_heads={k}, medusa_num_layers={lyr} but the tensors "
            f"({', '.join(f.name for f in found.files)}) hold {k_t} heads x {l_t} blocks")
    h, v = _sizes(cfg, tensors, f"{prefix}0.{lyr}.weight", found)
    what = f"{k} heads x {lyr} blocks, hidden {h}, vocab {v}"
    ex = _Expect(tensors, found, what)
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
    meta = _meta(found, k, lyr, h, v, base)
    return {"w": w, "b": b, "proj": proj}, meta


def _read_vllm(found: Found, cfg: ModelConfig | None) -> tuple[Params, dict]:
    raw = _read_files(found.files)
    tensors: dict = {}
    for name, val in raw.items():
        short = name[len(VLLM_PREFIX):] if name.startswith(VLLM_PREFIX) else name
        if short in tensors:
            raise HeadsFormatError(f"{val[1]}: tensor {name} duplicates {short}")
        tensors[short] = val
    if found.config is None:
        raise HeadsFormatError(f"{found.root}: vLLM Medusa heads need their config.json "
                               f"(model_type medusa, num_heads, num_hidden_layers, ...)")
    conf, cf = _json(found.config), found.config
    k = _count(conf, ("num_heads", "medusa_num_heads"), cf)
    lyr = _count(conf, ("num_hidden_layers", "medusa_num_layers"), cf)
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
    k_t, l_t = _names_counts(tensors, r"blocks\.(\d+)\.layers\.(\d+)(\.)")
    if (k_t, l_t) != (k, lyr):
        raise HeadsFormatError(f"{cf}: num_heads={k}, num_hidden_layers={lyr} but the tensors "
                               f"({', '.join(f.name for f in found.files)}) hold {k_t} heads "
                               f"x {l_t} layers")
    what = f"{cf.name}: {k} heads x {lyr} layers, hidden {h}, vocab {v}" + \
        (f", truncated_vocab_size {t}" if t < v else "") + \
        (", medusa_fc_bias" if bias else ", no medusa_fc_bias") + \
        (", original_lm_head" if shared else "")
    ex = _Expect(tensors, found, what)
    token_map = None
    if t < v:
        token_map = ex.get("token_map", (t,), "token ids of the reduced vocabulary")
        if not np.issubdtype(token_map.dtype, np.integer):
            raise HeadsFormatError(f"{_where(tensors, 'token_map', found)}: tensor token_map "
                                   f"has dtype {token_map.dtype}, expected integers")
        if token_map.min() < 0 or token_map.max() >= v or len(np.unique(token_map)) != t:
            raise HeadsFormatError(f"{_where(tensors, 'token_map', found)}: tensor token_map "
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
    meta = _meta(found, k, lyr, h, v, conf.get("base_model_name_or_path"))
    meta.update(shared_proj=str(shared).lower(), truncated_vocab_size=str(t),
                medusa_fc_bias=str(bias).lower())
    return params, meta


def _read_hydra(found: Found, cfg: ModelConfig | None) -> tuple[Params, dict]:
    """zankner/Hydra's grounded MLP heads (hydra_head_arch "mlp") -> our Hydra heads."""
    from medusa_jax.drafters.hydra import heads as hydra

    conf, cf = _json(found.config), found.config
    k = _count(conf, ("hydra_num_heads",), cf)
    lyr = _count(conf, ("hydra_num_layers",), cf)
    if k is None or lyr is None:
        raise HeadsFormatError(f"{cf}: needs hydra_num_heads and hydra_num_layers")
    arch = conf.get("hydra_head_arch", "mlp")
    if arch != "mlp":
        raise HeadsFormatError(f"{cf}: hydra_head_arch={arch!r} is not supported (only 'mlp': "
                               f"Hydra++'s prefix-attention layer is not implemented here)")
    if conf.get("grounded_heads", True) is not True:
        raise HeadsFormatError(f"{cf}: grounded_heads={conf.get('grounded_heads')!r}: "
                               f"ungrounded heads do not read the path; not Hydra heads")
    if conf.get("hidden_state_offset", 0) != 0:
        raise HeadsFormatError(f"{cf}: hidden_state_offset={conf['hidden_state_offset']!r} "
                               f"is not supported (only 0: the last hidden state)")
    tensors = _read_files(found.files)
    first = f"hydra_lm_head.0.weight"
    h, v = _sizes(cfg, tensors, first, found)
    what = f"{k} Hydra heads x {lyr} layers, hidden {h}, vocab {v}"
    ex = _Expect(tensors, found, what)
    specs = hydra.param_specs(h, v, k, lyr)
    out = {n: np.zeros(sp.shape, np.float32) for n, sp in specs.items()}
    for i in range(k):
        n = i + 2
        pre = f"hydra_mlp.{i}.0."
        for ours, theirs in (("in", "linear"), ("res", "res_connection")):
            wt = ex.get(pre + theirs + ".weight", (h, n * h),
                        f"head {i} input block {theirs} weight [out, in]")
            out[f"{ours}_w"][i, :n] = wt.T.reshape(n, h, h)
            out[f"{ours}_b"][i] = ex.get(pre + theirs + ".bias", (h,),
                                         f"head {i} input block {theirs} bias")
        for j in range(1, lyr):
            out["w"][i, j - 1] = ex.get(f"hydra_mlp.{i}.{j}.linear.weight", (h, h),
                                        f"head {i} block {j} Linear weight [out, in]").T
            out["b"][i, j - 1] = ex.get(f"hydra_mlp.{i}.{j}.linear.bias", (h,),
                                        f"head {i} block {j} bias")
        out["proj"][i] = ex.get(f"hydra_lm_head.{i}.weight", (v, h),
                                f"head {i} projection [vocab, hidden]").T
        out["proj_b"][i] = ex.get(f"hydra_lm_head.{i}.bias", (v,), f"head {i} projection bias")
    ex.done()
    try:
        hydra.check(out, cfg, found.root, k, lyr)
    except ValueError as e:
        raise HeadsFormatError(str(e)) from None
    meta = _meta(found, k, lyr, h, v, conf.get("base_model_name_or_path"))
    meta["kind"] = hydra.KIND
    return out, meta


def _meta(found: Found, k, lyr, h, v, base) -> dict:
    meta = {"format": found.layout, "num_heads": str(k), "num_layers": str(lyr),
            "hidden_size": str(h), "vocab_size": str(v),
            "extra": {"source": str(found.root), "files": [str(f) for f in found.files]}}
    if base:
        meta["base_model_name_or_path"] = str(base)
    return meta


def read(found: Found, cfg: ModelConfig | None, base_model=None) -> tuple[Params, dict]:
    """Heads (numpy: float32, token_index int32) and metadata from a detected layout, checked
    against the backbone config `cfg` (None: sizes from the files themselves)."""
    if found.layout == "medusa_jax":
        if cfg is None:
            cfg = _native_cfg(found.files[0])
        heads, meta = load_heads(found.files[0], cfg, base_model=base_model)
        return {n: np.asarray(a) for n, a in heads.items()}, meta
    if found.layout == "hydra":
        heads, meta = _read_hydra(found, cfg)
        warn_base_model(meta, base_model, found.root)
        return heads, meta
    if found.layout == "vllm":
        heads, meta = _read_vllm(found, cfg)
    else:
        heads, meta = _read_reference(found, cfg, MEDUSA2_PREFIX if found.layout == "medusa2"
                                      else "")
    warn_base_model(meta, base_model, found.root)
    check_heads(heads, cfg, found.root, int(meta["num_heads"]), int(meta["num_layers"]))
    return heads, meta


def _clip(value, n: int = 40) -> str:
    r = repr(value)
    return r if len(r) <= n else r[:n] + "..."


def meta_count(meta: dict, key: str, file: Path) -> int:
    """An integer >= 1 of our artifact's safetensors metadata (stored as text, "5"); a
    one-line HeadsFormatError naming the file and the field otherwise."""
    if key not in meta:
        raise HeadsFormatError(f"{file}: its metadata has no {key}")
    value = meta[key]
    try:
        n = int(value) if isinstance(value, str) and value.strip().isdigit() else None
    except ValueError:
        n = None
    if n is None or n < 1:
        raise HeadsFormatError(f"{file}: metadata {key}={value!r} is not a positive integer")
    return n


def _native_cfg(file: Path) -> ModelConfig:
    _, meta = _safetensors_names(file)
    return _sizes_cfg(meta_count(meta, "hidden_size", file), meta_count(meta, "vocab_size", file))


def _sizes_cfg(h: int, v: int) -> ModelConfig:
    """A stand-in backbone config with only the sizes the heads see (no backbone at hand)."""
    return ModelConfig(model_type="llama", vocab_size=v, hidden_size=h, intermediate_size=1,
                       num_layers=1, num_heads=1, num_kv_heads=1, head_dim=h,
                       max_position_embeddings=1)


def sizes_config(heads: Params) -> ModelConfig:
    """The stand-in config of `heads` themselves (hidden from w, vocab from proj/token_index)."""
    v = np.shape(heads["token_index"] if "token_index" in heads else heads["proj"])[-1]
    return _sizes_cfg(int(np.shape(heads["w"])[-1]), int(v))


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


# ----------------------------------------------------------------------------- base model


def _same_model(named: str, loaded: str) -> bool:
    a, b = str(named).rstrip("/\\"), str(loaded).rstrip("/\\")
    if a == b or Path(a).name.lower() == Path(b).name.lower():
        return True
    pa, pb = Path(a), Path(b)
    try:
        if pa.exists() and pb.exists() and pa.resolve() == pb.resolve():
            return True
        conf = pb / "config.json"
        if conf.is_file():
            name = json.loads(conf.read_text()).get("_name_or_path")
            if name and (str(name).rstrip("/") == a or Path(str(name)).name.lower() ==
                         pa.name.lower()):
                return True
    except (OSError, ValueError):
        pass
    return False


def base_model_of(meta: dict) -> str | None:
    extra = meta.get("extra") if isinstance(meta.get("extra"), dict) else {}
    return meta.get("base_model_name_or_path") or extra.get("base_model_name_or_path")


def warn_base_model(meta: dict, base_model, where) -> None:
    """Warn when the heads' config names another base model than the one loaded."""
    named = base_model_of(meta)
    if named and base_model is not None and not _same_model(named, str(base_model)):
        warnings.warn(f"{where}: these heads were made for base model {named!r}, but the "
                      f"model loaded is {str(base_model)!r}", UserWarning, stacklevel=3)


# ----------------------------------------------------------------------------- writing


def _np(a, dtype=np.float32) -> np.ndarray:
    return np.asarray(a, dtype)


def _c(a: np.ndarray) -> np.ndarray:
    """Contiguous, so safetensors writes the elements in their logical order."""
    return np.ascontiguousarray(a)


def _medusa_only(heads: Params, layout: str):
    if "in_w" in heads:  # Hydra heads (medusa_jax.drafters.hydra.heads)
        raise HeadsFormatError(f"these are Hydra heads; the {layout} layout holds only Medusa "
                               f"heads: write them with --format medusa_jax")


def _full_proj(heads: Params, layout: str) -> np.ndarray:
    """proj as [K, H, V] for layouts without shared or reduced projections."""
    if "token_index" in heads:
        raise HeadsFormatError(f"the {layout} layout has no reduced vocabulary (these heads "
                               f"carry token_index); export them with --format vllm or "
                               f"medusa_jax")
    k = int(np.shape(heads["w"])[0])
    proj = _np(heads["proj"])
    return np.broadcast_to(proj, (k, *proj.shape[1:])) if proj.shape[0] == 1 else proj


def reference_tensors(heads: Params, prefix: str = "") -> dict[str, np.ndarray]:
    """Our heads under the reference's names ({prefix}{i}.{j}.linear.weight, ...)."""
    _medusa_only(heads, "reference")
    w, b = _np(heads["w"]), _np(heads["b"])
    proj = _full_proj(heads, "reference")
    k, lyr = w.shape[:2]
    out = {}
    for i in range(k):
        for j in range(lyr):
            out[f"{prefix}{i}.{j}.linear.weight"] = _c(w[i, j].T)
            out[f"{prefix}{i}.{j}.linear.bias"] = _c(b[i, j])
        out[f"{prefix}{i}.{lyr}.weight"] = _c(proj[i].T)
    return out


def _blocks_differ(heads: Params) -> bool:
    w, b = _np(heads["w"]), _np(heads["b"])
    return w.shape[1] > 1 and not (np.all(w == w[:, :1]) and np.all(b == b[:, :1]))


def _write_json(file: Path, data: dict):
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, file)


def _write_tensors(out: Path, st_name: str, pt_name: str, tensors: dict,
                   pickle: bool | None) -> list[Path]:
    """The tensors as `st_name` (safetensors) in `out`, and as the torch pickle `pt_name` too
    when `pickle` (default: when torch is installed). Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    _write_st(out / st_name, tensors, {"format": "pt"})
    written = [out / st_name]
    if pickle is None:
        pickle = importlib.util.find_spec("torch") is not None
    if pickle:
        import torch

        tmp = out / (pt_name + ".tmp")
        torch.save({n: torch.from_numpy(np.array(a)) for n, a in tensors.items()}, str(tmp))
        os.replace(tmp, out / pt_name)
        written.append(out / pt_name)
    return written


def _write_st(file: Path, tensors: dict, metadata: dict | None = None):
    weights.save_safetensors({n: _c(a) for n, a in tensors.items()}, file, metadata)


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
                      UserWarning, stacklevel=2)
    out = Path(out_dir)
    written = _write_tensors(out, REFERENCE_ST, REFERENCE_PT, tensors, pickle)
    conf = {"medusa_num_heads": int(k), "medusa_num_layers": int(lyr)}
    if base_model:
        conf["base_model_name_or_path"] = str(base_model)
    _write_json(out / "config.json", conf)
    return [out / "config.json", *written]


def vllm_tensors(heads: Params) -> tuple[dict[str, np.ndarray], dict]:
    """Our heads under vLLM's names, and the config fields that describe them."""
    _medusa_only(heads, "vllm")
    w, b, proj = _np(heads["w"]), _np(heads["b"]), _np(heads["proj"])
    k, lyr, h = w.shape[:3]
    bias = bool(np.any(b != 0))
    out = {}
    for i in range(k):
        for j in range(lyr):
            out[f"blocks.{i}.layers.{j}.weight"] = _c(w[i, j].T)
            if bias:
                out[f"blocks.{i}.layers.{j}.bias"] = _c(b[i, j])
    shared = proj.shape[0] == 1 and k > 1
    if shared:
        out["lm_head.weight"] = _c(proj[0].T)
    else:
        for i in range(k):
            out[f"lm_heads.{i}.weight"] = _c(proj[i].T)
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
    _write_st(out / VLLM_FILE, tensors, {"format": "pt"})
    _write_json(out / "config.json", conf)
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

    _medusa_only(heads, "medusa2")
    head_tensors = reference_tensors(heads, MEDUSA2_PREFIX)
    k, lyr = np.shape(heads["w"])[:2]
    out = Path(out_dir)
    save_pretrained(cfg, backbone, out, source_dir=source_dir)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        backbone_names = list(f.keys())
    os.replace(out / "model.safetensors", out / first)
    _write_st(out / second, head_tensors, {"format": "pt"})
    with safe_open(str(out / first), framework="numpy") as f:  # save_pretrained: float32
        sizes = sum(4 * int(np.prod(f.get_slice(n).get_shape())) for n in backbone_names)
    sizes += sum(a.nbytes for a in head_tensors.values())
    weight_map = {**{n: first for n in backbone_names}, **{n: second for n in head_tensors}}
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": int(sizes)}, "weight_map": weight_map})
    conf = _json(out / "config.json")
    conf.update(medusa_num_heads=int(k), medusa_num_layers=int(lyr))
    if base_model:
        conf["base_model_name_or_path"] = str(base_model)
    _write_json(out / "config.json", conf)
    return out


def hydra_tensors(heads: Params) -> dict[str, np.ndarray]:
    """Our Hydra heads under zankner/Hydra's names (hydra_mlp.{i}.0.linear.weight, ...)."""
    if "in_w" not in heads:
        raise HeadsFormatError("the hydra layout holds Hydra heads; these are Medusa heads "
                               "(write them with --format medusa_jax, reference or vllm)")
    k, h = int(np.shape(heads["in_w"])[0]), int(np.shape(heads["in_w"])[-1])
    lyr = int(np.shape(heads["w"])[1]) + 1
    out = {}
    for i in range(k):
        n = i + 2
        for ours, theirs in (("in", "linear"), ("res", "res_connection")):
            w = _np(heads[f"{ours}_w"])[i, :n].reshape(n * h, h)
            out[f"hydra_mlp.{i}.0.{theirs}.weight"] = _c(w.T)
            out[f"hydra_mlp.{i}.0.{theirs}.bias"] = _c(_np(heads[f"{ours}_b"])[i])
        for j in range(1, lyr):
            out[f"hydra_mlp.{i}.{j}.linear.weight"] = _c(_np(heads["w"])[i, j - 1].T)
            out[f"hydra_mlp.{i}.{j}.linear.bias"] = _c(_np(heads["b"])[i, j - 1])
        out[f"hydra_lm_head.{i}.weight"] = _c(_np(heads["proj"])[i].T)
        out[f"hydra_lm_head.{i}.bias"] = _c(_np(heads["proj_b"])[i])
    return out


def write_hydra(heads: Params, out_dir: str | Path, *, base_model: str | None = None,
                pickle: bool | None = None) -> list[Path]:
    """zankner/Hydra's heads folder: config.json + hydra_lm_head.safetensors, and
    hydra_lm_head.pt (the file its loader opens) when `pickle` is true or, with None, when
    PyTorch is installed. Its model repeats one residual-block object for blocks 1..L-1
    (`[ResBlock(H)] * (L - 1)`), as the Medusa reference does: with L > 2 different blocks it
    loads only the last (a warning says so)."""
    tensors = hydra_tensors(heads)
    k = int(np.shape(heads["in_w"])[0])
    lyr = int(np.shape(heads["w"])[1]) + 1
    w, b = _np(heads["w"]), _np(heads["b"])
    if lyr > 2 and not (np.all(w == w[:, :1]) and np.all(b == b[:, :1])):
        warnings.warn(f"{lyr - 1} different residual blocks per head: zankner/Hydra's model "
                      f"repeats one block object and will load only the last",
                      UserWarning, stacklevel=2)
    out = Path(out_dir)
    written = _write_tensors(out, HYDRA_ST, HYDRA_PT, tensors, pickle)
    conf = {"hydra_num_heads": k, "hydra_num_layers": lyr, "hydra_head_arch": "mlp",
            "grounded_heads": True, "hidden_state_offset": 0}
    if base_model:
        conf["base_model_name_or_path"] = str(base_model)
    _write_json(out / "config.json", conf)
    return [out / "config.json", *written]


def write(heads: Params, layout: str, out_dir: str | Path, *, cfg: ModelConfig | None = None,
          base_model: str | None = None, extra: dict | None = None) -> list[Path]:
    """Write `heads` in `layout` (medusa_jax, reference or vllm) under `out_dir`."""
    if layout == "hydra":
        return write_hydra(heads, out_dir, base_model=base_model)
    if layout == "reference":
        return write_reference(heads, out_dir, base_model=base_model)
    if layout == "vllm":
        return write_vllm(heads, out_dir, base_model=base_model)
    if layout == "medusa_jax":
        if cfg is None:
            raise HeadsFormatError("medusa_jax artifacts record the backbone's sizes: need cfg")
        extra = dict(extra or {})
        if base_model:
            extra["base_model_name_or_path"] = str(base_model)
        return [save_heads(out_dir, heads, cfg, extra)]
    raise HeadsFormatError(f"unknown layout {layout!r}; writable: medusa_jax, reference, vllm, "
                           f"hydra (medusa2: write_medusa2_model)")
