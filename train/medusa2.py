"""Medusa-2 training: backbone and heads fine-tuned jointly, the original outputs kept.

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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

import jax
from tqdm import tqdm

from medusa_jax import data, medusa2, sharding
from medusa_jax import heads as heads_lib
from medusa_jax import train_step as ts
from medusa_jax import weights
from medusa_jax.checkpoint import CheckpointError, Checkpointer
from medusa_jax.data import DataError
from medusa_jax.tree import Tree
from train import distill, make_openings
from train import medusa1 as m1

CPU_TREE = "stories260K_cpu"  # the tree `python -m infer.tree` searched for the embedded model
DEFAULT_STEPS = 300  # joint steps (~6 min here; with lr 1e-3 and the anchor text, held-out
# perplexity +2.5%: see README)
STAGE1_STEPS = m1.DEFAULT_STEPS  # heads-only steps first, without --init: Medusa-1's default
# whole TinyStories stories, split like the openings (train.make_openings; see SOURCE.md)
TEXT_DIR = make_openings.DEFAULT_TEXT_OUT
DEFAULT_EVAL_TEXT = TEXT_DIR / "tinystories_heldout.txt"  # evaluation only
DEFAULT_ANCHOR_TEXT = TEXT_DIR / "tinystories_train.txt"


M1 = m1.TrainConfig()  # shared fields default to Medusa-1's: its distilled data is reused


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; saved as <run>/config.json and reused by --resume. Fields
    shared with train.medusa1 have its names, meanings and defaults (its data code reads
    them, and equal distillation settings let a Medusa-1 run's cached data be reused)."""

    model: str | None = None  # HF model dir; None = embedded stories260K
    init: str | None = None  # Medusa-1 run dir or heads artifact; None = stage 1 here
    data: tuple[str, ...] = ()  # empty = self-distill from the TinyStories openings
    data_format: str = M1.data_format
    template: str = M1.template
    output_dir: str | None = None  # default runs/medusa2-<timestamp>
    num_heads: int = M1.num_heads  # stage 1 only: with --init the artifact decides
    num_layers: int = M1.num_layers
    stage1_steps: int = STAGE1_STEPS  # heads-only steps when there is no --init
    stage1_lr: float | None = None  # None: train.medusa1's default
    steps: int | None = None  # joint steps; default DEFAULT_STEPS unless epochs is given
    epochs: float | None = None
    batch_size: int = M1.batch_size
    seq_len: int = M1.seq_len
    lr: float = 1e-3  # the backbone's peak learning rate
    head_lr_ratio: float = 4.0
    warmup_ratio: float = M1.warmup_ratio
    weight_decay: float = M1.weight_decay
    grad_clip: float = M1.grad_clip
    lm_loss: str = "auto"  # auto: kl when self-distilling, ce with --data
    lm_weight: float = 1.0
    head_schedule: str = "constant"
    head_weight: float | None = None  # None: 0.2 (constant) / 0.01 (sine peak)
    loss_decay: float = M1.loss_decay
    seed: int = M1.seed
    mesh: str = M1.mesh
    keep: int = M1.keep
    save_every: int = M1.save_every
    log_every: int = M1.log_every
    eval_every: int = M1.eval_every
    heldout_fraction: float = M1.heldout_fraction
    distill_samples: int = M1.distill_samples
    distill_temperature: float = M1.distill_temperature
    distill_max_new_tokens: int = M1.distill_max_new_tokens
    distill_batch_size: int = M1.distill_batch_size
    eval_prompts: int = M1.eval_prompts
    eval_max_new_tokens: int = M1.eval_max_new_tokens
    eval_text: str | None = None  # plain text for perplexity/KL; None: held-out TinyStories
    # real text trained with the LM term only: "auto" = the TinyStories training stories when
    # self-distilling the embedded model, "none", or a plain-text file
    anchor_text: str = "auto"
    tree: str = M1.tree

    def validate(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)
        # the view below puts stage 1's steps/lr in medusa1's fields: check ours first
        need(self.steps is None or self.steps >= 1, "--steps must be >= 1")
        need(self.epochs is None or self.epochs > 0, "--epochs must be > 0")
        need(self.steps is None or self.epochs is None, "give --steps or --epochs, not both")
        need(self.lr > 0, "--lr must be > 0")
        need(self.stage1_steps >= 1, "--stage1-steps must be >= 1")
        need(self.stage1_lr is None or self.stage1_lr > 0, "--stage1-lr must be > 0")
        self.medusa1_view().validate()  # the shared fields, checked by train.medusa1
        need(self.head_lr_ratio > 0, "--head-lr-ratio must be > 0")
        need(self.lm_loss in ("auto", *medusa2.LM_LOSSES),
             f"--lm-loss must be one of auto, {', '.join(medusa2.LM_LOSSES)}")
        need(self.lm_weight >= 0, "--lm-weight must be >= 0")
        need(self.head_schedule in medusa2.HEAD_SCHEDULES,
             f"--head-schedule must be one of {', '.join(medusa2.HEAD_SCHEDULES)}")
        need(self.head_weight is None or self.head_weight >= 0, "--head-weight must be >= 0")
        if self.eval_text is not None and not Path(self.eval_text).is_file():
            raise ValueError(f"--eval-text {self.eval_text}: no such file")
        if self.anchor_text not in ("auto", "none") and not Path(self.anchor_text).is_file():
            raise ValueError(f"--anchor-text {self.anchor_text}: no such file")
        if self.init is not None:
            resolve_init(self.init)
        return self

    def medusa1_view(self, **changes) -> m1.TrainConfig:
        """The fields train.medusa1 knows, as its config (for its data code and stage 1)."""
        names = {f.name for f in dataclasses.fields(m1.TrainConfig)}
        base = {k: v for k, v in dataclasses.asdict(self).items() if k in names}
        base.update(lr=self.stage1_lr, steps=self.stage1_steps, epochs=None)
        base.update(changes)
        return m1.TrainConfig(**base)

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
            own = self.model is None and not self.data and self.resolved_lm_loss == "kl"
            return DEFAULT_ANCHOR_TEXT if own else None
        return Path(self.anchor_text)


