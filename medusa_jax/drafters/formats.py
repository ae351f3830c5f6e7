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
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from medusa_jax.decoding import drafter
from medusa_jax.drafters.eagle3 import heads as eagle3
from medusa_jax.drafters.eagle3.drafter import bind
from medusa_jax.drafters.eagle3.formats import read_eagle3, write_eagle3
from medusa_jax.drafters.hydra import heads as hydra
from medusa_jax.drafters.hydra.formats import HYDRA_PT, HYDRA_ST, read_hydra, write_hydra
from medusa_jax.drafters.io import (  # noqa: F401 - HeadsFormatError, base_model_of: here too
    PICKLES,
    Found,
    HeadsFormatError,
    base_model_of,
    clip,
    meta_count,
    read_json,
    safetensors_names,
    sizes_cfg,
    warn_base_model,
)
from medusa_jax.drafters.medusa.formats import (  # noqa: F401 - the writers, here too
    MEDUSA2_PREFIX,
    REFERENCE_PT,
    REFERENCE_ST,
    VLLM_PREFIX,
    check_heads,
    is_medusa2_model,
    medusa_only,
    model_shards,
    read_reference,
    read_vllm,
    reference_tensors,
    write_medusa2_model,
    write_reference,
    write_vllm,
)
from medusa_jax.drafters.medusa.heads import HEADS_FILE, heads_config_of
from medusa_jax.model import weights
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig

LAYOUTS = ("medusa_jax", "reference", "medusa2", "vllm", "hydra")


LOOKED_FOR = (
    f"medusa_jax ({HEADS_FILE}, or heads/{HEADS_FILE} in a run directory); "
    f"reference (config.json + {REFERENCE_ST} or {REFERENCE_PT}); "
    "Medusa-2 model (config.json with medusa_num_heads + model.safetensors[.index.json] "
    "holding medusa_head.* tensors); "
    "vLLM (config.json with model_type medusa + *.safetensors); "
    f"zankner/Hydra (config.json with hydra_num_heads + {HYDRA_PT} or {HYDRA_ST}); "
    "EAGLE-3 (config.json with eagle_config or an Eagle3 architecture + model.safetensors)")


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
    conf = read_json(cfg_file) if cfg_file.is_file() else None
    config = cfg_file if conf is not None else None
    if conf is not None and _is_eagle3_config(conf):
        return Found("eagle3", p, (), config)
    if conf is not None and conf.get("model_type") == "medusa":
        files = sorted(f for f in p.glob("*.safetensors"))
        if not files:
            files = sorted(f for f in p.iterdir() if f.suffix in PICKLES and f.is_file())
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
        shards = model_shards(p)
        if shards is not None:
            return Found("medusa2", p, tuple(shards), config)
        raise HeadsFormatError(f"{cfg_file}: has medusa_num_heads but the folder has neither "
                               f"{REFERENCE_ST}/{REFERENCE_PT} nor model.safetensors[.index.json]")
    raise HeadsFormatError(f"{p}: no Medusa heads in any known layout; looked for: {LOOKED_FOR}")


def kind_at(path: str | Path) -> str:
    """The kind of drafter at `path` ("medusa", "hydra" or "eagle3"), from its config or
    header alone: commands that take only one kind refuse the others before any work."""
    found = detect(Path(path))
    if found.layout in (eagle3.KIND, hydra.KIND):
        return found.layout
    if found.layout == "medusa_jax":
        kind = safetensors_names(found.files[0])[1].get("kind", "medusa")
        if kind not in ("medusa", hydra.KIND, eagle3.KIND):
            raise HeadsFormatError(f"{found.files[0]}: unknown heads kind {kind!r} (medusa, "
                                   f"hydra or eagle3)")
        return kind
    return "medusa"


def _is_eagle3_config(conf: dict) -> bool:
    arch = conf.get("architectures")
    return "eagle_config" in conf or (isinstance(arch, list) and any(
        isinstance(a, str) and "eagle3" in a.lower() for a in arch))


def _detect_file(p: Path) -> Found:
    sibling = p.parent / "config.json"
    conf = read_json(sibling) if sibling.is_file() else {}
    config = sibling if sibling.is_file() else None
    if p.name in (HYDRA_PT, HYDRA_ST) and "hydra_num_heads" in conf:
        return Found("hydra", p, (p,), config)
    if p.suffix in PICKLES:
        layout = "vllm" if conf.get("model_type") == "medusa" else "reference"
        return Found(layout, p, (p,), config)
    if p.suffix != ".safetensors":
        raise HeadsFormatError(f"{p}: not a heads file (.safetensors, or a .pt/.bin pickle); "
                               f"looked for: {LOOKED_FOR}")
    names, meta = safetensors_names(p)
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


