"""Names every kind of drafter shares: our artifact's file name and format tag, the (head
count, blocks per head) pair some layouts and training records note, and each kind's
formats (`formats_of`). No kind is named here (`drafters.registry` knows them)."""

from __future__ import annotations

import dataclasses
import importlib

from medusa_jax.drafters import registry
from medusa_jax.drafters.io import HeadsFormatError

HEADS_FILE = "medusa_heads.safetensors"  # our artifact's tensors, of any kind (`formats`)
FORMAT = "medusa_jax.heads/1"  # the artifact's metadata `format`


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    num_heads: int = 5
    num_layers: int = 1

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"need at least one head and one layer, got {self}")


def heads_config_of(heads) -> HeadsConfig:
    """(head count, blocks per head) read off the parameters of any kind: the kind's
    `shape_of` (what our artifact's metadata records as num_heads, num_layers)."""
    return HeadsConfig(*registry.drafter_class(registry.kind_of(heads)).shape_of(heads))


def formats_of(kind: str):
    """The formats of `kind`: its class's `formats` ("module:class" imported here, or the
    object), which `drafters.formats` asks for layouts, `save`, `load` and `sizes`."""
    f = registry.drafter_class(kind).formats
    if f is None:
        raise HeadsFormatError(f"drafters of kind {kind!r} declare no file formats "
                               f"(their class has no `formats`)")
    if isinstance(f, str):
        module, name = f.split(":")
        f = getattr(importlib.import_module(module), name)
    from medusa_jax.drafters.kind import Formats  # JAX: not at import (`--help` reads this)

    if not isinstance(f, Formats) and not (isinstance(f, type) and issubclass(f, Formats)):
        raise HeadsFormatError(f"drafters of kind {kind!r}: their `formats` ({f!r}) must be "
                               f"a drafters.kind.Formats subclass")
    return f


def has_formats(kind: str) -> bool:
    return registry.drafter_class(kind).formats is not None


def writable_layouts(kind: str) -> list[str]:
    """The layouts heads of `kind` can be written in by `drafters.formats.write`."""
    return ["medusa_jax"] + [lay.name for lay in formats_of(kind).layouts
                             if lay.write is not None]


def check_kind(heads, kind: str, layout: str) -> None:
    """A one-line HeadsFormatError unless `heads` are of `kind`, the only kind `layout`
    holds."""
    have = registry.kind_of(heads)
    if have == kind:
        return
    own = formats_of(have)
    message = own.wrong_layout(layout)
    raise HeadsFormatError(message or (
        f"these are {own.what}; the {layout} layout holds only {formats_of(kind).what}: "
        f"write them with --format {' or '.join(writable_layouts(have))}"))
