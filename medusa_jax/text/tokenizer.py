"""Tokenizers, loaded without what the first token does not need.

- `load_tokenizer`: the tokenizer `Medusa.load` and the server use. For the embedded model
  an `EmbeddedTokenizer`: encoding and decoding straight from the `tokenizers` library,
  transformers imported only if something else is asked of it.
- `load_hf_tokenizer`: the transformers tokenizer of a model folder, with `tokenizer_class`
  (AutoTokenizer, or for the embedded model the class it would pick, so that PyTorch is
  not imported through AutoTokenizer's config machinery).
- `tokenizer_files`, `add_config_bos`: what a folder holds, and BOS when config.json asks.
"""

from __future__ import annotations

import json
from pathlib import Path


class TokenizerError(ValueError):
    """A model folder whose tokenizer is missing or unreadable (one line, naming it)."""



def tokenizer_class(path: Path):
    """The transformers class that loads the tokenizer of the model folder `path`.

    `AutoTokenizer` in general. For the embedded model it is the class AutoTokenizer would
    pick (`LlamaTokenizer`; the tests check both load the same tokenizer), imported
    directly: AutoTokenizer reads the model config through transformers' configuration
    module, which imports PyTorch whenever it is installed."""
    from medusa_jax.runtime import assets, quiet

    quiet.imports()  # transformers' "PyTorch was not found" notice: tokenizers only here
    if assets.is_embedded(path):
        from transformers import LlamaTokenizer

        return LlamaTokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer


class EmbeddedTokenizer:
    """The embedded model's tokenizer without importing transformers: `encode` (with BOS, as
    transformers' `encode`), `decode`, and the special tokens straight from its
    tokenizer.json with the `tokenizers` library, which transformers' `LlamaTokenizer`
    wraps for this model (the tests check the two agree on every shipped prompt). Anything
    else, and `encode`/`decode` with other options, goes to the transformers tokenizer
    (`full`), loaded on first use."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self._tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        config = json.loads((self.path / "tokenizer_config.json").read_text())
        self.bos_token, self.eos_token = config["bos_token"], config["eos_token"]
        self.bos_token_id = self._tokenizer.token_to_id(self.bos_token)
        self.eos_token_id = self._tokenizer.token_to_id(self.eos_token)
        self._full = None

    @property
    def full(self):
        """The transformers tokenizer of the same folder."""
        if self._full is None:
            self._full = load_hf_tokenizer(self.path)
        return self._full

    def encode(self, text, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.full.encode(text, **kwargs)
        return self._tokenizer.encode(text).ids

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self.full.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._tokenizer.decode([int(i) for i in ids],
                                      skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):  # only for what is not defined here
        if name.startswith("__") or name in ("_full", "_tokenizer", "path"):
            raise AttributeError(name)
        return getattr(self.full, name)

    def __call__(self, *args, **kwargs):
        return self.full(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.full)

    def __repr__(self) -> str:
        return f"EmbeddedTokenizer({str(self.path)!r})"


def load_tokenizer(model_dir: Path):
    """`EmbeddedTokenizer` for the embedded model, else `load_hf_tokenizer`."""
    from medusa_jax.runtime import assets

    model_dir = Path(model_dir)
    if assets.is_embedded(model_dir) and (model_dir / "tokenizer.json").is_file():
        return EmbeddedTokenizer(model_dir)
    return load_hf_tokenizer(model_dir)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_hf_tokenizer(path: Path):
    """The transformers tokenizer of the model folder `path`.

    Raises TokenizerError in one line naming the folder when it holds none of
    TOKENIZER_FILES, or when transformers cannot build a tokenizer from them."""
    found = tokenizer_files(path)

    try:
        tokenizer = tokenizer_class(path).from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises many types, over many lines
        first = (str(e).strip().splitlines() or [""])[0].rstrip(": ")
        raise TokenizerError(f"{path}: cannot load the tokenizer from {', '.join(found)} "
                           f"({type(e).__name__}: {first})") from None
    if not (path / "tokenizer_config.json").is_file():
        add_config_bos(tokenizer, path)
    return tokenizer


def tokenizer_files(path: Path) -> list[str]:
    """The tokenizer files of a model folder (of TOKENIZER_FILES); a TokenizerError naming the
    folder when it is missing or holds none."""
    if not path.is_dir():
        raise TokenizerError(f"{path}: no such model folder (looking for its tokenizer)")
    found = [f for f in TOKENIZER_FILES if (path / f).is_file()]
    if not found:
        raise TokenizerError(f"{path}: no tokenizer in this folder (looked for "
                           f"{', '.join(TOKENIZER_FILES)})")
    return found


def add_config_bos(tokenizer, path: Path) -> None:
    """A tokenizer without tokenizer_config.json (e.g. tokenizer.model alone) is built
    without knowing whether the model expects BOS first: config.json's bos_token_id says it
    does, so it is added (prompts then encode as in training); refused when it cannot be."""
    try:
        bos = json.loads((path / "config.json").read_text()).get("bos_token_id")
    except (OSError, ValueError, AttributeError):
        return
    if not isinstance(bos, int) or isinstance(bos, bool) or tokenizer.encode("a")[:1] == [bos]:
        return
    try:
        if tokenizer.bos_token is None:
            tokenizer.bos_token = tokenizer.convert_ids_to_tokens(bos)
        tokenizer.add_bos_token = True
        ok = tokenizer.encode("a")[:1] == [bos]
    except (AttributeError, ValueError, TypeError):
        ok = False
    if not ok:
        raise TokenizerError(f"{path}: the tokenizer does not start prompts with BOS (token {bos}, "
                           f"config.json's bos_token_id) and cannot be told to; add a "
                           f"tokenizer_config.json with \"add_bos_token\": true")
