"""CPU kernels for decoding through XLA's FFI: few-row matrix products and few-query
attention.

A decoding step multiplies a few rows (1 token, or a Medusa tree's 5 to 65) by every weight
of the model, so it is bound by reading the weights. XLA:CPU runs such products as library
calls far from that bound; `fewrow_matmul.cc` reads each weight once for all rows, on the
threads of XLA's own pool. Its attention kernel (`attention`) computes a few query rows
over a per-layer KV cache, each row alone, skipping the slots its mask hides, so a token's
attention is the same bits in a 1-token and in a tree's verification pass; backbones whose
heads are a multiple of 16 wide attend with it (`attention_wants`).

How it is switched on: a weight wrapped in `KernelWeight` is multiplied by the kernel
(`matmul`); a plain array by XLA. `use_cpu_kernels(params, head_dim=...)` wraps a backbone
in the decoding layout, and marks it to attend with the kernel, when the kernels are
available (CPU backend, library built: `build`), and the heads follow the backbone inside
the decoders (`wrap_heads`). Being part of the
parameters' pytree structure, the choice is part of every jitted function's cache key:
the same process can time both (`unwrap`).

- Off: `--no-cpu-kernels` on the commands, or MEDUSA_JAX_CPU_KERNELS=0.
- Only on the CPU: other backends never get wrapped weights, and a wrapped weight that
  reaches another platform lowers to XLA's product (`jax.lax.platform_dependent`).
- Not under autodiff: the derivative of a kernel product is XLA's (`jax.custom_jvp`), so a
  gradient through it is exact; training keeps the standard layout and never wraps.
- Only float32 activations (bfloat16 or float32 weights, float32 accumulation); anything
  else falls back to XLA's product.
"""

# Importing this package (for its flags, say) does not import JAX: the product code is
# `fewrow`, loaded on the first use of one of its names here.


_SUBMODULES = ("build", "fewrow", "flags")  # imported as modules: never through fewrow


def __getattr__(name):
    if name.startswith("__") or name in _SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module("medusa_jax.kernels.fewrow"), name)
