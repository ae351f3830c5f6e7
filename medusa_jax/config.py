"""Model configuration: one frozen dataclass read from a Hugging Face `config.json`.

Everything the backbone needs to know about an architecture lives here, so the forward pass
never looks at raw JSON. Unsupported options fail here, loudly, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def as_dtype(name: str | Any) -> Any:
    """`"bfloat16"` -> `jnp.bfloat16`; dtypes pass through."""
    if isinstance(name, str):
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
        return _DTYPES[name]
    return name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. Hashable, so it can be a static argument of `jax.jit`."""

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
    param_dtype: str = "float32"
    compute_dtype: str = "float32"

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        """Translate a Hugging Face config dict; raise ValueError naming any unsupported field."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key):
            if key not in cfg or cfg[key] is None:
                raise ValueError(f"{source}: required field {key!r} is missing")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        head_dim = cfg.get("head_dim") or hidden // heads
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if cfg.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")

        # transformers 5 writes `rope_parameters`; older files use rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
        rope_type = rope_type or "default"
        params = {**scaling, **rope}
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"{source}: rope type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "llama3":
            rope_scaling = (
                "llama3",
                float(params["factor"]),
                float(params["low_freq_factor"]),
                float(params["high_freq_factor"]),
                int(params["original_max_position_embeddings"]),
            )
        elif rope_type == "linear":
            rope_scaling = ("linear", float(params["factor"]))
        else:
            rope_scaling = ("default",)

        if model_type == "qwen2":
            bias = True
        else:
            bias = bool(cfg.get("attention_bias", False))
        window = None
        if model_type in ("mistral", "qwen2", "qwen3"):
            use_window = cfg.get("use_sliding_window", model_type == "mistral")
            window = cfg.get("sliding_window") if use_window else None
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=model_type == "qwen3",
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            param_dtype=dtype if dtype in _DTYPES else "float32",
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        file = path / "config.json"
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist")
        if not file.is_file():
            raise FileNotFoundError(f"{file}: config.json is missing")
        try:
            cfg = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: invalid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{file}: expected a JSON object, got {type(cfg).__name__}")
        try:
            return cls.from_hf_dict(cfg, source=str(file))
        except (TypeError, ValueError) as e:  # e.g. int("wide"): name the file
            if str(file) in str(e):
                raise
            raise ValueError(f"{file}: invalid model config ({e})") from None


def stop_tokens(cfg: ModelConfig, tokenizer=None) -> tuple[int, ...]:
    """The token ids that end a generation, for every caller (API, CLIs, benchmarks,
    self-distillation): the config's EOS ids, the tokenizer's EOS, and its BOS (a base model
    that emits BOS has started a new document)."""
    ids = set(cfg.eos_token_id)
    for t in (getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "bos_token_id", None)):
        if t is not None:
            ids.add(int(t))
    return tuple(sorted(ids))
