"""Multi-host training: 2 processes x 4 CPU devices on 127.0.0.1.

The same run as 2 processes (gloo collectives, a free port per launch), as 1 process x 8
devices and as 1 device gives the same losses and heads (Medusa heads; an EAGLE-3 drafter's
2 processes equal its 1 process); killing a process mid-run and
resuming all of them from the last checkpoint gives the uninterrupted run's heads; a process
that cannot reach its coordinator fails with one line within its timeout.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

pytestmark = [pytest.mark.multihost, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parents[2]  # the repository
# Waits end on their event (a process exiting, a checkpoint written), never on a short clock:
# on a busy machine these runs are slower, not failed. HANG only catches a hang; PEER_WAIT
# is how long a process waits for the other to join (its start, JAX's import, under load).
HANG, PEER_WAIT = 900, 300
STEPS = 6
FLAGS = ["--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32", "--num-heads", "2",
         "--log-every", "1", "--save-every", "1", "--eval-every", "100000", "--keep", "10",
         "--eval-prompts", "0", "--template", "plain", "--heldout-fraction", "0",
         "--lr", "0.0005"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "d.jsonl"
    stories = ["Once upon a time there was a cat who liked the sun.",
               "Lily had a red ball and she played with it in the park every day.",
               "Tom and his dog went to the river to find a big fish.",
               "The little bird sang a happy song in the tall green tree."]
    f.write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": s.split(" ", 3)[-1][:10]},
        {"from": "gpt", "value": " " + s}]}) + "\n" for s in stories * 4))
    return f


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# train.eagle through the same trainer: its own flags in place of --num-heads
_HEADS = FLAGS.index("--num-heads")
EAGLE_FLAGS = FLAGS[:_HEADS] + FLAGS[_HEADS + 2:] + ["--ttt-steps", "2", "--draft-vocab", "64"]


def _launch(run: Path, data: Path, n: int, *extra, devices: int = 4, mesh="data=2,fsdp=4",
            command="train.medusa1", flags=FLAGS):
    port = _free_port()
    procs = []
    for i in range(n):
        dist = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
                "--process-id", str(i)] if n > 1 else []
        procs.append(subprocess.Popen(
            [sys.executable, "-m", command, "--output-dir", str(run), "--data",
             str(data), "--mesh", mesh, *flags, *dist, "--init-timeout", str(PEER_WAIT),
             *extra],
            cwd=ROOT, env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    return procs


def _finish(procs):
    outs = [p.communicate(timeout=HANG) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, (out[-2000:], err[-3000:])
    return outs


def _result(run: Path):
    heads = load_file(str(run / "heads" / "medusa_heads.safetensors"))
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").open()
              if json.loads(line)["split"] == "train"]
    return heads, losses


def _close(a, b, heads_atol=1e-5):
    (ha, la), (hb, lb) = a, b
    assert len(la) == len(lb) == STEPS
    np.testing.assert_allclose(la, lb, atol=1e-5, rtol=0)
    for k in ha:
        np.testing.assert_allclose(ha[k], hb[k], atol=heads_atol, rtol=0, err_msg=k)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, data_file):
    run = tmp_path_factory.mktemp("mp") / "run"
    outs = _finish(_launch(run, data_file, 2))
    assert "process 1 of 2, 8 devices" in outs[1][0]
    return run


@pytest.mark.slow
def test_two_processes_equal_one_process_and_one_device(tmp_path, data_file, two_processes):
    one8 = _launch(tmp_path / "one8", data_file, 1, devices=8)
    one1 = _launch(tmp_path / "one1", data_file, 1, devices=1, mesh="1,1")
    _finish(one8 + one1)
    ref = _result(two_processes)
    _close(ref, _result(tmp_path / "one8"))
    # one device sums in another order than 8; Adam turns that float noise into up to
    # ~1.2e-5 on a single head weight (1 of 65,536, measured) after 6 steps
    _close(ref, _result(tmp_path / "one1"), heads_atol=2e-5)
    # only process 0 wrote the run directory's files; every checkpoint is complete
    assert sorted(int(p.name) for p in (two_processes / "checkpoints").iterdir()) == \
        list(range(1, STEPS + 1))


@pytest.mark.slow
def test_kill_one_process_and_resume_all_equals_uninterrupted(tmp_path, data_file,
                                                              two_processes):
    run = tmp_path / "run"
    procs = _launch(run, data_file, 2)
    t0 = time.time()
    while not (run / "checkpoints" / "2").is_dir():  # Orbax renames a step when complete
        assert time.time() - t0 < HANG and all(p.poll() is None for p in procs), \
            [p.communicate() for p in procs]
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)  # one host dies mid-run ...
    procs[0].send_signal(signal.SIGKILL)  # ... and the job is torn down (as a scheduler does)
    for p in procs:
        p.communicate()
    assert not (run / "heads").exists()  # it had not finished
    _finish(_launch(run, data_file, 2, "--resume", str(run)))
    _close(_result(two_processes), _result(run))


@pytest.mark.slow
def test_eagle3_two_processes_equal_one_process(tmp_path, data_file):
    """train.eagle (an EAGLE-3 drafter split over fsdp; rows over 2 x 4 devices) as 2
    processes gives the 1-process x 8-device run's losses and drafter."""
    kw = dict(command="train.eagle", flags=EAGLE_FLAGS)
    two = _launch(tmp_path / "two", data_file, 2, **kw)
    one = _launch(tmp_path / "one", data_file, 1, devices=8, **kw)
    outs = _finish(two + one)
    assert "process 1 of 2, 8 devices" in outs[1][0]
    _close(_result(tmp_path / "two"), _result(tmp_path / "one"))


def _start_up_seconds() -> float:
    """How long a training command takes, here and now, to import what it runs before it
    joins the cluster (the machine's load included)."""
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import train.medusa1, medusa_jax.training.trainer, "
                    "medusa_jax.training.recipes.medusa1"], cwd=ROOT, env=_env(4), check=True,
                   timeout=HANG)
    return time.time() - t0


@pytest.mark.slow
def test_unreachable_coordinator_fails_in_one_line(tmp_path, data_file):
    # within its --init-timeout of 3 s once started, where JAX alone would wait minutes: the
    # bound is the start-up measured now (twice, for the data and the run's setup) + 3 s + 30
    bound = 2 * _start_up_seconds() + 3 + 30
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-m", "train.medusa1", "--output-dir", str(tmp_path / "r"),
         "--data", str(data_file), *FLAGS, "--coordinator", f"127.0.0.1:{_free_port()}",
         "--num-processes", "2", "--process-id", "1", "--init-timeout", "3"],
        cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=HANG)
    assert p.returncode != 0
    assert time.time() - t0 < bound
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot reach the coordinator" in lines[0], p.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_coordinator_address_that_is_not_this_machine_fails_process_0_in_one_line(
        tmp_path, data_file):
    """Process 0 runs the coordinator: an address of another machine (192.0.2.1, TEST-NET-1)
    would make JAX abort with a C++ stack trace (exit 134) after the timeout."""
    p = subprocess.run(
        [sys.executable, "-m", "train.medusa1", "--output-dir", str(tmp_path / "r"),
         "--data", str(data_file), *FLAGS, "--coordinator", "192.0.2.1:12345",
         "--num-processes", "2", "--process-id", "0", "--init-timeout", "5"],
        cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=HANG)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("error: --coordinator 192.0.2.1:12345: process 0 runs the "
                               "coordinator, but 192.0.2.1 is not an address of this machine")
    assert not (tmp_path / "r").exists()
