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
# Waits end on their event (a step logged, a file written, a line printed, the process
# exiting), never on a short clock: on a busy machine the tests run slower, not fail. HANG
# only catches a process that will never get there; a bound on how fast something must
# happen ("at once") is kept far from the slow path it rules out.
HANG = 900
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


def _wait_until(done, proc, what: str, poll: float = 0.05):
    """Until `done()` holds, however long a busy machine takes; fails at once if the
    process exits first, and after HANG seconds (a hang)."""
    t0 = time.time()
    while not done():
        if proc.poll() is not None:
            raise AssertionError(f"exited before {what}: {proc.communicate()}")
        if time.time() - t0 > HANG:
            proc.kill()
            raise AssertionError(f"{what}: not within {HANG} s (hung)")
        time.sleep(poll)


def _logged(metrics: Path, text: str) -> bool:
    return metrics.is_file() and text in metrics.read_text()


def _wait_for_training(run: Path, proc):
    """Until the run has logged a training step (the loop is running)."""
    _wait_until(lambda: _logged(run / "metrics.jsonl", '"split": "train"'), proc,
                "training started", poll=0.2)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_the_current_step_and_says_how_to_resume(
        tmp_path, data_file, sig, code):
    run = tmp_path / "run"
    proc = _start("--data", str(data_file), "--output-dir", str(run), *FAST)
    _wait_for_training(run, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=HANG)  # the step finishes and its checkpoint saves
    assert proc.returncode == code, (out[-2000:], err[-2000:])
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"continue with --resume {run}" in last and signal.Signals(sig).name in last
    steps = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and f"checkpoint {steps[0]} saved" in last
    # the run resumes from there and finishes
    done = subprocess.run([sys.executable, "-m", "train.medusa1", "--resume", str(run),
                           "--steps", str(steps[0] + 2)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=HANG)
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
                                capture_output=True, text=True, timeout=HANG)
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
        f"RunLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); time.sleep(900)")],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunDirBusy, match=f"in use by pid {holder.pid}"):
        RunLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    lock = RunLock(tmp_path).acquire()  # the kernel dropped the dead holder's lock
    assert lock.stale["pid"] == holder.pid
    lock.release()


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_that_fails_before_any_work_leaves_no_directory(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "train.medusa1", "--data", str(empty),
                           "--output-dir", str(run)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ")
    assert not run.exists()


# ---- the second signal is never lost, and says what it stopped (in-process)


@pytest.mark.slow
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


@pytest.fixture
def exit_raises(monkeypatch):
    """The command's immediate exit (os._exit) as SystemExit, so it can run in-process."""
    from medusa_jax.training import command

    def exit_at_once(code):
        raise SystemExit(code)

    monkeypatch.setattr(command, "exit_at_once", exit_at_once)


def test_a_second_signal_before_anything_was_saved_exits_143_and_offers_no_resume(
        tmp_path, monkeypatch, capsys, exit_raises):
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
                                                                    capsys, exit_raises):
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


# ---- once training is done, a signal stops the wrap-up and the benchmark at once


AFTER = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--num-heads", "2",
         "--log-every", "1", "--template", "plain", "--heldout-fraction", "0.25",
         "--eval-prompts", "1", "--eval-max-new-tokens", "8", "--tree", "chain2"]


@pytest.mark.slow
@pytest.mark.parametrize("during", ["wrap-up", "benchmark"])
def test_a_signal_after_training_stops_at_once_with_130(tmp_path, data_file, monkeypatch,
                                                       capsys, exit_raises, during):
    """Training is over (its last checkpoint saved): a signal during the final evaluation,
    the heads' writing (the wrap-up) or the decoding benchmark stops there, exits 130 and
    says what is saved; it never offers another checkpoint or benchmarks on."""
    from medusa_jax.tools import bench
    from medusa_jax.training import trainer
    from train import medusa1

    benchmarked = []

    def sigint_now(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)  # the handler runs here (Python calls it between bytecodes)

    def compare(*a, **k):
        benchmarked.append(1)
        if during == "benchmark":
            sigint_now()
        raise AssertionError("the benchmark went on after the signal")

    if during == "wrap-up":
        monkeypatch.setattr(trainer, "plot_accuracy", sigint_now)
    monkeypatch.setattr(bench, "compare_decoding", compare)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--data", str(data_file), "--output-dir", str(run), *AFTER])
    err = capsys.readouterr()
    assert e.value.code == 130, err
    assert len(benchmarked) == (1 if during == "benchmark" else 0)
    assert "saving a checkpoint" not in err.out + err.err
    assert err.err.strip().splitlines()[-1] == (
        f"stopped by SIGINT after training finished; the checkpoint of step 2 and the heads "
        f"are in {run}")
    assert (run / "heads" / "medusa_heads.safetensors").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]


# ---- a second signal while an Orbax save is in flight ends the process at once (train.hydra)

