"""The decoding commands' shared flags: --model, --heads (and --mesh), loading a model with
its heads, and the prompts a benchmark runs on."""

from __future__ import annotations

import argparse
import sys

from medusa_jax.constants import HEADS_DTYPES, MODES
from medusa_jax.runtime.options import errors_to_exit, mesh_spec

DECODE_MODES = MODES  # the name the commands used before `constants`


def add_model_flags(ap: argparse.ArgumentParser, heads_help: str | None = None,
                    mesh: bool = False):
    """--model, --heads and --heads-dtype as every decoding command takes them (and
    --mesh)."""
    ap.add_argument("--model", help="Hugging Face model directory or hub id such as "
                    "HuggingFaceTB/SmolLM2-135M (downloaded into huggingface_hub's cache, or "
                    "found there with HF_HUB_OFFLINE=1; default: embedded stories260K)")
    ap.add_argument("--heads", help=(heads_help or "a drafter: Medusa or Hydra heads, an "
                    "EAGLE-3 drafter (any layout load_heads reads), or 'default' / 'hydra' / "
                    "'eagle' for the embedded model's shipped ones (default: the shipped "
                    "Medusa heads for the embedded model)") + "; a hub id works here too")
    ap.add_argument("--heads-dtype", choices=HEADS_DTYPES, default="float32",
                    help="the heads' weight matrices in bfloat16 halve what a step reads of "
                         "them; they change only the drafts, not what is emitted (default "
                         "float32)")
    if mesh:
        ap.add_argument("--mesh", type=mesh_spec, default=None,
                        help="tensor-parallel decoding on a device mesh, e.g. 'model=8' or "
                             "'data=2,model=4' (default: one device)")


def load_with_heads(model: str | None, heads: str | None, mesh: str | None = None,
                    heads_dtype: str = "float32"):
    """`Medusa.load` for the benchmarking commands: heads are required, and default to the
    shipped ones for the embedded model. Errors exit with one line."""
    from medusa_jax.api import Medusa
    from medusa_jax.runtime import assets

    with errors_to_exit():
        m = Medusa.load(model, heads or assets.default_heads(model), mesh=mesh,
                        heads_dtype=heads_dtype)
    if m.heads is None:
        sys.exit("error: no heads: pass --heads (train some with python -m train.medusa1)")
    return m


def read_prompts(path: str | None, num: int | None = None,
                 flag: str = "--prompts") -> list[tuple[str, str | None]]:
    """(prompt, category) pairs from a prompts file (`text.prompt_files.read_prompt_file`),
    or the embedded held-out TinyStories openings; the first `num`. A bad file exits with
    one line naming `flag`."""
    from medusa_jax.runtime import assets
    from medusa_jax.text.prompt_files import read_prompt_file

    if path is None:
        prompts = [(p, None) for p in assets.heldout_prompts()]
    else:
        try:
            prompts = read_prompt_file(path)
        except FileNotFoundError:
            sys.exit(f"error: {flag} {path}: no such file")
        except ValueError as e:
            sys.exit(f"error: {flag} {e}")
    return prompts[:num] if num is not None else prompts
