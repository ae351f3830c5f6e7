"""`dataclass`: an immutable dataclass that is a JAX pytree (every field a leaf) and has
`replace`, as `flax.struct.dataclass` makes one, without importing Flax: importing its
package imports flax.linen too, about 0.2 s of every decoding command's start-up. The
decoder's KV cache and loop states use it; training (`train_step`) keeps Flax's."""

from __future__ import annotations

import dataclasses

import jax


def _replace(self, **changes):
    return dataclasses.replace(self, **changes)


def dataclass(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.replace = _replace
    fields = [f.name for f in dataclasses.fields(cls)]
    jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])
    return cls
