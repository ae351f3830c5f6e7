"""The XLA compiler options the decoding programs are compiled with, per backend.

On the CPU the decoders ask for XLA's memory-optimized instruction schedule. Its default,
concurrency-optimized schedule orders a step's independent kernels so that XLA's runtime can
run them on two threads at once; a decoding step is a long chain of small kernels, and each
hand-over to another thread costs more than the kernel it runs (most of all in a Medusa step,
whose tree pass, heads and acceptance give the scheduler more independent kernels than a
plain step). The memory-optimized schedule runs them in an order that keeps the chain on one
thread. The instructions and their results are the same; only their order changes.

Other backends get no options: their programs are XLA's defaults, unchanged.
"""

from __future__ import annotations

import functools

import jax

CPU_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def for_backend(backend: str | None = None) -> dict | None:
    """The options for programs compiled for `backend` (default: JAX's default backend)."""
    return dict(CPU_OPTIONS) if (backend or jax.default_backend()) == "cpu" else None


class DecoderJit:
    """`jax.jit(fn, **jit_kwargs)`, compiled with `for_backend()`'s options: a jitted
    function of each kind, chosen by the default backend at each call. Calls, `lower`,
    `trace`, `eval_shape` and the rest of a jitted function's attributes go to it;
    `__wrapped__` is `fn`."""

    def __init__(self, fn, **jit_kwargs):
        self._plain = jax.jit(fn, **jit_kwargs)
        self._cpu = jax.jit(fn, compiler_options=dict(CPU_OPTIONS), **jit_kwargs)
        functools.update_wrapper(self, fn)

    def _jitted(self):
        return self._cpu if jax.default_backend() == "cpu" else self._plain

    def __call__(self, *args, **kwargs):
        return self._jitted()(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_plain", "_cpu"):
            raise AttributeError(name)
        return getattr(self._jitted(), name)


def decoder_jit(fn=None, **jit_kwargs):
    """Decorator: `DecoderJit(fn, **jit_kwargs)` (with or without arguments, as
    `functools.partial(jax.jit, ...)` is used)."""
    if fn is None:
        return functools.partial(decoder_jit, **jit_kwargs)
    return DecoderJit(fn, **jit_kwargs)
