"""Command-line options shared by the entry points in train/ and infer/ (stdlib only).

- `add_config_flags` turns a config dataclass into flags: one `--flag-name` per field (or
  the name its `option` gives), its type from the annotation, its help and choices from
  the field's metadata (`option`; a subclass rewords inherited help in its `HELP` class
  attribute). Defaults stay None on the command line, so "given" means typed by the user
  (a field whose flag has a default of its own passes the flag's value as it is).
- `config_from_flags` builds the config from those flags; `parse_config` does so for the
  training commands, or from a run's saved config.json plus the flags allowed to change
  on `--resume`. `same_option` declares a field as another config declares it.
- `int_list` parses "1,4,16"; `errors_to_exit` turns the library's errors into one line;
  `writable_output` and `mesh_spec` check an output path and a mesh spec before any work.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path

_UNSET = object()


def option(default, help: str, flag: str | tuple[str, ...] | None = None,
           flag_default=_UNSET, **argparse_kw):
    """A config field with its command-line help (`{default}` is filled in) and any extra
    argparse keywords (type, choices, metavar, nargs, const; action="store_true" for a
    switch with no --no- form). `flag`: the flag's name, or names, where they are not the
    field's (`--prefill-buckets` for `buckets`). `flag_default`: the flag's own default
    where a command's differs from the field's, or where a flag value stands for None
    ("never", 0: off); such a flag's value always goes to the config, None included."""
    names = (flag,) if isinstance(flag, str) else tuple(flag or ())
    meta = {"help": help, "flag": argparse_kw, "names": names}
    if flag_default is not _UNSET:
        meta["flag_default"] = flag_default
    return dataclasses.field(default=default, metadata=meta)


def same_option(cls, name: str):
    """The field `name` as the config `cls` declares it (default, help, flag): for a config
    that takes the same option."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def _base_type(annotation):
    """int for `int`, `int | None`; str for `tuple[str, ...]` (an appendable flag)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin is tuple:
        return typing.get_args(annotation)[0]
    return annotation


def add_config_flags(ap: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()):
    """One flag per field of the dataclass `cls` (fields without `option` metadata and those
    in `skip` get none)."""
    hints = typing.get_type_hints(cls)
    helps = getattr(cls, "HELP", {})  # a subclass's own wording for an inherited field
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        typ = _base_type(hints[f.name])
        kw = dict(f.metadata["flag"], dest=f.name, default=f.metadata.get("flag_default"))
        kw["help"] = helps.get(f.name, f.metadata["help"]).format(default=f.default)
        names = f.metadata.get("names") or ("--" + f.name.replace("_", "-"),)
        if typing.get_origin(hints[f.name]) is tuple and "type" not in kw:
            ap.add_argument(*names, action="append", **kw)  # one value per flag given
        elif typ is bool:
            kw.setdefault("action", argparse.BooleanOptionalAction)
            ap.add_argument(*names, **kw)
        else:
            if "choices" not in kw:
                kw.setdefault("metavar", typ.__name__.upper())
            kw.setdefault("type", typ)  # a field's own parser (e.g. `int_list`) wins
            ap.add_argument(*names, **kw)


def config_from_flags(cls, args: argparse.Namespace):
    """`cls` from the flags `add_config_flags` made for it: each flag given (a list as a
    tuple), the field's default for the others. ValueError (one line) from its checks."""
    given = {}
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value is not None or "flag_default" in f.metadata:
            given[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**given)


def add_run_flags(ap: argparse.ArgumentParser):
    """--resume, --stop-after, --no-compile-cache and --no-cpu-kernels (the closing
    benchmark's decoding), which every training command takes."""
    from medusa_jax.kernels import flags as kernel_flags
    from medusa_jax.runtime import compile_cache

    ap.add_argument("--resume", metavar="RUN_DIR",
                    help="continue the run in RUN_DIR from its last checkpoint")
    ap.add_argument("--stop-after", type=int, metavar="N",
                    help="stop after N steps in this invocation (as if preempted; resume later)")
    compile_cache.add_flag(ap)
    kernel_flags.add_flag(ap)


def parse_config(ap: argparse.ArgumentParser, cls, argv=None):
    """(config, --resume, --stop-after) from the command line. With --resume the run's saved
    config.json is the base and only the fields in `cls.RESUMABLE` may change; the config
    is validated; every problem is an `ap.error` (one line, exit 2). Then the persistent
    compilation cache is turned on, unless --no-compile-cache (`compile_cache.enable`)."""
    args = vars(ap.parse_args(argv))
    resume, stop_after = args.pop("resume"), args.pop("stop_after")
    no_compile_cache = args.pop("no_compile_cache", None)  # None: a parser without the flag
    if args.pop("no_cpu_kernels", False):
        from medusa_jax.kernels import flags as kernel_flags

        kernel_flags.apply_flag(argparse.Namespace(no_cpu_kernels=True))
    given = {k: (tuple(v) if isinstance(v, list) else v) for k, v in args.items()
             if v is not None}
    if stop_after is not None and stop_after < 1:
        ap.error("--stop-after must be >= 1")
    try:
        cfg = _resumed(cls, given, resume) if resume is not None else cls(**given)
        cfg = cfg.validate()
    except (ValueError, OSError) as e:
        ap.error(str(e))
    if no_compile_cache is not None:
        from medusa_jax.runtime import compile_cache

        compile_cache.enable(off=no_compile_cache)
    return cfg, resume, stop_after