def save_heads(path: str | Path, heads: Params, cfg: ModelConfig,
               extra: dict | None = None) -> Path:
    """Write heads as a standalone safetensors artifact (atomically: temp file, then rename).

    `path` is a directory (the file goes inside as medusa_heads.safetensors) or a file path.
    The backbone's hidden and vocab sizes are recorded so a mismatch is caught at load time.
    """
    path = Path(path)
    file = path if path.suffix == ".safetensors" else path / HEADS_FILE
    file.parent.mkdir(parents=True, exist_ok=True)
    kind = drafter.kind_of(heads)
    if kind == eagle3.KIND:
        return _save_eagle3(file, heads, cfg, extra)
    hc = heads_config_of(heads)
    meta = {
        "format": "medusa_jax.heads/1",
        "kind": kind,
        "num_heads": str(hc.num_heads),
        "num_layers": str(hc.num_layers),
        "hidden_size": str(cfg.hidden_size),
        "vocab_size": str(cfg.vocab_size),
        "extra": json.dumps(extra or {}),
    }
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.int32 if k == "token_index" else
                                                  np.float32)) for k, v in heads.items()}
    return weights.save_safetensors(tensors, file, metadata=meta)


def _save_eagle3(file: Path, heads: Params, cfg: ModelConfig, extra: dict | None) -> Path:
    """Our artifact of an EAGLE-3 drafter: its tensors (float32 weights, d2t int32, t2d
    bool) and its whole configuration (`eagle3_config`: what the shapes do not hold)."""
    bound = getattr(heads, "drafter", None)
    if bound is None or getattr(bound, "config", None) is None:
        raise ValueError("save_heads: these EAGLE-3 parameters carry no configuration (aux "
                         "layers, norm eps, rope); bind them first "
                         "(drafters.eagle3.drafter.bind(heads, config, model_cfg))")
    c = bound.config
    eagle3.check(heads, cfg, c, f"save_heads({file})")
    meta = {"format": "medusa_jax.heads/1", "kind": eagle3.KIND,
            "num_heads": str(eagle3.TTT_STEPS), "num_layers": "1",
            "hidden_size": str(cfg.hidden_size), "vocab_size": str(cfg.vocab_size),
            "eagle3_config": json.dumps(dataclasses.asdict(c)),
            "extra": json.dumps(extra or {})}
    tensors = {k: np.ascontiguousarray(np.asarray(
        v, np.int32 if k == "d2t" else bool if k == "t2d" else np.float32))
        for k, v in heads.items()}
    return weights.save_safetensors(tensors, file, metadata=meta)


def _eagle3_of(meta: dict, file: Path) -> "eagle3.Eagle3Config":
    """The Eagle3Config recorded in our artifact's metadata (one-line error otherwise)."""
    try:
        fields = json.loads(meta.get("eagle3_config") or "")
        names = {f.name for f in dataclasses.fields(eagle3.Eagle3Config)}
        if not isinstance(fields, dict) or set(fields) - names:
            raise ValueError(f"unknown fields {sorted(set(fields) - names)}"
                             if isinstance(fields, dict) else "not a JSON object")
        fields["aux_layers"] = tuple(int(i) for i in fields.get("aux_layers", ()))
        fields["rope_scaling"] = tuple(fields.get("rope_scaling", ("default",)))
        c = eagle3.Eagle3Config(**fields)
    except (ValueError, TypeError) as e:
        raise HeadsFormatError(f"{file}: metadata eagle3_config="
                               f"{clip(meta.get('eagle3_config'))} is not an EAGLE-3 "
                               f"drafter's configuration ({e})") from None
    try:
        eagle3.check_config(c, str(file), "metadata eagle3_config.")
    except ValueError as e:
        raise HeadsFormatError(str(e)) from None
    return c


def _bind_eagle3(heads: dict, c, cfg: ModelConfig | None):
    return bind(heads, c, cfg)


def load_heads(path: str | Path, cfg: ModelConfig, *,
               base_model: str | Path | None = None, embed=None) -> tuple[Params, dict]:
    """Load Medusa heads strictly against the backbone config `cfg`.

    `path`: this package's artifact (file, directory or run directory), or any layout
    `drafters.formats` reads (the reference's Medusa-1 heads, a Medusa-2 model folder, vLLM's).
    Returns (heads, metadata). Head count and depth come from the files; files that do not
    match the backbone (hidden size, vocab) or are incomplete raise ValueError.
    `base_model`: the backbone loaded (name or folder); a heads config naming another base
    model gives a warning with both names.
    `embed`: the backbone's embedding [V, H]; an EAGLE-3 folder's copy of it
    (`embed_tokens.weight`) must then be that table (the drafter embeds with the backbone's).
    """
    found = detect(Path(path))
    if found.layout == "eagle3":
        heads, meta = read(found, cfg, base_model, embed=embed)
        return jax.tree.map(jnp.asarray, heads), meta
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
    eagle_cfg = None
    if kind == eagle3.KIND:
        eagle_cfg = _eagle3_of(meta, file)
        try:
            eagle3.check(tensors, cfg, eagle_cfg, file)
        except ValueError as e:
            raise HeadsFormatError(str(e)) from None
    elif kind == hydra.KIND:
        try:
            hydra.check(tensors, cfg, file, k, lyr)
        except ValueError as e:
            raise HeadsFormatError(str(e)) from None
    elif kind == "medusa":
        check_heads(tensors, cfg, file, k, lyr)
    else:
        raise ValueError(f"{file}: unknown heads kind {kind!r} (medusa, hydra or eagle3)")
    if eagle_cfg is not None:
        heads = _bind_eagle3({name: jnp.asarray(a) for name, a in tensors.items()}, eagle_cfg,
                             cfg)
        meta["aux_layers"] = list(eagle_cfg.aux_layers)
    else:
        heads = {name: jnp.asarray(a, jnp.int32 if name == "token_index" else jnp.float32)
                 for name, a in tensors.items()}
    try:
        meta["extra"] = json.loads(meta.get("extra") or "{}")
    except json.JSONDecodeError:
        raise HeadsFormatError(f"{file}: metadata extra={clip(meta.get('extra'))} is not "
                               f"JSON") from None
    warn_base_model(meta, base_model, file)
    return heads, meta


