"""Owning a run directory: one training process at a time, and a clean stop on a signal.

- `RunLock`: an exclusive `flock` on `<run>/.lock`, which also records the holder (pid,
  host, start time). A second run on the same directory fails at once naming the holder. The
  kernel drops the lock when its process dies, however it dies, so a lock left by a killed
  run is never in the way (the file stays; its old contents are reported as stale).
- `StopSignals`: SIGINT (Ctrl-C) and SIGTERM (what schedulers and preemptible TPU/GPU VMs
  send) set a flag instead of killing the process; the training loop finishes the current
  step, saves a checkpoint and exits. A second signal stops at once.
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


class StopSignals:
    """Within the `with` block, SIGINT/SIGTERM set `requested` (the signal number); a second
    one raises KeyboardInterrupt at once. Outside the main thread it does nothing (Python
    only delivers signals there)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: int | None = None
        self._old = {}

    def _handle(self, signum, frame):
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum
        print(f"\n{signal.Signals(signum).name} received: finishing the current step and "
              f"saving a checkpoint (send it again to stop at once)", flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}
