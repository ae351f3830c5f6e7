"""The decoders' compiler options (`runtime.xla_options`): the memory-optimized schedule on
the CPU only, reaching XLA, and a decorated function that behaves as `jax.jit`'s."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.runtime import xla_options


def test_only_the_cpu_gets_options():
    assert xla_options.for_backend("cpu") == xla_options.CPU_OPTIONS
    assert xla_options.for_backend("gpu") is None and xla_options.for_backend("tpu") is None


def test_a_decorated_function_is_a_jitted_one():
    @xla_options.decoder_jit(static_argnames=("n",))
    def f(x, n=2):
        """Doubles, n times."""
        for _ in range(n):
            x = x * 2
        return x

    x = jnp.arange(4.0)
    np.testing.assert_array_equal(f(x, n=3), jax.jit(f.__wrapped__, static_argnames="n")(x, n=3))
    assert f.__doc__ == "Doubles, n times." and f.__name__ == "f"
    assert "mul" in f.lower(x, n=1).as_text()
    before = f._cache_size()
    f(x, n=3), f(x + 1, n=3)
    assert f._cache_size() == before  # one compile per static configuration, as jax.jit
    f(x, n=4)
    assert f._cache_size() == before + 1


def test_the_options_reach_xla_on_the_cpu(monkeypatch):
    """An option XLA does not know fails the compile: so the CPU options are passed."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU options are for the CPU backend")
    monkeypatch.setattr(xla_options, "CPU_OPTIONS", {"xla_cpu_scheduler_type": "NO_SUCH_TYPE"})
    f = xla_options.decoder_jit(lambda x: x + 1)
    with pytest.raises(Exception, match="(?i)xla_cpu_scheduler_type|NO_SUCH_TYPE"):
        f(jnp.ones(3))
