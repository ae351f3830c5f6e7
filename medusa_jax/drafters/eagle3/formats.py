"""EAGLE-3 drafters in the published layout: a folder with config.json (a one-layer Llama
config plus draft_vocab_size and eagle_config) and model.safetensors (or pytorch_model.bin),
as SafeAILab/EAGLE and SpecForge write them and SGLang and vLLM read them. Torch `Linear`
weights are [out, in]; ours are [in, out] with the heads split out (`heads`):

tensor                                           shape            ours
-----------------------------------------------  ---------------  -------------------------
fc.weight                                        [H, 3*Ht]        fc [3*Ht, H]
midlayer.self_attn.{q,k,v}_proj.weight           [NH*D|KVH*D, 2H] wq [2H, NH, D], wk, wv
midlayer.self_attn.o_proj.weight                 [H, NH*D]        wo [NH, D, H]
midlayer.mlp.{gate,up,down}_proj.weight          [F, H], [H, F]   w_gate, w_up, w_down
midlayer.input_layernorm.weight                  [H]              input_norm (the embedding's)
midlayer.hidden_norm.weight                      [H]              hidden_norm (the feature's)
midlayer.post_attention_layernorm.weight         [H]              post_attn_norm
norm.weight                                      [H]              final_norm
lm_head.weight                                   [Vd, H]          lm_head [H, Vd]
d2t                                              [Vd] int64       d2t int32 (target - draft)
t2d                                              [V] bool         t2d

vLLM's own name for the layer, `layers.0.` in place of `midlayer.`, is read too. A copy of
the target's embedding (`embed_tokens.weight` [V, H], which some trainers save) is accepted
and not kept: the drafter embeds with the backbone's own table, as SafeAILab and SGLang do
(vLLM would draft with the saved copy), so given the backbone's table a copy that differs
from it is refused. d2t/t2d may be absent only with the full vocabulary (the reference
deletes them then).

Aux layers: eagle_config.eagle_aux_hidden_state_layer_ids holds the ids of layers whose
OUTPUT the drafter reads (SpecForge writes them so; SGLang adds one to capture the input of
layer id + 1); ours are the layers whose INPUT it reads, so ours = theirs + 1. vLLM reads a
top-level eagle_aux_hidden_state_layer_ids (the speculators format) as input-of-layer
indices, ours as they are; we write both (theirs in eagle_config, ours at the top level) and
refuse a file where they disagree. Without either, the `aux_layers` argument of
`read_eagle3` / `load_eagle3` (input-of-layer ids, ours), else the rule every reader applies
(`heads.eagle3_layers`: backbones of 7 layers or more); else a one-line error naming
config.json and the field to set.

Which folders: a config naming an Eagle3 architecture (SpecForge's `LlamaForCausalLMEagle3`,
SGLang's and vLLM's) or holding eagle_config; and SafeAILab's `traineagle3` output as it
saves it (DeepSpeed's pytorch_model.bin beside the training config.json, which names the
plain `LlamaForCausalLM` with draft_vocab_size and no eagle_config, as the published
yuhuili/EAGLE3-* drafters do), recognised by its tensors (fc.weight [H, 3H] and midlayer.*);
its num_hidden_layers is not read (the reference builds one `midlayer` whatever it says).
Reading is strict (unknown, missing, misshapen or mistyped
tensors, unsupported config options: one one-line HeadsFormatError naming the file and the
tensor or field); config.json is written last, so a folder without it is half-written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from medusa_jax.drafters.eagle3 import heads as eagle3
from medusa_jax.drafters.io import (
    Expect,
    Found,
    HeadsFormatError,
    Layout,
    clip,
    contiguous,
    read_files,
    read_json,
    write_json,
    write_safetensors,
)
from medusa_jax.drafters.kind import Formats
from medusa_jax.model import config as model_config
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig

WEIGHTS_ST, WEIGHTS_PT = "model.safetensors", "pytorch_model.bin"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's EntryClass; vLLM registers it too
# traineagle3's config.json (and the published yuhuili/EAGLE3-* drafters') name the plain
# Llama class: the reference's Model is built from it, and only the tensors say EAGLE-3
PLAIN_LLAMA = ("LlamaForCausalLM",)
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
LAYER, VLLM_LAYER = "midlayer.", "layers.0."
EMBED = "embed_tokens.weight"


def tensor_names() -> dict[str, str]:
    """{ours: theirs} for the weights (d2t and t2d keep their names)."""
    a, m = LAYER + "self_attn.", LAYER + "mlp."
    return {"fc": "fc.weight", "wq": a + "q_proj.weight", "wk": a + "k_proj.weight",
            "wv": a + "v_proj.weight", "wo": a + "o_proj.weight",
            "w_gate": m + "gate_proj.weight", "w_up": m + "up_proj.weight",
            "w_down": m + "down_proj.weight", "input_norm": LAYER + "input_layernorm.weight",
            "hidden_norm": LAYER + "hidden_norm.weight",
            "post_attn_norm": LAYER + "post_attention_layernorm.weight",
            "final_norm": "norm.weight", "lm_head": "lm_head.weight"}


def to_torch(name: str, a: np.ndarray) -> np.ndarray:
    """Our tensor `name` -> theirs ([out, in])."""
    a = np.asarray(a)
    if name in ("wq", "wk", "wv"):
        return a.reshape(a.shape[0], -1).T  # [2H, N, D] -> [N*D, 2H]
    if name == "wo":
        return a.reshape(-1, a.shape[-1]).T  # [NH, D, H] -> [H, NH*D]
    return a.T if a.ndim == 2 else a


def from_torch(name: str, a: np.ndarray, c: eagle3.Eagle3Config) -> np.ndarray:
    """Their tensor (already checked to have the expected [out, in] shape) -> our `name`."""
    if name in ("wq", "wk", "wv"):
        n = c.num_heads if name == "wq" else c.num_kv_heads
        return a.T.reshape(2 * c.hidden_size, n, c.head_dim)
    if name == "wo":
        return a.T.reshape(c.num_heads, c.head_dim, c.hidden_size)
    return a.T if a.ndim == 2 else a


# ----------------------------------------------------------------------------- reading


def _count(conf: dict, key: str, cf: Path, default=None) -> int:
    if key not in conf or conf[key] is None:
        if default is None:
            raise HeadsFormatError(f"{cf}: needs {key}")
        return default
    v = conf[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise HeadsFormatError(f"{cf}: {key}={clip(v)} is not a positive integer")
    return v


def _layer_ids(value, key: str, cf: Path) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise HeadsFormatError(f"{cf}: {key}={clip(value)} is not a list of layer ids")
    return tuple(value)


def aux_layers_of(conf: dict, cf: Path, model_cfg: ModelConfig | None,
                  given=None) -> tuple[tuple, str]:
    """(our aux layers: input-of-layer indices, where they came from) of a config.json:
    the file's ids, else `given` (ours), else the reference's rule for the backbone
    `model_cfg`; a one-line error naming `cf` and what to set when none applies."""
    eagle = conf.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        raise HeadsFormatError(f"{cf}: eagle_config={clip(eagle)} is not a JSON object")
    eagle = eagle or {}
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise HeadsFormatError(f"{cf}: eagle_config.use_aux_hidden_state="
                               f"{clip(eagle['use_aux_hidden_state'])}: a drafter without the "
                               f"three aux features is not EAGLE-3")
    key = AUX_KEY
    theirs = _layer_ids(eagle[key], f"eagle_config.{key}", cf) if key in eagle else None
    top = _layer_ids(conf[key], key, cf) if key in conf else None
    given = None if given is None else _layer_ids(
        list(given) if isinstance(given, (list, tuple)) else given, "aux_layers", cf)
    ours, source = None, None
    if theirs is not None:
        ours = tuple(i + 1 for i in theirs)  # output of layer i = input of layer i + 1
        if top is not None and top != ours:
            raise HeadsFormatError(
                f"{cf}: eagle_config.{key}={list(theirs)} (outputs of those layers, SGLang's "
                f"reading) and top-level {key}={list(top)} (inputs of those layers, vLLM's "
                f"reading) name different layers; keep one")
        source = f"eagle_config.{key}"
    elif top is not None:
        ours, source = top, f"{key} (top level: vLLM's input-of-layer ids)"
    if ours is not None:
        if given is not None and tuple(given) != ours:
            raise HeadsFormatError(
                f"{cf}: {source.split(' ')[0]} gives aux layers {list(ours)} (inputs of "
                f"layers, ours), the aux_layers given {list(given)}; drop one")
        return ours, source
    if given is not None:
        return tuple(given), "aux_layers given (not in the file)"
    what = (f"set eagle_config.{key} in {cf} to the three layers whose output the drafter "
            f"reads (SpecForge's ids; ours are one more), or pass aux_layers (input-of-layer "
            f"ids) to drafters.eagle3.formats.load_eagle3")
    if model_cfg is None:
        raise HeadsFormatError(f"{cf}: names no eagle_config.{key}, and the reference's rule "
                               f"(inputs of layers 2, L//2, L-3) needs the backbone's config; "
                               f"load it against the backbone, or {what}")
    try:
        return eagle3.eagle3_layers(model_cfg.num_layers), "default (2, L//2, L-3)"
    except ValueError:
        raise HeadsFormatError(f"{cf}: names no eagle_config.{key}, and the reference's rule "
                               f"(inputs of layers 2, L//2, L-3) needs a backbone of 7 layers "
                               f"or more, this one has {model_cfg.num_layers}; {what}") from None


def is_plain_llama(conf: dict) -> bool:
    """The config names the plain Llama class (traineagle3's; eagle_config may have been
    added to it by hand, as the error for its missing aux layers asks)."""
    arch = conf.get("architectures")
    return isinstance(arch, list) and len(arch) > 0 and all(a in PLAIN_LLAMA for a in arch) \
        and conf.get("model_type", "llama") == "llama"


def read_config(cf: Path, model_cfg: ModelConfig | None, aux_layers=None
                ) -> tuple[eagle3.Eagle3Config, dict]:
    """config.json -> (Eagle3Config, the raw config), strictly; `aux_layers` (ours) when the
    file names none (`aux_layers_of`)."""
    conf = read_json(cf)
    if "speculators_config" in conf or "transformer_layer_config" in conf:
        raise HeadsFormatError(f"{cf}: a vLLM speculators config (speculators_config / "
                               f"transformer_layer_config) is not read here; use the "
                               f"SafeAILab/SpecForge layout (a one-layer Llama config.json)")
    arch = conf.get("architectures")
    reference = is_plain_llama(conf)  # the tensors decide (strictly, below)
    if arch is not None and not reference and not (isinstance(arch, list) and any(
            isinstance(a, str) and "eagle3" in a.lower() for a in arch)):
        raise HeadsFormatError(f"{cf}: architectures={clip(arch)} names no EAGLE-3 drafter "
                               f"(expected {ARCHITECTURE}, or {PLAIN_LLAMA[0]} as SafeAILab's "
                               f"traineagle3 config)")
    if conf.get("model_type", "llama") != "llama":
        raise HeadsFormatError(f"{cf}: model_type={clip(conf['model_type'])}: only Llama-layer "
                               f"EAGLE-3 drafters are supported")
    # traineagle3's Model builds one midlayer whatever num_hidden_layers says (its config
    # is often the target's, copied); any other layer's tensors are refused as unknown
    layers = 1 if reference else _count(conf, "num_hidden_layers", cf, 1)
    if layers != 1:
        raise HeadsFormatError(f"{cf}: num_hidden_layers={layers}: only one-layer drafters "
                               f"are supported (SafeAILab's; SGLang's extra plain layers are not)")
    if conf.get("hidden_act", "silu") != "silu":
        raise HeadsFormatError(f"{cf}: hidden_act={clip(conf['hidden_act'])} is not supported "
                               f"(only 'silu')")
    for flag in ("attention_bias", "mlp_bias", "bias", "norm_before_residual",
                 "tie_word_embeddings"):
        if conf.get(flag):
            raise HeadsFormatError(f"{cf}: {flag}={clip(conf[flag])} is not supported "
                                   f"(SafeAILab's drafter has no biases, adds the residual "
                                   f"before its norm and has its own lm_head)")
    h = _count(conf, "hidden_size", cf)
    nh = _count(conf, "num_attention_heads", cf)
    v = _count(conf, "vocab_size", cf)
    try:
        theta = conf.get("rope_theta")
        theta, scaling = model_config._rope(
            model_config.rope_object(conf, "rope_parameters", str(cf)),
            model_config.rope_object(conf, "rope_scaling", str(cf)),
            10000.0 if theta is None else theta, str(cf))
        eps = model_config._positive(conf.get("rms_norm_eps", 1e-6), "rms_norm_eps", str(cf))
    except ValueError as e:
        raise HeadsFormatError(str(e)) from None
    aux, source = aux_layers_of(conf, cf, model_cfg, aux_layers)
    c = eagle3.Eagle3Config(
        hidden_size=h, num_heads=nh, num_kv_heads=_count(conf, "num_key_value_heads", cf, nh),
        head_dim=_count(conf, "head_dim", cf, h // nh),
        intermediate_size=_count(conf, "intermediate_size", cf),
        draft_vocab_size=_count(conf, "draft_vocab_size", cf, v), vocab_size=v,
        aux_layers=aux, target_hidden_size=_count(conf, "target_hidden_size", cf, h),
        rms_norm_eps=eps, rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=_count(conf, "max_position_embeddings", cf, 2048))
    return c, {**conf, "_aux_layers_source": source}


def read_eagle3(path: str | Path, model_cfg: ModelConfig | None, embed_table=None, *,
                aux_layers=None) -> tuple[Params, eagle3.Eagle3Config, dict]:
    """An EAGLE-3 drafter folder -> (numpy parameters, config, metadata), checked strictly
    against the backbone config `model_cfg` (None: against the files themselves) and, when
    given, the backbone's embedding `embed_table` [V, H] (a saved copy must match it).
    `aux_layers`: the layers whose input the drafter reads, for a config that names none
    (traineagle3's) on a backbone the reference's rule does not fit."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no EAGLE-3 drafter here (not a folder)")
    files = [root / n for n in (WEIGHTS_ST, WEIGHTS_PT) if (root / n).is_file()]
    cf = root / "config.json"
    if not cf.is_file():
        half = "a half-written folder: " if files else ""
        raise HeadsFormatError(f"{root}: no config.json ({half}an EAGLE-3 drafter is "
                               f"config.json + {WEIGHTS_ST} or {WEIGHTS_PT}; config.json is "
                               f"written last)")
    if not files:
        raise HeadsFormatError(f"{root}: config.json but neither {WEIGHTS_ST} nor {WEIGHTS_PT}")
    files = files[:1]  # both: the safetensors file (the same tensors, and no pickle to trust)
    c, conf = read_config(cf, model_cfg, aux_layers)
    found = Found("eagle3", root, tuple(files), cf)
    tensors = {}
    for name, item in read_files(found.files).items():
        ours = LAYER + name[len(VLLM_LAYER):] if name.startswith(VLLM_LAYER) else name
        if ours in tensors:
            raise HeadsFormatError(f"{item[1]}: tensor {name} and {ours} both present")
        tensors[ours] = item
    what = (f"EAGLE-3 drafter, hidden {c.hidden_size}, {c.num_heads} heads x {c.head_dim}, "
            f"{c.num_kv_heads} kv heads, draft vocab {c.draft_vocab_size} of {c.vocab_size}")
    ex = Expect(tensors, found, what)
    shapes = eagle3.param_shapes(c)
    out = {}
    for ours, theirs in tensor_names().items():
        shape = to_torch(ours, np.zeros(shapes[ours], np.int8)).shape
        out[ours] = from_torch(ours, ex.get(theirs, shape, f"our {ours}"), c)
    if c.draft_vocab_size == c.vocab_size and "d2t" not in tensors and "t2d" not in tensors:
        out["d2t"] = np.zeros(c.vocab_size, np.int32)  # the identity map
        out["t2d"] = np.ones(c.vocab_size, bool)
    else:
        out["d2t"] = ex.get("d2t", shapes["d2t"], "draft id -> target id - draft id")
        out["t2d"] = ex.get("t2d", shapes["t2d"], "target ids in the draft vocabulary")
    if EMBED in tensors:
        copy = ex.get(EMBED, (c.vocab_size, c.hidden_size), "a copy of the target's embedding")
        if embed_table is not None:
            table = np.asarray(embed_table, np.float32)
            diff = float(np.max(np.abs(copy - table)))
            if diff > 1e-2 * float(np.max(np.abs(table))):  # bfloat16 copies differ a little
                raise HeadsFormatError(
                    f"{tensors[EMBED][1]}: tensor {EMBED} is not the backbone's embedding "
                    f"(max abs difference {diff:.3g}); a drafter with its own embedding is "
                    f"not supported (SGLang would draft with the backbone's, vLLM with this)")
    ex.done()
    try:
        eagle3.check(out, model_cfg, c, files[0])
    except ValueError as e:
        raise HeadsFormatError(str(e)) from None
    out["d2t"] = out["d2t"].astype(np.int32)
    meta = {"format": "eagle3", "kind": eagle3.KIND, "aux_layers": list(c.aux_layers),
            "source_layout": "traineagle3" if is_plain_llama(conf) else "eagle3",
            "aux_layers_source": conf["_aux_layers_source"], "embedding_copy_dropped":
            EMBED in tensors,
            "extra": {"source": str(root), "files": [str(f) for f in files]}}
    if conf.get("base_model_name_or_path"):
        meta["base_model_name_or_path"] = str(conf["base_model_name_or_path"])
    return out, c, meta


