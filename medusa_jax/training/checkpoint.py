"""Training checkpoints with Orbax: trained params, optimizer state, step, data position.

One `ocp.CheckpointManager` per run directory (`<run>/checkpoints/<step>/`), each step a
Composite of three items:

    params     StandardSave: the trained subtrees only ({"heads": ...} for Medusa-1; the
               frozen backbone is reloaded from --model, not copied into every checkpoint)
    opt_state  StandardSave: the full optax state (frozen leaves hold no arrays)
    meta       JsonSave: {"step", "data_position", "config"}

Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it only once every item
is on disk, so a run killed mid-save leaves a temp directory that `all_steps()` never lists
(and that the next writing `Checkpointer` on the folder removes); resuming always starts from
the last complete step. `max_to_keep` prunes older steps.

Every step's meta also holds a checksum of each saved tensor, computed from the values
(`fingerprints`), so a data file whose bytes were damaged in place (orbax reads it without
complaint) is caught on restore; a restored tensor must also be finite (a diverged run's
step is not resumed as if intact).

A finalized step can still be unreadable (a truncated or deleted array file, damaged bytes,
non-finite values, a junk folder named like a step): `restore` then falls back to the
newest step that restores, moves the newer unreadable ones aside (renamed
`<step>.unreadable`, so a resumed run can save those steps again) and reports them in
`meta["skipped"]`. A failed save (disk full, a path that
is not a writable directory) raises one-line `CheckpointError` from `save()` or `wait()`;
the earlier checkpoints stay restorable.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from medusa_jax.runtime import quiet, sharding
from medusa_jax.training.step import TrainState

ITEMS = ("params", "opt_state", "meta")
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """No checkpoint to resume from, or one that does not match the run."""


def _one_line(e: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, clipped (TensorStore errors run to pages)."""
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    msg = str(msg).strip().splitlines()[0] if str(msg).strip() else ""
    msg = msg.split(" See full TensorStore details")[0]
    if len(msg) > limit:
        msg = msg[:limit] + "..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


# Checkpointers whose save is in flight (`save` to `wait`): orbax's errors about it are
# raised by `wait()` or the next `save()` as one CheckpointError line
_SAVING: set[int] = set()


class _FoldOrbaxTracebacks(logging.Filter):
    """Orbax logs ERROR records (some with a full traceback) when a background save fails,
    before the error reaches `wait()`, which raises it as one CheckpointError line: while a
    save is in flight those records are dropped; other tracebacks are folded into their
    line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" in record.pathname and record.levelno >= logging.ERROR and _SAVING:
            return False
        if record.exc_info and record.exc_info[1] is not None and "orbax" in record.pathname:
            msg, exc = record.getMessage(), record.exc_info[1]
            if isinstance(exc, KeyboardInterrupt):
                # a second signal interrupted the wait for a save, not the save: the command
                # reports the stop in its own line
                return False
            record.msg = msg if str(exc) and str(exc) in msg else f"{msg} ({_one_line(exc)})"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


if not any(isinstance(f, _FoldOrbaxTracebacks) for f in logging.getLogger("absl").filters):
    logging.getLogger("absl").addFilter(_FoldOrbaxTracebacks())


def _collect_quietly():
    """After a failed restore, orbax's abandoned read coroutines raise again when they are
    garbage-collected ("Exception ignored in: <coroutine ...>" and a page of traceback on
    stderr, possibly much later). The failure is already reported in one line: those are
    dropped (`quiet.unraisable`, installed by every Checkpointer) and collected now."""
    gc.collect()


class _Damaged(ValueError):
    """A step that reads but does not hold what was saved (its message is the reason)."""


def _unreadable(e: Exception) -> str:
    if "error while reading array" in str(e):
        return "an array file is missing or truncated"
    if isinstance(e, _Damaged):
        return str(e)
    return _one_line(e, limit=120)


def _bits(x: jax.Array) -> jax.Array:
    """The raw bits of `x`, flat, as uint32 (64-bit values as two words each)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


@jax.jit
def _leaf_fingerprints(leaves: list) -> list:
    """Per leaf: two position-weighted sums of its bits (uint32, wrapping; every weight is
    odd, so changing any one value always changes both) and whether it is finite. Exact
    integer sums: the same on any mesh and sharding, computed where the arrays live."""
    out = []
    for x in leaves:
        bits = _bits(x)
        i = jnp.arange(bits.shape[0], dtype=jnp.uint32)
        w1 = (i * jnp.uint32(0x9E3779B1)) ^ (i >> 15) | jnp.uint32(1)
        w2 = (i * jnp.uint32(0x85EBCA77) + jnp.uint32(0xC2B2AE3D)) | jnp.uint32(1)
        finite = (jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
                  else jnp.bool_(True))
        out.append((jnp.sum(bits * w1, dtype=jnp.uint32), jnp.sum(bits * w2, dtype=jnp.uint32),
                    finite))
    return out


