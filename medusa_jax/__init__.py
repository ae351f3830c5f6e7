"""medusa_jax: Medusa speculative decoding for JAX/Flax.

The package is layered; each folder imports only from the folders above it in this list:

    kernels/    the CPU few-row product kernel (jax.ffi)
    runtime/    assets, hub ids, compile cache, distributed, run folders, timing, sharding,
                command-line options
    text/       training data formats and chat templates, prompt files, the tokenizer
    model/      model config, named shapes, the backbone, Hugging Face weights
    decoding/   trees, acceptance, the decoding step and the loops that drive it
    drafters/   the kinds of drafter (medusa/, hydra/) and their file formats
    tools/      benchmarks, enlarging a model, tree search
    training/   the train step, the one trainer and its recipes, checkpoints
    serving/    the engine (continuous batching) and the HTTP server
    api, cli    the notebook API and the commands' shared flags
"""

import importlib

# The public names, imported on first use: `import medusa_jax` (and a stdlib-only tool that
# reads `medusa_jax.runtime.assets`) does not start JAX.
_EXPORTS = {
    "Medusa": "api", "Generation": "api", "Decoder": "api",
    "Sampling": "decoding.acceptance", "Tree": "decoding.tree",
    "generate": "decoding.decode", "medusa_generate": "decoding.decode",
    "ModelConfig": "model.config",
    "default_model_dir": "model.weights", "load_pretrained": "model.weights",
    "save_pretrained": "model.weights",
    "HeadsConfig": "drafters.medusa.heads", "apply_heads": "drafters.medusa.heads",
    "init_heads": "drafters.medusa.heads",
    "load_heads": "drafters.formats", "save_heads": "drafters.formats",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"medusa_jax.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'medusa_jax' has no attribute {name!r}")
