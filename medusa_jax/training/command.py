"""The training commands' command line (train/medusa1.py, medusa2.py, hydra.py, eagle.py):
flags from the config class (`training.config`), --memory-report, and `main` with its exit
statuses.
Nothing here imports JAX before the flags are parsed and the paths checked: `--help` and a
flag or path error answer at once; the recipe and `trainer` are imported when work starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys

from medusa_jax.model.config import ModelConfig
from medusa_jax.model.paths import check_model_paths
from medusa_jax.runtime import assets, options, quiet


def add_memory_flags(ap: argparse.ArgumentParser):
    g = ap.add_argument_group("memory report (no training: compile the step from shapes)")
    g.add_argument("--memory-report", action="store_true", default=None,
                   help="print the training step's per-device memory (parameters, optimizer "
                        "state, temporaries, total) for --shape with these flags (--mesh, "
                        "--batch-size, --seq-len, --dtype, ...), from compiles at 1 and 2 "
                        "layers extrapolated to all; no weights, no data, no run directory")
    g.add_argument("--shape", metavar="NAME|DIR",
                   help="with --memory-report: a named shape (llama-2-7b, llama-2-13b, "
                        "llama-2-70b, llama-3-8b, ...) or a model folder's config.json")
    g.add_argument("--json", action="store_true", default=None,
                   help="with --memory-report: the report as JSON (per_device_bytes, "
                        "parts_bytes, ...)")
    g.add_argument("--memory-layers", metavar="A,B", type=options.int_list(1),
                   help="with --memory-report: compile at depths A and B and extrapolate "
                        "the temporaries linearly to all layers (default: compile the full "
                        "depth, exact and no slower; A,A reports depth A as it is)")
    g.add_argument("--device-memory", metavar="SIZE",
                   help="with --memory-report: say whether the step fits this much memory "
                        "per device (e.g. 80GB, 16GiB)")


def _memory_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_memory_flags(ap)
    return ap


def _without_memory(argv):
    """argv less the memory-report flags (the config's parser must not see them)."""
    _, rest = _memory_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    return rest


def check_context(ap: argparse.ArgumentParser, seq_len: int, model_cfg: ModelConfig,
                  what: str) -> None:
    """--seq-len within the model's context (max_position_embeddings): rows longer than
    the positions the model was trained on are refused before any work."""
    limit = model_cfg.max_position_embeddings
    if seq_len > limit:
        ap.error(f"--seq-len {seq_len} is longer than the context of {what} "
                 f"(max_position_embeddings {limit})")


def check_writable(resume: str | None, output_dir: str | None):
    """The run's folder (or the folder it will be made in) takes files, before any work: a
    read-only one is refused in one line naming it (a file there is the trainer's to name)."""
    from pathlib import Path

    flag, folder = ("--resume", resume) if resume else ("--output-dir", output_dir or "runs")
    if not Path(folder).exists() or Path(folder).is_dir():
        with options.errors_to_exit():
            options.writable_output(flag, str(folder), folder=True)


def exit_at_once(code: int):
    """End the process now, without Python's shutdown. A second signal can land while an
    Orbax save runs in its threads (or interrupt the main thread inside Orbax): a normal
    exit then waits for, or races, that save at interpreter shutdown and can hang. The
    abandoned save only ever leaves a `*.orbax-checkpoint-tmp` folder, which is never read
    as a checkpoint; finished checkpoints are not touched."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(code)


class Command:
    """A training command (train/medusa1.py, train/medusa2.py): its flags come from the
    config class, its run is `trainer.train` with the recipe. `recipe_cls` is the class or
    "module:Name" (imported when the run starts, so --help and flag errors import no JAX)."""

    def __init__(self, prog: str, doc: str, config_cls, recipe_cls):
        self.prog, self.doc = prog, doc
        self.config_cls, self._recipe = config_cls, recipe_cls

    @property
    def recipe_cls(self):
        if isinstance(self._recipe, str):
            import importlib

            module, name = self._recipe.split(":")
            self._recipe = getattr(importlib.import_module(module), name)
        return self._recipe

    def build_parser(self):
        ap = argparse.ArgumentParser(prog=self.prog, description=self.doc.split("\n")[0])
        options.add_config_flags(ap, self.config_cls)
        options.add_run_flags(ap)
        add_memory_flags(ap)
        return ap

    def parse_args(self, argv=None):
        """(config, --resume, --stop-after); bad flags exit with one line (status 2)."""
        return options.parse_config(self.build_parser(), self.config_cls, _without_memory(argv))

    def memory_report(self, argv=None) -> dict | None:
        """--memory-report: print the training step's per-device memory for --shape (or
        None when the flag is not given). Bad flags exit with one line (status 2)."""
        ap = self.build_parser()
        mem, _ = _memory_parser().parse_known_args(argv)
        given = [f for f in ("shape", "json", "device_memory", "memory_layers")
                 if getattr(mem, f) is not None]
        if not mem.memory_report:
            if given:
                ap.error(f"--{given[0].replace('_', '-')} needs --memory-report")
            return None
        if mem.memory_layers is not None and len(mem.memory_layers) != 2:
            ap.error("--memory-layers takes two depths, e.g. 2,3")
        if mem.shape is None:
            ap.error("--memory-report needs --shape (e.g. llama-2-7b, or a model folder)")
        # no decoding benchmark runs here: its tree need not fit these heads
        argv = list(sys.argv[1:] if argv is None else argv)
        cfg, resume, _ = self.parse_args([*argv, "--eval-prompts", "0"])
        if resume is not None or cfg.model is not None:
            ap.error("--memory-report takes --shape, not --model or --resume")
        from medusa_jax.training import memory

        try:
            device_memory = None if mem.device_memory is None else \
                memory.parse_bytes(mem.device_memory)
            shape_cfg = memory.model_config(mem.shape)
        except (ValueError, FileNotFoundError) as e:
            ap.error(str(e))
        check_context(ap, cfg.seq_len, shape_cfg, f"--shape {mem.shape}")
        try:  # train.eagle's --aux-layers, --draft-vocab against the shape, not a depth
            cfg.check_model(shape_cfg, f"--shape {mem.shape}")
        except ValueError as e:
            ap.error(str(e))
        import jax

        from medusa_jax.runtime import sharding

        need = math.prod(sharding.parse_mesh_spec(cfg.mesh).values())
        if need > 1:  # simulated CPU devices for the mesh (before JAX starts its backends)
            with contextlib.suppress(RuntimeError):
                jax.config.update("jax_num_cpu_devices", need)
        with options.errors_to_exit():
            r = memory.training_memory(self.recipe_cls(), cfg.resolve(), mem.shape,
                                       device_memory,
                                       tuple(mem.memory_layers or ()) or memory.DEFAULT_LAYERS)
        if mem.json:
            print(json.dumps(r, indent=2))
        else:
            memory.print_report(r)
        return r

    def run(self, cfg, resume: str | None = None, stop_after: int | None = None) -> dict:
        from pathlib import Path

        from medusa_jax.runtime.rundir import StopSignals
        from medusa_jax.training import report
        from medusa_jax.training.trainer import train

        result = train(cfg, self.recipe_cls(), resume, stop_after)
        with StopSignals() as stop:  # the benchmark: a signal stops it at once
            if result.finished:
                stop.training_done(Path(result.summary["run_dir"]), result.summary["step"])
            return report.finish(result)

    def main(self, argv=None):
        """Parse, run; errors and interrupts end the process with one line and the exit
        status a shell expects (1 error, 2 bad flags, 128 + signal number)."""
        if self.memory_report(argv) is not None:
            return
        cfg, resume, stop_after = self.parse_args(argv)
        with options.errors_to_exit():  # --model: a path or hub id, config.json, the weights
            check_model_paths(cfg.model)
            model_cfg = ModelConfig.from_dir(cfg.model or assets.model_dir())
        check_context(self.build_parser(), cfg.seq_len, model_cfg,
                      f"--model {cfg.model or assets.EMBEDDED_MODEL}")
        try:  # flags that depend on the model (train.eagle's --aux-layers, --draft-vocab)
            cfg.check_model(model_cfg, f"--model {cfg.model or assets.EMBEDDED_MODEL}")
        except ValueError as e:
            self.build_parser().error(str(e))
        check_writable(resume, cfg.output_dir)
        quiet.imports()
        from medusa_jax.runtime.rundir import Interrupted, StopNow

        try:
            with options.errors_to_exit():
                self.run(cfg, resume, stop_after)
        except OSError as e:  # a folder that turned read-only or full under the run
            sys.exit(f"error: {e.filename}: {e.strerror}" if e.filename and e.strerror
                     else f"error: {e}")
        except Interrupted as e:
            print(f"\n{e}", file=sys.stderr, flush=True)
            sys.exit(e.code)
        except StopNow as e:
            if e.done is not None:  # training had ended: no save in flight, a plain exit
                print(f"\n{e.done_message()}", file=sys.stderr, flush=True)
                sys.exit(e.code)
            name = signal.Signals(e.signum).name
            print(f"\nstopped at once (second {name}) before anything was saved; nothing to "
                  f"resume" if e.run_dir is None else
                  f"\nstopped at once (second {name}); continue with --resume {e.run_dir} "
                  f"(its last finished checkpoint, if any, is intact)", file=sys.stderr,
                  flush=True)
            exit_at_once(e.code)
        except KeyboardInterrupt:  # Ctrl-C outside the training run
            print("\nstopped (SIGINT)", file=sys.stderr, flush=True)
            sys.exit(128 + signal.SIGINT)
