"""The training loop shared by Medusa-1 and Medusa-2.

A run is a `TrainConfig` (the fields every method shares; each method's config adds its
own) and a `Recipe` (the method: its parameters, loss and optimizer, and what it reports).
`train` does everything else, the same way for every method:

    run directory   config.json, metrics.jsonl, checkpoints/ (Orbax), heads/, accuracy.png,
                    benchmark.json, summary.json
    data            --data files (a seeded fraction held out), or self-distilled answers to
                    the TinyStories openings (cached in <run>/distill/)
    loop            sharded jitted steps, tqdm progress, metrics every --log-every steps,
                    held-out accuracy every --eval-every, a checkpoint every --save-every
    resume          --resume restores the last checkpoint and the data position, and drops
                    metrics logged after it (those steps are trained again)
    report          per-head held-out accuracy, the heads artifact, a plot, the recipe's own
                    report, then Medusa vs plain greedy decoding on held-out prompts
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from tqdm import tqdm

from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters.medusa import heads as heads_lib
from medusa_jax.model import backbone as backbone_lib
from medusa_jax.model import weights
from medusa_jax.model.backbone import Params, decoding_layout
from medusa_jax.model.config import ModelConfig, stop_tokens
from medusa_jax.runtime import assets, distributed, rundir, sharding
from medusa_jax.text import data
from medusa_jax.training import distill
from medusa_jax.training import step as ts
from medusa_jax.training.checkpoint import Checkpointer, CheckpointError
from medusa_jax.training.config import DTYPES, TrainConfig, check_batch  # noqa: F401 - re-exported

__all__ = ["DTYPES", "TrainConfig"]  # the configs live in train_config (no JAX there)
from medusa_jax.decoding.tree import Tree
from medusa_jax.runtime.rundir import LOCK_FILE, Interrupted, RunLock, StopNow, StopSignals

# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Context:
    """What a recipe sees of the run."""

    cfg: TrainConfig
    run_dir: Path
    mesh: jax.sharding.Mesh
    model_cfg: ModelConfig
    backbone: Params  # the pretrained backbone, as loaded
    tokenizer: object
    template: str
    stops: tuple[int, ...]
    held_rows: data.Packed | None = None  # the held-out set, once the data is read

    def put(self, batch: dict) -> dict:
        return sharding.shard_batch(batch, self.mesh)


@dataclasses.dataclass
class Method:
    """What a recipe builds for the loop: parameters, their labels (which optax partition
    trains each top-level subtree; "frozen" ones are never saved), optimizer, loss."""

    params: Params
    labels: dict
    tx: object
    schedule: Callable
    loss_fn: Callable
    # gradient accumulation: the whole batch's denominators of the loss's means (read by the
    # loss from batch["totals"]), and the metrics that are not sums over micro-batches
    totals_fn: Callable | None = None
    mean_metrics: tuple[str, ...] = ()

    @property
    def trained(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.labels.items() if v != "frozen")


class Recipe:
    """A training method. Override what differs; the defaults do nothing extra."""

    name = "medusa"  # progress-bar label

    def backbone_dtypes(self, cfg: TrainConfig) -> dict:
        """`weights.load_pretrained`'s dtypes for --dtype: a frozen backbone is stored in it."""
        return {"param_dtype": cfg.dtype, "compute_dtype": cfg.dtype}

    def setup(self, ctx: Context) -> None:
        """Before the data is read (Medusa-2: its first stage)."""

    def training_rows(self, ctx: Context, rows: data.Packed) -> data.Packed:
        return rows

    def heldout_rows(self, ctx: Context, rows: data.Packed) -> data.Packed:
        """The held-out rows as evaluated (after `training_rows`)."""
        return rows

    def num_heads(self, ctx: Context, heads: Params) -> int:
        """The entries of the metrics' per-head `top1`/`top5` (heads, or drafting depths)."""
        return heads_lib.heads_config_of(heads).num_heads

    head_label = "head"  # what one entry of the per-head metrics is called in the report

    def tree_depth(self, ctx: Context, heads: Params) -> int | None:
        """How deep a tree the trained drafter fills (None: any depth); the closing
        benchmark's trees are checked against it."""
        return self.num_heads(ctx, heads)

    def build(self, ctx: Context, total_steps: int) -> Method:
        raise NotImplementedError

    def memory_method(self, cfg: TrainConfig, model_cfg, params: dict,
                      total_steps: int) -> Method:
        """The Method `--memory-report` compiles, for `memory_params`' parameters."""
        return type(self).method(cfg, model_cfg, params, total_steps)

    def memory_heads(self, cfg: TrainConfig) -> str | None:
        """What the memory report says it trains (None: `cfg.num_heads` heads and their
        loss's chunking)."""
        return None

    def batch(self, batch: dict, step: int) -> dict:
        """A host batch before it is sharded (Medusa-2 adds the step)."""
        return batch

    def train_log(self, m: dict) -> dict:
        """Extra fields of a train record in metrics.jsonl."""
        return {}

    def postfix(self, m: dict) -> str:
        return f"loss={float(m['loss']):.3f}"

    def artifact_extra(self, ctx: Context) -> dict:
        return {}

    def heads_artifact(self, ctx: Context, heads: Params) -> Params:
        """The trained heads as written and decoded with (a reduced vocabulary adds its
        token_index, a constant the training state does not hold)."""
        return heads

    def finish(self, ctx: Context, state: ts.TrainState, summary: dict) -> Params:
        """After the heads artifact is written; returns the backbone to decode with."""
        return ctx.backbone