# ----------------------------------------------------------------------------- writing


def eagle3_tensors(heads: Params) -> dict[str, np.ndarray]:
    """Our drafter under the published names, float32 weights, d2t int64, t2d bool."""
    out = {theirs: contiguous(to_torch(ours, np.asarray(heads[ours], np.float32)))
           for ours, theirs in tensor_names().items()}
    out["d2t"] = contiguous(np.asarray(heads["d2t"], np.int64))  # torch.long, as written
    out["t2d"] = contiguous(np.asarray(heads["t2d"], bool))
    return out


def eagle3_config(c: eagle3.Eagle3Config, base_model: str | None = None) -> dict:
    """The config.json of a drafter: SpecForge's fields, aux ids as output-of-layer ids."""
    scaling = tuple(c.rope_scaling)
    rope = None
    if scaling[0] == "linear":
        rope = {"rope_type": "linear", "factor": scaling[1]}
    elif scaling[0] == "llama3":
        rope = dict(zip(("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"), scaling))
    conf = {"architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": rope,
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                             [int(i) - 1 for i in c.aux_layers],
                             "use_aux_hidden_state": True},
            # vLLM's field (speculators format): input-of-layer ids, ours as they are
            "eagle_aux_hidden_state_layer_ids": [int(i) for i in c.aux_layers]}
    if c.feature_size != c.hidden_size:
        # only then: with target_hidden_size SafeAILab's Model skips loading the target's
        # embedding and keeps its own, which this layout does not hold
        conf["target_hidden_size"] = c.feature_size
    if base_model:
        conf["base_model_name_or_path"] = str(base_model)
    return conf


