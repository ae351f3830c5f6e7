"""Multi-process (multi-host) runs: joining the JAX cluster, and who writes what.

`initialize` joins the processes of one run with `jax.distributed.initialize`, before any JAX
computation: explicitly (`--coordinator HOST:PORT --num-processes N --process-id I`, the same
coordinator and N on every process), or by JAX's own cluster detection on a Cloud TPU pod
slice or under SLURM / Open MPI when those flags are absent. On CPU the cross-process
collectives are gloo's.

Every process computes every step; only process 0 (`is_writer`) writes the run directory's
files (config, metrics, plots, the heads artifact); Orbax checkpoints are written and read by
all processes together.

JAX aborts a process whose coordinator does not answer (a C++ fatal error with a stack
trace), so a non-coordinator first checks, with a plain TCP connection retried for
`timeout` seconds, that the coordinator is listening, and process 0 that the coordinator's
address is its own; each fails with one line if not.
"""

from __future__ import annotations

import os
import socket
import time

import jax


def cluster_detected(env=None) -> bool:
    """Whether JAX's cluster auto-detection applies: a multi-host Cloud TPU slice, or a
    SLURM / Open MPI job of more than one task."""
    env = os.environ if env is None else env
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return True
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if env.get(var, "1").isdigit() and int(env.get(var, "1")) > 1:
            return True
    return False


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--coordinator {address!r}: expected HOST:PORT")
    return host, int(port)


def wait_for_coordinator(address: str, timeout: float):
    host, port = _split(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ValueError(f"cannot reach the coordinator {address} within {timeout:g}s "
                                 f"({e.strerror or e}); start process 0 first, or check "
                                 f"--coordinator") from None
            time.sleep(0.2)


def check_coordinator_host(address: str):
    """Process 0 runs the coordinator on `address`: its host must be this machine (JAX would
    otherwise wait out the timeout and abort with a C++ stack trace)."""
    host, _ = _split(address)
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"--coordinator {address}: cannot resolve {host} "
                         f"({e.strerror or e})") from None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((sockaddr[0], 0))
            return
        except OSError as e:
            why = e.strerror or str(e)
    raise ValueError(f"--coordinator {address}: process 0 runs the coordinator, but {host} is "
                     f"not an address of this machine ({why}); give process 0's own host name "
                     f"or IP")


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               timeout: float = 300):
    """Join the cluster (once per process; a no-op when already joined or single-process)."""
    if jax.distributed.is_initialized():
        return
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not any(given):
        if cluster_detected():
            jax.distributed.initialize(initialization_timeout=int(timeout))
        return
    if not all(given):
        raise ValueError("multi-process runs need --coordinator, --num-processes and "
                         "--process-id together (or none of them on a TPU pod / SLURM)")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} is not in 0..{num_processes - 1} "
                         f"(--num-processes {num_processes})")
    _split(coordinator)
    if num_processes == 1:
        return
    if process_id != 0:
        wait_for_coordinator(coordinator, timeout)
    else:
        check_coordinator_host(coordinator)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               initialization_timeout=int(timeout))
    if jax.process_count() != num_processes:
        raise ValueError(f"--num-processes {num_processes}, but the coordinator {coordinator} "
                         f"runs {jax.process_count()} processes")


def is_writer() -> bool:
    """Process 0 writes the run directory's files; the others only compute."""
    return jax.process_index() == 0


def barrier(name: str):
    """All processes wait here (no-op on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
