"""`python -m train.hydra`: Hydra heads (frozen backbone; each head also reads the path).

    python -m train.hydra                        # the default TinyStories job (as train.medusa1)
    python -m train.hydra --data chats.jsonl --model DIR --steps 2000 --mesh data=1,fsdp=8
    python -m train.hydra --teacher-loss         # Hydra++'s loss (the base model's soft labels)
    python -m train.hydra --resume runs/hydra-20250101-120000

Data, self-distillation, the run directory (config.json, metrics.jsonl, checkpoints/ (Orbax),
heads/, accuracy.png) and the final report are train.medusa1's: held-out per-head accuracy
(head i's conditional on the true path above it), then greedy decoding with the Hydra heads
against plain greedy decoding on held-out prompts (batch 1, compile time excluded): tokens per
step, wall-clock speedup and whether the outputs are identical.
The loop is `medusa_jax.training.trainer`; the method `medusa_jax.training.recipes.hydra`.
"""

from medusa_jax.training.command import Command
from medusa_jax.training.config import HydraConfig

# the recipe is imported when work starts: --help and flag errors import no JAX
command = Command("python -m train.hydra", __doc__, HydraConfig, "medusa_jax.training.recipes.hydra:Hydra")

if __name__ == "__main__":
    command.main()