def write_eagle3(heads: Params, out_dir: str | Path, c: eagle3.Eagle3Config, *,
                 model_cfg: ModelConfig | None = None,
                 base_model: str | None = None) -> list[Path]:
    """Write the drafter as config.json + model.safetensors under `out_dir`, checked first
    (against `model_cfg` when given); config.json last, so a folder without it is
    half-written. Returns the files written."""
    try:
        eagle3.check(heads, model_cfg, c, "write_eagle3")
    except ValueError as e:
        raise HeadsFormatError(str(e)) from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)  # a rewrite is half-written until done
    write_safetensors(out / WEIGHTS_ST, eagle3_tensors(heads), {"format": "pt"})
    write_json(out / "config.json", eagle3_config(c, base_model))
    return [out / WEIGHTS_ST, out / "config.json"]


# ----------------------------------------------------------------------------- the kind's formats


def is_eagle3_config(conf: dict) -> bool:
    arch = conf.get("architectures")
    return "eagle_config" in conf or (isinstance(arch, list) and any(
        isinstance(a, str) and "eagle3" in a.lower() for a in arch))


def _weight_shapes(file: Path) -> dict[str, tuple] | None:
    """{tensor name: shape} of a weights file without reading the tensors; None when it
    cannot be looked into here (a pickle without PyTorch, a broken file)."""
    try:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="numpy") as f:
                return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
        import torch

        sd = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        return {str(n): tuple(t.shape) for n, t in sd.items()} if isinstance(sd, dict) else {}
    except Exception:  # noqa: BLE001 - not a readable weights file: the reader says why
        return None