RESUMABLE = {"steps", "epochs", "keep", "save_every", "log_every", "eval_every", "mesh",
             "eval_prompts", "eval_max_new_tokens", "tree", "eval_text"}


SPECIAL_HELP = {
    "steps": f"joint optimizer steps (default {DEFAULT_STEPS} unless --epochs is given)",
    "epochs": "joint passes over the training data (instead of --steps)",
    "lr": f"the backbone's peak learning rate (default {TrainConfig.lr})",
    "head_lr_ratio": f"heads' lr = this x the backbone's (default {TrainConfig.head_lr_ratio})",
    "stage1_steps": f"heads-only steps first, without --init (default {STAGE1_STEPS})",
    "stage1_lr": "stage 1's learning rate (default: train.medusa1's)",
    "lm_weight": "weight of the LM term (default 1)",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m train.medusa2",
                                 description=__doc__.split("\n")[0])
    d = TrainConfig()
    add = lambda flag, **kw: ap.add_argument(flag, default=None, **kw)  # noqa: E731
    add("--model", metavar="DIR", help="Hugging Face model dir (default: embedded stories260K)")
    add("--init", metavar="PATH",
        help="Medusa-1 run dir or heads artifact to start from (default: run stage 1 here)")
    ap.add_argument("--data", action="append", metavar="FILE",
                    help="training data (repeatable); default: self-distilled TinyStories")
    add("--data-format", choices=data.FORMATS, help=f"default {d.data_format}")
    add("--template", choices=data.TEMPLATES, help=f"default {d.template}")
    add("--output-dir", metavar="DIR", help="run directory (default runs/medusa2-<timestamp>)")
    add("--lm-loss", choices=("auto", *medusa2.LM_LOSSES),
        help="kl: KL(original || fine-tuned); ce: next-token cross-entropy "
             "(default auto: kl when self-distilling, ce with --data)")
    add("--head-schedule", choices=medusa2.HEAD_SCHEDULES,
        help="lambda of the heads' loss: constant, or sine rising over the run "
             f"(default {d.head_schedule})")
    add("--head-weight", type=float, metavar="FLOAT",
        help="lambda (constant) or its peak (sine); default 0.2 / 0.01")
    for name, typ in (("num_heads", int), ("num_layers", int), ("stage1_steps", int),
                      ("stage1_lr", float), ("steps", int), ("epochs", float),
                      ("batch_size", int), ("seq_len", int), ("lr", float),
                      ("head_lr_ratio", float), ("warmup_ratio", float),
                      ("weight_decay", float), ("grad_clip", float), ("lm_weight", float),
                      ("loss_decay", float), ("seed", int), ("keep", int), ("save_every", int),
                      ("log_every", int), ("eval_every", int), ("heldout_fraction", float),
                      ("distill_samples", int), ("distill_temperature", float),
                      ("distill_max_new_tokens", int), ("distill_batch_size", int),
                      ("eval_prompts", int), ("eval_max_new_tokens", int)):
        default = getattr(d, name)
        add("--" + name.replace("_", "-"), type=typ, metavar=typ.__name__.upper(),
            help=SPECIAL_HELP.get(name, f"default {default}"))
    add("--mesh", help=f"device mesh, e.g. 'data=1,fsdp=8' or '2,4' (default {d.mesh})")
    add("--tree", help=f"Medusa tree for the benchmark (default {d.tree})")
    add("--anchor-text", metavar="FILE|auto|none",
        help="real text (documents separated by blank lines) trained with the LM term only, "
             "next to the training data: with the KL term it keeps the original's "
             "predictions on text the model did not write (default auto: the shipped "
             "TinyStories training stories when self-distilling the embedded model)")
    add("--eval-text", metavar="FILE",
        help="plain text (documents separated by blank lines) for the perplexity/KL report "
             "(default: held-out TinyStories stories)")
    add("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    add("--stop-after", type=int, metavar="N",
        help="stop after N joint steps in this invocation (as if preempted; resume later)")
    return ap


