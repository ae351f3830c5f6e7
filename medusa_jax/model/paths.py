"""Model and heads paths checked before JAX is imported (the commands call it right after
parsing): stdlib, huggingface_hub and the config and safetensors header readers only."""

from __future__ import annotations

from pathlib import Path


def check_model_paths(model: str | None, heads: str | None = None,
                      tokenizer: bool = True) -> None:
    """Before JAX is imported (the commands call it right after parsing): --model and
    --heads resolved (a hub id through huggingface_hub's cache, `hub`), the model folder's
    config.json fields and its weights' headers checked, and --heads present. Raises
    ValueError / FileNotFoundError in one line naming the flag or file. `tokenizer`: the
    folder must hold a tokenizer (every command that encodes text)."""
    from medusa_jax.model.config import ModelConfig
    from medusa_jax.model.weights import check_headers, tokenizer_files
    from medusa_jax.runtime import assets, hub

    if model is not None:
        folder = Path(hub.local(model, "--model"))
        if not folder.exists():
            raise FileNotFoundError(f"--model {model}: no such folder")
        if not folder.is_dir():
            raise NotADirectoryError(f"--model {model}: not a folder (a Hugging Face model "
                                     f"folder holds config.json and *.safetensors)")
        ModelConfig.from_dir(folder)
        if tokenizer:
            tokenizer_files(folder)
        check_headers(folder)
    if heads is not None and heads not in assets.SHIPPED_HEADS:
        path = Path(hub.local(heads, "--heads", hub.HEADS_FILES))
        if not path.exists():
            raise FileNotFoundError(f"--heads {heads}: no Medusa heads artifact here (no such "
                                    f"file or folder)")
