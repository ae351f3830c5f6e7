"""Model configuration: one frozen dataclass read from a Hugging Face `config.json`.

Everything the backbone needs to know about an architecture lives here, so the forward pass
never looks at raw JSON. Unsupported options fail here, loudly, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                         "gemma3")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")  # "gemma3" (multimodal): its text_config

# The defaults of transformers' Gemma config classes (configuration_gemma*.py), for the fields
# a checkpoint's config.json may leave out (Gemma 3's text_config is often a handful of keys).
_GEMMA2_DEFAULTS = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=256, hidden_activation="gelu_pytorch_tanh",
                        max_position_embeddings=8192, rms_norm_eps=1e-6, bos_token_id=2,
                        eos_token_id=1, tie_word_embeddings=True, rope_theta=10000.0,
                        query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
_GEMMA_DEFAULTS = {
    "gemma": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
                  head_dim=256, hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192,
                  rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True,
                  rope_theta=10000.0),
    "gemma2": _GEMMA2_DEFAULTS,
    # Gemma 3's text model: Gemma 2's sizes, a larger vocabulary and context, local layers
    # with their own rotary base, one global layer in six, no softcapping
    "gemma3_text": dict(_GEMMA2_DEFAULTS, vocab_size=262208, max_position_embeddings=131072,
                        rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        sliding_window_pattern=6, final_logit_softcapping=None,
                        attn_logit_softcapping=None),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = ("float32", "bfloat16", "float16")  # jax.numpy's names (this module imports no jax:
# the commands check a config.json before JAX is imported)


def as_dtype(name: str | Any) -> Any:
    """`"bfloat16"` -> `jnp.bfloat16`; dtypes pass through."""
    if isinstance(name, str):
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
        import jax.numpy as jnp

        return getattr(jnp, name)
    return name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family or Gemma decoder. Hashable, so it can be a static argument of
    `jax.jit`; the Gemma fields below default to the Llama family's behaviour."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings),
    # ("linear", factor) or ("default",): a tuple so the config stays hashable.
    rope_scaling: tuple = ("default",)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on queries and keys (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # Gemma (defaults: the Llama family). MLP activation: "silu", "gelu_tanh" or "gelu".
    hidden_act: str = "silu"
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma stores w - 1
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the weights' dtype
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP too
    query_scale: float | None = None  # attention scores' scale (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask
    final_softcap: float | None = None  # the same on the output logits
    # Per-layer sliding windows (None: global attention; () : every layer global). A local
    # layer attends keys whose position p_k satisfies p_q - p_k < window.
    layer_windows: tuple = ()
    # The local layers' rotary embedding (Gemma 3's rope_local_base_freq); None: as global
    local_rope_theta: float | None = None
    local_rope_scaling: tuple = ("default",)
    param_dtype: str = "float32"
    compute_dtype: str = "float32"

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: does it use a sliding window (and the local rotary embedding)?"""
        return tuple(w is not None for w in self.layer_windows) or (False,) * self.num_layers

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        """Translate a Hugging Face config dict; raise ValueError naming any unsupported field."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "gemma3":  # multimodal: the language model's own config
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ValueError(f"{source}: model_type 'gemma3' without a text_config object")
            top = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "dtype", "torch_dtype",
                                       "tie_word_embeddings") if cfg.get(k) is not None}
            cfg = {**top, **text, "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        gemma = model_type in GEMMA_TYPES
        if gemma:  # transformers' class defaults for what the file leaves out
            cfg = {**_GEMMA_DEFAULTS[model_type], **cfg}

        def need(key):
            if key not in cfg or cfg[key] is None:
                raise ValueError(f"{source}: required field {key!r} is missing")
            return cfg[key]

        def count(key, default=None):
            """An integer size or count (>= 1), type and range checked; `default` where the
            field is absent or null (None: the field is required)."""
            if cfg.get(key) is None and default is not None:
                return default
            return _check_int(need(key), key, source)

        _check_flags(cfg, source)
        hidden = count("hidden_size")
        heads = count("num_attention_heads")
        kv_heads = count("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        if cfg.get("head_dim") is None and hidden % heads:
            raise ValueError(f"{source}: hidden_size={hidden} is not a multiple of "
                             f"num_attention_heads={heads} (and no head_dim is given)")
        head_dim = count("head_dim") if cfg.get("head_dim") is not None else hidden // heads
        if gemma:
            act = _gemma_activation(cfg, model_type, source)
        else:
            act = cfg.get("hidden_act", "silu")
            if act not in ("silu", "swish"):
                raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
            act = "silu"
        if cfg.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")

        # transformers 5 writes `rope_parameters`; older files use rope_theta + rope_scaling.
        rope = rope_object(cfg, "rope_parameters", source)
        scaling = rope_object(cfg, "rope_scaling", source)
        global_theta = 10000.0 if cfg.get("rope_theta") is None else cfg["rope_theta"]
        local_theta, local_scaling = None, ("default",)
        if model_type == "gemma3_text":  # one rotary embedding per attention kind
            per_kind = "full_attention" in rope or "sliding_attention" in rope
            glob = rope_object(rope, "full_attention", source, "rope_parameters.") \
                if per_kind else rope
            local = rope_object(rope, "sliding_attention", source, "rope_parameters.") \
                if per_kind else {}
            theta, rope_scaling = _rope(glob, scaling, global_theta, source)
            local_theta, local_scaling = _rope(local, {}, cfg.get("rope_local_base_freq"),
                                               source, "rope_local_base_freq")
        else:
            theta, rope_scaling = _rope(rope, scaling, global_theta, source)

        if model_type == "qwen2":
            bias = True
        else:
            bias = bool(cfg.get("attention_bias", False))
        if gemma and bias:  # transformers' Gemma puts a bias on o_proj too
            raise ValueError(f"{source}: attention_bias=true is not supported for {model_type}")
        if gemma and cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{source}: use_bidirectional_attention=true is not supported "
                             f"(a decoder attends causally)")
        window = None
        if model_type in ("mistral", "qwen2", "qwen3"):
            use_window = cfg.get("use_sliding_window", model_type == "mistral")
            window = cfg.get("sliding_window") if use_window else None
            if window is not None:
                window = _check_int(window, "sliding_window", source)
        layers = count("num_hidden_layers")
        layer_windows = ()
        if model_type in ("gemma2", "gemma3_text"):
            local = [t == "sliding_attention" for t in _layer_types(cfg, model_type, layers,
                                                                     source)]
            if any(local):
                window = count("sliding_window")
                layer_windows = tuple(window if lo else None for lo in local)
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        eos = tuple(_check_int(e, "eos_token_id", source, minimum=0) for e in eos)
        bos = cfg.get("bos_token_id")
        if bos is not None:
            _check_int(bos, "bos_token_id", source, minimum=0)
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        sandwich = model_type in ("gemma2", "gemma3_text")
        return cls(
            model_type=model_type,
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            max_position_embeddings=count("max_position_embeddings", 2048),
            rms_norm_eps=_positive(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            hidden_act=act,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=gemma,
            sandwich_norms=sandwich,
            query_scale=_positive(need("query_pre_attn_scalar"), "query_pre_attn_scalar",
                                  source) ** -0.5 if sandwich else None,
            # transformers' Gemma 3 never applies attn_logit_softcapping (parity: nor do we)
            attn_softcap=_cap(cfg, "attn_logit_softcapping", source)
            if model_type == "gemma2" else None,
            final_softcap=_cap(cfg, "final_logit_softcapping", source) if sandwich else None,
            layer_windows=layer_windows,
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            param_dtype=dtype if dtype in _DTYPES else "float32",
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """From a model folder's config.json (or a Hugging Face hub id: `hub.local`)."""
        from medusa_jax.runtime import hub

        path = Path(hub.local(path))
        file = path / "config.json"
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist")
        if not file.is_file():
            raise FileNotFoundError(f"{file}: config.json is missing")
        cfg = read_json_object(file)
        try:
            model_cfg = cls.from_hf_dict(cfg, source=str(file))
        except (TypeError, ValueError) as e:  # e.g. int("wide"): name the file
            if str(file) in str(e):
                raise
            raise ValueError(f"{file}: invalid model config ({e})") from None
        return with_generation_eos(model_cfg, path / GENERATION_CONFIG)