def parse_args(argv=None) -> tuple[TrainConfig, str | None, int | None]:
    ap = build_parser()
    given, resume, stop_after = m1.split_args(ap, argv)
    cfg = (m1.merge_resumed(ap, TrainConfig, given, resume, RESUMABLE) if resume is not None
           else TrainConfig(**given))
    try:
        cfg.validate()
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    return cfg, resume, stop_after


# ----------------------------------------------------------------------------- stage 1


@dataclasses.dataclass(frozen=True)
class Init:
    heads: Path  # the heads artifact (file or directory)
    run_dir: Path | None  # the Medusa-1 run it came from, if any


def resolve_init(path: str | Path) -> Init:
    """A Medusa-1 run directory (with heads/) or a heads artifact; ValueError otherwise."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--init {p}: no such file or directory")
    if (p / "heads" / heads_lib.HEADS_FILE).is_file():
        return Init(heads=p / "heads", run_dir=p)
    if (p / heads_lib.HEADS_FILE).is_file() or (p.is_file() and p.suffix == ".safetensors"):
        return Init(heads=p, run_dir=None)
    if (p / "checkpoints").is_dir():
        raise ValueError(f"--init {p}: this Medusa-1 run has no heads/ yet "
                         f"(finish it: python -m train.medusa1 --resume {p})")
    raise ValueError(f"--init {p}: neither a Medusa-1 run directory (with heads/) "
                     f"nor a heads artifact ({heads_lib.HEADS_FILE})")


def stage1(cfg: TrainConfig, run_dir: Path) -> Init:
    """Heads first: a train.medusa1 run in <run>/stage1 (resumed if it was interrupted)."""
    stage_dir = run_dir / "stage1"
    if (stage_dir / "heads" / heads_lib.HEADS_FILE).is_file():
        print(f"stage 1 (heads only) already done: {stage_dir}", flush=True)
        return Init(heads=stage_dir / "heads", run_dir=stage_dir)
    ckpts = stage_dir / "checkpoints"
    resume = str(stage_dir) if ckpts.is_dir() and any(ckpts.iterdir()) else None
    print(f"stage 1: heads only, {cfg.stage1_steps} steps (train.medusa1 in {stage_dir})",
          flush=True)
    m1.run(cfg.medusa1_view(output_dir=str(stage_dir), eval_prompts=0), resume)
    print("stage 2: backbone and heads jointly", flush=True)
    return Init(heads=stage_dir / "heads", run_dir=stage_dir)


def reuse_distilled(init: Init, run_dir: Path):
    """Copy the first stage's self-distilled data (and its settings sidecar) into this run:
    `distill.distill_cached` then reuses it when the settings match, and regenerates in this
    run's directory (never the other run's) when they do not."""
    if init.run_dir is None or init.run_dir.resolve() == run_dir.resolve():
        return
    src, dst = init.run_dir / "distill", run_dir / "distill"
    if not src.is_dir():
        return
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name.endswith((".jsonl", ".jsonl.meta.json")) and \
                not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)


def check_init_model(cfg: TrainConfig, init: Init):
    """A Medusa-1 run trained on another backbone is refused (its heads would not match)."""
    if init.run_dir is None or not (init.run_dir / "config.json").is_file():
        return
    try:
        theirs = json.loads((init.run_dir / "config.json").read_text()).get("model")
    except json.JSONDecodeError:
        return
    where = lambda m: None if m is None else Path(m).resolve()  # noqa: E731
    if where(theirs) != where(cfg.model):
        raise ValueError(f"--init {init.run_dir}: trained on model {theirs or 'stories260K'}, "
                         f"this run uses {cfg.model or 'stories260K'}")


# ----------------------------------------------------------------------------- eval text


def eval_text_rows(cfg: TrainConfig, tokenizer, seq_len: int) -> tuple[data.Packed | None, str]:
    """(packed rows, description) of the perplexity text; (None, why) when there is none.
    Documents longer than `seq_len` tokens are cut there (and counted)."""
    if cfg.eval_text is not None:
        convs = data.read_file(cfg.eval_text, "text")
        what = f"{cfg.eval_text} ({len(convs)} documents)"
    elif cfg.model is None:
        convs = data.read_file(DEFAULT_EVAL_TEXT, "text")
        what = f"{len(convs)} held-out TinyStories stories, {DEFAULT_EVAL_TEXT.name}"
    else:
        return None, "no --eval-text given for this model"
    report = data.LoadReport()
    rows = data.build(convs, tokenizer, seq_len=seq_len, template="plain", seed=cfg.seed,
                      report=report, what="evaluation text")
    if report.truncated:
        what += f"; {report.truncated} cut to {seq_len} tokens"
    return rows, what


def print_lm_report(title: str, r: dict):
    print(f"  {title}: {r['tokens']} tokens, perplexity {r['ppl_original']:.4f} (original) -> "
          f"{r['ppl_finetuned']:.4f} (fine-tuned), {100 * r['ppl_change']:+.2f}%; "
          f"mean KL(original || fine-tuned) {r['kl_mean']:.5f} nats/token")


# ----------------------------------------------------------------------------- run


def run(cfg: TrainConfig, resume: str | None = None, stop_after: int | None = None) -> dict:
    from transformers import AutoTokenizer

    t_start = time.perf_counter()
    run_dir = Path(cfg.output_dir or f"runs/medusa2-{time.strftime('%Y%m%d-%H%M%S')}")
    if resume is None:
        for d in (run_dir / "checkpoints", run_dir / "stage1" / "checkpoints"):
            if d.is_dir() and any(d.iterdir()):
                raise CheckpointError(f"{run_dir} already holds checkpoints; "
                                      f"use --resume {run_dir}")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, output_dir=str(run_dir))
    print(f"run directory: {run_dir}", flush=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))

    mesh = sharding.make_mesh(cfg.mesh)
    sharding.check_batch_size(cfg.batch_size, mesh)
    mcfg, backbone = weights.load_pretrained(cfg.model)
    model_dir = cfg.model or str(weights.default_model_dir())
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise DataError(f"{model_dir}: cannot load the tokenizer ({str(e).splitlines()[0]})") \
            from None
    m1view = cfg.medusa1_view()
    template = m1.resolve_template(m1view, tokenizer)
    stops = distill.stop_tokens(mcfg, tokenizer)

    init = resolve_init(cfg.init) if cfg.init is not None else stage1(cfg, run_dir)
    check_init_model(cfg, init)
    heads, _ = heads_lib.load_heads(init.heads, mcfg)
    num_heads = heads_lib.heads_config_of(heads).num_heads
    trees = [Tree.load(cfg.tree, num_heads=num_heads)]
    if cfg.model is None and cfg.tree != CPU_TREE:
        try:  # as train.medusa1: the embedded model also gets the tree searched for CPUs
            trees.append(Tree.load(CPU_TREE, num_heads=num_heads))
        except ValueError:  # deeper than these heads
            pass
    reuse_distilled(init, run_dir)
    train_rows, held_rows, bench_prompts, report = m1.prepare_data(
        m1view, backbone, mcfg, tokenizer, run_dir, template)
    print(f"data ({template} template): {report.summary()}", flush=True)
    anchor = cfg.resolved_anchor_text
    if anchor is not None:
        a_report = data.LoadReport()
        docs = data.split_documents(data.read_file(anchor, "text", a_report), tokenizer,
                                     cfg.seq_len)
        a_rows = data.build(docs, tokenizer,
                            seq_len=cfg.seq_len, template="plain", seed=cfg.seed,
                            report=a_report, what=f"--anchor-text {anchor}")
        print(f"anchor text (LM term only) {anchor}: {a_report.summary()}", flush=True)
        train_rows = data.concat([train_rows, a_rows], lm_only=[False, True])
    total = cfg.steps or (math.ceil(cfg.epochs * len(train_rows) / cfg.batch_size)
                          if cfg.epochs else DEFAULT_STEPS)

    lm_loss = cfg.resolved_lm_loss
    loss_cfg = medusa2.LossConfig(lm_loss=lm_loss, lm_weight=cfg.lm_weight,
                                  head_schedule=cfg.head_schedule, head_weight=cfg.head_weight,
                                  head_ramp_steps=total, decay=cfg.loss_decay)
    params = medusa2.make_params(backbone, heads, lm_loss)
    labels = medusa2.labels(params)
    trained = tuple(k for k, v in labels.items() if v != "frozen")
    tx, schedule = medusa2.make_optimizer2(
        ts.OptimConfig(lr=cfg.lr, warmup_ratio=cfg.warmup_ratio, weight_decay=cfg.weight_decay,
                       grad_clip=cfg.grad_clip), total, labels, cfg.head_lr_ratio)
    state, shardings = ts.create_state(params, tx, mesh)
    del params, backbone  # the state owns them now (the train step donates its buffers)
    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=cfg.keep)
    position = 0
    metrics_file = run_dir / "metrics.jsonl"
    if resume is not None and ckpt.latest_step() is not None:
        state, meta = ckpt.restore(state, shardings, trained)
        position = meta["data_position"]
        if metrics_file.is_file():  # steps after the checkpoint are trained again
            keep = [ln for ln in metrics_file.read_text().splitlines()
                    if json.loads(ln)["step"] <= meta["step"]]
            metrics_file.write_text("".join(ln + "\n" for ln in keep))
        print(f"resumed at step {meta['step']} (data position {position})", flush=True)
    elif metrics_file.exists():
        metrics_file.unlink()

    print(f"joint training: {total} steps, LM term {lm_loss}, heads weight "
          f"{cfg.head_schedule} {loss_cfg.peak_head_weight}, lr {cfg.lr:g} (backbone) / "
          f"{cfg.lr * cfg.head_lr_ratio:g} (heads)", flush=True)
    loss_fn = medusa2.make_loss_fn(mcfg, loss_cfg)
    train_step = ts.make_train_step(loss_fn, tx, labels, shardings, mesh, schedule)
    eval_step = ts.make_eval_step(loss_fn, shardings, mesh)
    held_batches = data.eval_batches(held_rows, cfg.batch_size) if held_rows else []
    batches = data.BatchIterator(train_rows, cfg.batch_size, seed=cfg.seed, position=position)
    step = int(state.step)
    end = total if stop_after is None else min(total, step + stop_after)
    put = lambda b: sharding.shard_batch(b, mesh)  # noqa: E731

    def log(rec):
        with open(metrics_file, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def held_eval(step):
        if not held_batches:
            return None
        m = m1.evaluate(eval_step, state.params, held_batches, mesh)
        log({"step": step, "split": "heldout", "top1": m["top1"].tolist(),
             "top5": m["top5"].tolist(), "head_loss": m["head_loss"].tolist()})
        return m

    bar = tqdm(total=total, initial=step, desc="joint", unit="step", file=sys.stdout,
               dynamic_ncols=True)
    t_train, tokens_seen, t_last = time.perf_counter(), 0, time.perf_counter()
    while step < end:
        batch = medusa2.with_step(next(batches), step)
        tokens_seen += int((batch["segments"] > 0).sum())
        state, m = train_step(state, put(batch))
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == end:
            m = jax.device_get(m)
            now = time.perf_counter()
            tok_s = tokens_seen / (now - t_last)
            tokens_seen, t_last = 0, now
            rec = {"step": step, "split": "train", "epoch": round(batches.epoch(), 4),
                   "loss": float(m["loss"]), "lm_loss": float(m["lm_loss"]),
                   "lm_nll": float(m["lm_nll"]), "heads_loss": float(m["heads_loss"]),
                   "head_weight": float(m["head_weight"]), "top1": m["top1"].tolist(),
                   "top5": m["top5"].tolist(), "lr": float(m["lr"]),
                   "lr_heads": float(m["lr"]) * cfg.head_lr_ratio,
                   "grad_norm": float(m["grad_norm"]), "tokens_per_s": round(tok_s, 1)}
            if "kl" in m:
                rec["kl"] = float(m["kl"])
            log(rec)
            lm = f"kl={float(m['kl']):.4f}" if "kl" in m else f"nll={float(m['lm_nll']):.3f}"
            bar.set_postfix_str(f"{lm} heads={float(m['heads_loss']):.3f} "
                                f"top1={m1.fmt_heads(m['top1'])} tok/s={tok_s:.0f}")
        if step % cfg.eval_every == 0 and step != end:
            held_eval(step)
        if step % cfg.save_every == 0 or step == end:
            ckpt.save(state, trained, batches.position, dataclasses.asdict(cfg), force=True)
    bar.close()
    train_s = time.perf_counter() - t_train
    ckpt.wait()
    summary = {"run_dir": str(run_dir), "init": str(init.heads), "step": step,
               "total_steps": total, "train_seconds": round(train_s, 1),
               "checkpoints": ckpt.all_steps()}
    ckpt.close()
    if step < total:
        print(f"stopped at step {step} of {total}; continue with --resume {run_dir}")
        return summary

    final = held_eval(step)
    finetuned = jax.device_get(state.params["backbone"])
    heads = jax.device_get(state.params["heads"])
    extra = {"step": step, "template": template, "stage": "medusa2",
             "backbone": str(run_dir / "model"), "init": str(init.heads),
             "config": dataclasses.asdict(cfg)}
    if final is not None:
        extra["heldout_top1"] = final["top1"].tolist()
        extra["heldout_top5"] = final["top5"].tolist()
        summary.update(heldout_top1=final["top1"].tolist(), heldout_top5=final["top5"].tolist())
        print("\nheld-out accuracy (%d label positions for head 1)" % int(final["count"][0]))
        print(f"  {'head':>4} {'predicts':>8} {'top-1':>7} {'top-5':>7}")
        for k in range(num_heads):
            print(f"  {k + 1:>4} {f't+{k + 2}':>8} {final['top1'][k]:>7.3f} "
                  f"{final['top5'][k]:>7.3f}")
    model_out = weights.save_pretrained(mcfg, finetuned, run_dir / "model", source_dir=model_dir)
    print(f"fine-tuned backbone (Hugging Face layout): {model_out}")
    artifact = heads_lib.save_heads(run_dir / "heads", heads, mcfg, extra)
    print(f"heads artifact: {artifact} (for the backbone in {model_out})")
    m1.plot_accuracy(metrics_file, run_dir / "accuracy.png", num_heads)
    print(f"accuracy plot: {run_dir / 'accuracy.png'}")

    # how far the fine-tuned model moved from the original
    original = state.params["teacher"] if "teacher" in state.params else \
        weights.load_pretrained(cfg.model)[1]
    print("\noriginal vs fine-tuned model (next-token perplexity, KL):")
    # whole stories where the context allows (training rows may be shorter)
    text_rows, what = eval_text_rows(
        cfg, tokenizer, max(cfg.seq_len, min(mcfg.max_position_embeddings, 1024)))
    closeness = {}
    if text_rows is not None:
        closeness["eval_text"] = dict(medusa2.lm_report(
            mcfg, original, state.params["backbone"], text_rows, cfg.batch_size, put),
            source=what)
        print_lm_report(f"held-out text [{what}]", closeness["eval_text"])
    else:
        print(f"  held-out text: skipped ({what})")
    if held_rows is not None:
        closeness["heldout"] = medusa2.lm_report(
            mcfg, original, state.params["backbone"], held_rows, cfg.batch_size, put)
        print_lm_report("held-out set (label tokens)", closeness["heldout"])
    summary["closeness"] = closeness

    if cfg.eval_prompts and not bench_prompts:
        print("no held-out conversations to benchmark decoding on (plain-text data)")
    if cfg.eval_prompts and bench_prompts:
        prompts = bench_prompts[:cfg.eval_prompts]
        summary["benchmarks"] = []
        for tree in trees:
            b = m1.benchmark(jax.device_put(finetuned), jax.device_put(heads), mcfg, prompts,
                             tree, cfg.eval_max_new_tokens, stops)
            summary["benchmarks"].append(b)
            m1.print_benchmark(b, tree, "greedy decoding with the fine-tuned model")
        summary["benchmark"] = summary["benchmarks"][0]
        (run_dir / "benchmark.json").write_text(json.dumps(summary["benchmarks"], indent=2))
    summary["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\ndone in {summary['wall_seconds']:.0f}s; run directory: {run_dir}")
    print(f"compare: python -m infer.bench --model {model_out} --heads {run_dir / 'heads'} "
          f"--trees {','.join(t.name for t in trees)}")
    return summary


def main(argv=None):
    cfg, resume, stop_after = parse_args(argv)
    try:
        run(cfg, resume, stop_after)
    except (DataError, CheckpointError, weights.WeightsError, FileNotFoundError,
            ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
