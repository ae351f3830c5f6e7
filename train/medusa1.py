"""Medusa-1 training: frozen backbone, K heads trained on its last hidden state.

    python -m train.medusa1                      # the default TinyStories job (see below)
    python -m train.medusa1 --data chats.jsonl --model DIR --steps 2000 --mesh data=1,fsdp=8
    python -m train.medusa1 --resume runs/medusa1-20250101-120000

With no --data the job self-distills: the backbone continues the TinyStories openings in
medusa_jax/assets/prompts/train_openings.txt (cached as <run>/distill/train.jsonl), and
greedy continuations of the held-out openings are the held-out set. With --data, a small
seeded fraction of the records is held out instead.

The run directory gets config.json, metrics.jsonl, checkpoints/ (Orbax, last --keep steps),
heads/ (the artifact `heads.load_heads` reads), accuracy.png and a final report: held-out
per-head accuracy, then Medusa greedy decoding against plain greedy decoding on held-out
prompts (batch 1, compile time excluded): tokens per step and wall-clock speedup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from importlib import resources
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from medusa_jax import data, decode, sharding
from medusa_jax import heads as heads_lib
from medusa_jax import train_step as ts
from medusa_jax import weights
from medusa_jax.acceptance import Sampling
from medusa_jax.checkpoint import CheckpointError, Checkpointer
from medusa_jax.data import DataError
from medusa_jax.tree import Tree
from train import distill

DEFAULT_STEPS = 600
# The self-distilled stories260K job trains only a few hundred steps to fit its time budget;
# at the Medusa paper's lr of 1e-3 the heads are still far from converged there, so that job
# defaults to a larger lr (tuned: 1e-3 -> 2.55, 1e-2 -> 3.15, 3e-2 -> 3.26 tokens/step at
# 400 steps). Runs on user data keep the paper's 1e-3.
DEFAULT_LR, SELF_DISTILL_LR = 1e-3, 3e-2


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; saved as <run>/config.json and reused by --resume."""

    model: str | None = None  # HF model dir; None = embedded stories260K
    data: tuple[str, ...] = ()  # empty = self-distill from the TinyStories openings
    data_format: str = "auto"
    template: str = "auto"  # auto: chat template if any; else plain (self-distill) / vicuna
    output_dir: str | None = None  # default runs/medusa1-<timestamp>
    num_heads: int = 5
    num_layers: int = 1
    steps: int | None = None  # default DEFAULT_STEPS unless epochs is given
    epochs: float | None = None
    batch_size: int = 16
    seq_len: int = 256
    lr: float | None = None  # None: DEFAULT_LR, or SELF_DISTILL_LR without --data
    warmup_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss_decay: float = 0.8
    seed: int = 0
    mesh: str = "1,1"
    keep: int = 3  # checkpoints kept
    save_every: int = 250
    log_every: int = 10
    eval_every: int = 150
    heldout_fraction: float = 0.02  # with --data: records held out for evaluation
    distill_samples: int = 640
    # low temperature: the heads are judged on greedy decoding, so near-greedy data helps
    # (0.1 beat 0.3 and pure greedy, which has only one answer per opening)
    distill_temperature: float = 0.1
    # with a ~20-token opening this nearly fills seq_len 256 (long openings lose a few tail
    # tokens to truncation, which the data summary counts)
    distill_max_new_tokens: int = 240
    distill_batch_size: int = 64
    eval_prompts: int = 64  # held-out prompts for the decoding benchmark (0 = skip)
    eval_max_new_tokens: int = 128
    tree: str = "mc_sim_7b_63"

    def resolve(self) -> "TrainConfig":
        """Fill the defaults that depend on the kind of run (saved resolved in config.json)."""
        if self.lr is None:
            return dataclasses.replace(self, lr=DEFAULT_LR if self.data else SELF_DISTILL_LR)
        return self

    def validate(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)
        need(self.data_format in data.FORMATS, f"--data-format must be one of {data.FORMATS}")
        need(self.template in data.TEMPLATES, f"--template must be one of {data.TEMPLATES}")
        for name in ("num_heads", "num_layers", "batch_size", "keep", "save_every",
                     "log_every", "eval_every", "distill_samples", "distill_max_new_tokens",
                     "distill_batch_size", "eval_max_new_tokens"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1")
        need(self.seq_len >= 2 + self.num_heads,
             f"--seq-len must be > num_heads + 1 (got {self.seq_len})")
        need(self.steps is None or self.steps >= 1, "--steps must be >= 1")
        need(self.epochs is None or self.epochs > 0, "--epochs must be > 0")
        need(self.steps is None or self.epochs is None, "give --steps or --epochs, not both")
        need(self.lr is None or self.lr > 0, "--lr must be > 0")
        need(0 <= self.warmup_ratio < 1, "--warmup-ratio must be in [0, 1)")
        need(0 < self.loss_decay <= 1, "--loss-decay must be in (0, 1]")
        need(self.distill_temperature >= 0, "--distill-temperature must be >= 0")
        need(self.eval_prompts >= 0, "--eval-prompts must be >= 0")
        need(0 <= self.heldout_fraction < 1, "--heldout-fraction must be in [0, 1)")
        sharding.parse_mesh_spec(self.mesh)
        return self


# flags that may change on --resume (everything else must match the saved run)
RESUMABLE = {"steps", "epochs", "keep", "save_every", "log_every", "eval_every", "mesh",
             "eval_prompts", "eval_max_new_tokens", "tree"}


SPECIAL_HELP = {
    "steps": f"optimizer steps (default {DEFAULT_STEPS} unless --epochs is given)",
    "epochs": "passes over the training data (instead of --steps)",
    "lr": f"peak learning rate (default {DEFAULT_LR}; {SELF_DISTILL_LR} without --data)",
    "distill_samples": f"self-distilled answers when no --data (default {TrainConfig.distill_samples})",
    "eval_prompts": "held-out prompts for the decoding benchmark, 0 = skip "
                    f"(default {TrainConfig.eval_prompts})",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m train.medusa1", description=__doc__.split("\n")[0])
    d = TrainConfig()
    # defaults are None: a flag counts as "given" only when it is on the command line
    add = lambda flag, **kw: ap.add_argument(flag, default=None, **kw)  # noqa: E731
    add("--model", metavar="DIR", help="Hugging Face model dir (default: embedded stories260K)")
    ap.add_argument("--data", action="append", metavar="FILE",
                    help="training data (repeatable); default: self-distilled TinyStories")
    add("--data-format", choices=data.FORMATS, help=f"default {d.data_format}")
    add("--template", choices=data.TEMPLATES, help=f"default {d.template}")
    add("--output-dir", metavar="DIR", help="run directory (default runs/medusa1-<timestamp>)")
    for name, typ in (("num_heads", int), ("num_layers", int), ("steps", int),
                      ("epochs", float), ("batch_size", int), ("seq_len", int), ("lr", float),
                      ("warmup_ratio", float), ("weight_decay", float), ("grad_clip", float),
                      ("loss_decay", float), ("seed", int), ("keep", int), ("save_every", int),
                      ("log_every", int), ("eval_every", int), ("heldout_fraction", float),
                      ("distill_samples", int), ("distill_temperature", float),
                      ("distill_max_new_tokens", int), ("distill_batch_size", int),
                      ("eval_prompts", int), ("eval_max_new_tokens", int)):
        add("--" + name.replace("_", "-"), type=typ, metavar=typ.__name__.upper(),
            help=SPECIAL_HELP.get(name, f"default {getattr(d, name)}"))
    add("--mesh", help=f"device mesh, e.g. 'data=1,fsdp=1' or '2,4' (default {d.mesh})")
    add("--tree", help=f"Medusa tree for the benchmark (default {d.tree})")
    add("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    add("--stop-after", type=int, metavar="N",
        help="stop after N steps in this invocation (as if preempted; resume later)")
    return ap


def merge_resumed(ap: argparse.ArgumentParser, config_cls, given: dict, resume: str,
                  resumable: set[str]):
    """The config of `--resume RUN_DIR`: its saved config.json with the flags `given` on the
    command line applied; only `resumable` fields may change (ap.error otherwise)."""
    run_dir = Path(resume)
    saved = run_dir / "config.json"
    if not saved.is_file():
        ap.error(f"--resume {resume}: no config.json there (not a run directory)")
    try:
        base = config_cls(**{k: tuple(v) if k == "data" else v
                             for k, v in json.loads(saved.read_text()).items()})
    except (json.JSONDecodeError, TypeError) as e:
        ap.error(f"--resume {resume}: unreadable config.json ({e})")
    changed = sorted(k for k, v in given.items()
                     if k not in resumable and k != "output_dir" and v != getattr(base, k))
    if changed:
        ap.error(f"cannot change {', '.join('--' + c.replace('_', '-') for c in changed)} "
                 f"when resuming (only {', '.join(sorted(resumable))})")
    given = dict(given)
    if "steps" in given:
        given["epochs"] = None
    if "epochs" in given:
        given["steps"] = None
    given["output_dir"] = str(run_dir)
    return dataclasses.replace(base, **given)


def split_args(ap: argparse.ArgumentParser, argv) -> tuple[dict, str | None, int | None]:
    """(the flags given, --resume, --stop-after) from the command line."""
    args = vars(ap.parse_args(argv))
    resume, stop_after = args.pop("resume"), args.pop("stop_after")
    given = {k: v for k, v in args.items() if v is not None}
    if "data" in given:
        given["data"] = tuple(given["data"])
    if stop_after is not None and stop_after < 1:
        ap.error("--stop-after must be >= 1")
    return given, resume, stop_after


def parse_args(argv=None) -> tuple[TrainConfig, str | None, int | None]:
    ap = build_parser()
    given, resume, stop_after = split_args(ap, argv)
    cfg = (merge_resumed(ap, TrainConfig, given, resume, RESUMABLE) if resume is not None
           else TrainConfig(**given))
    try:
        cfg = cfg.validate().resolve()
    except ValueError as e:
        ap.error(str(e))
    return cfg, resume, stop_after


# ----------------------------------------------------------------------------- data


def prompts_dir() -> Path:
    return Path(str(resources.files("medusa_jax") / "assets" / "prompts"))


def resolve_template(cfg: TrainConfig, tokenizer) -> str:
    if cfg.template == "auto" and not cfg.data and not getattr(tokenizer, "chat_template", None):
        return "plain"  # self-distilling story openings with a base model
    return data.resolve_template(cfg.template, tokenizer)


def prepare_data(cfg: TrainConfig, params, mcfg, tokenizer, run_dir: Path, template: str):
    """-> (train rows, held-out rows or None, benchmark prompts as token lists, report)."""
    report = data.LoadReport()
    if cfg.data:
        convs = data.read_files(cfg.data, cfg.data_format, report)
        order = np.random.default_rng(cfg.seed).permutation(len(convs))
        n_held = int(len(convs) * cfg.heldout_fraction) if len(convs) > 1 else 0
        if cfg.heldout_fraction > 0 and len(convs) > 1:
            n_held = max(1, n_held)
        held = [convs[i] for i in order[:n_held]]
        train = [convs[i] for i in order[n_held:]]
    else:
        settings = lambda **kw: dict(model=cfg.model or "stories260K", template=template,  # noqa
                                     max_new_tokens=cfg.distill_max_new_tokens,
                                     seed=cfg.seed, **kw)
        train_prompts = distill.read_prompts(prompts_dir() / "train_openings.txt")
        held_prompts = distill.read_prompts(prompts_dir() / "heldout_openings.txt")
        gen = lambda prompts, n, temp, desc: lambda: distill.generate_answers(  # noqa: E731
            params, mcfg, tokenizer, prompts, template=template, num_samples=n,
            temperature=temp, max_new_tokens=cfg.distill_max_new_tokens,
            batch_size=cfg.distill_batch_size, seed=cfg.seed, desc=desc)
        train_file, stats = distill.distill_cached(
            run_dir / "distill" / "train.jsonl",
            settings(samples=cfg.distill_samples, temperature=cfg.distill_temperature),
            gen(train_prompts, cfg.distill_samples, cfg.distill_temperature, "distill"))
        print(f"distilled training data: {train_file}"
              + (f" ({stats})" if stats else " (cached)"), flush=True)
        # held-out answers are greedy: that is how the benchmark decodes
        held_file, _ = distill.distill_cached(
            run_dir / "distill" / "heldout.jsonl", settings(samples=len(held_prompts)),
            gen(held_prompts, len(held_prompts), 0.0, "heldout"))
        train = data.read_file(train_file, "sharegpt", report)
        held = data.read_file(held_file, "sharegpt", data.LoadReport())
    train_rows = data.build(train, tokenizer, seq_len=cfg.seq_len, template=template,
                            seed=cfg.seed, report=report, what="training data")
    held_rows = None
    if held:
        held_rows = data.build(held, tokenizer, seq_len=cfg.seq_len, template=template,
                               seed=cfg.seed, what="held-out data")
    # benchmark prompts: what each held-out conversation feeds before its first answer
    bench = [data.render_prompt(c, tokenizer, template) for c in held if c[0][0] != "text"]
    return train_rows, held_rows, bench, report


# ----------------------------------------------------------------------------- eval


def evaluate(eval_step, params, batches, mesh) -> dict[str, np.ndarray]:
    """Per-head top-1/top-5 over all valid positions of the batches (count-weighted)."""
    sums = None
    for batch in batches:
        m = jax.device_get(eval_step(params, sharding.shard_batch(batch, mesh)))
        part = {k: m[k] * m["count"] for k in ("top1", "top5", "head_loss")}
        part["count"] = m["count"]
        sums = part if sums is None else {k: sums[k] + part[k] for k in sums}
    n = np.maximum(sums["count"], 1)
    return {"top1": sums["top1"] / n, "top5": sums["top5"] / n,
            "head_loss": sums["head_loss"] / n, "count": sums["count"]}


def benchmark(params, heads, mcfg, prompts: list[list[int]], tree: Tree,
              max_new_tokens: int, stops: tuple[int, ...]) -> dict:
    """Batch-1 greedy decoding, plain vs Medusa, each compiled once before timing."""
    bucket = decode.prompt_bucket(max(len(p) for p in prompts))
    decode.check_fits(mcfg, bucket, max_new_tokens, tree.num_nodes)
    key = jax.random.key(0)
    plain = lambda t, l: decode.generate(  # noqa: E731
        params, mcfg, t, l, key, sampling=Sampling(), max_new_tokens=max_new_tokens, eos=stops)
    medusa = lambda t, l: decode.medusa_generate(  # noqa: E731
        params, heads, mcfg, t, l, key, tree=tree, sampling=Sampling(),
        max_new_tokens=max_new_tokens, eos=stops)
    inputs = [decode.pad_prompts([p], bucket) for p in prompts]
    res = {}
    for name, fn in (("plain", plain), ("medusa", medusa)):
        jax.block_until_ready(fn(*inputs[0]))  # compile
        outs, t0 = [], time.perf_counter()
        for t, l in inputs:
            outs.append(jax.block_until_ready(fn(t, l)))
        res[name] = (time.perf_counter() - t0, jax.device_get(outs))
    (t_plain, plain_out), (t_medusa, medusa_out) = res["plain"], res["medusa"]
    new = sum(int(o.num_new[0]) for o in medusa_out)
    steps = sum(int(o.steps[0]) for o in medusa_out)
    plain_steps = sum(int(o.steps[0]) for o in plain_out)
    same = sum(int(a.num_new[0]) == int(b.num_new[0]) and
               np.array_equal(a.tokens[0, :a.num_new[0]], b.tokens[0, :b.num_new[0]])
               for a, b in zip(plain_out, medusa_out))
    return {"prompts": len(prompts), "tree": tree.name, "max_new_tokens": max_new_tokens,
            "new_tokens": new, "medusa_steps": steps, "tokens_per_step": new / max(steps, 1),
            "plain_s": t_plain, "medusa_s": t_medusa, "speedup": t_plain / t_medusa,
            # cost of one decoding step: the tree step verifies tree.num_nodes tokens at once
            "plain_ms_per_step": 1e3 * t_plain / max(plain_steps, 1),
            "medusa_ms_per_step": 1e3 * t_medusa / max(steps, 1),
            "identical_outputs": same,
            "plain_tok_s": sum(int(o.num_new[0]) for o in plain_out) / t_plain,
            "medusa_tok_s": new / t_medusa}


def print_benchmark(b: dict, tree: Tree, title: str):
    """The decoding benchmark of `benchmark`, as the training CLIs print it."""
    print(f"\n{title}, {b['prompts']} held-out prompts, batch 1, up to "
          f"{b['max_new_tokens']} new tokens, tree {b['tree']} (compile excluded):")
    print(f"  plain : {b['plain_s']:.2f}s  {b['plain_tok_s']:.0f} tok/s  1.00 tokens/step"
          f"  {b['plain_ms_per_step']:.2f} ms/step")
    print(f"  medusa: {b['medusa_s']:.2f}s  {b['medusa_tok_s']:.0f} tok/s  "
          f"{b['tokens_per_step']:.2f} tokens/step  {b['medusa_ms_per_step']:.2f} ms/step "
          f"({tree.num_nodes} tokens verified per step)")
    print(f"  speedup {b['speedup']:.2f}x; outputs identical to plain greedy for "
          f"{b['identical_outputs']}/{b['prompts']} prompts")


def plot_accuracy(metrics_file: Path, out: Path, num_heads: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, held = {}, {}
    for line in metrics_file.read_text().splitlines():
        rec = json.loads(line)
        (held if rec.get("split") == "heldout" else train)[rec["step"]] = rec
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k in range(num_heads):
        c = colors[k % len(colors)]
        steps = sorted(train)
        if steps:
            ax.plot(steps, [train[s]["top1"][k] for s in steps], color=c, alpha=0.35, lw=1)
        hs = sorted(held)
        if hs:
            ax.plot(hs, [held[s]["top1"][k] for s in hs], "o-", color=c, lw=2,
                    label=f"head {k + 1} (t+{k + 2})")
        elif steps:
            ax.lines[-1].set_label(f"head {k + 1} (t+{k + 2})")
    ax.set_xlabel("step")
    ax.set_ylabel("top-1 accuracy")
    ax.set_title("Medusa head top-1 accuracy (thin: train batches, dots: held-out)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def fmt_heads(values) -> str:
    return "/".join(f"{v:.2f}" for v in values)


# ----------------------------------------------------------------------------- run


def run(cfg: TrainConfig, resume: str | None = None, stop_after: int | None = None) -> dict:
    from transformers import AutoTokenizer

    t_start = time.perf_counter()
    cfg = cfg.resolve()
    run_dir = Path(cfg.output_dir or f"runs/medusa1-{time.strftime('%Y%m%d-%H%M%S')}")
    if resume is None and (run_dir / "checkpoints").is_dir() and \
            any((run_dir / "checkpoints").iterdir()):
        raise CheckpointError(f"{run_dir} already holds checkpoints; use --resume {run_dir}")
    mesh = sharding.make_mesh(cfg.mesh)  # fail on a bad mesh before creating anything
    sharding.check_batch_size(cfg.batch_size, mesh)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, output_dir=str(run_dir))
    print(f"run directory: {run_dir}", flush=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    mcfg, backbone = weights.load_pretrained(cfg.model)
    model_dir = cfg.model or str(weights.default_model_dir())
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise DataError(f"{model_dir}: cannot load the tokenizer ({str(e).splitlines()[0]})") \
            from None
    template = resolve_template(cfg, tokenizer)
    tree = Tree.load(cfg.tree, num_heads=cfg.num_heads)
    trees = [tree]
    if cfg.model is None and cfg.tree != "stories260K_cpu":
        # the embedded model also gets the tree searched for CPUs (python -m infer.tree):
        # the 64-node tree measures acceptance, the small one what a CPU user gets
        trees.append(Tree.load("stories260K_cpu", num_heads=cfg.num_heads))
    stops = distill.stop_tokens(mcfg, tokenizer)

    train_rows, held_rows, bench_prompts, report = prepare_data(
        cfg, backbone, mcfg, tokenizer, run_dir, template)
    print(f"data ({template} template): {report.summary()}", flush=True)
    total = cfg.steps or (math.ceil(cfg.epochs * len(train_rows) / cfg.batch_size)
                          if cfg.epochs else DEFAULT_STEPS)

    params = {"backbone": backbone,
              "heads": heads_lib.init_heads(mcfg, backbone,
                                            heads_lib.HeadsConfig(cfg.num_heads, cfg.num_layers))}
    labels = ts.medusa1_labels(params)
    trained = tuple(k for k, v in labels.items() if v == "train")
    tx, schedule = ts.make_optimizer(
        ts.OptimConfig(lr=cfg.lr, warmup_ratio=cfg.warmup_ratio, weight_decay=cfg.weight_decay,
                       grad_clip=cfg.grad_clip), total, labels)
    state, shardings = ts.create_state(params, tx, mesh)
    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=cfg.keep)
    position = 0
    metrics_file = run_dir / "metrics.jsonl"
    if resume is not None:
        state, meta = ckpt.restore(state, shardings, trained)
        position = meta["data_position"]
        # drop metrics logged after the checkpoint: those steps are trained again
        if metrics_file.is_file():
            keep = [ln for ln in metrics_file.read_text().splitlines()
                    if json.loads(ln)["step"] <= meta["step"]]
            metrics_file.write_text("".join(ln + "\n" for ln in keep))
        print(f"resumed at step {meta['step']} (data position {position})", flush=True)
    elif metrics_file.exists():
        metrics_file.unlink()

    loss_fn = ts.medusa1_loss_fn(mcfg, cfg.loss_decay)
    train_step = ts.make_train_step(loss_fn, tx, labels, shardings, mesh, schedule)
    eval_step = ts.make_eval_step(loss_fn, shardings, mesh)
    held_batches = data.eval_batches(held_rows, cfg.batch_size) if held_rows else []
    batches = data.BatchIterator(train_rows, cfg.batch_size, seed=cfg.seed, position=position)
    step = int(state.step)
    end = total if stop_after is None else min(total, step + stop_after)

    def log(rec):
        with open(metrics_file, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def held_eval(step):
        if not held_batches:
            return None
        m = evaluate(eval_step, state.params, held_batches, mesh)
        log({"step": step, "split": "heldout", "top1": m["top1"].tolist(),
             "top5": m["top5"].tolist(), "head_loss": m["head_loss"].tolist()})
        return m

    if step == 0:
        held_eval(0)  # the starting point: every head is a copy of the LM head
    bar = tqdm(total=total, initial=step, desc="train", unit="step", file=sys.stdout,
               dynamic_ncols=True)
    t_train, tokens_seen, t_last = time.perf_counter(), 0, time.perf_counter()
    while step < end:
        batch = next(batches)
        tokens_seen += int((batch["segments"] > 0).sum())
        state, m = train_step(state, sharding.shard_batch(batch, mesh))
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == end:
            m = jax.device_get(m)
            now = time.perf_counter()
            tok_s = tokens_seen / (now - t_last)
            tokens_seen, t_last = 0, now
            log({"step": step, "split": "train", "epoch": round(batches.epoch(), 4),
                 "loss": float(m["loss"]), "top1": m["top1"].tolist(),
                 "top5": m["top5"].tolist(), "lr": float(m["lr"]),
                 "grad_norm": float(m["grad_norm"]), "tokens_per_s": round(tok_s, 1)})
            bar.set_postfix_str(f"loss={float(m['loss']):.3f} top1={fmt_heads(m['top1'])} "
                                f"tok/s={tok_s:.0f}")
        if step % cfg.eval_every == 0 and step != end:
            held_eval(step)
        if step % cfg.save_every == 0 or step == end:
            ckpt.save(state, trained, batches.position, dataclasses.asdict(cfg), force=True)
    bar.close()
    train_s = time.perf_counter() - t_train
    ckpt.wait()
    summary = {"run_dir": str(run_dir), "step": step, "total_steps": total,
               "train_seconds": round(train_s, 1), "checkpoints": ckpt.all_steps()}
    ckpt.close()
    if step < total:
        print(f"stopped at step {step} of {total}; continue with --resume {run_dir}")
        return summary

    final = held_eval(step)
    heads = jax.device_get(state.params["heads"])
    extra = {"step": step, "template": template, "config": dataclasses.asdict(cfg)}
    if final is not None:
        extra["heldout_top1"] = final["top1"].tolist()
        extra["heldout_top5"] = final["top5"].tolist()
        summary.update(heldout_top1=final["top1"].tolist(), heldout_top5=final["top5"].tolist())
        print("\nheld-out accuracy (%d label positions for head 1)" % int(final["count"][0]))
        print(f"  {'head':>4} {'predicts':>8} {'top-1':>7} {'top-5':>7}")
        for k in range(cfg.num_heads):
            print(f"  {k + 1:>4} {f't+{k + 2}':>8} {final['top1'][k]:>7.3f} "
                  f"{final['top5'][k]:>7.3f}")
    artifact = heads_lib.save_heads(run_dir / "heads", heads, mcfg, extra)
    print(f"heads artifact: {artifact}")
    plot_accuracy(metrics_file, run_dir / "accuracy.png", cfg.num_heads)
    print(f"accuracy plot: {run_dir / 'accuracy.png'}")

    if cfg.eval_prompts and not bench_prompts:
        print("no held-out conversations to benchmark decoding on (plain-text data)")
    if cfg.eval_prompts and bench_prompts:
        prompts = bench_prompts[:cfg.eval_prompts]
        summary["benchmarks"] = []
        for tree in trees:
            b = benchmark(backbone, jax.device_put(heads), mcfg, prompts, tree,
                          cfg.eval_max_new_tokens, stops)
            summary["benchmarks"].append(b)
            print_benchmark(b, tree, "greedy decoding")
        summary["benchmark"] = summary["benchmarks"][0]
        (run_dir / "benchmark.json").write_text(json.dumps(summary["benchmarks"], indent=2))
    summary["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\ndone in {summary['wall_seconds']:.0f}s; run directory: {run_dir}")
    return summary


def main(argv=None):
    cfg, resume, stop_after = parse_args(argv)
    try:
        run(cfg, resume, stop_after)
    except (DataError, CheckpointError, weights.WeightsError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    except ValueError as e:  # config/tree/mesh problems found after parsing
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