def read(found: Found, cfg: ModelConfig | None, base_model=None, embed=None
         ) -> tuple[Params, dict]:
    """Heads (numpy: float32, token_index int32) and metadata from a detected layout, checked
    against the backbone config `cfg` (None: sizes from the files themselves) and, for an
    EAGLE-3 folder, the backbone's embedding `embed` (None: not checked)."""
    if found.layout == "medusa_jax":
        if cfg is None:
            cfg = _native_cfg(found.files[0])
        heads, meta = load_heads(found.files[0], cfg, base_model=base_model)
        return jax.tree.map(np.asarray, heads), meta
    if found.layout == "eagle3":
        heads, c, meta = read_eagle3(found.root, cfg, embed)
        warn_base_model(meta, base_model, found.root)
        return _bind_eagle3(heads, c, cfg), meta
    if found.layout == "hydra":
        heads, meta = read_hydra(found, cfg)
        warn_base_model(meta, base_model, found.root)
        return heads, meta
    if found.layout == "vllm":
        heads, meta = read_vllm(found, cfg)
    else:
        heads, meta = read_reference(found, cfg, MEDUSA2_PREFIX if found.layout == "medusa2"
                                      else "")
    warn_base_model(meta, base_model, found.root)
    check_heads(heads, cfg, found.root, int(meta["num_heads"]), int(meta["num_layers"]))
    return heads, meta


def _native_cfg(file: Path) -> ModelConfig:
    _, meta = safetensors_names(file)
    cfg = sizes_cfg(meta_count(meta, "hidden_size", file), meta_count(meta, "vocab_size", file))
    if meta.get("kind") == eagle3.KIND:  # deep enough for the layers the drafter reads
        cfg = cfg.replace(num_layers=max(_eagle3_of(meta, file).aux_layers, default=0) + 1)
    return cfg


def sizes_config(heads: Params) -> ModelConfig:
    """The stand-in config of `heads` themselves (hidden from w, vocab from proj/token_index)."""
    v = np.shape(heads["token_index"] if "token_index" in heads else heads["proj"])[-1]
    return sizes_cfg(int(np.shape(heads["w"])[-1]), int(v))


def check_layout(heads: Params, layout: str) -> None:
    """`layout` can hold this kind of drafter (one-line HeadsFormatError otherwise): callers
    check before costly work, such as loading the backbone a Medusa-2 folder bundles."""
    is_eagle = eagle3.is_eagle3(heads)
    if is_eagle and layout not in ("eagle3", "medusa_jax"):
        raise HeadsFormatError(f"an EAGLE-3 drafter is written in the eagle3 or medusa_jax "
                               f"layout, not {layout!r}")
    if layout == "eagle3" and not is_eagle:
        raise HeadsFormatError(f"the eagle3 layout holds EAGLE-3 drafters; these are "
                               f"{drafter.kind_of(heads)} heads")
    if layout in ("reference", "vllm", "medusa2"):
        medusa_only(heads, layout)


def write(heads: Params, layout: str, out_dir: str | Path, *, cfg: ModelConfig | None = None,
          base_model: str | None = None, extra: dict | None = None) -> list[Path]:
    """Write `heads` in `layout` (medusa_jax, reference or vllm) under `out_dir`."""
    check_layout(heads, layout)
    if layout == "eagle3":
        bound = getattr(heads, "drafter", None)
        if getattr(bound, "config", None) is None:
            raise HeadsFormatError("the eagle3 layout records the drafter's configuration: "
                                   "bind the parameters first (drafters.eagle3.drafter.bind)")
        return write_eagle3(dict(heads), out_dir, bound.config, model_cfg=cfg,
                            base_model=base_model)
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
                           f"hydra, eagle3 (medusa2: write_medusa2_model)")
