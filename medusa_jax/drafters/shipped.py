"""The drafters shipped for the embedded model, by the name `--heads` / `heads=` takes (each
trained by its command's default run; their folders: `runtime.assets.SHIPPED_HEADS`). No
JAX here: `--help` and the commands' early checks read it."""

from __future__ import annotations

from pathlib import Path

from medusa_jax.runtime import assets

MEDUSA, HYDRA, EAGLE = "default", "hydra", "eagle"  # train.medusa1, train.hydra, train.eagle
NAMES = tuple(assets.SHIPPED_HEADS)


def folder(name: str) -> Path:
    """The folder of the shipped drafter `name` (one of NAMES)."""
    if name not in assets.SHIPPED_HEADS:
        raise ValueError(f"no shipped drafter {name!r}; shipped: {', '.join(NAMES)}")
    return assets.shipped_heads_dir(name)


def help_names() -> str:
    """"'default' / 'hydra' / 'eagle'", for the commands' --heads help."""
    return " / ".join(repr(n) for n in NAMES)
