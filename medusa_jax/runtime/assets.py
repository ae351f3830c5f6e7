"""What ships inside the package, in one place: the embedded model and its heads, the trees,
the TinyStories prompts and text, and which tree a model decodes with by default.

    stories260K/          Karpathy's llama2.c stories260K in the Hugging Face layout (MIT)
    stories260K_heads/    the heads the default `python -m train.medusa1` trains
    shipped_drafters.json the drafters `--heads NAME` takes by name, and their folders
    trees/                published Medusa trees (by name) and the tree searched for CPUs
    prompts/              TinyStories story openings, split train / held-out
    text/                 the whole stories behind those openings, split the same way

Nothing here imports JAX: entry points call it before the heavy imports.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

EMBEDDED_MODEL = "stories260K"  # how the embedded model is named in configs and messages
PUBLISHED_DEFAULT_TREE = "mc_sim_7b_63"  # the Medusa paper's tree, for any other model
# the tree `python -m infer.tree` searched for the embedded model on a 2-core CPU
EMBEDDED_DEFAULT_TREE = "stories260K_cpu"


def root() -> Path:
    return Path(str(resources.files("medusa_jax") / "assets"))


def model_dir() -> Path:
    """The embedded stories260K model."""
    return root() / "stories260K"


def heads_dir() -> Path:
    """The heads trained by the default `python -m train.medusa1`, shipped for stories260K."""
    return root() / "stories260K_heads"


# `--heads NAME` / `heads=NAME`: the drafters shipped for the embedded model (name -> their
# folder here), each trained by its command's default run. The table is data
# (shipped_drafters.json, beside the folders): this layer, below the drafters, names no kind.
SHIPPED_HEADS: dict[str, str] = json.loads((root() / "shipped_drafters.json").read_text())


def shipped_heads_dir(name: str) -> Path:
    """The folder of the shipped drafter `name` (a key of SHIPPED_HEADS)."""
    return root() / SHIPPED_HEADS[name]


def trees_dir() -> Path:
    return root() / "trees"


def prompts_file(split: str) -> Path:
    """TinyStories story openings: split "train" or "heldout"."""
    return root() / "prompts" / f"{_split(split)}_openings.txt"


def text_file(split: str) -> Path:
    """Whole TinyStories stories (blank-line separated): split "train" or "heldout"."""
    return root() / "text" / f"tinystories_{_split(split)}.txt"


def heldout_prompts() -> list[str]:
    """The held-out openings, one per line: the default prompts of every benchmark."""
    return [line for line in prompts_file("heldout").read_text().splitlines() if line.strip()]


def inside_package(path: str | Path) -> bool:
    """Whether `path` lies inside the installed package's assets (the embedded model, the
    shipped heads, trees, prompts): nothing the commands write goes there, --force or not."""
    try:
        target = Path(path).expanduser().resolve()
    except (OSError, RuntimeError):
        return False
    base = root().resolve()
    return target == base or base in target.parents


def is_embedded(model: str | Path | None) -> bool:
    """Whether `model` (None = the default) is the embedded stories260K."""
    return model is None or Path(model).resolve() == model_dir().resolve()


# A model folder may name its own default tree here ({"default_tree": NAME}): train.enlarge
# writes the source's, since an enlarged model accepts exactly as its source does.
MODEL_SETTINGS = "medusa_jax.json"


def default_tree(model: str | Path | None) -> str:
    """The tree a model decodes with when none is named: the CPU-searched tree for the
    embedded model, the one its folder's `MODEL_SETTINGS` names, else the published
    `mc_sim_7b_63`."""
    if is_embedded(model):
        return EMBEDDED_DEFAULT_TREE
    settings = Path(model) / MODEL_SETTINGS
    if settings.is_file():
        import json

        try:
            tree = json.loads(settings.read_text()).get("default_tree")
        except (OSError, ValueError, AttributeError):
            raise ValueError(f"{settings}: not a JSON object with a default_tree") from None
        if isinstance(tree, str) and tree:
            return tree
    return PUBLISHED_DEFAULT_TREE


def default_heads(model: str | Path | None) -> Path | None:
    """The shipped heads for the embedded model; None for any other model."""
    return heads_dir() if is_embedded(model) else None


def _split(split: str) -> str:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return split