def looks_like_traineagle3(folder: Path, conf: dict) -> bool:
    """A plain-Llama config beside EAGLE-3's tensors: fc.weight [H, 3H] (H the config's
    hidden size, 3H the target's three features) and the one decoder layer's midlayer.*
    (or vLLM's layers.0.*). A pickle that cannot be looked into (no PyTorch) counts when
    the config has draft_vocab_size, which only a drafter's has; the reader then says how
    to convert it."""
    if not is_plain_llama(conf):
        return False
    files = [folder / n for n in (WEIGHTS_ST, WEIGHTS_PT) if (folder / n).is_file()]
    if not files:
        return False
    shapes = _weight_shapes(files[0])
    if shapes is None:
        return files[0].suffix != ".safetensors" and "draft_vocab_size" in conf
    fc = shapes.get("fc.weight", ())
    h = conf.get("hidden_size")
    return len(fc) == 2 and fc[0] == h and fc[1] % 3 == 0 and any(
        n.startswith((LAYER, VLLM_LAYER)) for n in shapes)


def _eagle3_dir(p: Path, conf: dict | None, config: Path | None) -> Found | None:
    if conf is None:
        return None
    if is_eagle3_config(conf) or looks_like_traineagle3(p, conf):
        return Found("eagle3", p, (), config)
    return None


