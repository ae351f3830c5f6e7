"""The names every layer and command shares, in one JAX-free module (stdlib only): the
commands build their flags' choices from these before importing JAX, and the library's own
checks read the same tuples, so there is nothing to keep in step."""

# acceptance modes: how a row turns the verified tree into tokens (`decoding.acceptance`)
MODES = ("greedy", "typical", "rejection")

# the backbone's compute dtype (`--dtype`) and a drafter's stored weight dtype
# (`--heads-dtype`); jax.numpy's names
DTYPES = ("float32", "bfloat16")
HEADS_DTYPES = ("float32", "bfloat16")


def check_dtype(value) -> None:
    """A one-line ValueError naming --dtype unless `value` is one of DTYPES (the configs'
    check of a value given in code; the flag's choices check the command line)."""
    if value not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {value!r}")
