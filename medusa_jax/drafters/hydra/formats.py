"""Hydra heads in zankner/Hydra's layout (config.json + hydra_lm_head.safetensors or .pt):
the strict reader and the writer, and `HydraFormats` (what `drafters.formats` asks of a
kind). The table of every layout is in `drafters.formats`."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from medusa_jax.drafters import io as hio  # the layouts' shared reading and writing
from medusa_jax.drafters.artifact import check_kind
from medusa_jax.drafters.hydra import heads as hydra
from medusa_jax.drafters.kind import Formats
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig

HYDRA_PT, HYDRA_ST = "hydra_lm_head.pt", "hydra_lm_head.safetensors"  # zankner/Hydra


def read_hydra(found: hio.Found, cfg: ModelConfig | None) -> tuple[Params, dict]:
    """zankner/Hydra's grounded MLP heads (hydra_head_arch "mlp") -> our Hydra heads."""
    conf, cf = hio.read_json(found.config), found.config
    k = hio.config_count(conf, ("hydra_num_heads",), cf)
    lyr = hio.config_count(conf, ("hydra_num_layers",), cf)
    if k is None or lyr is None:
        raise hio.HeadsFormatError(f"{cf}: needs hydra_num_heads and hydra_num_layers")
    arch = conf.get("hydra_head_arch", "mlp")
    if arch != "mlp":
        raise hio.HeadsFormatError(f"{cf}: hydra_head_arch={arch!r} is not supported "
                                   f"(only 'mlp': Hydra++'s prefix-attention layer is not "
                                   f"implemented here)")
    if conf.get("grounded_heads", True) is not True:
        raise hio.HeadsFormatError(f"{cf}: grounded_heads={conf.get('grounded_heads')!r}: "
                                   f"ungrounded heads do not read the path; not Hydra heads")
    if conf.get("hidden_state_offset", 0) != 0:
        raise hio.HeadsFormatError(f"{cf}: hidden_state_offset={conf['hidden_state_offset']!r} "
                                   f"is not supported (only 0: the last hidden state)")
    tensors = hio.read_files(found.files)
    first = "hydra_lm_head.0.weight"
    h, v = hio.tensor_sizes(cfg, tensors, first, found)
    what = f"{k} Hydra heads x {lyr} layers, hidden {h}, vocab {v}"
    ex = hio.Expect(tensors, found, what)
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
        raise hio.HeadsFormatError(str(e)) from None
    meta = hio.heads_meta(found, k, lyr, h, v, conf.get("base_model_name_or_path"))
    meta["kind"] = hydra.KIND
    return out, meta


def hydra_tensors(heads: Params) -> dict[str, np.ndarray]:
    """Our Hydra heads under zankner/Hydra's names (hydra_mlp.{i}.0.linear.weight, ...)."""
    check_kind(heads, hydra.KIND, "hydra")
    k, h = int(np.shape(heads["in_w"])[0]), int(np.shape(heads["in_w"])[-1])
    lyr = int(np.shape(heads["w"])[1]) + 1
    a = {n: hio.as_float32(heads[n])
         for n in ("in_w", "in_b", "res_w", "res_b", "w", "b", "proj", "proj_b")}
    out = {}
    for i in range(k):
        n = i + 2
        for ours, theirs in (("in", "linear"), ("res", "res_connection")):
            w = a[f"{ours}_w"][i, :n].reshape(n * h, h)
            out[f"hydra_mlp.{i}.0.{theirs}.weight"] = hio.contiguous(w.T)
            out[f"hydra_mlp.{i}.0.{theirs}.bias"] = hio.contiguous(a[f"{ours}_b"][i])
        for j in range(1, lyr):
            out[f"hydra_mlp.{i}.{j}.linear.weight"] = hio.contiguous(a["w"][i, j - 1].T)
            out[f"hydra_mlp.{i}.{j}.linear.bias"] = hio.contiguous(a["b"][i, j - 1])
        out[f"hydra_lm_head.{i}.weight"] = hio.contiguous(a["proj"][i].T)
        out[f"hydra_lm_head.{i}.bias"] = hio.contiguous(a["proj_b"][i])
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
    w, b = hio.as_float32(heads["w"]), hio.as_float32(heads["b"])
    if lyr > 2 and not (np.all(w == w[:, :1]) and np.all(b == b[:, :1])):
        warnings.warn(f"{lyr - 1} different residual blocks per head: zankner/Hydra's model "
                      f"repeats one block object and will load only the last",
                      UserWarning, stacklevel=2)
    out = Path(out_dir)
    written = hio.write_tensors(out, HYDRA_ST, HYDRA_PT, tensors, pickle)
    conf = {"hydra_num_heads": k, "hydra_num_layers": lyr, "hydra_head_arch": "mlp",
            "grounded_heads": True, "hidden_state_offset": 0}
    if base_model:
        conf["base_model_name_or_path"] = str(base_model)
    hio.write_json(out / "config.json", conf)
    return [out / "config.json", *written]


# ----------------------------------------------------------------------------- the kind's formats


def _hydra_dir(p: Path, conf: dict | None, config: Path | None) -> hio.Found | None:
    for name in (HYDRA_ST, HYDRA_PT):
        if (p / name).is_file():
            if config is None:
                raise hio.HeadsFormatError(f"{p / name}: zankner/Hydra heads need their "
                                           f"config.json (hydra_num_heads, hydra_num_layers, ...)")
            return hio.Found("hydra", p, (p / name,), config)
    return None


def _hydra_file(p: Path, conf: dict, config: Path | None, names, meta) -> hio.Found | None:
    if p.name in (HYDRA_PT, HYDRA_ST) and "hydra_num_heads" in conf:
        return hio.Found("hydra", p, (p,), config)
    return None


class HydraFormats(Formats):
    """What `drafters.formats` asks of a kind: its layouts, and its fields of our artifact."""

    kind = hydra.KIND
    what = "Hydra heads"
    layouts = (
        hio.Layout("hydra", f"zankner/Hydra (config.json with hydra_num_heads + {HYDRA_PT} "
                   f"or {HYDRA_ST})", _hydra_dir, _hydra_file,
                   lambda found, cfg, embed: read_hydra(found, cfg),
                   lambda heads, out, cfg, base: write_hydra(heads, out, base_model=base)),
    )

    @staticmethod
    def save(heads: Params, cfg: ModelConfig, file: Path) -> tuple[dict, dict]:
        k, lyr = hydra.config_of(heads)
        tensors = {n: hio.contiguous(hio.as_float32(a)) for n, a in heads.items()}
        return tensors, {"num_heads": str(k), "num_layers": str(lyr)}

    @staticmethod
    def load(tensors: dict, meta: dict, cfg: ModelConfig | None, file: Path) -> Params:
        try:
            hydra.check(tensors, cfg, file, hio.meta_count(meta, "num_heads", file),
                        hio.meta_count(meta, "num_layers", file))
        except hio.HeadsFormatError:
            raise
        except ValueError as e:
            raise hio.HeadsFormatError(str(e)) from None
        return {n: jnp.asarray(a, jnp.float32) for n, a in tensors.items()}

    @staticmethod
    def sizes(heads: Params) -> tuple[int, int]:
        return int(np.shape(heads["w"])[-1]), int(np.shape(heads["proj"])[-1])
