"""Notices of other libraries that do not apply here, silenced (stdlib only).

- transformers prints `PyTorch was not found. Models won't be available and only tokenizers,
  configuration and file/data utilities can be used.` when it is imported without PyTorch.
  This project uses transformers for tokenizers only (its models are JAX), so the notice
  reads as a broken install where nothing is missing. It is one of transformers' "advisory"
  warnings, which TRANSFORMERS_NO_ADVISORY_WARNINGS=1 turns off (set here unless the user
  set it: `imports`). Real errors and other warnings still print.

Called before transformers is first imported (`startup.tokenizer_class`) and by the
commands before their heavy imports.

- Errors that Python can only report as "unraisable" (`sys.unraisablehook`: an exception in
  a finalizer or a callback with no caller), once the failure they belong to has its own
  one-line error: Orbax's abandoned read coroutines after a failed restore ("Encountered
  error while reading array") and TensorStore callbacks that find Orbax's event loop closed
  after a failed save ("Event loop is closed"). `unraisable(...)` drops exactly those
  messages; every other unraisable error still prints.
"""

from __future__ import annotations

import os
import sys

ADVISORY = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def imports() -> None:
    """Silence the notices above for this process (and the processes it starts)."""
    os.environ.setdefault(ADVISORY, "1")


def unraisable(*messages: str) -> None:
    """From now on, drop unraisable errors whose message holds one of `messages` (see
    above); an "Event loop is closed" message must be a RuntimeError's whole message.
    Installing twice adds the messages to the one filter."""
    hook = sys.unraisablehook
    if not hasattr(hook, "drops"):
        prev = hook

        def hook(report):
            msg = str(report.exc_value)
            if not any(m in msg if m != CLOSED_LOOP else
                       (isinstance(report.exc_value, RuntimeError) and msg == m)
                       for m in hook.drops):
                prev(report)

        hook.drops = set()
        sys.unraisablehook = hook
    hook.drops.update(messages)


CLOSED_LOOP = "Event loop is closed"
