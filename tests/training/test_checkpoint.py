"""Checkpoints: exact resume, max_to_keep, and a save killed before it finalizes."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from medusa_jax.text import data
from medusa_jax.training.checkpoint import Checkpointer, CheckpointError

TRAINED = ("heads",)


# setup, toy_rows and train: tests/training/conftest.py's toy_train


@pytest.mark.slow
def test_resume_equals_straight_run(toy_train, tmp_path):
    setup, toy_rows, train = toy_train.setup, toy_train.toy_rows, toy_train.train
    rows, n = toy_rows(), 3
    # straight: 2N steps
    state, step, _, _ = setup()
    straight = train(state, step, data.BatchIterator(rows, 4, seed=5), 2 * n)
    # N steps, checkpoint, throw everything away
    state, step, _, _ = setup()
    it = data.BatchIterator(rows, 4, seed=5)
    state = train(state, step, it, n)
    ck = Checkpointer(tmp_path / "ckpt")
    ck.save(state, TRAINED, it.position, {"note": "test"})
    ck.wait()
    ck.close()
    del state, it
    # a fresh process would do this: rebuild from scratch, restore, continue N steps
    fresh, step2, shardings, _ = setup()
    ck = Checkpointer(tmp_path / "ckpt", create=False)
    restored, meta = ck.restore(fresh, shardings, TRAINED)
    ck.close()
    assert meta["step"] == n and meta["data_position"] == n and meta["config"] == {"note": "test"}
    assert int(restored.step) == n
    restored_w = np.asarray(restored.params["heads"]["w"])  # the step donates its input
    resumed = train(restored, step2, data.BatchIterator(rows, 4, seed=5,
                                                         position=meta["data_position"]), n)
    assert int(resumed.step) == int(straight.step) == 2 * n
    for name in ("w", "b", "proj"):
        np.testing.assert_array_equal(np.asarray(resumed.params["heads"][name]),
                                      np.asarray(straight.params["heads"][name]))
    for a, b in zip(jax.tree.leaves(resumed.opt_state), jax.tree.leaves(straight.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and the heads did move away from the restored point
    assert not np.array_equal(np.asarray(resumed.params["heads"]["w"]), restored_w)


@pytest.mark.slow
def test_keeps_last_n_and_async_save_survives_donation(toy_train, tmp_path):
    setup, toy_rows, train = toy_train.setup, toy_train.toy_rows, toy_train.train
    state, step, shardings, _ = setup()
    it = data.BatchIterator(toy_rows(), 2)
    ck = Checkpointer(tmp_path / "ckpt", max_to_keep=2)
    saved = {}
    for _ in range(4):
        state = train(state, step, it, 1)
        saved[int(state.step)] = np.asarray(state.params["heads"]["proj"]).copy()
        # the save runs in the background while the next step donates (frees) `state`
        ck.save(state, TRAINED, it.position, {})
    ck.wait()
    assert ck.all_steps() == [3, 4] and ck.latest_step() == 4
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["3", "4"]
    fresh, _, _, _ = setup()
    for s in (3, 4):
        restored, meta = ck.restore(fresh, shardings, TRAINED, step=s)
        assert meta["step"] == s
        np.testing.assert_array_equal(np.asarray(restored.params["heads"]["proj"]), saved[s])
    ck.close()


def test_restore_without_checkpoint_is_a_clear_error(toy_train, tmp_path):
    setup = toy_train.setup
    state, _, shardings, _ = setup()
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        Checkpointer(tmp_path / "missing", create=False)
    ck = Checkpointer(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no finished checkpoint"):
        ck.restore(state, shardings, TRAINED)
    ck.close()


KILLED_SAVE = textwrap.dedent("""
    import os, runpy, sys
    import numpy as np
    from orbax.checkpoint._src.path import atomicity
    from medusa_jax.text import data
    from medusa_jax.training.checkpoint import Checkpointer
    kit = runpy.run_path(sys.argv[3])  # tests/training/conftest.py: plain functions
    setup, toy_rows, train = kit["setup"], kit["toy_rows"], kit["train"]

    state, step, _, _ = setup()
    it = data.BatchIterator(toy_rows(), 2)
    ck = Checkpointer(sys.argv[1], max_to_keep=3)
    state = train(state, step, it, 1)
    ck.save(state, ("heads",), it.position, {})
    ck.wait()
    np.save(sys.argv[2], np.asarray(state.params["heads"]["w"]))

    async def die(self, *a, **k):  # the process dies after writing, before the commit
        os._exit(17)
    atomicity.AtomicRenameTemporaryPath.finalize = die
    atomicity.CommitFileTemporaryPath.finalize = die
    state = train(state, step, it, 1)
    ck.save(state, ("heads",), it.position, {})
    ck.wait()
    os._exit(0)  # not reached
