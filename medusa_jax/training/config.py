"""The training commands' configs: one frozen dataclass per method, its fields the
command's flags (`options.add_config_flags`), saved as <run>/config.json and reused by
--resume.

`TrainConfig` (every method), `Medusa1Config` (train.medusa1), `HydraConfig` (train.hydra),
`EagleConfig` (train.eagle), `Medusa2Config` (train.medusa2). This module imports no JAX,
so `--help` and flag errors are immediate; `validate` imports what it checks with (the mesh
spec, the tree). The methods themselves are `training.recipes.medusa1`, `.hydra`, `.eagle3`
and `.medusa2` (which re-export their config from here).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import ClassVar

from medusa_jax.runtime import assets
from medusa_jax.runtime.options import int_list, option
from medusa_jax.text import data
from medusa_jax.text.data import FORMATS, TEMPLATES  # names: the config has a field called data

DTYPES = ("float32", "bfloat16")  # --dtype: the backbone's

# --target (`training.targets`): hard labels, or the frozen backbone's distribution
TARGETS = ("hard", "kl", "tv", "tv+kl")
SOFT_TARGETS = ("kl", "tv", "tv+kl")


def check_target(target: str, temperature: float, flag: str = "--target") -> None:
    """One-line ValueErrors for a target or temperature that cannot be trained on."""
    if target not in TARGETS:
        raise ValueError(f"{flag} must be one of {', '.join(TARGETS)}, got {target!r}")
    if not (isinstance(temperature, (int, float)) and 0 < temperature < math.inf):
        raise ValueError(f"--target-temperature must be finite and > 0, got {temperature}")
    if target == "hard" and temperature != 1.0:
        raise ValueError(f"--target-temperature {temperature} applies to the soft targets "
                         f"(--target {', '.join(SOFT_TARGETS)}); --target hard trains on "
                         f"one token")


def float_list(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated numbers (their range is checked by `validate`)."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got "
                                         f"{text!r}") from None
    return values


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What every training run needs; saved as <run>/config.json and reused by --resume.
    Medusa-1 and Medusa-2 extend it (equal distillation settings let a Medusa-2 run reuse a
    Medusa-1 run's self-distilled data)."""

    model: str | None = option(None, "Hugging Face model dir or hub id (default: embedded "
                                     "stories260K)",
                               metavar="DIR")
    data: tuple[str, ...] = option((), "training data (repeatable); default: self-distilled "
                                       "TinyStories", metavar="FILE")
    data_format: str = option("auto", "format of the --data files (default {default}: from "
                                      "the file)", choices=FORMATS)
    template: str = option("auto", "how conversations become tokens (default {default}: the "
                                   "tokenizer's chat template if any, else plain when "
                                   "self-distilling, vicuna with --data)", choices=TEMPLATES)
    output_dir: str | None = option(None, "run directory (default runs/<method>-<timestamp>)",
                                    metavar="DIR")
    num_heads: int = option(5, "Medusa heads to train (default {default})")
    num_layers: int = option(1, "residual blocks per head (default {default})")
    steps: int | None = option(None, "optimizer steps (default: the method's, unless --epochs)")
    epochs: float | None = option(None, "passes over the training data (instead of --steps)")
    batch_size: int = option(16, "packed rows per optimizer step (default {default})")
    seq_len: int = option(256, "tokens per packed row (default {default})")
    lr: float | None = option(None, "peak learning rate (default: the method's)")
    warmup_ratio: float = option(0.1, "linear warmup, as a fraction of the steps, then cosine "
                                      "decay (default {default})")
    weight_decay: float = option(0.0, "AdamW weight decay (default {default})")
    grad_clip: float = option(1.0, "global gradient-norm clip, 0 = off (default {default})")
    adam_b2: float = option(0.999, "Adam's second-moment decay b2 (default {default})")
    loss_decay: float = option(0.8, "head k's loss weighs this**k (default {default})")
    target: str = option("hard", "what each head learns: hard = the data's token; kl = the "
                                 "frozen backbone's distribution p, KL(p || q); tv = a drawn "
                                 "draft's acceptance sum(min(p, q)), i.e. 1 - TV(p, q); "
                                 "tv+kl = both (default {default})", choices=TARGETS)
    target_temperature: float = option(1.0, "soft targets compare p = softmax(backbone / T) "
                                             "with q = softmax(drafter / T), as sampling at T "
                                             "does (default {default})", metavar="T")
    shared_proj: bool = option(False, "heads share one projection: the base model's output "
                                      "layer, frozen; only their residual blocks train (K x "
                                      "H x H trained weights instead of K x H x (H + V); "
                                      "vLLM's original_lm_head form; Medusa-2: for its first "
                                      "stage, and kept frozen jointly; default: off)")
    dtype: str = option("float32", "the backbone's dtype: its weights and activations "
                                   "(Medusa-2: its activations; its trained weights stay "
                                   "float32). The heads' master weights, their gradients and "
                                   "Adam moments are float32 either way (default {default})",
                        choices=DTYPES)
    grad_accum: int = option(1, "micro-batches per optimizer step: --batch-size rows in "
                                "--grad-accum passes, equal to one pass over them "
                                "(default {default})")
    loss_chunk: int = option(0, "tokens of every row scored at once by the heads' loss "
                                "(0 = auto: a power of two that keeps one chunk's logits "
                                "under 512 MiB per device; the whole row, today's unchunked "
                                "loss, when it fits; default {default})")
    seed: int = option(0, "data order, held-out split and sampling (default {default})")
    mesh: str = option("1,1", "device mesh, e.g. 'data=1,fsdp=8' or '2,4' (default {default})")
    keep: int = option(3, "checkpoints kept (default {default})")
    save_every: int = option(250, "steps between checkpoints (default {default})")
    log_every: int = option(10, "steps between metrics.jsonl records (default {default})")
    eval_every: int = option(150, "steps between held-out evaluations (default {default})")
    heldout_fraction: float = option(0.02, "with --data: records held out for evaluation "
                                           "(default {default})")
    distill_samples: int = option(640, "self-distilled answers when no --data (default {default})")
    # low temperature: the heads are judged on greedy decoding, so near-greedy data helps
    # (0.1 beat 0.3 and pure greedy, which has only one answer per opening)
    distill_temperature: float = option(0.1, "sampling temperature of the self-distilled "
                                             "answers, 0 = greedy (default {default})")
    # the contexts sampled decoding produces: answers drawn at the temperatures served
    distill_temperatures: tuple[float, ...] = option(
        (), "self-distill at several temperatures instead (e.g. 0,0.8,1.0): the samples "
            "split evenly, the same openings each; 0 = greedy, one answer an opening",
        type=float_list, metavar="T1,T2,...")
    # with a ~20-token opening this nearly fills seq_len 256 (long openings lose a few tail
    # tokens to truncation, which the data summary counts)
    distill_max_new_tokens: int = option(240, "tokens per self-distilled answer "
                                              "(default {default})")
    distill_batch_size: int = option(64, "prompts answered at once (default {default})")
    eval_prompts: int = option(64, "held-out prompts for the decoding benchmark, 0 = skip "
                                   "(default {default})")
    eval_max_new_tokens: int = option(128, "tokens per prompt in the decoding benchmark "
                                           "(default {default})")
    coordinator: str | None = option(None, "multi-process run: process 0's HOST:PORT, the "
                                           "same on every process (default: one process, or "
                                           "JAX's cluster detection on a TPU pod / SLURM)",
                                     metavar="HOST:PORT")
    num_processes: int | None = option(None, "multi-process run: how many processes")
    process_id: int | None = option(None, "multi-process run: this process, 0..N-1 (0 "
                                          "writes the run directory's files)")
    init_timeout: int = option(300, "seconds to wait for the coordinator and the other "
                                    "processes (default {default})")
    tree: str = option(assets.PUBLISHED_DEFAULT_TREE,
                       "Medusa tree for the benchmark (default {default}; the embedded model "
                       "is also benchmarked on its CPU tree)")

    DEFAULT_STEPS: ClassVar[int] = 600
    RUN_PREFIX: ClassVar[str] = "medusa"
    # flags that may change on --resume (everything else must match the saved run)
    RESUMABLE: ClassVar[frozenset] = frozenset({
        "steps", "epochs", "keep", "save_every", "log_every", "eval_every", "mesh",
        "eval_prompts", "eval_max_new_tokens", "tree", "coordinator", "num_processes",
        "process_id", "init_timeout", "grad_accum", "loss_chunk"})

    # the default peak learning rates (with --data, self-distilled) that `resolve` gives --lr
    LRS: ClassVar[tuple | None] = None

    def resolve(self):
        """Fill the defaults that depend on the kind of run (saved resolved): --lr from `LRS`."""
        if self.lr is None and self.LRS is not None:
            return dataclasses.replace(self, lr=self.LRS[0] if self.data else self.LRS[1])
        return self

    def validate(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)
        if self.model is not None:  # a path or hub id, its config.json and weights' headers
            from medusa_jax.model.paths import check_model_paths

            check_model_paths(self.model)
        need(self.data_format in data.FORMATS, f"--data-format must be one of {data.FORMATS}")
        need(self.template in data.TEMPLATES, f"--template must be one of {data.TEMPLATES}")
        for name in ("num_heads", "num_layers", "batch_size", "keep", "save_every",
                     "log_every", "eval_every", "distill_samples", "distill_max_new_tokens",
                     "distill_batch_size", "eval_max_new_tokens"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1")
        need(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, "
                                   f"got {self.dtype!r}")
        need(self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        need(self.batch_size % self.grad_accum == 0,
             f"--batch-size {self.batch_size} is not divisible by --grad-accum "
             f"{self.grad_accum}")
        need(self.loss_chunk >= 0, f"--loss-chunk must be >= 0, got {self.loss_chunk}")
        need(self.seq_len >= 2 + self.num_heads,
             f"--seq-len must be > num_heads + 1 (got {self.seq_len})")
        need(self.steps is None or self.steps >= 1, "--steps must be >= 1")
        need(self.epochs is None or self.epochs > 0, "--epochs must be > 0")
        need(self.steps is None or self.epochs is None, "give --steps or --epochs, not both")
        need(self.lr is None or self.lr > 0, "--lr must be > 0")
        need(0 <= self.warmup_ratio < 1, "--warmup-ratio must be in [0, 1)")
        need(0 <= self.adam_b2 < 1, f"--adam-b2 must be in [0, 1), got {self.adam_b2}")
        need(self.grad_clip >= 0, f"--grad-clip must be >= 0, got {self.grad_clip}")
        need(0 < self.loss_decay <= 1, "--loss-decay must be in (0, 1]")
        for flag, values in (("--distill-temperature", (self.distill_temperature,)),
                             ("--distill-temperatures", tuple(self.distill_temperatures))):
            bad = [t for t in values if not (math.isfinite(t) and t >= 0)]
            need(not bad, f"{flag} must be finite and >= 0, got {bad[0] if bad else ''}")
        need(not self.distill_temperatures or
             self.distill_temperature == TrainConfig.distill_temperature,
             "give --distill-temperature or --distill-temperatures, not both")
        need(len(set(self.distill_temperatures)) == len(self.distill_temperatures),
             "--distill-temperatures: a temperature given twice")
        check_target(self.target, self.target_temperature)
        need(self.eval_prompts >= 0, "--eval-prompts must be >= 0")
        need(0 <= self.heldout_fraction < 1, "--heldout-fraction must be in [0, 1)")
        need(self.init_timeout >= 1, "--init-timeout must be >= 1")
        need(-2**63 <= self.seed < 2**63, f"--seed must be in -2**63..2**63-1, got {self.seed}")
        need(self.num_processes is None or self.num_processes >= 1,
             "--num-processes must be >= 1")
        from medusa_jax.decoding.tree import Tree
        from medusa_jax.runtime import sharding  # imports JAX: not before the flags are parsed

        sharding.parse_mesh_spec(self.mesh)
        # the benchmark's tree, before the run rather than after training (its depth only
        # matters when the benchmark runs; the vocabulary is checked there)
        Tree.load(self.tree, num_heads=self.tree_heads() if self.eval_prompts else None)
        return self

    @property
    def batch_ways(self) -> int:
        """The devices a batch's rows are split over (--mesh's data x fsdp)."""
        from medusa_jax.runtime import sharding

        sizes = sharding.parse_mesh_spec(self.mesh)
        return math.prod(sizes[a] for a in sharding.BATCH_AXES)

    def tree_heads(self) -> int | None:
        """The head count --tree is checked against (None: not known before the run)."""
        return self.num_heads

    def check_model(self, model_cfg, what: str = "this backbone") -> None:
        """Flags checked against the model's config.json before any work (one-line
        ValueError naming `what`, e.g. "--shape llama-2-7b"); nothing to check by default."""

    def total_steps(self, num_rows: int) -> int:
        if self.steps:
            return self.steps
        if self.epochs:
            return math.ceil(self.epochs * num_rows / self.batch_size)
        return self.DEFAULT_STEPS

    def shared(self, **changes) -> dict:
        """The fields of `TrainConfig` itself, with changes: what another method's config
        is built from (Medusa-2's first stage is a Medusa-1 run)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(TrainConfig)}
        out.update(changes)
        return out


# The self-distilled stories260K job trains only a few hundred steps to fit its time budget;
# at the Medusa paper's lr of 1e-3 the heads are still far from converged there, so that job
# defaults to a larger lr, tuned on that job (docs/benchmarks/2026-11-30-medusa1-medusa2.md).
# Runs on user data keep the paper's 1e-3.
DEFAULT_LR, SELF_DISTILL_LR = 1e-3, 3e-2


def recipe_help(prefix: str, steps: int, lrs: tuple, **more: str) -> dict:
    """The HELP every recipe's config has (its steps, learning rates and run directory)."""
    return {"steps": f"optimizer steps (default {steps} unless --epochs is given)",
            "lr": f"peak learning rate (default {lrs[0]}; {lrs[1]} without --data)",
            "output_dir": f"run directory (default runs/{prefix}-<timestamp>)", **more}


@dataclasses.dataclass(frozen=True)
class Medusa1Config(TrainConfig):
    """Medusa-1 adds --reduced-vocab; its other defaults differ."""

    # two residual blocks per head: more tokens/step than one on the default job
    # (docs/benchmarks/2026-11-30-medusa1-medusa2.md), for a negligible cost per step (the
    # heads run on one token)
    num_layers: int = option(2, "residual blocks per head (default {default})")
    reduced_vocab: int = option(0, "heads predict only the N most frequent label tokens of "
                                   "the training data (their projection K x H x N instead "
                                   "of K x H x V; vLLM's token_map form; 0 = the whole "
                                   "vocabulary, default {default})", metavar="N")

    DEFAULT_STEPS: ClassVar[int] = 600
    RUN_PREFIX: ClassVar[str] = "medusa1"
    LRS: ClassVar[tuple] = (DEFAULT_LR, SELF_DISTILL_LR)
    HELP: ClassVar[dict] = recipe_help(RUN_PREFIX, DEFAULT_STEPS, LRS)

    def validate(self):
        if self.reduced_vocab < 0:
            raise ValueError(f"--reduced-vocab must be >= 0, got {self.reduced_vocab}")
        return super().validate()


# Hydra: as Medusa-1, the short self-distilled job needs a larger lr than the paper's
# (DEFAULT_LR, SELF_DISTILL_LR above)


@dataclasses.dataclass(frozen=True)
class HydraConfig(TrainConfig):
    """Hydra's defaults and its own flags."""

    num_layers: int = option(2, "blocks per head: the input block, then residual blocks "
                                "(default {default})")
    teacher_loss: bool = option(False, "Hydra++'s teacher loss: soft cross-entropy against "
                                       "the frozen base model's distribution at each target "
                                       "position instead of the data's token (default: off)")

    DEFAULT_STEPS: ClassVar[int] = 600
    RUN_PREFIX: ClassVar[str] = "hydra"
    LRS: ClassVar[tuple] = (DEFAULT_LR, SELF_DISTILL_LR)
    HELP: ClassVar[dict] = recipe_help(RUN_PREFIX, DEFAULT_STEPS, LRS,
                                       num_heads="Hydra heads to train (default {default})")

    def validate(self):
        if self.teacher_loss and self.target != "hard":
            raise ValueError(f"--teacher-loss and --target {self.target}: give one (the "
                             f"teacher loss is --target kl at temperature 1)")
        if self.shared_proj:
            raise ValueError("--shared-proj is a Medusa-heads option; Hydra heads have one "
                             "projection each (train.medusa1 --shared-proj)")
        if self.loss_chunk:
            raise ValueError("--loss-chunk is a Medusa-heads option; the Hydra loss is "
                             "computed in one block")
        return super().validate()


# EAGLE-3: the reference trains at lr 1e-4 (SpecForge) on large data; the short
# self-distilled job on the embedded model needs a larger one (the sweep: docs/training.md)
EAGLE_LR, EAGLE_SELF_DISTILL_LR = 1e-4, 1e-2
EAGLE_DRAFT_VOCAB = 32000  # the reference's draft vocabulary (capped at the model's)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """--aux-layers' default: the drafter's own rule
    (`drafters.eagle3.layers.default_aux_layers`)."""
    from medusa_jax.drafters.eagle3.layers import default_aux_layers as rule

    return rule(num_layers, "--aux-layers")


@dataclasses.dataclass(frozen=True)
class EagleConfig(TrainConfig):
    """train.eagle: an EAGLE-3 drafter (one decoder layer over three backbone layers'
    features) on a frozen backbone, trained with the reference's training-time test.
    (`Eagle3Config` is the drafter's own configuration, in drafters/eagle3.)"""

    # Medusa-heads fields with no meaning here: plain fields, so no flags
    num_heads: int = 5
    num_layers: int = 1
    shared_proj: bool = False
    loss_chunk: int = 0
    # the reference trainer's optimiser (SafeAILab/EAGLE traineagle3: AdamW betas (0.9, 0.95),
    # gradients clipped to norm 0.5)
    grad_clip: float = option(0.5, "global gradient-norm clip, 0 = off (default {default}, "
                                   "the reference's)")
    adam_b2: float = option(0.95, "Adam's second-moment decay b2 (default {default}, the "
                                  "reference's)")
    # the reference's loss: the soft cross-entropy against the backbone's distribution
    target: str = option("kl", "what each step learns: kl = the backbone's distribution p "
                               "(the reference's soft cross-entropy); tv = a drawn draft's "
                               "acceptance sum(min(p, q)); tv+kl = both; hard = the "
                               "backbone's greedy token (default {default})", choices=TARGETS)
    # the default job's budget (under 10 minutes on 2 cores, report included): a row costs
    # a drafter layer forward and back per training-time-test step, so 3 steps of 16 rows
    # (twice the rows of 7 steps of 8 for less compute: the better drafter at 4 and at 16
    # verified nodes, docs/benchmarks/2026-12-06-eagle3-recipe.md)
    batch_size: int = option(16, "packed rows per optimizer step (default {default})")
    aux_layers: tuple[int, ...] | None = option(
        None, "the three backbone layers A,B,C (low, mid, high) whose INPUT the drafter "
              "reads, 0 <= A < B < C < L (default: EAGLE's 2,L//2,L-3 from 7 layers, else "
              "1,L//2,L-1: 1,2,4 on the embedded model)",
        type=int_list(0), metavar="A,B,C")
    draft_vocab: int | None = option(
        None, "the drafter's vocabulary: the N most frequent label tokens of the training "
              f"rows (default min(V, {EAGLE_DRAFT_VOCAB}))", metavar="N")
    ttt_steps: int = option(3, "training-time-test steps: the drafter runs on its own "
                               "outputs this many times, step i guessing token t+i+2 "
                               "(default {default}; the reference's 7 for larger budgets)")

    DEFAULT_STEPS: ClassVar[int] = 400
    RUN_PREFIX: ClassVar[str] = "eagle"
    LRS: ClassVar[tuple] = (EAGLE_LR, EAGLE_SELF_DISTILL_LR)
    HELP: ClassVar[dict] = recipe_help(
        RUN_PREFIX, DEFAULT_STEPS, LRS,
        loss_decay="training-time-test step i's loss weighs this**i (default {default})")

    def validate(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)
        need(self.ttt_steps >= 1, f"--ttt-steps must be >= 1, got {self.ttt_steps}")
        need(self.seq_len >= self.ttt_steps + 2,
             f"--seq-len must be > ttt_steps + 1 (got {self.seq_len})")
        need(self.draft_vocab is None or self.draft_vocab >= 1,
             f"--draft-vocab must be >= 1, got {self.draft_vocab}")
        if self.aux_layers is not None:
            a = tuple(self.aux_layers)
            need(len(a) == 3 and a[0] < a[1] < a[2],
                 f"--aux-layers {','.join(map(str, a))}: give three layers A,B,C with "
                 f"0 <= A < B < C (low, mid, high)")
        return super().validate()

    def tree_heads(self) -> int | None:
        return None  # any depth: the drafter runs on its own outputs (as it decodes)

    def check_model(self, model_cfg, what: str = "this backbone") -> None:
        self.drafter_shape(model_cfg, what)

    def drafter_shape(self, model_cfg, what: str = "this backbone"
                      ) -> tuple[tuple[int, int, int], int]:
        """(aux layers, draft vocabulary size) for the backbone `model_cfg` (`what`, as the
        error names it): the flags, or their defaults; a one-line ValueError when they do
        not fit it."""
        n, v = model_cfg.num_layers, model_cfg.vocab_size
        aux = default_aux_layers(n) if self.aux_layers is None else tuple(self.aux_layers)
        if aux[-1] >= n:
            raise ValueError(f"--aux-layers {','.join(map(str, aux))}: layer {aux[-1]} is "
                             f"past the {n} layers of {what} (0 .. {n - 1})")
        vd = min(v, EAGLE_DRAFT_VOCAB) if self.draft_vocab is None else self.draft_vocab
        if vd > v:
            raise ValueError(f"--draft-vocab {vd} is larger than the model's vocabulary of "
                             f"{v} tokens")
        return aux, vd


LM_LOSSES = ("kl", "ce")
HEAD_SCHEDULES = ("constant", "sine")


@dataclasses.dataclass(frozen=True)
class Medusa2Config(TrainConfig):
    """The shared fields (their names, meanings and defaults: equal distillation settings
    let a Medusa-1 run's cached data be reused) plus Medusa-2's own."""

    init: str | None = option(None, "Medusa-1 run dir or heads artifact to start from "
                                    "(default: run stage 1 here)", metavar="PATH")
    stage1_steps: int = option(Medusa1Config.DEFAULT_STEPS,
                               "heads-only steps first, without --init (default {default})")
    stage1_lr: float | None = option(None, "stage 1's learning rate (default: train.medusa1's)")
    lr: float | None = option(1e-3, "the backbone's peak learning rate (default {default})")
    head_lr_ratio: float = option(4.0, "heads' lr = this x the backbone's (default {default})")
    lm_loss: str = option("auto", "kl: KL(original || fine-tuned); ce: next-token "
                                  "cross-entropy (default auto: kl when self-distilling, ce "
                                  "with --data)", choices=("auto", *LM_LOSSES))
    lm_weight: float = option(1.0, "weight of the LM term (default {default})")
    head_schedule: str = option("constant", "lambda of the heads' loss: constant, or sine "
                                            "rising over the run (default {default})",
                                choices=HEAD_SCHEDULES)
    head_weight: float | None = option(None, "lambda (constant) or its peak (sine); default "
                                             "0.2 / 0.01")
    remat: bool = option(False, "rematerialise the backbone's layers in the backward pass "
                                "(jax.checkpoint per layer, nothing saved inside it: only "
                                "each layer's input is kept, each layer runs twice; for 7B+ "
                                "shapes; default: off)")
    medusa2_folder: bool = option(False, "also write <run>/medusa2_model: the fine-tuned "
                                         "backbone and the heads in one folder, the reference's"
                                         " Medusa-2 layout (default: off)")
    eval_text: str | None = option(None, "plain text (documents separated by blank lines) for "
                                         "the perplexity/KL report (default: held-out "
                                         "TinyStories stories)", metavar="FILE")
    anchor_text: str = option(
        "auto", "real text (documents separated by blank lines) trained with the LM term only,"
                " next to the training data: with the KL term it keeps the original's "
                "predictions on text the model did not write (default auto: the shipped "
                "TinyStories training stories when self-distilling the embedded model)",
        metavar="FILE|auto|none")

    DEFAULT_STEPS: ClassVar[int] = 300  # joint steps (their cost and held-out perplexity:
    # docs/benchmarks/2026-11-30-medusa1-medusa2.md)
    RUN_PREFIX: ClassVar[str] = "medusa2"
    HELP: ClassVar[dict] = {
        "steps": f"joint optimizer steps (default {DEFAULT_STEPS} unless --epochs is given)",
        "epochs": "joint passes over the training data (instead of --steps)",
        "num_heads": "heads to train in stage 1 (with --init the artifact decides; "
                     "default {default})",
        "num_layers": "residual blocks per head in stage 1 (default {default})",
        "output_dir": "run directory (default runs/medusa2-<timestamp>)"}
    RESUMABLE: ClassVar[frozenset] = TrainConfig.RESUMABLE | {"eval_text",
                                                                        "medusa2_folder",
                                                                        "remat"}

    def validate(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)
        super().validate()
        need(self.target == "hard", f"--target {self.target}: Medusa-2 trains the backbone "
                                    f"that would be the teacher; soft targets are for the "
                                    f"frozen-backbone recipes (train.medusa1, train.hydra, "
                                    f"train.eagle)")
        need(self.stage1_steps >= 1, "--stage1-steps must be >= 1")
        need(self.stage1_lr is None or self.stage1_lr > 0, "--stage1-lr must be > 0")
        need(self.head_lr_ratio > 0, "--head-lr-ratio must be > 0")
        need(self.lm_loss in ("auto", *LM_LOSSES),
             f"--lm-loss must be one of auto, {', '.join(LM_LOSSES)}")
        need(self.lm_weight >= 0, "--lm-weight must be >= 0")
        need(self.head_schedule in HEAD_SCHEDULES,
             f"--head-schedule must be one of {', '.join(HEAD_SCHEDULES)}")
        need(self.head_weight is None or self.head_weight >= 0, "--head-weight must be >= 0")
        if self.eval_text is not None and not Path(self.eval_text).is_file():
            raise ValueError(f"--eval-text {self.eval_text}: no such file")
        if self.anchor_text not in ("auto", "none") and not Path(self.anchor_text).is_file():
            raise ValueError(f"--anchor-text {self.anchor_text}: no such file")
        if self.init is not None:
            init = resolve_init(self.init)
            if self.shared_proj:  # our artifact: its header says (other layouts: at load)
                from medusa_jax.drafters import formats as heads_formats

                found = heads_formats.detect(init.heads)
                if found.layout == "medusa_jax":
                    from safetensors import safe_open

                    with safe_open(str(found.files[0]), framework="numpy") as f:
                        check_shared(init.heads, tuple(f.get_slice("proj").get_shape()))
        return self

    def tree_heads(self) -> int | None:
        return None if self.init is not None else self.num_heads  # --init: its artifact's

    def stage1_config(self, run_dir: Path) -> Medusa1Config:
        """The first stage as a Medusa-1 run in <run>/stage1 (no decoding benchmark)."""
        return Medusa1Config(**self.shared(output_dir=str(run_dir / "stage1"),
                                           steps=self.stage1_steps, epochs=None,
                                           lr=self.stage1_lr, eval_prompts=0))

    @property
    def resolved_lm_loss(self) -> str:
        if self.lm_loss != "auto":
            return self.lm_loss
        return "ce" if self.data else "kl"

    @property
    def resolved_anchor_text(self) -> Path | None:
        if self.anchor_text == "none":
            return None
        if self.anchor_text == "auto":
            own = assets.is_embedded(self.model) and not self.data and \
                self.resolved_lm_loss == "kl"
            return assets.text_file("train") if own else None
        return Path(self.anchor_text)


@dataclasses.dataclass(frozen=True)
class Init:
    heads: Path  # the heads artifact (file or directory)
    run_dir: Path | None  # the Medusa-1 run it came from, if any


def resolve_init(path: str | Path) -> Init:
    """A Medusa-1 run directory (with heads/) or a heads artifact; ValueError otherwise."""
    from medusa_jax.drafters import formats as heads_formats

    p = Path(path)
    if not p.exists():
        raise ValueError(f"--init {p}: no such file or directory")
    if (p / "heads" / heads_formats.HEADS_FILE).is_file():
        return Init(heads=p / "heads", run_dir=p)
    if (p / "checkpoints").is_dir() and not (p / "heads").exists():
        raise ValueError(f"--init {p}: this Medusa-1 run has no heads/ yet "
                         f"(finish it: python -m train.medusa1 --resume {p})")
    try:  # heads in any layout heads_formats reads (ours, the reference's, vLLM's, ...)
        heads_formats.detect(p)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"--init {p}: neither a Medusa-1 run directory (with heads/) "
                         f"nor heads in a known layout ({e})") from None
    return Init(heads=p, run_dir=None)


def check_shared(heads_path, proj_shape):
    """--shared-proj needs heads with one projection (proj [1, H, V])."""
    if proj_shape[0] != 1:
        raise ValueError(f"--shared-proj: the heads in {heads_path} have their own "
                         f"projections (proj {list(proj_shape)}); train heads with "
                         f"train.medusa1 --shared-proj, or drop --shared-proj")


def check_batch(cfg: TrainConfig, mesh):
    """Every micro-batch (--batch-size / --grad-accum rows) splits over the mesh's batch
    shards."""
    from medusa_jax.runtime import sharding

    micro = cfg.batch_size // cfg.grad_accum
    if micro % sharding.batch_ways(mesh):
        raise ValueError(f"--batch-size {cfg.batch_size} / --grad-accum {cfg.grad_accum} = "
                         f"{micro} rows per micro-batch is not divisible by the "
                         f"{sharding.batch_ways(mesh)} batch shards of mesh "
                         f"data={mesh.shape['data']},fsdp={mesh.shape['fsdp']}")