def open_run_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.output_dir or f"runs/{cfg.RUN_PREFIX}-{time.strftime('%Y%m%d-%H%M%S')}")


def train(cfg: TrainConfig, recipe: Recipe, resume: str | None = None,
          stop_after: int | None = None) -> dict:
    """Run (or resume) training; returns the summary (also saved as summary.json).

    The run directory is locked while the run lives (a second run on it fails at once), and
    SIGINT/SIGTERM stop the run after the current step and a checkpoint, raising
    `rundir.Interrupted`. A run that fails before it wrote anything worth keeping removes
    the run directory it created."""
    cfg = cfg.validate().resolve()
    distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id,
                           cfg.init_timeout)
    if jax.process_count() > 1 and cfg.output_dir is None:
        raise ValueError("a multi-process run needs --output-dir (one directory every "
                         "process can reach)")
    run_dir = open_run_dir(cfg)
    mesh = sharding.make_mesh(cfg.mesh)  # fail on a bad mesh before creating anything
    sharding.check_batch_size(cfg.batch_size, mesh)
    if mesh.shape["model"] > 1:
        sharding.check_model_axis(ModelConfig.from_dir(cfg.model or weights.default_model_dir()),
                                  mesh)
    if distributed.is_writer():  # process 0 owns the folder (the others may see it half made)
        rundir.check_output_dir(run_dir, "--resume" if resume is not None else "--output-dir")
    if resume is not None:
        check_resume(cfg, run_dir)
    check_batch(cfg, mesh)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    # process 0 owns the run directory (lock, files); the others only compute
    lock_ctx = RunLock(run_dir) if distributed.is_writer() else contextlib.nullcontext()
    with lock_ctx as lock, StopSignals() as stop:
        try:
            if resume is None:
                for d in (run_dir / "checkpoints", run_dir / "stage1" / "checkpoints"):
                    if d.is_dir() and any(d.iterdir()):
                        raise CheckpointError(f"{run_dir} already holds checkpoints; "
                                              f"use --resume {run_dir}")
            if lock is not None and lock.stale:
                print(f"note: {run_dir} was locked by pid {lock.stale.get('pid')} "
                      f"(started {lock.stale.get('started')}), which is gone", flush=True)
            return _train(dataclasses.replace(cfg, output_dir=str(run_dir)), recipe, run_dir,
                          mesh, resume, stop_after, stop)
        except BaseException as e:
            if created and distributed.is_writer():
                remove_if_empty(run_dir)
            if isinstance(e, StopNow):  # what the message may offer to --resume
                e.run_dir = run_dir if rundir.is_run_dir(run_dir) else None
            removed = created and distributed.is_writer() and not run_dir.exists()
            if isinstance(e, Interrupted) and removed:  # its message offered --resume
                raise Interrupted(f"stopped by {signal.Signals(e.code - 128).name} before "
                                  f"anything was saved; nothing to resume ({run_dir} was "
                                  f"removed)", e.code - 128) from None
            raise


