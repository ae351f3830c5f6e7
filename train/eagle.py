"""`python -m train.eagle`: an EAGLE-3 drafter (frozen backbone; training-time test).

    python -m train.eagle                        # the default TinyStories job (as train.medusa1)
    python -m train.eagle --data chats.jsonl --model DIR --steps 2000 --mesh data=1,fsdp=8
    python -m train.eagle --aux-layers 2,16,29 --draft-vocab 32000 --ttt-steps 7
    python -m train.eagle --resume runs/eagle-20250101-120000

One decoder layer of its own over the residual stream entering three backbone layers
(--aux-layers) and the next token's embedding, over a draft vocabulary of the training
labels' most frequent tokens (--draft-vocab), trained as SafeAILab/EAGLE's traineagle3 does:
run on its own outputs --ttt-steps times, step i's loss (soft cross-entropy against the
frozen backbone's distribution) weighted --loss-decay**i.
Data, self-distillation, the run directory (config.json, metrics.jsonl, checkpoints/ (Orbax),
heads/, accuracy.png) and the final report are train.medusa1's: held-out accuracy per
training-time-test step (does the drafter's best guess, or one of its best 5, match the
backbone's greedy token), then greedy decoding with the drafter against plain greedy
decoding on held-out prompts (batch 1, compile time excluded).
The loop is `medusa_jax.training.trainer`; the method `medusa_jax.training.recipes.eagle3`.
"""

from medusa_jax.training.command import Command
from medusa_jax.training.config import EagleConfig

# the recipe is imported when work starts: --help and flag errors import no JAX
command = Command("python -m train.eagle", __doc__, EagleConfig,
                  "medusa_jax.training.recipes.eagle3:Eagle3")

if __name__ == "__main__":
    command.main()