def fingerprints(items: dict) -> dict[str, tuple[str, bool]]:
    """{tensor name: (checksum of its values as hex, all finite)} for the array leaves of
    each item (named like `params['heads']['proj']`)."""
    named = [(f"{path[0].key}{jax.tree_util.keystr(path[1:])}", x)
             for path, x in jax.tree_util.tree_flatten_with_path(items)[0]
             if isinstance(x, jax.Array | np.ndarray | np.generic) and np.size(x)]
    # replicated scalars: this process's copy is the value (also where arrays span hosts)
    local = lambda v: np.asarray(v.addressable_data(0))  # noqa: E731
    sums = [[local(v) for v in leaf] for leaf in _leaf_fingerprints([x for _, x in named])]
    return {name: (f"{int(a):08x}{int(b):08x}", bool(f))
            for (name, _), (a, b, f) in zip(named, sums)}


def _check_intact(saved: dict | None, restored: dict) -> None:
    """Refuse restored tensors that differ from the checksums saved with them (a checkpoint
    written before checksums has none: then only finiteness is checked) or are not finite."""
    for name, (checksum, finite) in restored.items():
        if isinstance(saved, dict) and name in saved and saved[name] != checksum:
            raise _Damaged(f"damaged: {name} does not match the checksum saved with it")
        if not finite:
            raise _Damaged(f"{name} holds non-finite values (NaN or inf)")