def check_resume(cfg: TrainConfig, run_dir: Path):
    """--resume continues the run as its checkpoint was trained: a field of config.json
    edited since (other than the RESUMABLE ones) or --steps below the checkpoint's step is
    refused in one line, before any work."""
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        return  # stopped before its first checkpoint: config.json is all there is
    ck = Checkpointer(ckpt_dir, create=False, async_save=False)
    try:
        step, saved = ck.saved_config()
    finally:
        ck.close()
    if saved is None:
        return
    now = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples as JSON lists
    for f in dataclasses.fields(cfg):
        k = f.name
        if k in cfg.RESUMABLE or k == "output_dir" or k not in saved or now[k] == saved[k]:
            continue
        raise ValueError(f"{run_dir}/config.json: {k} is {now[k]!r}, but checkpoint {step} "
                         f"was trained with {saved[k]!r} (only "
                         f"{', '.join(sorted(cfg.RESUMABLE))} may change on --resume); "
                         f"restore it, or start a new run")
    if cfg.steps is not None and cfg.steps < step:
        raise ValueError(f"--steps {cfg.steps}: the run in {run_dir} is already at step "
                         f"{step} (give more steps to continue it)")


def remove_if_empty(run_dir: Path):
    """Remove a run directory holding nothing but its config and lock (empty folders)."""
    kept = [f for f in run_dir.rglob("*") if f.is_file() and
            f.relative_to(run_dir).as_posix() not in ("config.json", LOCK_FILE)]
    if not kept:
        shutil.rmtree(run_dir, ignore_errors=True)


