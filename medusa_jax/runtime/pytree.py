"""`dataclass`: an immutable dataclass that is a JAX pytree (every field a leaf) and has
`replace`, as `flax.struct.dataclass` makes one, without importing Flax: importing its
package imports flax.linen too, about 0.2 s of every decoding command's start-up. The
decoder's KV cache and loop states use it; training (`training.step`) keeps Flax's."""

from __future__ import annotations

import dataclasses

import jax


def _replace(self, **changes):
    return dataclasses.replace(self, **changes)


def static_field(**kwargs):
    """A field that is part of the pytree's structure, not a leaf (hashable; a change of
    its value is a new compiled program), as `flax.struct.field(pytree_node=False)`."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def dataclass(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.replace = _replace
    fields = dataclasses.fields(cls)
    jax.tree_util.register_dataclass(
        cls, data_fields=[f.name for f in fields if not f.metadata.get("static")],
        meta_fields=[f.name for f in fields if f.metadata.get("static")])
    return cls
