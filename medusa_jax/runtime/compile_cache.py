"""JAX's persistent compilation cache, on by default for the commands and `Medusa.load`.

Compiled programs are kept in `$XDG_CACHE_HOME/medusa_jax/jax-cache` (XDG_CACHE_HOME
defaults to ~/.cache), so a second run loads its decoders from disk instead of compiling
them again. Every compiled program is kept (no minimum compile time, no minimum size).

- Off for one run: `--no-compile-cache` on any command; off everywhere:
  MEDUSA_JAX_NO_COMPILE_CACHE=1 (also stops `Medusa.load` from turning it on).
- A cache folder already configured for JAX itself (JAX_COMPILATION_CACHE_DIR, or
  `jax.config.update("jax_compilation_cache_dir", ...)`) is used as it is, with its own
  settings: that is how the test suite shares one folder with the commands it launches.
- To clear it, delete the folder; it is rebuilt as programs compile.

A cache that cannot be written (the folder is a file, read-only, on a full disk) turns the
cache off for that run with a one-line note; an entry that no longer decompresses (a run
killed while writing it, a damaged disk) is deleted, recompiled and written again. Neither
stops a run. The first call of `enable` in a process decides; later calls return that
decision.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ENV_OFF = "MEDUSA_JAX_NO_COMPILE_CACHE"
FLAG = "--no-compile-cache"

_UNSET = object()
_decided = _UNSET  # the folder in use, or None (off), once `enable` has run


def default_dir() -> Path:
    """$XDG_CACHE_HOME/medusa_jax/jax-cache, XDG_CACHE_HOME defaulting to ~/.cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "medusa_jax" / "jax-cache"


def off_by_env() -> bool:
    """MEDUSA_JAX_NO_COMPILE_CACHE set to anything but "", 0, false, no or off."""
    return os.environ.get(ENV_OFF, "").strip().lower() not in ("", "0", "false", "no", "off")


def add_flag(ap: argparse.ArgumentParser):
    """--no-compile-cache, which every command takes."""
    ap.add_argument(FLAG, dest="no_compile_cache", action="store_true",
                    help=f"do not use the persistent compilation cache ({default_dir()}; "
                         f"{ENV_OFF}=1 turns it off for good)")


def _note(message: str):
    print(f"note: {message}", file=sys.stderr, flush=True)


def _writable(path: Path) -> str | None:
    """None when `path` is (or can be made) a folder we can write a file into; else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def enable(off: bool = False) -> Path | None:
    """Turn on the persistent compilation cache for this process (before the first compile)
    unless `off` (--no-compile-cache) or MEDUSA_JAX_NO_COMPILE_CACHE say otherwise. Returns
    the folder in use, or None. Never raises for the cache's sake."""
    global _decided
    if _decided is not _UNSET:
        return _decided
    import jax

    if off or off_by_env():
        jax.config.update("jax_enable_compilation_cache", False)
        _decided = None
        return None
    configured = jax.config.jax_compilation_cache_dir
    if configured:  # the user's (or the test suite's) own JAX settings
        _decided = Path(configured)
        _heal_corrupt_entries()
        return _decided
    path = default_dir()
    why = _writable(path)
    if why is not None:
        _note(f"compilation cache off for this run: cannot write to {path} ({why}); "
              f"{FLAG} or {ENV_OFF}=1 silences this")
        _decided = None
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _heal_corrupt_entries()
    _decided = path
    return path


def enable_from_args(args: argparse.Namespace) -> Path | None:
    """`enable` with the command's --no-compile-cache."""
    return enable(off=getattr(args, "no_compile_cache", False))


def _heal_corrupt_entries():
    """Make an entry that fails to decompress a miss that replaces it, not a warning on
    every run: JAX never overwrites an existing entry. (Entries that decompress but do not
    load, e.g. compiled for another CPU, are left to JAX, which recompiles them.) Relies on
    JAX internals, so any mismatch leaves JAX's own handling (a warning, then a compile)."""
    try:
        from jax._src import compilation_cache as cc
        from jax._src import lru_cache
    except ImportError:
        return
    original = getattr(cc, "get_executable_and_time", None)
    if original is None or getattr(original, "_medusa_jax_heals", False):
        return
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", "-cache")

    def get_executable_and_time(cache_key, *args, **kwargs):
        try:
            return original(cache_key, *args, **kwargs)
        except Exception:
            import jax

            folder = jax.config.jax_compilation_cache_dir
            entry = Path(folder) / f"{cache_key}{suffix}" if folder else None
            if entry is None or not _undecompressable(cc, entry):
                raise  # JAX warns and compiles
            try:
                entry.unlink()
            except OSError:
                raise  # cannot fix it: JAX warns and compiles
            _note(f"compilation cache: removed a corrupt entry ({entry.name}); recompiling it")
            return None, None

    get_executable_and_time._medusa_jax_heals = True
    cc.get_executable_and_time = get_executable_and_time


def _undecompressable(cc, entry: Path) -> bool:
    try:
        data = entry.read_bytes()
    except OSError:
        return False
    try:
        cc.decompress_executable(data)
    except Exception:  # noqa: BLE001 - zlib.error, zstd errors: the bytes are damaged
        return True
    return False
