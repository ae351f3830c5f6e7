"""`python -m train.medusa2`: Medusa-2 training (backbone and heads jointly).

    python -m train.medusa2                                  # the default job (see below)
    python -m train.medusa2 --init runs/medusa1-X            # start from a Medusa-1 run
    python -m train.medusa2 --init runs/medusa1-X/heads --steps 600 --mesh data=1,fsdp=8
    python -m train.medusa2 --resume runs/medusa2-X

The paper's recipe is heads first (Medusa-1), then everything jointly. `--init` names the
first stage: a Medusa-1 run directory (its heads, and its cached self-distilled data when the
settings match) or a bare heads artifact. Without --init the first stage runs here, as a
`train.medusa1` run in <run>/stage1 (--stage1-steps).

Data and loss: with no --data the job self-distills from the TinyStories openings exactly
like train.medusa1, and the LM term is KL(original || fine-tuned) on the answer tokens (the
original is a frozen copy of the backbone); with --data it is next-token cross-entropy
(--lm-loss overrides either). Self-distilling the embedded model, the TinyStories training
stories join the data as anchor text (--anchor-text): they train the KL term only, so the
model also keeps its predictions on text it did not write itself. Total loss:
lm + lambda * sum_k 0.8^k CE_k, lambda constant (0.2) or rising on a sine (--head-schedule
sine, peak 0.01), the heads' learning rate --head-lr-ratio (4) times the backbone's.

The run directory gets config.json, metrics.jsonl, checkpoints/ (Orbax: backbone, heads and
their optimizer state; the frozen original is reloaded from --model), model/ (the fine-tuned
backbone in the Hugging Face layout), heads/ (the heads artifact), accuracy.png,
summary.json and a final report: held-out per-head accuracy; perplexity of the original and
the fine-tuned model and their mean per-token KL on held-out TinyStories text (the shipped
stories whose openings are in heldout_openings.txt; none of their text reaches training) and
on the held-out set; Medusa greedy decoding with the fine-tuned model against its own plain
greedy decoding. Then:

    python -m infer.bench --model <run>/model --heads <run>/heads

The loop is `medusa_jax.training.trainer`; the method `medusa_jax.training.recipes.medusa2`.
"""

from medusa_jax.training.command import Command
from medusa_jax.training.config import Medusa2Config

# the recipe is imported when work starts: --help and flag errors import no JAX
command = Command("python -m train.medusa2", __doc__, Medusa2Config, "medusa_jax.training.recipes.medusa2:Medusa2")

if __name__ == "__main__":
    command.main()
