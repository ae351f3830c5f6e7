"""Signals, concurrent runs and failed starts of the training commands (rundir.py, trainer)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medusa_jax.runtime.rundir import RunDirBusy, RunLock

ROOT = Path(__file__).resolve().parents[2]  # the repository
# tiny settings on a small user data file: no self-distillation, a step takes milliseconds
FAST = ["--steps", "100000", "--batch-size", "2", "--seq-len", "32", "--num-heads", "2",
        "--log-every", "1", "--save-every", "100000", "--eval-every", "100000",
        "--eval-prompts", "0", "--template", "plain", "--heldout-fraction", "0"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "d.jsonl"
    rec = {"conversations": [{"from": "human", "value": "Once upon a time"},
                             {"from": "gpt", "value": " there was a cat who liked the sun."}]}
    f.write_text("".join(json.dumps(rec) + "\n" for _ in range(8)))
    return f


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start(*args):
    return subprocess.Popen([sys.executable, "-m", "train.medusa1", *args], cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_training(run: Path, proc, timeout=120):
    """Until the run has logged a training step (the loop is running)."""
    t0 = time.time()
    metrics = run / "metrics.jsonl"
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"exited early: {proc.communicate()}")
        if metrics.is_file() and '"split": "train"' in metrics.read_text():
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("training never started")


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_the_current_step_and_says_how_to_resume(
        tmp_path, data_file, sig, code):
    run = tmp_path / "run"
    proc = _start("--data", str(data_file), "--output-dir", str(run), *FAST)
    _wait_for_training(run, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, (out[-2000:], err[-2000:])
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"continue with --resume {run}" in last and signal.Signals(sig).name in last
    steps = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and f"checkpoint {steps[0]} saved" in last
    # the run resumes from there and finishes
    done = subprocess.run([sys.executable, "-m", "train.medusa1", "--resume", str(run),
                           "--steps", str(steps[0] + 2)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed at step {steps[0]}" in done.stdout
    assert json.loads((run / "summary.json").read_text())["step"] == steps[0] + 2


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_second_run_on_the_same_directory_fails_at_once_naming_the_holder(
        tmp_path, data_file):
    run = tmp_path / "run"
    first = _start("--data", str(data_file), "--output-dir", str(run), *FAST)
    try:
        _wait_for_training(run, first)
        second = subprocess.run([sys.executable, "-m", "train.medusa1", "--data", str(data_file),
                                 "--output-dir", str(run), *FAST], cwd=ROOT, env=_env(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert second.stderr.strip().splitlines()[-1].startswith("error: ")
        assert f"is in use by pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.kill()
        first.communicate()
    # the config of the first run was not overwritten, and its metrics hold each step once
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if r["split"] == "train"]
    assert steps == sorted(set(steps))


@pytest.mark.subprocess
def test_a_lock_left_by_a_killed_process_is_not_in_the_way(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from medusa_jax.runtime.rundir import RunLock; "
        f"RunLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); time.sleep(60)")],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunDirBusy, match=f"in use by pid {holder.pid}"):
        RunLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    lock = RunLock(tmp_path).acquire()  # the kernel dropped the dead holder's lock
    assert lock.stale["pid"] == holder.pid
    lock.release()


@pytest.mark.subprocess
def test_a_run_that_fails_before_any_work_leaves_no_directory(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "train.medusa1", "--data", str(empty),
                           "--output-dir", str(run)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ")
    assert not run.exists()


# ---- the second signal is never lost, and says what it stopped (in-process)


@pytest.mark.subprocess
def test_two_signals_during_one_long_call_are_two(tmp_path):
    """Signals that arrive while the main thread is inside one C call (a compile, a batch of
    self-distillation) reach Python's handler once: the second must still stop at once."""
    import hashlib

    from medusa_jax.runtime.rundir import StopNow, StopSignals

    pid = os.getpid()
    with pytest.raises(StopNow) as e:
        with StopSignals() as stop:
            sender = subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -TERM {pid}; sleep 0.1; "
                                                   f"kill -TERM {pid}"])
            hashlib.pbkdf2_hmac("sha256", b"x", b"y", 4_000_000)  # ~1-3 s in C, no bytecode
            sender.wait()
            time.sleep(0.5)  # the handler runs by now (it raises)
    assert stop.requested == signal.SIGTERM and e.value.code == 143
    sender.wait()


def test_a_second_signal_before_anything_was_saved_exits_143_and_offers_no_resume(
        tmp_path, monkeypatch, capsys):
    from medusa_jax.runtime.rundir import StopNow
    from medusa_jax.training import trainer
    from train import medusa1

    def second_signal(*a, **k):  # as if during self-distillation
        raise StopNow(signal.SIGTERM)

    monkeypatch.setattr(trainer, "_train", second_signal)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--output-dir", str(run)])
    assert e.value.code == 143 and not run.exists()
    assert capsys.readouterr().err.strip() == ("stopped at once (second SIGTERM) before anything "
                                               "was saved; nothing to resume")


def test_a_second_signal_after_a_checkpoint_names_the_run_to_resume(tmp_path, monkeypatch,
                                                                    capsys):
    from medusa_jax.runtime.rundir import StopNow
    from medusa_jax.training import trainer
    from train import medusa1

    run = tmp_path / "run"

    def second_signal(cfg, recipe, run_dir, *a, **k):
        import dataclasses

        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        (run_dir / "checkpoints" / "5").mkdir(parents=True)
        (run_dir / "checkpoints" / "5" / "x").write_text("saved")
        raise StopNow(signal.SIGINT)

    monkeypatch.setattr(trainer, "_train", second_signal)
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--output-dir", str(run)])
    assert e.value.code == 130 and run.is_dir()
    assert capsys.readouterr().err.strip() == (f"stopped at once (second SIGINT); continue "
                                               f"with --resume {run} (its last finished "
                                               f"checkpoint, if any, is intact)")
