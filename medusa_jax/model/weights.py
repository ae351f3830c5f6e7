"""Hugging Face weights in and out: local safetensors <-> the backbone's parameter pytree.

Loading is strict: every tensor the architecture needs must be present with the right shape,
and every tensor in the files must be used (but for the multi-token-prediction layers that
config.json's num_nextn_predict_layers declares, a drafter's: `nextn_layers`). Any problem
raises one `WeightsError` naming the file and tensor. Export writes the Hugging Face layout
back so a fine-tuned backbone still loads in transformers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors import SafetensorError

from medusa_jax.model.config import ModelConfig, as_dtype
from medusa_jax.runtime import assets, hub
from medusa_jax.text import tokenizer as tokenizer_lib

if TYPE_CHECKING:
    from medusa_jax.model.backbone import Params

# JAX and the backbone are imported where the weights become arrays: the commands check a
# model folder (config.json, the safetensors headers) before JAX is imported.


class WeightsError(ValueError):
    """A checkpoint that cannot be loaded exactly as asked."""


def default_model_dir() -> Path:
    """The embedded stories260K model shipped inside the package."""
    return assets.model_dir()


# HF name -> (our layer key, transpose?) for the per-layer tensors.
_LAYER_MAP = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
# Gemma 2/3 normalise each block's output too: there post_attention_layernorm is the norm
# after attention, and the norm before the MLP is pre_feedforward_layernorm.
_SANDWICH_MAP = {
    **{k: v for k, v in _LAYER_MAP.items() if k != "post_attention_layernorm.weight"},
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
}


def layer_map(cfg: ModelConfig) -> dict:
    """HF per-layer tensor name -> (our layer key, transpose?) for this architecture."""
    return _SANDWICH_MAP if cfg.sandwich_norms else _LAYER_MAP


_TOP_MAP = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
# Buffers some older checkpoints carry; they are recomputed, never loaded. A Medusa-2 model's
# heads (medusa_head.*) are read by drafters.formats.load_heads, not here.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|^medusa_head\.")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# DeepSeek-V3's layout keeps its multi-token-prediction modules as layers N .. N+D-1 past
# the backbone's N (D this field of config.json): a drafter's, read by drafters.formats.
NEXTN = "num_nextn_predict_layers"
# A multimodal Gemma 3 folder (model_type gemma3): the language model's tensors under one of
# these prefixes (transformers 5, then older files); the vision tower and projector unused.
_GEMMA3_TEXT = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."))
_GEMMA3_VISION = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model folder: its index's shards, or model.safetensors."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # not UTF-8 too
            raise WeightsError(f"{index}: not a valid safetensors index "
                               f"({type(e).__name__}: {e})") from None
        for f in files:
            if not f.is_file():
                raise WeightsError(f"{index}: shard {f.name} is missing")
        return files
    if single.is_file():
        return [single]
    raise WeightsError(f"{path}: no model.safetensors or model.safetensors.index.json")


# safetensors' dtypes and their sizes in bytes (the format's header names them so)
_ST_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
              "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def read_header(file: Path) -> dict:
    """The JSON header of a safetensors file, checked against the file's size: every
    tensor's dtype, shape and byte range must agree and lie inside the file. Pure Python
    (no tensor is read): a truncated file or a garbage header is a one-line WeightsError
    naming the file, before anything else loads."""
    bad = f"{file}: corrupt or truncated safetensors file"
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{bad} ({size} bytes: no header)")
            n = int.from_bytes(head, "little")
            if n > min(_MAX_HEADER, size - 8):
                raise WeightsError(f"{bad} (its header claims {n} bytes; the file has "
                                   f"{size})")
            raw = f.read(n)
    except OSError as e:
        raise WeightsError(f"{file}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise WeightsError(f"{bad} (its header is not JSON: {str(e)[:80]})") from None
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            ok = (dtype in _ST_DTYPES and all(isinstance(d, int) and d >= 0 for d in shape)
                  and 0 <= begin <= end and end - begin == count * _ST_DTYPES[dtype])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise WeightsError(f"{bad} (tensor {name}: an invalid header entry)")
        if end > data:
            raise WeightsError(f"{bad} (tensor {name} ends at byte {end} of its data; the "
                               f"file holds {data}: truncated)")
    return header


def check_headers(path: Path) -> list[Path]:
    """`weight_files(path)`, each with its header read and checked (`read_header`)."""
    files = weight_files(path)
    for file in files:
        read_header(file)
    return files


class _Tensors:
    """The tensors of a checkpoint's files, indexed by name; each is read only when asked for
    (`read`), so loading holds one tensor at a time in host memory beside the result. Read
    as numpy arrays; bfloat16 ones (which numpy's reader cannot read) through the flax
    reader, which imports Flax only then."""

    def __init__(self, files: list[Path], multimodal: bool = False):
        """`multimodal`: a Gemma 3 folder, read as its language model (`_GEMMA3_TEXT`)."""
        self.where: dict[str, Path] = {}
        self.stored: dict[str, str] = {}  # our name -> the name in the file, where renamed
        self._open: dict[tuple[Path, str], object] = {}
        for file in files:
            for stored in self._handle(file, "numpy").keys():
                name = stored
                if multimodal:
                    if _GEMMA3_VISION.match(stored):
                        continue
                    for old, new in _GEMMA3_TEXT:
                        if stored.startswith(old):
                            name = new + stored[len(old):]
                            self.stored[name] = stored
                if _IGNORED.match(name):  # never read (a Medusa-2 model's heads)
                    continue
                if name in self.where:
                    raise WeightsError(f"{file}: tensor {name} also in {self.where[name]}")
                self.where[name] = file

    def shape(self, name: str) -> tuple[int, ...]:
        stored = self.stored.get(name, name)
        return tuple(self._handle(self.where[name], "numpy").get_slice(stored).get_shape())

    def read(self, name: str) -> np.ndarray:
        file = self.where[name]
        name = self.stored.get(name, name)
        try:
            if self._handle(file, "numpy").get_slice(name).get_dtype() == "BF16":
                return np.asarray(self._handle(file, "flax").get_tensor(name))
            return self._handle(file, "numpy").get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"{file}: corrupt or truncated safetensors file ({e})") from None

    def _handle(self, file: Path, framework: str):
        if (file, framework) not in self._open:
            from safetensors import safe_open

            try:
                self._open[file, framework] = safe_open(str(file), framework=framework)
            except (SafetensorError, OSError) as e:
                raise WeightsError(f"{file}: corrupt or truncated safetensors file ({e})") \
                    from None
        return self._open[file, framework]


def read_embedding(path: str | Path) -> np.ndarray:
    """The token embedding [V, H] of a model folder alone (an EAGLE-3 folder's saved copy is
    checked against it without loading the backbone)."""
    path = Path(path)
    tensors = _Tensors(weight_files(path), multimodal=_is_multimodal_gemma3(path))
    name = "model.embed_tokens.weight"
    if name not in tensors.where:
        raise WeightsError(f"{path}: no tensor {name}")
    return tensors.read(name)


def check_finite(array: np.ndarray, name: str, file) -> None:
    """Random bytes under an intact header still read as tensors; NaN or inf never belongs to
    a trained model (it would decode as garbage, e.g. token 0 forever): refused, named."""
    if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
        return
    bad = int(array.size - np.count_nonzero(np.isfinite(array)))
    if bad:
        raise WeightsError(f"{file}: tensor {name} holds {bad} non-finite values (NaN or inf) "
                           f"of {array.size}; the file is corrupt")


def load_pretrained(
    path: str | Path | None = None,
    *,
    param_dtype: str | None = None,
    compute_dtype: str = "float32",
    decoding_layout: bool = False,
) -> tuple[ModelConfig, Params]:
    """Load a Hugging Face checkpoint directory (default: the embedded stories260K).

    Returns (config, backbone params). `param_dtype` defaults to float32; pass "bfloat16"
    to halve memory. `decoding_layout=True` returns `backbone.decoding_layout`'s layout (a
    tuple of per-layer dicts, fused projections), built layer by layer as the checkpoint is
    read, so no stacked copy of the weights ever exists. Every tensor's name and shape is
    checked before any is read. Raises FileNotFoundError / ValueError / WeightsError on bad
    input.
    """
    import jax
    import jax.numpy as jnp

    from medusa_jax.model.backbone import fuse_layer, on_cpu, param_shapes

    path = Path(hub.local(path)) if path is not None else default_model_dir()
    cfg = ModelConfig.from_dir(path)
    check_headers(path)  # a truncated or garbage file, before any tensor is read
    cfg = cfg.replace(param_dtype=param_dtype or "float32", compute_dtype=compute_dtype)
    tensors = _Tensors(weight_files(path), multimodal=_is_multimodal_gemma3(path))
    shapes = param_shapes(cfg)
    lmap = layer_map(cfg)
    dtype = as_dtype(cfg.param_dtype)

    # 1. names and shapes, from the files' headers: (our key, layer or None) -> (name, T?)
    layer_names: dict[str, list] = {k: [None] * cfg.num_layers for k in shapes["layers"]}
    top_names: dict[str, tuple[str, bool]] = {}
    drafter_layers = nextn_layers(path, cfg)
    for name, file in tensors.where.items():
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) in drafter_layers:
            continue  # a multi-token-prediction module: the drafter's, not the backbone's
        if m and m.group(2) in lmap:
            idx = int(m.group(1))
            key, transpose = lmap[m.group(2)]
            if key not in layer_names or idx >= cfg.num_layers:
                raise WeightsError(f"{file}: unexpected tensor {name} for this config")
            _check_shape(tensors.shape(name), shapes["layers"][key][1:], name, file, transpose)
            layer_names[key][idx] = (name, transpose)
        elif name in _TOP_MAP:
            key, transpose = _TOP_MAP[name]
            if key == "lm_head" and cfg.tie_word_embeddings:
                continue  # tied: some writers still store the shared matrix
            _check_shape(tensors.shape(name), shapes[key], name, file, transpose)
            top_names[key] = (name, transpose)
        else:
            raise WeightsError(f"{file}: unexpected tensor {name}")
    for key in ("embed", "final_norm", "lm_head"):
        if key in shapes and key not in top_names:
            hf = next(n for n, (k, _) in _TOP_MAP.items() if k == key)
            raise WeightsError(f"{path}: missing tensor {hf}")
    for key, names in layer_names.items():
        for i, found in enumerate(names):
            if found is None:
                hf = next(n for n, (k, _) in lmap.items() if k == key)
                raise WeightsError(f"{path}: missing tensor model.layers.{i}.{hf}")

    # 2. the data, one tensor at a time
    def read(name: str, transpose: bool) -> np.ndarray:
        array = tensors.read(name)
        check_finite(array, name, tensors.where[name])
        return array.T if transpose else array

    def to_device(array: np.ndarray) -> jax.Array:
        return jnp.asarray(array, dtype=dtype)

    params: Params = {key: to_device(read(*found)) for key, found in top_names.items()}
    if decoding_layout:
        params["layers"] = tuple(
            jax.tree.map(to_device, fuse_layer({key: read(*names[i]) for key, names in
                                                layer_names.items()}, np.concatenate))
            for i in range(cfg.num_layers))
        params = on_cpu(cfg, params)
    else:
        params["layers"] = {key: to_device(np.stack([read(*found) for found in names]))
                            for key, names in layer_names.items()}
    return cfg, params


def nextn_layers(path: Path, cfg: ModelConfig) -> range:
    """The layer indices a checkpoint's multi-token-prediction modules take (DeepSeek-V3's
    layout: N .. N+D-1, N the backbone's layer count, D = num_nextn_predict_layers of
    config.json, none when it is absent)."""
    config = path / "config.json"
    try:
        value = json.loads(config.read_text()).get(NEXTN, 0)
    except (OSError, ValueError, AttributeError):
        return range(0)  # ModelConfig.from_dir has read it; a Gemma 3 text config aside
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WeightsError(f"{config}: {NEXTN}={value!r} is not a count of layers (a "
                           f"non-negative integer)")
    return range(cfg.num_layers, cfg.num_layers + value)


def _is_multimodal_gemma3(path: Path) -> bool:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") == "gemma3"
    except (OSError, ValueError, AttributeError):
        return False


def load_tokenizer(model_dir: str | Path | None = None):
    """The Hugging Face tokenizer of a model folder or hub id (default: the embedded
    stories260K); a WeightsError in one line naming the folder when there is none."""
    path = Path(hub.local(model_dir)) if model_dir is not None else default_model_dir()
    try:
        return tokenizer_lib.load_hf_tokenizer(path)
    except tokenizer_lib.TokenizerError as e:
        raise WeightsError(str(e)) from None


def tokenizer_files(path: Path) -> list[str]:
    """`text.tokenizer.tokenizer_files`, its error a WeightsError."""
    try:
        return tokenizer_lib.tokenizer_files(path)
    except tokenizer_lib.TokenizerError as e:
        raise WeightsError(str(e)) from None


def _check_shape(shape: tuple, want: tuple, name: str, file: Path,
                 transpose: bool = False) -> None:
    """A tensor of `shape` as stored in the file, against our layout's `want` ([in, out], so
    HF's [out, in] matrices are transposed). A wrong shape is reported as the file stores it,
    against the shape the file should hold (our expected shape in the file's convention)."""
    ours = tuple(reversed(shape)) if transpose else tuple(shape)
    if ours != tuple(want):
        in_file = tuple(reversed(want)) if transpose else tuple(want)
        layout = " ([out_features, in_features], as the file stores it)" if transpose else ""
        raise WeightsError(
            f"{file}: tensor {name} has shape {tuple(shape)}, expected {in_file}{layout}"
        )


def save_safetensors(tensors: dict, file: str | Path, metadata: dict | None = None) -> Path:
    """Write a safetensors file atomically (a temp file, then a rename), with the
    permissions of any other file the process writes (safetensors itself creates 0600)."""
    from safetensors.numpy import save_file

    file = Path(file)
    tmp = file.with_name(file.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    os.replace(tmp, file)
    return file


def save_pretrained(cfg: ModelConfig, params: Params, out_dir: str | Path,
                    source_dir: str | Path | None = None) -> Path:
    """Write params in the Hugging Face layout (config.json + model.safetensors).

    `source_dir`: the checkpoint the model came from; its config and tokenizer files are
    copied so the result loads in transformers as a drop-in replacement.
    """
    from medusa_jax.model.backbone import standard_layout

    if source_dir is not None:
        source_dir = hub.local(source_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    to_np = lambda a: np.ascontiguousarray(np.asarray(a, dtype=np.float32))  # noqa: E731
    tensors = {}
    for name, (key, transpose) in _TOP_MAP.items():
        if key in params:
            a = to_np(params[key])
            tensors[name] = np.ascontiguousarray(a.T) if transpose else a
    layers = standard_layout(cfg, params)["layers"]  # from `decoding_layout` too
    for hf, (key, transpose) in layer_map(cfg).items():
        if key not in layers:
            continue
        stacked = to_np(layers[key])
        for i in range(cfg.num_layers):
            a = stacked[i]
            tensors[f"model.layers.{i}.{hf}"] = np.ascontiguousarray(a.T) if transpose else a
    save_safetensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if source_dir is not None:
        for f in Path(source_dir).iterdir():
            if f.is_file() and f.suffix in (".json", ".model", ".txt") and \
                    not f.name.startswith("model.safetensors"):
                shutil.copy(f, out / f.name)
        cfg_json = json.loads((out / "config.json").read_text())
        cfg_json["dtype"] = "float32"
        cfg_json.pop("torch_dtype", None)
        (out / "config.json").write_text(json.dumps(cfg_json, indent=2))
    return out
