"""The kinds of drafter, one folder each, and the registry that names them
(`drafters.registry`: the one door to them). Importing this package tells the decoders how to
find the drafter of parameters that carry none (`decoding.kinds`); the registry itself is
imported on the first such lookup, so the JAX-free modules here (`shipped`) stay JAX-free."""

from medusa_jax.decoding import kinds as _kinds


def _drafter_for(heads, head_fn=None):
    from medusa_jax.drafters import registry

    return registry.drafter_for(heads, head_fn)


_kinds.install(_drafter_for)