""")


@pytest.mark.slow
@pytest.mark.subprocess
def test_killed_save_leaves_no_valid_checkpoint(tmp_path, toy_train):
    setup = toy_train.setup
    ckdir, saved = tmp_path / "ckpt", tmp_path / "w1.npy"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(ckdir), str(saved),
                           os.path.join(here, "conftest.py")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 17, proc.stderr[-2000:]
    names = sorted(p.name for p in ckdir.iterdir())
    assert "1" in names and "2" not in names
    assert any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names  # the dead save
    ck = Checkpointer(ckdir, create=False)
    assert ck.all_steps() == [1]
    state, _, shardings, _ = setup()
    restored, meta = ck.restore(state, shardings, TRAINED)
    ck.close()
    assert meta["step"] == 1
    np.testing.assert_array_equal(np.asarray(restored.params["heads"]["w"]), np.load(saved))


@pytest.mark.slow
def test_checkpoint_restores_onto_another_mesh(toy_train, tmp_path):
    """Saved on data=1,fsdp=8, restored onto data=2,fsdp=2,model=2 and onto one device:
    the restore target's shardings decide, the values are the saved ones."""
    setup, toy_rows, train = toy_train.setup, toy_train.toy_rows, toy_train.train
    rows = toy_rows()
    state, step, _, _ = setup("data=1,fsdp=8")
    state = train(state, step, data.BatchIterator(rows, 8, seed=5), 2)
    saved = {k: np.asarray(v) for k, v in state.params["heads"].items()}
    ck = Checkpointer(tmp_path / "ckpt")
    ck.save(state, TRAINED, 2, {})
    ck.wait()
    ck.close()
    for spec in ("data=2,fsdp=2,model=2", "1,1"):
        fresh, _, shardings, mesh = setup(spec)
        ck = Checkpointer(tmp_path / "ckpt", create=False)
        restored, meta = ck.restore(fresh, shardings, TRAINED)
        ck.close()
        assert meta["step"] == 2 and int(restored.step) == 2
        for k, v in restored.params["heads"].items():
            assert v.sharding.mesh.shape == mesh.shape
            np.testing.assert_array_equal(np.asarray(v), saved[k])


# ---- corrupt / junk checkpoints and failed saves: fall back, say so, one line


@pytest.fixture(scope="module")
def two_steps(toy_train, tmp_path_factory):
    """A checkpoint directory holding steps 1 and 2, and each step's saved heads."""
    setup, toy_rows, train = toy_train.setup, toy_train.toy_rows, toy_train.train
    ckdir = tmp_path_factory.mktemp("two") / "ckpt"
    state, step, _, _ = setup()
    it = data.BatchIterator(toy_rows(), 2)
    ck = Checkpointer(ckdir)
    saved = {}
    for _ in range(2):
        state = train(state, step, it, 1)
        saved[int(state.step)] = np.asarray(state.params["heads"]["proj"]).copy()
        ck.save(state, TRAINED, it.position, {})
    ck.wait()
    ck.close()
    return ckdir, saved


def _copy_of(two_steps, tmp_path):
    import shutil

    return shutil.copytree(two_steps[0], tmp_path / "ckpt")


