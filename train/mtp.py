"""`python -m train.mtp`: multi-token-prediction modules (frozen backbone; MaxText's loss).

    python -m train.mtp                          # the default TinyStories job (as train.medusa1)
    python -m train.mtp --data chats.jsonl --model DIR --steps 2000 --num-heads 3
    python -m train.mtp --style mimo             # MiMo's conventions instead of DeepSeek-V3's
    python -m train.mtp --resume runs/mtp-20250101-120000

--num-heads modules chained depth by depth, each a projection of [its normed embedding of
the next token; its normed input hidden state] into a decoder layer of the backbone's kind,
read by the backbone's output head behind the module's own norm; module k at position t
reads module k-1's output at t (the backbone's final hidden state for the first) and the
token t+k+1, and is trained on token t+k+2 (teacher-forced): the loss is the cross-entropy
averaged over each depth's tokens, then over the depths. Data, self-distillation, the run
directory (config.json, metrics.jsonl, checkpoints/ (Orbax), heads/, accuracy.png) and the
final report are train.medusa1's: held-out accuracy per depth, then greedy decoding with the
modules against plain greedy decoding on held-out prompts.
The loop is `medusa_jax.training.trainer`; the method `medusa_jax.training.recipes.mtp`.
"""

from medusa_jax.training.command import Command
from medusa_jax.training.recipes.mtp_config import MtpConfig

# the recipe is imported when work starts: --help and flag errors import no JAX
command = Command("python -m train.mtp", __doc__, MtpConfig, "medusa_jax.training.recipes.mtp:Mtp")

if __name__ == "__main__":
    command.main()
