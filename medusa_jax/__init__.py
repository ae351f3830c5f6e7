"""medusa_jax: Medusa speculative decoding for JAX/Flax.

Modules, one concept each: `config` (model config), `backbone` (the decoder), `heads`
(Medusa heads), `weights` (Hugging Face I/O), `tree` (static tree buffers), `acceptance`
(greedy / typical / rejection), `decode` (jitted decoders), `api` (the notebook API),
`assets` (what ships), `data`, `distill`, `train_step`, `trainer`, `medusa1`, `medusa2`,
`checkpoint`, `sharding` (training), `bench`, `tree_search` (measuring), `cli`,
`compile_cache` (the persistent compilation cache), `timing` (compile and decode time
apart), `startup` and `pytree` (what start-up does not import).
"""

import importlib

# The public names, imported on first use: `import medusa_jax` (and a stdlib-only tool that
# reads `medusa_jax.assets`) does not start JAX.
_EXPORTS = {
    "Sampling": "acceptance", "Generation": "api", "Medusa": "api", "Decoder": "api", "ModelConfig": "config",
    "HeadsConfig": "heads", "apply_heads": "heads", "init_heads": "heads",
    "load_heads": "heads", "save_heads": "heads", "Tree": "tree",
    "default_model_dir": "weights", "load_pretrained": "weights", "save_pretrained": "weights",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"medusa_jax.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'medusa_jax' has no attribute {name!r}")