def _eagle3_file(p: Path, conf: dict, config: Path | None, names, meta) -> Found | None:
    """The weights file of a drafter folder, named itself: the folder is read."""
    if p.name in (WEIGHTS_ST, WEIGHTS_PT) and config is not None and (
            is_eagle3_config(conf) or looks_like_traineagle3(p.parent, conf)):
        return Found("eagle3", p.parent, (), config)
    return None


def config_of_meta(meta: dict, file: Path) -> eagle3.Eagle3Config:
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


def _config_of(heads: Params, what: str) -> eagle3.Eagle3Config:
    from medusa_jax.decoding.drafter import BoundParams
    from medusa_jax.drafters.eagle3.drafter import Eagle3Drafter

    bound = heads.drafter if isinstance(heads, BoundParams) else None
    if not isinstance(bound, Eagle3Drafter) or bound.config is None:
        raise HeadsFormatError(f"{what}: these EAGLE-3 parameters carry no configuration (aux "
                               f"layers, norm eps, rope); bind them first "
                               f"(drafters.eagle3.drafter.bind(heads, config, model_cfg))")
    return bound.config


def _read(found: Found, cfg: ModelConfig | None, embed):
    from medusa_jax.drafters.eagle3.drafter import bind

    heads, c, meta = read_eagle3(found.root, cfg, embed)
    return bind(heads, c, cfg), meta


