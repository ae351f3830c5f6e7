"""`python -m train.medusa1`: Medusa-1 training (frozen backbone, heads only).

    python -m train.medusa1                      # the default TinyStories job (see below)
    python -m train.medusa1 --data chats.jsonl --model DIR --steps 2000 --mesh data=1,fsdp=8
    python -m train.medusa1 --resume runs/medusa1-20250101-120000

With no --data the job self-distills: the backbone continues the TinyStories openings in
medusa_jax/assets/prompts/train_openings.txt (cached as <run>/distill/train.jsonl), and
greedy continuations of the held-out openings are the held-out set. With --data, a small
seeded fraction of the records is held out instead.

The run directory gets config.json, metrics.jsonl, checkpoints/ (Orbax, last --keep steps),
heads/ (the artifact `load_heads` reads), accuracy.png and a final report: held-out
per-head accuracy, then Medusa greedy decoding against plain greedy decoding on held-out
prompts (batch 1, compile time excluded): tokens per step and wall-clock speedup.
The loop is `medusa_jax.training.trainer`; the method `medusa_jax.training.recipes.medusa1`.
"""

from medusa_jax.training.command import Command
from medusa_jax.training.config import Medusa1Config

# the recipe is imported when work starts: --help and flag errors import no JAX
command = Command("python -m train.medusa1", __doc__, Medusa1Config, "medusa_jax.training.recipes.medusa1:Medusa1")

if __name__ == "__main__":
    command.main()
