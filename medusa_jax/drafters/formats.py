"""Heads in the layouts other tools use: detection, strict readers, writers, and our own
artifact (`save_heads`, `load_heads`), as one loop over the kinds of drafter
(`drafters.registry`): each kind's class names its formats (`formats`: an object with the
kind's `layouts`, each a `drafters.io.Layout` with detect / read / write, and `save`,
`load`, `sizes` for our artifact, whose metadata records the kind). No kind is named here.

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

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from medusa_jax.drafters import registry
from medusa_jax.drafters.artifact import (  # noqa: F401 - kind-neutral names, here too
    FORMAT,
    HEADS_FILE,
    HeadsConfig,
    check_kind,
    formats_of,
    has_formats,
    heads_config_of,
    writable_layouts,
)
from medusa_jax.drafters.io import (  # noqa: F401 - HeadsFormatError, base_model_of: here too
    PICKLES,
    Found,
    HeadsFormatError,
    Layout,
    base_model_of,
    check_finite,
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
from medusa_jax.model import weights
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig

OURS = "medusa_jax"  # our own artifact's layout, which holds every kind


def layouts() -> dict[str, tuple[str, Layout]]:
    """{layout name: (kind, Layout)} of every registered kind, in detection order."""
    out = {}
    for kind in registry.kinds():
        for lay in formats_of(kind).layouts if has_formats(kind) else ():
            out[lay.name] = (kind, lay)
    return out


def layout_names() -> tuple[str, ...]:
    return (OURS, *layouts())


def looked_for() -> str:
    return "; ".join([f"{OURS} ({HEADS_FILE}, or heads/{HEADS_FILE} in a run directory)"] +
                     [lay.looked_for for _, lay in layouts().values()])


def __getattr__(name):
    if name == "LAYOUTS":
        return layout_names()
    if name == "LOOKED_FOR":
        return looked_for()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def detect(path: str | Path) -> Found:
    """Which layout `path` (a file or a folder) holds; one-line errors otherwise."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no Medusa heads artifact here (no such file or folder)")
    if p.is_file():
        return _detect_file(p)
    if (p / HEADS_FILE).is_file():
        return Found(OURS, p, (p / HEADS_FILE,))
    if (p / "heads" / HEADS_FILE).is_file():
        return Found(OURS, p, (p / "heads" / HEADS_FILE,))
    cfg_file = p / "config.json"
    conf = read_json(cfg_file) if cfg_file.is_file() else None
    config = cfg_file if conf is not None else None
    for _, lay in layouts().values():
        found = lay.detect_dir(p, conf, config) if lay.detect_dir is not None else None
        if found is not None:
            return found
    raise HeadsFormatError(f"{p}: no Medusa heads in any known layout; looked for: "
                           f"{looked_for()}")


def _detect_file(p: Path) -> Found:
    sibling = p.parent / "config.json"
    conf = read_json(sibling) if sibling.is_file() else {}
    config = sibling if sibling.is_file() else None
    names, meta = None, {}
    if p.suffix == ".safetensors":
        names, meta = safetensors_names(p)
        if meta.get("format") == FORMAT:
            return Found(OURS, p, (p,))
    elif p.suffix not in PICKLES:
        raise HeadsFormatError(f"{p}: not a heads file (.safetensors, or a .pt/.bin pickle); "
                               f"looked for: {looked_for()}")
    for _, lay in layouts().values():
        found = (lay.detect_file(p, conf, config, names, meta)
                 if lay.detect_file is not None else None)
        if found is not None:
            return found
    if p.name == HEADS_FILE:  # our name, but not our metadata
        raise HeadsFormatError(f"{p}: not a medusa_jax heads artifact "
                               f"(format={meta.get('format')!r})")
    raise HeadsFormatError(f"{p}: no Medusa heads in any known layout (tensors "
                           f"{', '.join(sorted(names or ())[:4]) or 'none'}...); "
                           f"looked for: {looked_for()}")


def _recorded_kind(meta: dict, file: Path) -> str:
    kind = meta.get("kind", registry.HEAD_FN_KIND)  # written before the kind was recorded
    if kind not in registry.KINDS:
        raise HeadsFormatError(f"{file}: unknown heads kind {kind!r} "
                               f"({', '.join(registry.kinds())})")
    return kind


def kind_at(path: str | Path) -> str:
    """The kind of drafter at `path`, from its config or header alone: commands that take
    only some kinds refuse the others before any work."""
    found = detect(Path(path))
    if found.layout == OURS:
        return _recorded_kind(safetensors_names(found.files[0])[1], found.files[0])
    return layouts()[found.layout][0]


def bundled_model(path: str | Path) -> bool:
    """Whether `path` is a folder holding a backbone with its drafter (a Medusa-2 model
    folder): it is then the model too, when none is named."""
    return any(lay.bundles_model is not None and lay.bundles_model(path)
               for _, lay in layouts().values())


