"""Import-time notices of other libraries that do not apply here, silenced (stdlib only).

- transformers prints `PyTorch was not found. Models won't be available and only tokenizers,
  configuration and file/data utilities can be used.` when it is imported without PyTorch.
  This project uses transformers for tokenizers only (its models are JAX), so the notice
  reads as a broken install where nothing is missing. It is one of transformers' "advisory"
  warnings, which TRANSFORMERS_NO_ADVISORY_WARNINGS=1 turns off (set here unless the user
  set it: `imports`). Real errors and other warnings still print.

Called before transformers is first imported (`startup.tokenizer_class`) and by the
commands before their heavy imports.
"""

from __future__ import annotations

import os

ADVISORY = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def imports() -> None:
    """Silence the notices above for this process (and the processes it starts)."""
    os.environ.setdefault(ADVISORY, "1")
