"""train.mtp's config (`MtpConfig`): the fields of every training run and the MTP modules'
own. Imports no JAX (the command's --help and flag errors answer at once); the method is
`training.recipes.mtp`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from medusa_jax.runtime.options import option
from medusa_jax.training.config import TrainConfig, recipe_help

# as EAGLE-3's recipe: the reference rate on real data, a larger one for the short
# self-distilled job on the embedded model
MTP_LR, MTP_SELF_DISTILL_LR = 1e-4, 1e-2
STYLES = ("deepseek", "mimo")  # `drafters.mtp.heads.STYLES`


@dataclasses.dataclass(frozen=True)
class MtpConfig(TrainConfig):
    """train.mtp: D multi-token-prediction modules on a frozen backbone (MaxText's loss)."""

    num_heads: int = option(2, "MTP modules to train, chained depth by depth (default "
                               "{default})")
    # Medusa-heads fields with no meaning here: plain fields, so no flags
    num_layers: int = 1
    shared_proj: bool = False
    loss_chunk: int = 0
    loss_decay: float = 1.0
    style: str = option("deepseek", "the modules' layout conventions: deepseek (the "
                                    "embedding first in the projection, as DeepSeek-V3, GLM, "
                                    "Qwen3.5) or mimo (the hidden state first, the normed "
                                    "output fed on) (default {default})", choices=STYLES)

    DEFAULT_STEPS: ClassVar[int] = 400
    RUN_PREFIX: ClassVar[str] = "mtp"
    LRS: ClassVar[tuple] = (MTP_LR, MTP_SELF_DISTILL_LR)
    HELP: ClassVar[dict] = recipe_help(RUN_PREFIX, DEFAULT_STEPS, LRS)

    def validate(self):
        if self.style not in STYLES:
            raise ValueError(f"--style must be one of {', '.join(STYLES)}, got {self.style!r}")
        return super().validate()

    def tree_heads(self) -> int | None:
        return None  # any depth: the last module is reused past the module count