def _truncate_arrays(step_dir):
    for f in (step_dir / "params" / "ocdbt.process_0" / "d").iterdir():
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.mark.slow
def test_restore_falls_back_past_a_corrupt_newest_step(toy_train, two_steps, tmp_path, caplog):
    setup, toy_rows, train = toy_train.setup, toy_train.toy_rows, toy_train.train
    ckdir = _copy_of(two_steps, tmp_path)
    _truncate_arrays(ckdir / "2")
    state, step, shardings, _ = setup()
    ck = Checkpointer(ckdir, create=False)
    with caplog.at_level("WARNING", logger="medusa_jax.training.checkpoint"):
        restored, meta = ck.restore(state, shardings, TRAINED)
    assert meta["step"] == 1 and int(restored.step) == 1
    np.testing.assert_array_equal(np.asarray(restored.params["heads"]["proj"]), two_steps[1][1])
    [skip] = meta["skipped"]
    assert skip["step"] == 2 and "missing or truncated" in skip["reason"]
    assert skip["moved_to"] == "2.unreadable" and (ckdir / "2.unreadable" / "params").is_dir()
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "restored step 1" in warning and "2 (an array file is missing or truncated" in warning
    # the corrupt step no longer blocks the resumed run from saving step 2 again
    assert ck.all_steps() == [1]
    restored = train(restored, step, data.BatchIterator(toy_rows(), 2, position=1), 1)
    ck.save(restored, TRAINED, 2, {})
    ck.wait()
    assert ck.all_steps() == [1, 2]
    ck.close()