def _train(cfg: TrainConfig, recipe: Recipe, run_dir: Path, mesh, resume: str | None,
           stop_after: int | None, stop: StopSignals) -> dict:
    t_start = time.perf_counter()
    writer = distributed.is_writer()
    print(f"run directory: {run_dir}" + (f" (process {jax.process_index()} of "
                                         f"{jax.process_count()}, {jax.device_count()} devices)"
                                         if jax.process_count() > 1 else ""), flush=True)
    if writer:
        (run_dir / "config.json").write_text(json.dumps(
            {"method": cfg.RUN_PREFIX, **dataclasses.asdict(cfg)}, indent=2))

    model_cfg, backbone = weights.load_pretrained(cfg.model, **recipe.backbone_dtypes(cfg))
    tokenizer = weights.load_tokenizer(cfg.model)
    ctx = Context(cfg, run_dir, mesh, model_cfg, backbone, tokenizer,
                  resolve_template(cfg, tokenizer), stop_tokens(model_cfg, tokenizer))
    recipe.setup(ctx)
    train_rows, held_rows, bench_prompts, report = prepare_data(ctx)
    ctx.held_rows = held_rows
    print(f"data ({ctx.template} template): {report.summary()}", flush=True)
    train_rows = recipe.training_rows(ctx, train_rows)
    if held_rows is not None:
        held_rows = ctx.held_rows = recipe.heldout_rows(ctx, held_rows)
    if stop.requested is not None:
        cached = "self-distilled data cached" if not cfg.data else "nothing new saved"
        raise Interrupted(f"stopped by {signal.Signals(stop.requested).name} before training "
                          f"started ({cached}); continue with --resume {run_dir}",
                          stop.requested)
    total = cfg.total_steps(len(train_rows))

    method = recipe.build(ctx, total)
    state, shardings = ts.create_state(method.params, method.tx, mesh,
                                       ts.param_axes(model_cfg, method.params),
                                       backbone_lib.head_units(model_cfg))
    method.params = None  # the state owns them now (the train step donates its buffers)
    num_heads = recipe.num_heads(ctx, state.params["heads"])
    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=cfg.keep)
    metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=writer)
    position = 0
    if resume is not None and ckpt.latest_step() is not None:
        state, meta = ckpt.restore(state, shardings, method.trained)
        for skipped in meta.get("skipped", []):
            print(f"note: checkpoint {skipped['step']} is unreadable ({skipped['reason']}); "
                  f"moved to {skipped['moved_to']}", flush=True)
        position = meta["data_position"]
        if meta["step"] > total:  # --epochs fewer than done (--steps is checked up front)
            raise ValueError(f"the run in {run_dir} is already at step {meta['step']}, past "
                             f"the {total} steps asked for")
        metrics.truncate(meta["step"])
        print(f"resumed at step {meta['step']} (data position {position})", flush=True)
    else:
        metrics.truncate(-1)

    train_step = ts.make_train_step(method.loss_fn, method.tx, method.labels, shardings, mesh,
                                    method.schedule, cfg.grad_accum, method.totals_fn,
                                    method.mean_metrics)
    eval_step = ts.make_eval_step(method.loss_fn, shardings, mesh)
    held_batches = data.eval_batches(held_rows, cfg.batch_size) if held_rows else []
    batches = data.BatchIterator(train_rows, cfg.batch_size, seed=cfg.seed, position=position)
    step = int(state.step)
    end = total if stop_after is None else min(total, step + stop_after)

    def held_eval(step):
        if not held_batches:
            return None
        m = evaluate(eval_step, state.params, held_batches, mesh)
        metrics.write({"step": step, "split": "heldout", "top1": m["top1"].tolist(),
                       "top5": m["top5"].tolist(), "head_loss": m["head_loss"].tolist()})
        return m

    if step == 0:
        held_eval(0)  # the starting point
    bar = tqdm(total=total, initial=step, desc=recipe.name, unit="step", file=sys.stdout,
               dynamic_ncols=True, disable=not writer)
    t_train, tokens_seen, t_last = time.perf_counter(), 0, time.perf_counter()
    tokens_total, first = 0, step  # this session's, for the closing report
    while step < end:
        batch = recipe.batch(next(batches), step)
        real = int((batch["segments"] > 0).sum())  # the rows' tokens, padding excluded
        tokens_seen, tokens_total = tokens_seen + real, tokens_total + real
        state, m = train_step(state, ctx.put(batch))
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == end:
            m = sharding.to_host(m)
            now = time.perf_counter()
            tok_s = tokens_seen / (now - t_last)
            tokens_seen, t_last = 0, now
            metrics.write({"step": step, "split": "train", "epoch": round(batches.epoch(), 4),
                           "loss": float(m["loss"]), "top1": m["top1"].tolist(),
                           "top5": m["top5"].tolist(), "lr": float(m["lr"]),
                           "grad_norm": float(m["grad_norm"]), "tokens_per_s": round(tok_s, 1),
                           **recipe.train_log(m)})
            bar.set_postfix_str(f"{recipe.postfix(m)} top1={fmt_heads(m['top1'])} "
                                f"tok/s={tok_s:.0f}")
        if stop.requested is not None:
            end = step  # a signal: checkpoint this step and stop
        if step % cfg.eval_every == 0 and step != end:
            held_eval(step)
        if step % cfg.save_every == 0 or step == end:
            ckpt.save(state, method.trained, batches.position, dataclasses.asdict(cfg),
                      force=True)
    bar.close()
    train_s = time.perf_counter() - t_train
    ckpt.wait()
    summary = {"run_dir": str(run_dir), "step": step, "total_steps": total,
               "train_seconds": round(train_s, 1), "checkpoints": ckpt.all_steps(),
               "tokens_seen": tokens_total,
               "tokens_per_minute": round(60 * tokens_total / max(train_s, 1e-9))}
    print(f"trained {step - first} steps in {train_s:.0f} s: {tokens_total} tokens seen, "
          f"{summary['tokens_per_minute']} tokens per minute", flush=True)
    ckpt.close()
    if step < total:
        message = f"stopped at step {step} of {total}; continue with --resume {run_dir}"
        if stop.requested is not None:
            raise Interrupted(f"{signal.Signals(stop.requested).name}: {message} (checkpoint "
                              f"{step} saved)", stop.requested)
        print(message)
        return TrainResult(summary, t_start)

    stop.training_done(run_dir, step)  # from here a signal stops at once (all is saved)
    final = held_eval(step)
    heads = recipe.heads_artifact(ctx, sharding.to_host(state.params["heads"]))
    extra = {"step": step, "template": ctx.template, "config": dataclasses.asdict(cfg),
             **recipe.artifact_extra(ctx)}
    if final is not None:
        extra.update(heldout_top1=final["top1"].tolist(), heldout_top5=final["top5"].tolist())
        summary.update(heldout_top1=final["top1"].tolist(), heldout_top5=final["top5"].tolist())
        print_accuracy(final, num_heads, recipe.head_label)
    if writer:
        artifact = heads_formats.save_heads(run_dir / "heads", heads, model_cfg, extra)
        print(f"heads artifact: {artifact}")
        plot_accuracy(metrics.path, run_dir / "accuracy.png", num_heads, recipe.head_label)
        print(f"accuracy plot: {run_dir / 'accuracy.png'}")
    decode_backbone = recipe.finish(ctx, state, summary)
    distributed.barrier("heads written")
    if not writer:  # the decoding benchmark and the summary are process 0's
        return TrainResult(summary, t_start)
    check = None
    if cfg.eval_prompts and not bench_prompts:
        print("no held-out conversations to benchmark decoding on (plain-text data)")
    elif cfg.eval_prompts:
        check = DecodingCheck(
            backbone=jax.device_put(decoding_layout(model_cfg, decode_backbone)),
            heads=jax.device_put(heads), cfg=model_cfg, prompts=bench_prompts[:cfg.eval_prompts],
            trees=benchmark_trees(cfg, recipe.tree_depth(ctx, heads)), eos=ctx.stops,
            max_new_tokens=cfg.eval_max_new_tokens, name=recipe.name,
            embedded=assets.is_embedded(cfg.model))
    summary["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return TrainResult(summary, t_start, finished=True, decoding=check)


@dataclasses.dataclass
class DecodingCheck:
    """What the decoding benchmark after training needs (`training.report`): the decoding
    backbone and the trained heads on device, the held-out prompts and the trees."""

    backbone: Params
    heads: Params
    cfg: ModelConfig
    prompts: list
    trees: list
    eos: tuple
    max_new_tokens: int
    name: str
    embedded: bool = False  # the model is the embedded stories260K


@dataclasses.dataclass
class TrainResult:
    """A training run's outcome: its summary (also <run>/summary.json once finished, on the
    writing process) and, when there are held-out prompts, what to benchmark decoding on."""

    summary: dict
    t_start: float
    finished: bool = False  # trained every step, on the writing process
    decoding: DecodingCheck | None = None


def benchmark_trees(cfg: TrainConfig, num_heads: int | None) -> list[Tree]:
    """The model's default tree (the one it decodes with) when it fits these heads, then
    --tree when that differs."""
    trees = []
    default = assets.default_tree(cfg.model)
    if default != cfg.tree:
        try:
            trees.append(Tree.load(default, num_heads=num_heads))
        except ValueError:  # deeper than these heads
            pass
    return trees + [Tree.load(cfg.tree, num_heads=num_heads)]


class MetricsLog:
    """metrics.jsonl: one JSON record per line, appended as training goes (by the writing
    process only: `enabled`)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled

    def write(self, rec: dict):
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def truncate(self, step: int):
        """Keep the records up to `step` (-1: none): later steps are trained again."""
        if not self.enabled or not self.path.is_file():
            return
        keep = [ln for ln in self.path.read_text().splitlines()
                if ln.strip() and json.loads(ln)["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))


# ----------------------------------------------------------------------------- data


def resolve_template(cfg: TrainConfig, tokenizer) -> str:
    if cfg.template == "auto" and not cfg.data and not getattr(tokenizer, "chat_template", None):
        return "plain"  # self-distilling story openings with a base model
    return data.resolve_template(cfg.template, tokenizer)


def prepare_data(ctx: Context):
    """-> (train rows, held-out rows or None, benchmark prompts as token lists, report)."""
    cfg, report = ctx.cfg, data.LoadReport()
    if cfg.data:
        convs = data.read_files(cfg.data, cfg.data_format, report)
        order = np.random.default_rng(cfg.seed).permutation(len(convs))
        n_held = int(len(convs) * cfg.heldout_fraction) if len(convs) > 1 else 0
        if cfg.heldout_fraction > 0 and len(convs) > 1:
            n_held = max(1, n_held)
        held = [convs[i] for i in order[:n_held]]
        train = [convs[i] for i in order[n_held:]]
    else:
        train_file, held_file = distill.self_distill(ctx)
        train = data.read_file(train_file, "sharegpt", report)
        held = data.read_file(held_file, "sharegpt", data.LoadReport())
    build = lambda convs, what, rep=None: data.build(  # noqa: E731
        convs, ctx.tokenizer, seq_len=cfg.seq_len, template=ctx.template, seed=cfg.seed,
        report=rep, what=what)
    train_rows = build(train, "training data", report)
    held_rows = build(held, "held-out data") if held else None
    # benchmark prompts: what each held-out conversation feeds before its first answer
    prompts = [data.render_prompt(c, ctx.tokenizer, ctx.template) for c in held
               if c[0][0] != "text"]
    return train_rows, held_rows, prompts, report


# ----------------------------------------------------------------------------- reports


def evaluate(eval_step, params, batches, mesh) -> dict[str, np.ndarray]:
    """Per-head top-1/top-5 over all valid positions of the batches (count-weighted)."""
    sums = None
    for batch in batches:
        m = sharding.to_host(eval_step(params, sharding.shard_batch(batch, mesh)))
        part = {k: m[k] * m["count"] for k in ("top1", "top5", "head_loss")}
        part["count"] = m["count"]
        sums = part if sums is None else {k: sums[k] + part[k] for k in sums}
    n = np.maximum(sums["count"], 1)
    return {"top1": sums["top1"] / n, "top5": sums["top5"] / n,
            "head_loss": sums["head_loss"] / n, "count": sums["count"]}


def fmt_heads(values) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def print_accuracy(m: dict, num_heads: int, label: str = "head"):
    print("\nheld-out accuracy (%d label positions for %s 1)" % (int(m["count"][0]), label))
    print(f"  {label:>4} {'predicts':>8} {'top-1':>7} {'top-5':>7}")
    for k in range(num_heads):
        print(f"  {k + 1:>4} {f't+{k + 2}':>8} {m['top1'][k]:>7.3f} {m['top5'][k]:>7.3f}")


def plot_accuracy(metrics_file: Path, out: Path, num_heads: int, label: str = "head"):
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
                    label=f"{label} {k + 1} (t+{k + 2})")
        elif steps:
            ax.lines[-1].set_label(f"{label} {k + 1} (t+{k + 2})")
    ax.set_xlabel("step")
    ax.set_ylabel("top-1 accuracy")
    ax.set_title(f"{'Medusa head' if label == 'head' else 'drafter ' + label} top-1 accuracy "
                 f"(thin: train batches, dots: held-out)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
