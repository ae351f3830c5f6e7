"""Start-up shortcuts: what the first token does not need is not imported or built.

Where the start-up of `python -m infer.generate --heads default --prompt "..."` went before
these (README, "Start-up"): importing transformers (about 1 s) and, through AutoTokenizer's
config machinery, PyTorch whenever it is installed (about 2 s more), importing JAX and
Flax, then tracing and compiling the decoder (the persistent compilation cache,
`compile_cache`, turns the compile into a load).

- `load_tokenizer`: the tokenizer `Medusa.load` uses. For the embedded model, an
  `EmbeddedTokenizer`: encoding and decoding straight from the `tokenizers` library,
  transformers only imported if something else is asked of it.
- `tokenizer_class`: the transformers class `weights.load_tokenizer` loads with; PyTorch is
  not imported for the embedded model.
- weights are read as numpy arrays (`weights._Tensors`): reading them as JAX arrays
  (safetensors' flax reader) imported Flax and compiled a small program per tensor shape.
"""

from __future__ import annotations

import json
from pathlib import Path



def tokenizer_class(path: Path):
    """The transformers class that loads the tokenizer of the model folder `path`.

    `AutoTokenizer` in general. For the embedded model it is the class AutoTokenizer would
    pick (`LlamaTokenizer`; the tests check both load the same tokenizer), imported
    directly: AutoTokenizer reads the model config through transformers' configuration
    module, which imports PyTorch whenever it is installed."""
    from medusa_jax import assets, quiet

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
            from medusa_jax.weights import load_tokenizer

            self._full = load_tokenizer(self.path)
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
    """`EmbeddedTokenizer` for the embedded model, else `weights.load_tokenizer`."""
    from medusa_jax import assets

    model_dir = Path(model_dir)
    if assets.is_embedded(model_dir) and (model_dir / "tokenizer.json").is_file():
        return EmbeddedTokenizer(model_dir)
    from medusa_jax.weights import load_tokenizer as load

    return load(model_dir)
