"""The decoding options `infer.generate` takes: a frozen, JAX-free dataclass validated once.

Its fields with `option` metadata are the command's flags (`runtime.options.add_config_flags`);
`tools.bench_config.BenchConfig` declares the options it shares with it from here
(`options.same_option`). Errors name the flag, as the commands print them. This module
imports no JAX, so `--help` and a bad flag stay immediate.
"""

from __future__ import annotations

import dataclasses
import math

from medusa_jax.constants import DTYPES, MODES, check_dtype
from medusa_jax.runtime.options import option, positive_int, seed_int


def check_temperature(temperature: float, modes, what: str) -> None:
    """The temperature for decoding in `modes`: a finite number, > 0 where any mode samples;
    `what` names the modes in the error ("--mode rejection")."""
    if not math.isfinite(temperature):
        raise ValueError(f"--temperature must be a finite number, got {temperature}")
    if any(m != "greedy" for m in modes) and not temperature > 0:
        raise ValueError(f"--temperature must be > 0 for {what}, got {temperature}")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How `infer.generate` decodes: the arguments of `Medusa.generate` (`generate_args`)
    and the backbone's dtype for `Medusa.load`."""

    mode: str = option("greedy", "how tokens are chosen: greedy (default: argmax, lossless), "
                       "typical (the Medusa paper's typical acceptance: longer accepted "
                       "spans, lossy) or rejection (lossless speculative sampling)",
                       choices=MODES)
    tree: str | None = option(None, "tree name, chainN, JSON file of paths, or dynamic:N[:POOL] "
                              "(POOL e.g. deep7; default: the model's tree; --heads ngram: a "
                              "chain)", metavar="TREE")
    max_new_tokens: int = option(128, "tokens generated per prompt at most (default "
                                 "{default})", type=positive_int, metavar="N")
    temperature: float = option(0.7, "sampling temperature of the typical and rejection "
                                "modes, > 0 (default {default})", metavar="T")
    top_k: int = option(0, "sample from the K most likely tokens only (default 0: all)",
                        metavar="K")
    top_p: float = option(1.0, "sample from the smallest set of tokens whose probabilities "
                          "sum to P, in (0, 1] (default 1: all)", metavar="P")
    seed: int = option(0, "the sampling seed (default {default})", type=seed_int)
    batch_size: int = option(8, "prompts decoded at once (default {default})",
                             type=positive_int, metavar="N")
    dtype: str = option("float32", "the backbone's weights and compute dtype (default "
                        "{default})", choices=DTYPES)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_temperature(self.temperature, (self.mode,), f"--mode {self.mode}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"--top-k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        for name in ("max_new_tokens", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, "
                                 f"got {value!r}")
        check_dtype(self.dtype)

    def generate_args(self) -> dict:
        """The keyword arguments of `Medusa.generate` (all but the dtype, a loading one)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "dtype"}