def _abstract(tree, shardings):
    """ShapeDtypeStructs carrying the target shardings (what StandardRestore fills in)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


class Checkpointer:
    def __init__(self, directory: str | Path, max_to_keep: int | None = 3,
                 async_save: bool = True, create: bool = True):
        self.directory = Path(directory).absolute()
        # late TensorStore callbacks of a failed save or restore (also the previous run's,
        # on --resume) and abandoned reads: each failure has its own one-line error
        quiet.unraisable(quiet.CLOSED_LOOP, "Encountered error while reading array")
        if not create and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: no checkpoint directory")
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory, cannot save checkpoints "
                                  f"there")
        # a writing manager removes the temp folders of saves a killed run left unfinished
        # (a reading one leaves the folder as it is)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=create, cleanup_tmp_directories=create,
            enable_async_checkpointing=async_save)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options,
                                                 item_names=ITEMS)
        except OSError as e:
            raise CheckpointError(f"{self.directory}: cannot create the checkpoint directory "
                                  f"({_one_line(e)})") from None
        self._saving: int | None = None  # the step an unfinished async save is writing

    def all_steps(self) -> list[int]:
        """Finalized steps only: temp directories of unfinished saves are never listed."""
        return list(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def saved_config(self) -> tuple[int | None, dict | None]:
        """(step, config) from the metadata of the newest checkpoint whose metadata reads;
        (None, None) without one. Reads no arrays (what --resume checks before any work)."""
        self.manager.reload()
        for s in sorted(self.all_steps(), reverse=True):
            try:
                meta = self.manager.restore(s, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore())).meta
            except Exception:  # noqa: BLE001 - unreadable: restore() will skip it too
                continue
            if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
                return s, meta["config"]
        return None, None

    def save(self, state: TrainState, trained: tuple[str, ...], data_position: int,
             config: dict, force: bool = False) -> bool:
        """Start saving `state` at its step (asynchronously); returns whether it saves.

        A failed save raises CheckpointError here or from the next `save()`/`wait()`."""
        self.wait()  # an earlier save that failed in the background raises here
        step = int(state.step)
        # checked here because orbax, when it cannot create the step folder, raises but
        # leaves its writer threads waiting 5 minutes for that folder (and the process with
        # them)
        if not self.directory.is_dir() or not os.access(self.directory, os.W_OK | os.X_OK):
            what = ("is not writable" if self.directory.is_dir()
                    else "no longer exists or is not a directory")
            raise CheckpointError(f"{self.directory}: cannot save checkpoint step {step}: "
                                  f"the checkpoint directory {what}")
        params = {k: state.params[k] for k in trained}
        checksums = {name: checksum for name, (checksum, _) in fingerprints(
            {"params": params, "opt_state": state.opt_state}).items()}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(state.opt_state),
            meta=ocp.args.JsonSave({"step": step, "data_position": int(data_position),
                                    "config": config, "checksums": checksums}))
        _SAVING.add(id(self))  # orbax's threads may fail before save() returns
        try:
            saved = self.manager.save(step, args=args, force=force)
        except Exception as e:  # noqa: BLE001 - any failure to write is one line
            raise self._save_failed(step, e) from None
        if saved:
            self._saving = step
        else:
            _SAVING.discard(id(self))
        return saved

    def _save_failed(self, step: int | None, e: Exception) -> CheckpointError:
        self._saving = None
        _SAVING.discard(id(self))
        try:
            self.manager.reload()  # forget the step that was not written
            last = self.manager.latest_step()
        except Exception:  # noqa: BLE001
            last = None
        kept = (f"step {last} is the last complete checkpoint" if last is not None
                else "no complete checkpoint")
        return CheckpointError(f"{self.directory}: saving checkpoint step {step} failed "
                               f"({_one_line(e)}); {kept}")

    def _restore_step(self, step: int, target: TrainState, shardings: TrainState,
                      trained: tuple[str, ...]) -> tuple[TrainState, dict]:
        params_t = {k: target.params[k] for k in trained}
        params_s = {k: shardings.params[k] for k in trained}
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params_t, params_s)),
            opt_state=ocp.args.StandardRestore(
                _abstract(target.opt_state, shardings.opt_state)),
            meta=ocp.args.JsonRestore()))
        meta = out.meta
        if not isinstance(meta, dict) or meta.get("step") != step:
            got = meta.get("step") if isinstance(meta, dict) else type(meta).__name__
            raise ValueError(f"its meta says step {got}, not {step}")
        _check_intact(meta.get("checksums"), fingerprints(
            {"params": out.params, "opt_state": out.opt_state}))
        params = dict(target.params)
        params.update(out.params)
        state = TrainState(step=sharding.put(np.int32(meta["step"]), shardings.step),
                           params=params, opt_state=out.opt_state)
        return state, dict(meta)

    def restore(self, target: TrainState, shardings: TrainState, trained: tuple[str, ...],
                step: int | None = None) -> tuple[TrainState, dict]:
        """Restore into the structure/shardings of `target` (an abstract or real state).

        Frozen subtrees are taken from `target.params` unchanged. Returns (state, meta).

        `step=None`: the newest step that restores. Newer steps that do not (corrupt, junk,
        or not from this run) are moved aside to `<step>.unreadable` and listed in
        `meta["skipped"]` as {"step", "reason", "moved_to"} (empty when none was skipped);
        a warning is logged as well. CheckpointError (one line) when no step restores.
        An explicit `step` is restored or raises, without falling back."""
        self.manager.reload()  # steps on disk now (another process may have written)
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                have = ", ".join(map(str, steps)) or "none"
                raise CheckpointError(f"{self.directory}: no checkpoint at step {step} "
                                      f"(have: {have})")
            why = None
            try:
                state, meta = self._restore_step(step, target, shardings, trained)
            except Exception as e:  # noqa: BLE001 - corrupt or foreign: one line
                why = _unreadable(e)
            if why is not None:
                _collect_quietly()
                raise CheckpointError(f"{self.directory}/{step}: cannot restore this checkpoint "
                                      f"(corrupt or not from this run: {why})")
            meta["skipped"] = []
            return state, meta
        if not steps:
            raise CheckpointError(f"{self.directory}: no finished checkpoint to resume from")
        failed: list[tuple[int, str]] = []
        for s in sorted(steps, reverse=True):
            why = None
            try:
                state, meta = self._restore_step(s, target, shardings, trained)
            except Exception as e:  # noqa: BLE001 - try the next older step
                why = _unreadable(e)
            if why is not None:
                failed.append((s, why))
                _collect_quietly()
                continue
            meta["skipped"] = [{"step": f, "reason": why, "moved_to": self._set_aside(f)}
                               for f, why in failed]
            if failed:
                self.manager.reload()
                log.warning("%s: restored step %d; skipped newer unreadable step(s) %s",
                            self.directory, s, "; ".join(
                                f"{k['step']} ({k['reason']}; moved to {k['moved_to']})"
                                for k in meta["skipped"]))
            return state, meta
        raise CheckpointError(
            f"{self.directory}: no checkpoint restores (corrupt or not from this run): "
            + "; ".join(f"step {f}: {why}" for f, why in failed))

    def _set_aside(self, step: int) -> str:
        """Rename an unreadable step folder so orbax no longer lists it (kept, not deleted)."""
        src = self.directory / str(step)
        dst = self.directory / f"{step}.unreadable"
        n = 1
        while dst.exists():
            n += 1
            dst = self.directory / f"{step}.unreadable{n}"
        try:
            src.rename(dst)
        except OSError as e:
            return f"nowhere ({_one_line(e, limit=80)})"
        return dst.name

    def wait(self):
        """Block until the running save is on disk; CheckpointError if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - raised by orbax's background save
            raise self._save_failed(self._saving, e) from None
        self._saving = None
        _SAVING.discard(id(self))

    def close(self):
        self.wait()
        self.manager.close()
