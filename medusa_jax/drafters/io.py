"""What the heads file formats share: one-line errors, reading safetensors and torch pickles,
checking tensors against the names and shapes a layout expects, the base model a config
names, and writing files atomically. No kind of drafter is known here (`drafters.formats`
dispatches; `drafters.medusa.formats` and `drafters.hydra.formats` hold the layouts)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from medusa_jax.model import weights
from medusa_jax.model.config import ModelConfig

PICKLES = (".pt", ".bin", ".pth")


class HeadsFormatError(ValueError):
    """Heads that cannot be read or written exactly as asked (a one-line message)."""


def first_line(e: BaseException | str) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@dataclasses.dataclass(frozen=True)
class Found:
    layout: str  # one of `drafters.formats.layout_names()`
    root: Path  # the path given
    files: tuple[Path, ...]  # the files holding the tensors
    config: Path | None = None  # config.json with the head counts (None: counts from names)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A file layout a kind of drafter is read from (and perhaps written in), as the kind's
    formats declare it (`drafters.formats` loops over every kind's). Each callable returns
    None for "not this layout" and raises a one-line HeadsFormatError for "this layout,
    but broken"."""

    name: str
    looked_for: str  # what detection looks for, for the error that lists every layout
    detect_dir: object = None  # (folder, config.json's dict | None, its path) -> Found
    detect_file: object = None  # (file, sibling config dict, its path, tensor names or
    #                             None for a pickle, safetensors metadata) -> Found
    read: object = None  # (found, backbone cfg | None, embed table | None) -> (heads, meta)
    write: object = None  # (heads, out_dir, cfg | None, base_model) -> [Path]
    bundles_model: object = None  # (folder) -> whether it holds a backbone with the drafter


def read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadsFormatError(f"{file}: not valid JSON ({first_line(e)})") from None
    if not isinstance(data, dict):
        raise HeadsFormatError(f"{file}: expected a JSON object")
    return data


def safetensors_names(file: Path) -> tuple[list[str], dict]:
    try:
        with safe_open(str(file), framework="numpy") as f:
            return list(f.keys()), dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        raise HeadsFormatError(f"{file}: corrupt or truncated heads file "
                               f"({first_line(e)})") from None


def read_safetensors(file: Path, keep=None) -> dict[str, np.ndarray]:
    out, bf16 = {}, []
    try:
        with safe_open(str(file), framework="numpy") as f:
            for n in f.keys():
                if keep is not None and not keep(n):
                    continue
                if f.get_slice(n).get_dtype() == "BF16":
                    bf16.append(n)
                else:
                    out[n] = as_numpy(f.get_tensor(n))
        if bf16:  # numpy's reader has no bfloat16; flax's has
            with safe_open(str(file), framework="flax") as f:
                out.update({n: as_numpy(np.asarray(f.get_tensor(n))) for n in bf16})
    except (SafetensorError, OSError) as e:
        raise HeadsFormatError(f"{file}: corrupt or truncated safetensors file ({first_line(e)})") \
            from None
    return out


def check_float_tensors(tensors: dict, names, where: str) -> None:
    """Each of `names` in `tensors` must be a float tensor (bfloat16 included) holding only
    finite values; one-line ValueError naming `where` and the tensor otherwise."""
    for name in names:
        a = np.asarray(tensors[name])
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise ValueError(f"{where}: tensor {name} has dtype {a.dtype}, expected float")
        if not np.all(np.isfinite(np.asarray(a, np.float32))):
            raise ValueError(f"{where}: tensor {name} has non-finite values (NaN or inf)")


def as_numpy(a: np.ndarray) -> np.ndarray:
    """Floats as float32; integer and bool tensors (token maps, EAGLE-3's t2d) as they are."""
    keep = np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_
    return a if keep else np.asarray(a, np.float32)


def pickle_help(file: Path) -> str:
    st = file.with_suffix(".safetensors").name
    return (f"{file}: a PyTorch pickle, and PyTorch is not installed; pip install torch, or "
            f"convert it where PyTorch is: python -c \"import torch; from safetensors.torch "
            f"import save_file; sd = torch.load('{file.name}', map_location='cpu'); "
            f"save_file({{k: v.contiguous() for k, v in sd.items()}}, '{st}')\"")