def load_eagle3(path: str | Path, cfg: ModelConfig, *, aux_layers=None, embed=None
                ) -> tuple[Params, dict]:
    """`drafters.formats.load_heads` for an EAGLE-3 folder, with the aux layers (ours:
    input-of-layer ids) when its config names none and the reference's rule does not fit
    the backbone `cfg`. Returns (parameters bound to their drafter, metadata)."""
    from medusa_jax.drafters.eagle3.drafter import bind

    heads, c, meta = read_eagle3(path, cfg, embed, aux_layers=aux_layers)
    return bind({n: jnp.asarray(a) for n, a in heads.items()}, c, cfg), meta


def _write(heads: Params, out_dir, cfg: ModelConfig | None, base_model):
    return write_eagle3(dict(heads), out_dir, _config_of(heads, "the eagle3 layout records "
                                                         "the drafter's configuration"),
                        model_cfg=cfg, base_model=base_model)


class Eagle3Formats(Formats):
    """What `drafters.formats` asks of a kind: its layout, and its fields of our artifact
    (the drafter's whole configuration, which the tensors' shapes do not hold)."""

    kind = eagle3.KIND
    what = "EAGLE-3 drafters"
    layouts = (
        Layout("eagle3", "EAGLE-3 (config.json with eagle_config or an Eagle3 architecture, "
               "or traineagle3's LlamaForCausalLM one, + model.safetensors or "
               "pytorch_model.bin)", _eagle3_dir, _eagle3_file, _read, _write),
    )

    @staticmethod
    def wrong_layout(layout: str) -> str:
        return f"an EAGLE-3 drafter is written in the eagle3 or medusa_jax layout, not {layout!r}"

    @staticmethod
    def save(heads: Params, cfg: ModelConfig, file: Path) -> tuple[dict, dict]:
        """Float32 weights, d2t int32, t2d bool, and the configuration (`eagle3_config`)."""
        c = _config_of(heads, "save_heads")
        eagle3.check(heads, cfg, c, f"save_heads({file})")
        tensors = {k: contiguous(np.asarray(
            v, np.int32 if k == "d2t" else bool if k == "t2d" else np.float32))
            for k, v in heads.items()}
        return tensors, {"num_heads": str(eagle3.TTT_STEPS), "num_layers": "1",
                         "eagle3_config": json.dumps(dataclasses.asdict(c))}

    @staticmethod
    def load(tensors: dict, meta: dict, cfg: ModelConfig | None, file: Path) -> Params:
        from medusa_jax.drafters.eagle3.drafter import bind

        c = config_of_meta(meta, file)
        try:
            eagle3.check(tensors, cfg, c, file)
        except ValueError as e:
            raise HeadsFormatError(str(e)) from None
        meta["aux_layers"] = list(c.aux_layers)
        return bind({n: jnp.asarray(a) for n, a in tensors.items()}, c, cfg)

    @staticmethod
    def native_cfg(meta: dict, file: Path, cfg: ModelConfig) -> ModelConfig:
        """Deep enough for the layers the drafter reads."""
        return cfg.replace(num_layers=max(config_of_meta(meta, file).aux_layers, default=0) + 1)

    @staticmethod
    def sizes(heads: Params) -> tuple[int, int]:
        c = _config_of(heads, "sizes")
        return c.hidden_size, c.vocab_size