GENERATION_CONFIG = "generation_config.json"


def read_json_object(file: Path) -> dict:
    """A JSON object from `file` (UTF-8), else one ValueError naming the file."""
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text (byte {e.start}: "
                         f"{e.object[e.start:e.start + 1]!r})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def with_generation_eos(cfg: ModelConfig, file: Path) -> ModelConfig:
    """`cfg` with the EOS ids of the model's generation_config.json added: many chat models
    declare their end-of-turn tokens only there, and transformers stops at them. A corrupt
    file is an error (naming it), not a silently different stop rule."""
    if not file.is_file():
        return cfg
    eos = read_json_object(file).get("eos_token_id")
    if eos is None:
        return cfg
    ids = eos if isinstance(eos, list) else [eos]
    if not ids:
        return cfg
    for e in ids:
        _check_int(e, "eos_token_id", str(file), minimum=0)
        if e >= cfg.vocab_size:
            raise ValueError(f"{file}: eos_token_id {e} is not a token id of this model "
                             f"(vocab_size {cfg.vocab_size})")
    merged = tuple(dict.fromkeys((*cfg.eos_token_id, *ids)))  # config.json's first, in order
    return cfg.replace(eos_token_id=merged)


def rope_object(cfg: dict, key: str, source: str, prefix: str = "") -> dict:
    """The rotary-embedding object `cfg[key]` (absent or null: {}); anything but a JSON
    object ("linear", ["linear", 2.0]) is refused naming the file and the field."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{source}: {prefix}{key} must be a JSON object (e.g. "
                         f'{{"rope_type": "linear", "factor": 2.0}}) or null, got '
                         f"{type(value).__name__} {_clip(value)}")
    return dict(value)


def _clip(value, n: int = 40) -> str:
    r = repr(value)
    return r if len(r) <= n else r[:n] + "..."


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(value, key: str, source: str, minimum: int = 1) -> int:
    """`value` as config.json's field `key`: an integer >= `minimum`, else one ValueError
    naming the file and the field (a string "64", a float, a bool or -64 are refused)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be an integer >= {minimum}, got "
                         f"{type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{source}: {key} must be an integer >= {minimum}, got {value}")
    return value