def read_pickle(file: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise HeadsFormatError(pickle_help(file)) from None
    try:
        sd = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad pickle
        raise HeadsFormatError(f"{file}: corrupt or truncated PyTorch file ({first_line(e)})") \
            from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise HeadsFormatError(f"{file}: expected a state dict (names -> tensors)")
    out = {}
    for name, t in sd.items():
        t = t.detach().cpu()
        out[str(name)] = t.numpy() if not t.is_floating_point() else \
            t.to(torch.float32).numpy()
    return out


def read_files(files, keep=None) -> dict[str, tuple[np.ndarray, Path]]:
    tensors: dict[str, tuple[np.ndarray, Path]] = {}
    for file in files:
        part = read_pickle(file) if file.suffix in PICKLES else read_safetensors(file, keep)
        for name, a in part.items():
            if keep is not None and not keep(name):
                continue
            if name in tensors:
                raise HeadsFormatError(f"{file}: tensor {name} also in {tensors[name][1]}")
            tensors[name] = (a, file)
    return tensors


def config_count(conf: dict, keys: tuple[str, ...], config: Path) -> int | None:
    for key in keys:
        if key in conf:
            v = conf[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HeadsFormatError(f"{config}: {key}={v!r} is not a positive integer")
            return v
    return None


def file_of(tensors, name, found: Found) -> Path:
    return tensors[name][1] if name in tensors else (
        found.files[0] if len(found.files) == 1 else found.root)


class Expect:
    """Checks the tensors of one file set against a list of expected names and shapes."""

    def __init__(self, tensors: dict, found: Found, what: str):
        self.tensors, self.found, self.what, self.used = tensors, found, what, set()

    def get(self, name: str, shape: tuple, role: str) -> np.ndarray:
        if name not in self.tensors:
            raise HeadsFormatError(f"{file_of(self.tensors, name, self.found)}: missing tensor "
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


def tensor_sizes(cfg: ModelConfig | None, tensors: dict, name: str,
                 found: Found) -> tuple[int, int]:
    """(hidden, vocab): the backbone's, or read off the projection `name` [V, H] without one."""
    if cfg is not None:
        return cfg.hidden_size, cfg.vocab_size
    if name not in tensors or tensors[name][0].ndim != 2:
        raise HeadsFormatError(f"{file_of(tensors, name, found)}: missing tensor {name} "
                               f"(a head's projection [vocab, hidden])")
    v, h = tensors[name][0].shape
    return int(h), int(v)


def names_counts(names, pattern: str) -> tuple[int, int]:
    """(heads, blocks) implied by names like {i}.{j}.linear.weight under a prefix."""
    heads, blocks = set(), set()
    for n in names:
        m = re.match(pattern, n)
        if m:
            heads.add(int(m.group(1)))
            if m.group(3):
                blocks.add(int(m.group(2)))
    return (max(heads) + 1 if heads else 0), (max(blocks) + 1 if blocks else 0)


def heads_meta(found: Found, k, lyr, h, v, base) -> dict:
    meta = {"format": found.layout, "num_heads": str(k), "num_layers": str(lyr),
            "hidden_size": str(h), "vocab_size": str(v),
            "extra": {"source": str(found.root), "files": [str(f) for f in found.files]}}
    if base:
        meta["base_model_name_or_path"] = str(base)
    return meta


def clip(value, n: int = 40) -> str:
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


def sizes_cfg(h: int, v: int) -> ModelConfig:
    """A stand-in backbone config with only the sizes the heads see (no backbone at hand)."""
    return ModelConfig(model_type="llama", vocab_size=v, hidden_size=h, intermediate_size=1,
                       num_layers=1, num_heads=1, num_kv_heads=1, head_dim=h,
                       max_position_embeddings=1)


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


def as_float32(a, dtype=np.float32) -> np.ndarray:
    return np.asarray(a, dtype)


def contiguous(a: np.ndarray) -> np.ndarray:
    """Contiguous, so safetensors writes the elements in their logical order."""
    return np.ascontiguousarray(a)


def write_json(file: Path, data: dict):
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, file)


def write_tensors(out: Path, st_name: str, pt_name: str, tensors: dict,
                   pickle: bool | None) -> list[Path]:
    """The tensors as `st_name` (safetensors) in `out`, and as the torch pickle `pt_name` too
    when `pickle` (default: when torch is installed). Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / st_name, tensors, {"format": "pt"})
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


def check_finite(tensors: dict, file: Path) -> None:
    """Refuse to write a float tensor holding NaN or inf (one line naming it)."""
    for name, a in tensors.items():
        a = np.asarray(a)
        if (a.dtype.kind == "f" or a.dtype.name == "bfloat16") and \
                not np.all(np.isfinite(a.astype(np.float32))):
            raise ValueError(f"{file}: tensor {name} has non-finite values (NaN or inf); "
                             f"not written")


def write_safetensors(file: Path, tensors: dict, metadata: dict | None = None):
    check_finite(tensors, file)
    weights.save_safetensors({n: contiguous(a) for n, a in tensors.items()}, file, metadata)