def _flip_bytes(step_dir, item="params", n=256):
    """Flip `n` bytes in the middle of the largest data file of `item`: a damaged disk or a
    bad copy, which leaves every file its length (orbax reads it without complaint)."""
    files = [f for f in (step_dir / item).rglob("*") if f.is_file() and "/d/" in str(f)]
    f = max(files, key=lambda f: f.stat().st_size)
    raw = bytearray(f.read_bytes())
    mid = len(raw) // 2
    raw[mid - n // 2: mid + n // 2] = bytes(b ^ 0xFF for b in raw[mid - n // 2: mid + n // 2])
    f.write_bytes(bytes(raw))


@pytest.mark.slow
@pytest.mark.parametrize("item", ["params", "opt_state"])
def test_restore_refuses_a_damaged_step_and_falls_back(toy_train, two_steps, tmp_path, item,
                                                       one_line_error):
    """Bytes flipped inside a data file (length unchanged) restore without a read error: the
    checksum saved with the step refuses it, in one line naming the step and the tensor, and
    resuming falls back to the newest intact step."""
    setup = toy_train.setup
    ckdir = _copy_of(two_steps, tmp_path)
    _flip_bytes(ckdir / "2", item)
    state, _, shardings, _ = setup()
    ck = Checkpointer(ckdir, create=False)
    with pytest.raises(CheckpointError) as e:
        ck.restore(state, shardings, TRAINED, step=2)
    msg = one_line_error.message(e)
    assert msg.startswith(f"{ckdir}/2: cannot restore this checkpoint") and "checksum" in msg
    assert f"damaged: {item}" in msg  # names the damaged tensor
    restored, meta = ck.restore(state, shardings, TRAINED)
    ck.close()
    assert meta["step"] == 1
    np.testing.assert_array_equal(np.asarray(restored.params["heads"]["proj"]), two_steps[1][1])
    [skip] = meta["skipped"]
    assert skip["step"] == 2 and "checksum" in skip["reason"]
    assert skip["moved_to"] == "2.unreadable"


@pytest.mark.slow
def test_only_a_damaged_step_is_one_line(toy_train, two_steps, tmp_path, one_line_error):
    setup = toy_train.setup
    ckdir = _copy_of(two_steps, tmp_path)
    import shutil
    shutil.rmtree(ckdir / "1")
    _flip_bytes(ckdir / "2")
    state, _, shardings, _ = setup()
    ck = Checkpointer(ckdir, create=False)
    with pytest.raises(CheckpointError) as e:
        ck.restore(state, shardings, TRAINED)
    ck.close()
    msg = one_line_error.message(e)
    assert msg.startswith(f"{ckdir}: no checkpoint restores") and "step 2: " in msg
    assert "checksum" in msg


@pytest.mark.slow
def test_a_step_saved_with_non_finite_values_is_refused(toy_train, tmp_path, one_line_error):
    """A state holding NaN (a diverged run) is saved as it is, but never restored as if
    intact: resuming from it would train on NaN."""
    import jax.numpy as jnp

    setup = toy_train.setup
    state, _, shardings, _ = setup()
    heads = dict(state.params["heads"], proj=state.params["heads"]["proj"].at[0].set(jnp.nan))
    state = dataclasses.replace(state, params=dict(state.params, heads=heads))
    ck = Checkpointer(tmp_path / "ckpt")
    ck.save(state, TRAINED, 0, {})
    ck.wait()
    fresh, _, _, _ = setup()
    with pytest.raises(CheckpointError) as e:
        ck.restore(fresh, shardings, TRAINED, step=int(state.step))
    ck.close()
    msg = one_line_error.message(e)
    assert "params['heads']['proj']" in msg and "non-finite" in msg


@pytest.mark.slow
def test_restore_skips_junk_step_folders(toy_train, two_steps, tmp_path):
    setup = toy_train.setup
    ckdir = _copy_of(two_steps, tmp_path)
    (ckdir / "999").mkdir()
    (ckdir / "999" / "garbage").write_text("not a checkpoint")
    (ckdir / "notes").mkdir()  # not a step name: orbax never lists it
    (ckdir / "notes" / "todo.txt").write_text("x")
    state, _, shardings, _ = setup()
    ck = Checkpointer(ckdir, create=False)
    restored, meta = ck.restore(state, shardings, TRAINED)
    ck.close()
    assert meta["step"] == 2
    np.testing.assert_array_equal(np.asarray(restored.params["heads"]["proj"]), two_steps[1][2])
    assert [(s["step"], s["moved_to"]) for s in meta["skipped"]] == [(999, "999.unreadable")]
    assert "meta" in meta["skipped"][0]["reason"]
    assert (ckdir / "notes" / "todo.txt").is_file()


@pytest.mark.slow
def test_restore_without_an_intact_checkpoint_is_one_line(toy_train, two_steps, tmp_path,
                                                          one_line_error):
    setup = toy_train.setup
    ckdir = _copy_of(two_steps, tmp_path)
    for s in ("1", "2"):
        _truncate_arrays(ckdir / s)
    state, _, shardings, _ = setup()
    ck = Checkpointer(ckdir, create=False)
    with pytest.raises(CheckpointError) as e:
        ck.restore(state, shardings, TRAINED)
    ck.close()
    msg = str(e.value)
    one_line_error.message(msg)
    assert msg.startswith(f"{ckdir}: no checkpoint restores")
    assert "step 2: an array file is missing or truncated" in msg and "step 1: " in msg
    assert sorted(p.name for p in ckdir.iterdir()) == ["1", "2"]  # nothing moved or deleted


@pytest.mark.slow
def test_explicit_step_does_not_fall_back(toy_train, two_steps, tmp_path, one_line_error):
    setup = toy_train.setup
    ckdir = _copy_of(two_steps, tmp_path)
    _truncate_arrays(ckdir / "2")
    state, _, shardings, _ = setup()
    ck = Checkpointer(ckdir, create=False)
    with pytest.raises(CheckpointError, match=r"/2: cannot restore this checkpoint") as e:
        ck.restore(state, shardings, TRAINED, step=2)
    one_line_error.message(e)
    with pytest.raises(CheckpointError, match=r"no checkpoint at step 7 \(have: 1, 2\)"):
        ck.restore(state, shardings, TRAINED, step=7)
    ck.close()


@pytest.mark.parametrize("surfaces_in", ["wait", "next save"])
def test_disk_full_during_save_is_one_line_and_keeps_the_last_checkpoint(
        toy_train, two_steps, tmp_path, monkeypatch, caplog, surfaces_in, one_line_error):
    setup, toy_rows, train = toy_train.setup, toy_train.toy_rows, toy_train.train
    import errno

    from orbax.checkpoint._src.handlers import json_checkpoint_handler as jh

    ckdir = _copy_of(two_steps, tmp_path)
    state, step, shardings, _ = setup()
    ck = Checkpointer(ckdir)
    state, meta = ck.restore(state, shardings, TRAINED)
    it = data.BatchIterator(toy_rows(), 2, position=meta["data_position"])
    state = train(state, step, it, 1)

    async def disk_full(self, x, directory):  # runs in orbax's background commit thread
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))

    monkeypatch.setattr(jh.JsonCheckpointHandler, "_save_fn", disk_full)
    assert ck.save(state, TRAINED, it.position, {})  # the write fails in the background
    with pytest.raises(CheckpointError) as e:
        if surfaces_in == "wait":
            ck.wait()
        else:
            monkeypatch.undo()
            state = train(state, step, it, 1)
            ck.save(state, TRAINED, it.position, {})
    msg = str(e.value)
    one_line_error.message(msg)
    assert msg == (f"{ckdir}: saving checkpoint step 3 failed (OSError: [Errno 28] No space "
                   f"left on device: '{ckdir}/3.orbax-checkpoint-tmp/meta.orbax-checkpoint-tmp'"
                   f"); step 2 is the last complete checkpoint")
    assert not any(r.exc_info for r in caplog.records)  # orbax's tracebacks folded to a line
    # and orbax's own ERROR records of the failed save dropped: the error above says it
    assert not [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    monkeypatch.undo()
    ck.close()
    ck = Checkpointer(ckdir, create=False)
    assert ck.all_steps() == [1, 2]
    fresh, _, _, _ = setup()
    restored, meta = ck.restore(fresh, shardings, TRAINED)
    ck.close()
    assert meta["step"] == 2 and meta["skipped"] == []
    np.testing.assert_array_equal(np.asarray(restored.params["heads"]["proj"]), two_steps[1][2])


def test_checkpoint_directory_that_is_a_file(tmp_path, one_line_error):
    f = tmp_path / "ckpt"
    f.write_text("a file where the checkpoint directory should be")
    with pytest.raises(CheckpointError, match=r"ckpt: not a directory, cannot save"):
        Checkpointer(f)
    with pytest.raises(CheckpointError, match=r"ckpt/sub: cannot create the checkpoint "
                                              r"directory \(NotADirectoryError") as e:
        Checkpointer(f / "sub")
    one_line_error.message(e)


def test_unwritable_checkpoint_directory_during_a_run(toy_train, two_steps, tmp_path):
    # root ignores chmod, so the directory is made unwritable by putting a file in its place
    setup, toy_rows, train = toy_train.setup, toy_train.toy_rows, toy_train.train
    ckdir = _copy_of(two_steps, tmp_path)
    state, step, shardings, _ = setup()
    ck = Checkpointer(ckdir)
    state, meta = ck.restore(state, shardings, TRAINED)
    state = train(state, step, data.BatchIterator(toy_rows(), 2, position=2), 1)
    ckdir.rename(tmp_path / "aside")
    ckdir.write_text("not a directory")
    with pytest.raises(CheckpointError) as e:
        ck.save(state, TRAINED, 3, {})
    assert str(e.value) == (f"{ckdir}: cannot save checkpoint step 3: the checkpoint "
                            f"directory no longer exists or is not a directory")
    ckdir.unlink()
    (tmp_path / "aside").rename(ckdir)
    ck.close()
    ck = Checkpointer(ckdir, create=False)
    fresh, _, _, _ = setup()
    restored, meta = ck.restore(fresh, shardings, TRAINED)
    ck.close()
    assert meta["step"] == 2 and meta["skipped"] == []
    np.testing.assert_array_equal(np.asarray(restored.params["heads"]["proj"]), two_steps[1][2])


def test_closed_event_loop_leftovers_are_dropped_from_the_start(tmp_path, monkeypatch, capsys):
    """After a failed save (a full disk), TensorStore callbacks that find orbax's event loop
    closed are reported through sys.unraisablehook, also in the next run's first restore:
    a Checkpointer drops those from the start (only those)."""
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    Checkpointer(tmp_path / "ckpt").close()

    class RaisesWhenCollected:
        def __init__(self, message):
            self.message = message

        def __del__(self):
            raise RuntimeError(self.message)

    RaisesWhenCollected("Event loop is closed")  # collected at once: an unraisable error
    assert capsys.readouterr().err == ""
    RaisesWhenCollected("something else")
    assert "RuntimeError: something else" in capsys.readouterr().err