def _resumed(cls, given: dict, resume: str):
    from medusa_jax.runtime import rundir

    run_dir = Path(resume)
    saved = run_dir / rundir.CONFIG_FILE
    if not saved.is_file():
        raise ValueError(f"--resume {resume}: not a training run (no config.json there)")
    try:
        raw = json.loads(saved.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--resume {resume}: unreadable config.json ({e})") from None
    if rundir.run_config(run_dir) is None:
        raise ValueError(f"--resume {resume}: not a training run (its config.json is not a "
                         f"run's: a model or heads folder?)")
    method = rundir.run_method(run_dir)
    if method != cls.RUN_PREFIX:
        raise ValueError(f"--resume {resume}: a {method} run; continue it with "
                         f"python -m train.{method} --resume {resume}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - fields - {"method"})
    if unknown:
        raise ValueError(f"--resume {resume}: config.json has unknown field"
                         f"{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    try:
        base = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()
                      if k in fields})
    except TypeError as e:
        raise ValueError(f"--resume {resume}: unreadable config.json ({e})") from None
    changed = sorted(k for k, v in given.items()
                     if k not in cls.RESUMABLE and k != "output_dir" and v != getattr(base, k))
    if changed:
        raise ValueError(f"cannot change {', '.join('--' + c.replace('_', '-') for c in changed)}"
                         f" when resuming (only {', '.join(sorted(cls.RESUMABLE))})")
    # --steps and --epochs replace each other (a saved run has one of them)
    given = dict(given, output_dir=str(run_dir))
    if "steps" in given and "epochs" not in given:
        given["epochs"] = None
    elif "epochs" in given and "steps" not in given:
        given["steps"] = None
    return dataclasses.replace(base, **given)


def int_in(low: int, high: int | None = None, what: str = "an integer", bounds: str = ""):
    """argparse type: an integer in low..high (`high` None: no upper bound); `bounds` words
    the range in the error (default "must be >= low")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{bounds or f'must be >= {low}'}, got {value}")
        return value

    return parse


positive_int = int_in(1)
positive_int.__doc__ = "argparse type: an integer >= 1."
nonnegative_int = int_in(0, 2**63 - 1, bounds="must be in 0..2**63-1")  # what numpy seeds take
seed_int = int_in(-2**63, 2**63 - 1, bounds="must be in -2**63..2**63-1")  # jax.random.key's


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def name_list(text: str) -> str:
    """argparse type: comma-separated names without empty entries (kept as the string)."""
    if any(not x.strip() for x in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty entry")
    return text


def int_list(minimum: int | None = None):
    """argparse type: comma-separated integers, each >= `minimum` when given."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
        bad = [v for v in values if minimum is not None and v < minimum]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be >= {minimum}, got {bad[0]}")
        return values

    return parse


@contextlib.contextmanager
def errors_to_exit():
    """The library's input errors (bad files, configs, checkpoints) as `error: ...` and
    exit status 1, without a traceback."""
    from medusa_jax.runtime.rundir import RunDirBusy

    try:
        yield
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError, RunDirBusy) as e:
        sys.exit(f"error: {e}")


def writable_output(flag: str, path: str, folder: bool = False) -> Path:
    """An output path checked before any work: a file (`folder=False`) must not be an
    existing folder and its parent must exist and be writable; a folder must be a folder or
    creatable. Raises ValueError naming the flag."""
    import os

    p = Path(path)
    if not folder and (p.is_dir() or path.endswith(("/", os.sep))):
        raise ValueError(f"{flag} {path}: is a folder; give a file name")
    if not folder and p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{flag} {path}: the file is read-only")
    if folder and p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a folder")
    parent = p if folder and p.exists() else p.parent
    while folder and not parent.exists() and parent != parent.parent:
        parent = parent.parent  # a folder is created with its parents
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: its folder {parent} does not exist")
    import tempfile

    try:  # os.access says yes to root on read-only and pseudo filesystems (/proc, /sys)
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".medusa-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write into {parent} "
                         f"({e.strerror or type(e).__name__})") from None
    return p


def mesh_spec(text: str) -> str:
    """argparse type: a mesh spec that parses (see `sharding.parse_mesh_spec`)."""
    from medusa_jax.runtime.sharding import parse_mesh_spec

    try:
        parse_mesh_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