def save_heads(path: str | Path, heads: Params, cfg: ModelConfig,
               extra: dict | None = None) -> Path:
    """Write heads of any kind as our standalone safetensors artifact (atomically: temp
    file, then rename), recording their kind and the kind's own fields (`formats.save`).

    `path` is a directory (the file goes inside as medusa_heads.safetensors) or a file path.
    The backbone's hidden and vocab sizes are recorded so a mismatch is caught at load time.
    """
    path = Path(path)
    file = path if path.suffix == ".safetensors" else path / HEADS_FILE
    file.parent.mkdir(parents=True, exist_ok=True)
    kind = registry.kind_of(heads)
    tensors, fields = formats_of(kind).save(heads, cfg, file)
    check_finite(tensors, file)
    meta = {"format": FORMAT, "kind": kind, **fields,
            "hidden_size": str(cfg.hidden_size), "vocab_size": str(cfg.vocab_size),
            "extra": json.dumps(extra or {})}
    return weights.save_safetensors(tensors, file, metadata=meta)


def load_heads(path: str | Path, cfg: ModelConfig, *,
               base_model: str | Path | None = None, embed=None) -> tuple[Params, dict]:
    """Load a drafter strictly against the backbone config `cfg`, as the kind its artifact
    records (our artifact's `kind`, or the kind whose layout it is).

    `path`: this package's artifact (file, directory or run directory), or any layout
    `drafters.formats` reads (the reference's Medusa-1 heads, a Medusa-2 model folder, vLLM's,
    zankner/Hydra's, a published EAGLE-3 drafter). Returns (heads, metadata). Sizes come
    from the files; files that do not match the backbone (hidden size, vocab) or are
    incomplete raise ValueError.
    `base_model`: the backbone loaded (name or folder); a heads config naming another base
    model gives a warning with both names.
    `embed`: the backbone's embedding [V, H]; a drafter folder's copy of it must then be
    that table (the drafter embeds with the backbone's).
    """
    found = detect(Path(path))
    if found.layout != OURS:
        heads, meta = read(found, cfg, base_model, embed=embed)
        return jax.tree.map(jnp.asarray, heads), meta
    file = found.files[0]
    try:
        with safe_open(str(file), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: corrupt or truncated heads file ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{file}: not a medusa_jax heads artifact (format={meta.get('format')!r})")
    heads = formats_of(_recorded_kind(meta, file)).load(tensors, meta, cfg, file)
    try:
        meta["extra"] = json.loads(meta.get("extra") or "{}")
    except json.JSONDecodeError:
        raise HeadsFormatError(f"{file}: metadata extra={clip(meta.get('extra'))} is not "
                               f"JSON") from None
    warn_base_model(meta, base_model, file)
    return heads, meta


def read(found: Found, cfg: ModelConfig | None, base_model=None, embed=None
         ) -> tuple[Params, dict]:
    """Heads (numpy) and metadata from a detected layout, checked against the backbone
    config `cfg` (None: sizes from the files themselves) and the backbone's embedding
    `embed` (None: not checked)."""
    if found.layout == OURS:
        if cfg is None:
            cfg = _native_cfg(found.files[0])
        heads, meta = load_heads(found.files[0], cfg, base_model=base_model)
        return jax.tree.map(np.asarray, heads), meta
    heads, meta = layouts()[found.layout][1].read(found, cfg, embed)
    warn_base_model(meta, base_model, found.root)
    return heads, meta


def _native_cfg(file: Path) -> ModelConfig:
    _, meta = safetensors_names(file)
    cfg = sizes_cfg(meta_count(meta, "hidden_size", file), meta_count(meta, "vocab_size", file))
    own = formats_of(_recorded_kind(meta, file))
    return own.native_cfg(meta, file, cfg)


def sizes_config(heads: Params) -> ModelConfig:
    """The stand-in config of `heads` themselves (their hidden and vocabulary sizes)."""
    return sizes_cfg(*formats_of(registry.kind_of(heads)).sizes(heads))


def check_layout(heads: Params, layout: str) -> None:
    """`layout` can hold this kind of drafter (one-line HeadsFormatError otherwise): callers
    check before costly work, such as loading the backbone a Medusa-2 folder bundles."""
    if layout in layouts():
        check_kind(heads, layouts()[layout][0], layout)


def write(heads: Params, layout: str, out_dir: str | Path, *, cfg: ModelConfig | None = None,
          base_model: str | None = None, extra: dict | None = None) -> list[Path]:
    """Write `heads` in `layout` (ours, or one their kind's formats write) under `out_dir`."""
    check_layout(heads, layout)
    if layout == OURS:
        if cfg is None:
            raise HeadsFormatError("medusa_jax artifacts record the backbone's sizes: need cfg")
        extra = dict(extra or {})
        if base_model:
            extra["base_model_name_or_path"] = str(base_model)
        return [save_heads(out_dir, heads, cfg, extra)]
    lay = layouts().get(layout, (None, None))[1]
    if lay is None or lay.write is None:
        writable = [OURS] + [n for n, (_, x) in layouts().items() if x.write is not None]
        raise HeadsFormatError(f"unknown layout {layout!r}; writable: {', '.join(writable)} "
                               f"(medusa2: write_medusa2_model)")
    return lay.write(heads, out_dir, cfg, base_model)