HYDRA = ["--batch-size", "4", "--seq-len", "64", "--num-heads", "2", "--log-every", "1",
         "--eval-every", "100000", "--eval-prompts", "0", "--template", "plain",
         "--heldout-fraction", "0"]
# train.hydra with Orbax's finalizing of every step from 10 on held for SAVE_HELD seconds: a
# second signal then always lands while that save's threads are running, and a process
# that waited for them would take that long (an exit "at once" is bound far below it)
SAVE_HELD, AT_ONCE = 600, 120
SLOW_SAVES = f"""
import asyncio, runpy, sys
from orbax.checkpoint._src.path import atomicity
finalize = atomicity.AtomicRenameTemporaryPath.finalize
async def slow(self):
    if self._final_path.name.isdigit() and int(self._final_path.name) >= 10:
        await asyncio.sleep({SAVE_HELD})
    return await finalize(self)
atomicity.AtomicRenameTemporaryPath.finalize = slow
sys.argv[0] = "train.hydra"
runpy.run_module("train.hydra", run_name="__main__")
"""


def _two_sigints(proc):
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    try:
        out, err = proc.communicate(timeout=AT_ONCE)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running {AT_ONCE} s after the second SIGINT: "
                             f"{err[-2000:]}")
    return out, err, time.time() - t0


def _resume(run: Path, steps: int):
    done = subprocess.run([sys.executable, "-m", "train.hydra", "--resume", str(run),
                           "--steps", str(steps)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["step"] == steps
    return done


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_second_sigint_during_a_save_exits_130_at_once_and_the_run_resumes(
        tmp_path, data_file):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVES, "--data", str(data_file),
                             "--output-dir", str(run), "--steps", "200", "--save-every", "5",
                             *HYDRA], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    # step 15 logged: the loop now waits for step 10's save before it saves step 15
    _wait_until(lambda: (ckpts / "5").is_dir() and _logged(metrics, '"step": 15,'), proc,
                "step 15")
    time.sleep(0.2)
    out, err, took = _two_sigints(proc)
    assert proc.returncode == 130 and took < AT_ONCE, (took, err[-2000:])
    assert err.strip().splitlines()[-1] == (
        f"stopped at once (second SIGINT); continue with --resume {run} (its last finished "
        f"checkpoint, if any, is intact)")
    assert "Traceback" not in err and "ERROR" not in err, err[-2000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["10.orbax-checkpoint-tmp", "5"]
    done = _resume(run, 7)
    assert "resumed at step 5 " in done.stdout
    # the unfinished save was removed; the resumed run saved its own last step
    assert sorted(p.name for p in ckpts.iterdir()) == ["5", "7"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_sigints_50ms_apart_after_step_20_always_exit_130(tmp_path, data_file):
    """The reported case, a few tries: the first SIGINT starts the checkpoint of the step,
    the second lands in or around it."""
    for attempt in range(2):
        run = tmp_path / f"run{attempt}"
        proc = subprocess.Popen([sys.executable, "-m", "train.hydra", "--data", str(data_file),
                                 "--output-dir", str(run), "--steps", "200", "--save-every",
                                 "50", *HYDRA], cwd=ROOT, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_until(lambda: _logged(run / "metrics.jsonl", '"step": 20,'), proc, "step 20",
                    poll=0.02)
        out, err, took = _two_sigints(proc)
        assert proc.returncode == 130 and took < AT_ONCE, (attempt, took, err[-2000:])
        assert "stopped at once (second SIGINT)" in err.strip().splitlines()[-1]
        assert "Traceback" not in err and "cannot schedule" not in err, err[-2000:]
    # finished checkpoints (if the save of the step got done) or none: either resumes
    _resume(run, 22)


# ---- a signal during start-up offers --resume only when the run directory is kept


@pytest.mark.slow
@pytest.mark.parametrize("existing", [False, True])
def test_a_signal_during_start_up_offers_resume_only_when_the_run_is_kept(
        tmp_path, data_file, monkeypatch, capsys, existing):
    from medusa_jax.runtime import rundir
    from medusa_jax.training import trainer
    from train import hydra

    prepare = trainer.prepare_data

    def sigterm_first(ctx):  # as if SIGTERM came while the model loaded
        os.kill(os.getpid(), signal.SIGTERM)
        return prepare(ctx)

    monkeypatch.setattr(trainer, "prepare_data", sigterm_first)
    run = tmp_path / "run"
    if existing:  # an empty folder given as --output-dir is not removed
        run.mkdir()
    with pytest.raises(SystemExit) as e:
        hydra.command.main(["--data", str(data_file), "--output-dir", str(run), *HYDRA])
    assert e.value.code == 143
    last = capsys.readouterr().err.strip().splitlines()[-1]
    if existing:
        assert rundir.is_run_dir(run)
        assert last == (f"stopped by SIGTERM before training started (nothing new saved); "
                        f"continue with --resume {run}")
    else:
        assert not run.exists()
        assert last == (f"stopped by SIGTERM before anything was saved; nothing to resume "
                        f"({run} was removed)")
