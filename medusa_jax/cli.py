"""The decoding commands' shared flags: --model, --heads (and --mesh), the n-gram flags
(--ngram, --ngram-max, --ngram-min), loading a model with its heads, and the prompts a
benchmark runs on."""

from __future__ import annotations

import argparse
import sys

from medusa_jax.constants import HEADS_DTYPES
from medusa_jax.drafters import registry, shipped
from medusa_jax.runtime.options import errors_to_exit, mesh_spec


def drafter_help(default: str, fileless: bool = True, what: str = "a drafter") -> str:
    """The --heads help, its kinds and names from the registry and the shipped table (a new
    kind shows up in every command's help): `default` says what no --heads does;
    `fileless`: the command takes the kinds built without files (`--heads ngram`) too."""
    text = (f"{what} ({registry.help_kinds(files_only=True)}; any layout load_heads "
            f"reads), {shipped.help_names()} for the embedded model's shipped ones")
    if fileless:
        text += ", or " + ", ".join(f"{k!r} for {registry.WHAT[k]}" for k in shipped.FILELESS)
        text += " (no files, any model)"
    return f"{text}; {default}"


def add_model_flags(ap: argparse.ArgumentParser, heads_help: str | None = None,
                    mesh: bool = False):
    """--model, --heads and --heads-dtype as every decoding command takes them (and
    --mesh); `heads_help`: the --heads help (default: the kinds read from files and the
    shipped drafters, `drafter_help`)."""
    ap.add_argument("--model", help="Hugging Face model directory or hub id such as "
                    "HuggingFaceTB/SmolLM2-135M (downloaded into huggingface_hub's cache, or "
                    "found there with HF_HUB_OFFLINE=1; default: embedded stories260K)")
    ap.add_argument("--heads", help=(heads_help or drafter_help(
        "default: the shipped Medusa heads for the embedded model", fileless=False)) +
        "; a hub id works here too")
    ap.add_argument("--heads-dtype", choices=HEADS_DTYPES, default="float32",
                    help="the heads' weight matrices in bfloat16 halve what a step reads of "
                         "them; they change only the drafts, not what is emitted (default "
                         "float32)")
    if mesh:
        ap.add_argument("--mesh", type=mesh_spec, default=None,
                        help="tensor-parallel decoding on a device mesh, e.g. 'model=8' or "
                             "'data=2,model=4' (default: one device)")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def add_ngram_flags(ap: argparse.ArgumentParser) -> None:
    """--ngram [N], --ngram-max N, --ngram-min N (checked by `check_ngram_flags`)."""
    ap.add_argument("--ngram", nargs="?", type=_int, const=shipped.NGRAM_MERGED_DEFAULT,
                    default=None, metavar="N",
                    help="merge n-gram (prompt-lookup) drafts into the drafter's tree: a "
                         f"chain of N more nodes (default {shipped.NGRAM_MERGED_DEFAULT}); "
                         "needs --heads (docs/ngram.md)")
    ap.add_argument("--ngram-max", type=_int, default=None, metavar="N",
                    help="the longest n-gram looked up, with --heads ngram or --ngram "
                         f"(default {shipped.NGRAM_DEFAULT_MAX}, at most "
                         f"{shipped.NGRAM_SIZE_LIMIT})")
    ap.add_argument("--ngram-min", type=_int, default=None, metavar="N",
                    help=f"the shortest (default {shipped.NGRAM_DEFAULT_MIN})")


def check_ngram_flags(ap: argparse.ArgumentParser, args) -> None:
    """The n-gram flags together with --heads, before any work (`shipped.check_ngram`; the
    model's context is checked when it is loaded). One-line error, exit status 2."""
    try:
        shipped.check_ngram(args.heads, args.ngram, args.ngram_max, args.ngram_min)
    except ValueError as e:
        ap.error(str(e))


def heads_to_check(heads: str | None) -> str | None:
    """--heads as `check_model_paths` checks it: None for a kind that needs no files."""
    return None if shipped.fileless(heads) else heads


def load_with_heads(model: str | None, heads: str | None, mesh: str | None = None,
                    heads_dtype: str = "float32", **ngram):
    """`Medusa.load` for the benchmarking commands: heads are required, and default to the
    shipped ones for the embedded model. Errors exit with one line."""
    from medusa_jax.api import Medusa
    from medusa_jax.runtime import assets

    with errors_to_exit():
        m = Medusa.load(model, heads or assets.default_heads(model), mesh=mesh,
                        heads_dtype=heads_dtype, **ngram)
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