def _positive(value, key: str, source: str) -> float:
    """A finite number > 0 (rms_norm_eps, rope_theta, ...): NaN, inf, 0, negatives and
    strings are refused, naming the file and the field."""
    if not _is_number(value):
        raise ValueError(f"{source}: {key} must be a number > 0, got "
                         f"{type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: {key} must be a finite number > 0, got {value!r}")
    return float(value)


_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
          "use_bidirectional_attention")


def _check_flags(cfg: dict, source: str) -> None:
    """Boolean fields are JSON booleans: "false" (a string) would read as true."""
    for key in _FLAGS:
        value = cfg.get(key)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{source}: {key} must be true or false, got "
                             f"{type(value).__name__} {value!r}")


def _rope(rope: dict, scaling: dict, theta, source: str,
          theta_key: str = "rope_theta") -> tuple[float | None, tuple]:
    """(theta, rope_scaling tuple) from a `rope_parameters` dict and/or an old-style
    `rope_scaling` dict with `theta` as the fallback base."""
    if "rope_theta" in rope:
        theta, theta_key = rope["rope_theta"], "rope_parameters.rope_theta"
    theta = None if theta is None else _positive(theta, theta_key, source)
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    rope_type = rope_type or "default"
    params = {**scaling, **rope}
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    def number(key):
        if params.get(key) is None:
            raise ValueError(f"{source}: rope type {rope_type!r} needs rope_scaling.{key}")
        return _positive(params[key], f"rope_scaling.{key}", source)

    if rope_type == "llama3":
        return theta, (
            "llama3",
            number("factor"),
            number("low_freq_factor"),
            number("high_freq_factor"),
            _check_int(params.get("original_max_position_embeddings"),
                       "rope_scaling.original_max_position_embeddings", source),
        )
    if rope_type == "linear":
        return theta, ("linear", number("factor"))
    return theta, ("default",)


def _gemma_activation(cfg: dict, model_type: str, source: str) -> str:
    """Gemma reads `hidden_act` ("gelu" there is the legacy name of the tanh approximation,
    as transformers' GemmaConfig says); Gemma 2/3 read `hidden_activation`."""
    key = "hidden_act" if model_type == "gemma" else "hidden_activation"
    act = cfg.get(key)
    if model_type == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"
    names = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if act not in names:
        raise ValueError(f"{source}: {key} {act!r} is not supported for {model_type} "
                         f"(supported: {', '.join(names)})")
    return names[act]


def _layer_types(cfg: dict, model_type: str, layers: int, source: str) -> list[str]:
    """Each layer's attention kind: `layer_types`, or transformers' default pattern (Gemma 2:
    alternating from a local layer 0; Gemma 3: every `sliding_window_pattern`-th global)."""
    types = cfg.get("layer_types")
    if types is None:
        every = 2 if model_type == "gemma2" else _check_int(
            cfg.get("sliding_window_pattern") or 6, "sliding_window_pattern", source)
        return ["sliding_attention" if (i + 1) % every else "full_attention"
                for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"{source}: layer_types must list {layers} layer kinds (one per "
                         f"layer), got {types!r}")
    for t in types:
        if t not in ("sliding_attention", "full_attention"):
            raise ValueError(f"{source}: layer type {t!r} is not supported; supported: "
                             f"sliding_attention, full_attention")
    return types


def _cap(cfg: dict, key: str, source: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: {key}={value!r}, expected a positive number or null")
    return float(value)


def stop_tokens(cfg: ModelConfig, tokenizer=None) -> tuple[int, ...]:
    """The token ids that end a generation, for every caller (API, CLIs, benchmarks,
    self-distillation): the config's EOS ids, the tokenizer's EOS, and its BOS (a base model
    that emits BOS has started a new document)."""
    ids = set(cfg.eos_token_id)
    for t in (getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "bos_token_id", None)):
        if t is not None:
            ids.add(int(t))
    return tuple(sorted(ids))
