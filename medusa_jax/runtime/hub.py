"""Hugging Face hub ids wherever a model or heads folder is taken (`--model`, `--heads`,
`Medusa.load`, the training commands).

A value that names an existing file or folder is that path. Otherwise a value shaped like a
hub repository id (`owner/name`: one slash, no leading `.`, `/` or `~`) is resolved
through `huggingface_hub.snapshot_download` and its cache ($HF_HUB_CACHE, default
~/.cache/huggingface/hub, laid out as `models--owner--name/{refs,snapshots}`): downloaded
when online, found in the cache when offline (HF_HUB_OFFLINE=1, or no network), and a
one-line `FileNotFoundError` saying which when neither works. Only the files the loaders
read are fetched (`MODEL_FILES`, `HEADS_FILES`).

Stdlib only at import: huggingface_hub is imported when a hub id is resolved.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

# what the model loaders read: config, safetensors weights (and index), tokenizer files
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken")
# heads: also the reference's medusa_lm_head.pt / Hydra's .pt pickles
HEADS_FILES = MODEL_FILES + ("*.pt", "*.bin")

# a hub repository id: owner/name, each [A-Za-z0-9_.-], not starting or ending with . or -
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_PART}/{_PART}$")


def is_repo_id(value: str | os.PathLike) -> bool:
    """`owner/name` that is not an existing path (a path always wins)."""
    text = os.fspath(value)
    return bool(_REPO_ID.match(text)) and ".." not in text and not Path(text).exists()


def offline() -> bool:
    """HF_HUB_OFFLINE set as huggingface_hub reads it (1, true, yes, on)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> str:
    """Where huggingface_hub keeps its cache (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return os.path.join(home, "hub")


def local(value: str | os.PathLike | None, what: str = "model",
          files: tuple[str, ...] = MODEL_FILES) -> str | os.PathLike | None:
    """`value` itself unless it is a hub id (`is_repo_id`); a hub id's local snapshot
    folder (a Path). None passes through. Raises FileNotFoundError in one line."""
    if value is None or not isinstance(value, (str, os.PathLike)) or not is_repo_id(value):
        return value
    return Path(_snapshot(os.fspath(value), what, files, offline(), cache_dir()))


@functools.lru_cache(maxsize=None)  # once per process and id: online, each call asks the hub
def _snapshot(repo_id: str, what: str, files: tuple[str, ...], is_offline: bool,
              cache: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{what} {repo_id}: no such file or folder here, and as a Hugging Face hub id"
    try:
        return snapshot_download(repo_id, allow_patterns=list(files), cache_dir=cache,
                                 local_files_only=is_offline)
    except GatedRepoError:
        raise FileNotFoundError(f"{where}: a gated repository (accept its terms on "
                                f"huggingface.co and log in with `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{where}: no such repository on the hub (or a private one: "
                                f"log in with `hf auth login`)") from None
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"{where}: {_first_line(e)}") from None
    except LocalEntryNotFoundError as e:
        if is_offline:
            raise FileNotFoundError(f"{where}: not in the cache ({cache}), and HF_HUB_OFFLINE=1 "
                                    f"forbids downloading it") from None
        raise FileNotFoundError(f"{where}: the hub could not be reached and it is not in the "
                                f"cache ({cache}): {_first_line(e.__cause__ or e)}") from None
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"{where}: {_first_line(e)}") from None
    except OSError as e:  # the cache folder cannot be written, a full disk
        raise FileNotFoundError(f"{where}: cannot download into the cache {cache} "
                                f"({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
