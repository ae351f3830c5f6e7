"""medusa_jax: Medusa speculative decoding for JAX/Flax.

Modules, one concept each: `config` (model config), `backbone` (the decoder), `heads`
(Medusa heads), `weights` (Hugging Face I/O), `tree` (static tree buffers), `acceptance`
(greedy / typical / rejection), `decode` (jitted decoders), `api` (the notebook API),
`assets` (what ships), `data`, `distill`, `train_step`, `trainer`, `medusa1`, `medusa2`,
`checkpoint`, `sharding` (training), `bench`, `tree_search` (measuring), `cli`.
"""

from medusa_jax.acceptance import Sampling
from medusa_jax.api import Generation, Medusa
from medusa_jax.config import ModelConfig
from medusa_jax.heads import HeadsConfig, apply_heads, init_heads, load_heads, save_heads
from medusa_jax.tree import Tree
from medusa_jax.weights import default_model_dir, load_pretrained, save_pretrained

__all__ = ["Generation", "HeadsConfig", "Medusa", "ModelConfig", "Sampling", "Tree",
           "apply_heads", "default_model_dir", "init_heads", "load_heads", "load_pretrained",
           "save_heads", "save_pretrained"]
__version__ = "0.1.0"
