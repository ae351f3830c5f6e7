"""Owning a run directory: one training process at a time, and a clean stop on a signal.

- `RunLock`: an exclusive `flock` on `<run>/.lock`, which also records the holder (pid,
  host, start time). A second run on the same directory fails at once naming the holder. The
  kernel drops the lock when its process dies, however it dies, so a lock left by a killed
  run is never in the way (the file stays; its old contents are reported as stale).
- `StopSignals`: SIGINT (Ctrl-C) and SIGTERM (what schedulers and preemptible TPU/GPU VMs
  send) set a flag instead of killing the process; the training loop finishes the current
  step, saves a checkpoint and exits. A second signal stops at once, and so does any signal
  once training is done (`training_done`: the final evaluation, the heads, the benchmark).
- What a command may write into: `is_run_dir` / `run_method` (is this folder a training run,
  and of which method), `check_output_dir` (a new or empty folder, or a run: never a
  non-empty folder that is something else), `check_new_folder` (export folders).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

LOCK_FILE = ".lock"
CONFIG_FILE = "config.json"
# TrainConfig fields every run's config.json holds (a model's or a heads folder's config.json
# holds none of them); rundir stays free of the config classes, a test keeps these in step
RUN_FIELDS = ("output_dir", "num_heads", "seq_len", "batch_size", "save_every",
              "distill_samples")


def run_config(folder: str | Path) -> dict | None:
    """The saved config of the training run in `folder`, or None when it is not a run."""
    conf = Path(folder) / CONFIG_FILE
    if not conf.is_file():
        return None
    try:
        raw = json.loads(conf.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return raw if isinstance(raw, dict) and all(k in raw for k in RUN_FIELDS) else None


def is_run_dir(folder: str | Path) -> bool:
    return run_config(folder) is not None


def run_method(folder: str | Path) -> str | None:
    """"medusa1" or "medusa2" (the command that made the run), None when not a run. Runs
    written before config.json recorded its method are told apart by Medusa-2's own fields."""
    raw = run_config(folder)
    if raw is None:
        return None
    return raw.get("method") or ("medusa2" if "stage1_steps" in raw else "medusa1")


def _listing(folder: Path, n: int = 2) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def check_output_dir(folder: str | Path, flag: str = "--output-dir"):
    """A training run may write into a new folder, an empty one, or a training run (its own,
    unfinished or resumed); anything else is refused in one line (ValueError)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {folder}: is a file, not a folder")
    if folder.is_dir() and any(p.name != LOCK_FILE for p in folder.iterdir()) and \
            not is_run_dir(folder):
        raise ValueError(f"{flag} {folder}: holds files and is not a training run "
                         f"({_listing(folder)}); give a new or empty folder")


def check_new_folder(folder: str | Path, flag: str = "--output", force: bool = False,
                     allowed=None):
    """An output folder that must be new or empty, or, with `force`, hold only what
    `allowed(folder)` accepts (e.g. an earlier export of the same layout). ValueError."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {folder}: is a file, not a folder")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    if not force:
        raise ValueError(f"{flag} {folder}: the folder holds files ({_listing(folder)}); give "
                         f"a new or empty folder, or --force to replace an earlier export")
    if allowed is not None:
        why = allowed(folder)
        if why:
            raise ValueError(f"{flag} {folder}: {why}; not replaced even with --force")


class RunDirBusy(RuntimeError):
    """Another live process trains in this run directory."""


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None
        self.stale: dict | None = None  # what a dead holder left in the file, if anything

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            who = (f"pid {holder.get('pid')} on {holder.get('host')}, started "
                   f"{holder.get('started')}") if holder else "another process"
            raise RunDirBusy(f"{self.path.parent} is in use by {who}; wait for it to finish "
                             f"or use another --output-dir") from None
        self.stale = _read(fd) or None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self):
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        return json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        return {}


class Interrupted(Exception):
    """Training stopped on a signal (after saving when it could). `code` is the exit status
    a shell expects: 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.code = 128 + signum


class StopNow(KeyboardInterrupt):
    """A second signal, or a signal once training is done: stop at once. `code`: the exit
    status (128 + the signal number); `run_dir`: set by the trainer to the run a --resume
    would continue (None: removed, it held nothing worth keeping); `done`: (run directory,
    step) when training had finished and saved its last checkpoint."""

    def __init__(self, signum: int, done: tuple[Path, int] | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.code = signum, 128 + signum
        self.run_dir: Path | None = None
        self.done = done

    def done_message(self) -> str:
        """What a stop after training says is kept (the heads once they are written)."""
        run_dir, step = self.done
        name = signal.Signals(self.signum).name
        if (Path(run_dir) / "heads").is_dir():
            return (f"stopped by {name} after training finished; the checkpoint of step "
                    f"{step} and the heads are in {run_dir}")
        return (f"stopped by {name} after training finished; the checkpoint of step {step} "
                f"is in {run_dir} (--resume {run_dir} writes the heads)")


class StopSignals:
    """Within the `with` block, SIGINT/SIGTERM set `requested` (the signal number); a second
    one raises StopNow at once. Outside the main thread it does nothing (Python only
    delivers signals there).

    Signals that arrive while the main thread is inside one long C call (a compile, a batch
    of self-distillation) reach the Python handler only once; the C handler still writes one
    byte per signal to the wakeup fd, so the handler counts those: two SIGTERMs during one
    compile are two."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: int | None = None
        self.done: tuple[Path, int] | None = None  # `training_done`
        self._old = {}
        self._pipe: tuple[int, int] | None = None
        self._old_fd = -1

    def _arrived(self, signum: int) -> int:
        """How many `signum`s arrived since the last call (at least this one)."""
        n = 0
        while self._pipe is not None:
            try:
                data = os.read(self._pipe[0], 512)
            except (BlockingIOError, OSError):
                break
            n += data.count(bytes([signum]))
            if len(data) < 512:
                break
        return max(n, 1)

    def training_done(self, run_dir: Path, step: int):
        """Training has ended with its last checkpoint saved: from now on a signal stops at
        once (nothing is left to save, so nothing to finish first); one that came during the
        last step stops now."""
        self.done = (Path(run_dir), step)
        if self.requested is not None:
            raise StopNow(self.requested, self.done)

    def _handle(self, signum, frame):
        n = self._arrived(signum)
        if self.done is not None:
            self.requested = signum
            raise StopNow(signum, self.done)
        if self.requested is not None:
            raise StopNow(signum)
        self.requested = signum
        print(f"\n{signal.Signals(signum).name} received: finishing the current step and "
              f"saving a checkpoint (send it again to stop at once)", flush=True)
        if n > 1:
            raise StopNow(signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            for fd in (r, w):
                os.set_blocking(fd, False)
            self._pipe = (r, w)
            self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_fd)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
