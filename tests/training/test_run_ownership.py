"""A training command never writes into a folder it does not own, and `--resume` continues
only the run that is there, as it was trained (rundir.py, cli.py, trainer.py).

Every case must be refused before any work: `trainer._train` (where a run starts writing)
is replaced by a tripwire, so a refusal that comes too late fails the test at once."""

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.drafters.formats import write_reference
from medusa_jax.drafters.medusa.heads import HeadsConfig, init_heads
from medusa_jax.runtime import assets, rundir
from medusa_jax.training import trainer
from medusa_jax.training.checkpoint import Checkpointer
from medusa_jax.training.recipes.medusa1 import Medusa1Config
from medusa_jax.training.step import TrainState
from train import medusa1, medusa2


class TrainingStarted(Exception):
    pass


@pytest.fixture
def no_training(monkeypatch):
    def tripwire(cfg, *a, **k):
        raise TrainingStarted(cfg)

    monkeypatch.setattr(trainer, "_train", tripwire)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def model_copy(tmp_path):
    return Path(shutil.copytree(assets.model_dir(), tmp_path / "M"))


@pytest.fixture
def reference_heads(tmp_path, stories):
    cfg, params, _ = stories
    out = tmp_path / "ref"
    write_reference({k: np.asarray(v) for k, v in
                     init_heads(cfg, params, HeadsConfig(2)).items()}, out, pickle=False)
    return out


def make_run(run: Path, step: int = 20, **fields) -> dict:
    """A Medusa-1 run directory as a short run leaves it: config.json and one checkpoint
    whose metadata holds the same config (tiny arrays: only the metadata is read here)."""
    cfg = dataclasses.replace(Medusa1Config(steps=step, eval_prompts=0, distill_samples=16,
                                            output_dir=str(run), **fields)).resolve()
    saved = {"method": "medusa1", **dataclasses.asdict(cfg)}
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(saved, indent=2))
    state = TrainState(step=jnp.int32(step), params={"heads": {"w": jnp.zeros((2, 2))}},
                       opt_state={"mu": jnp.zeros((2, 2))})
    ck = Checkpointer(run / "checkpoints")
    ck.save(state, ("heads",), 3, dataclasses.asdict(cfg), force=True)
    ck.close()
    return saved


def edit_config(run: Path, **changes):
    conf = json.loads((run / "config.json").read_text())
    conf.update(changes)
    (run / "config.json").write_text(json.dumps(conf))


def last_err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    return err[-1]


# ---- bad cases 1, 2 and 9: folders that are not (this kind of) run


@pytest.mark.parametrize("which", ["model", "reference heads", "shipped heads"])
def test_resume_refuses_a_folder_that_is_not_a_run(which, model_copy, reference_heads,
                                                   tmp_path, no_training, capsys):
    folder = {"model": model_copy, "reference heads": reference_heads,
              "shipped heads": Path(shutil.copytree(assets.heads_dir(), tmp_path / "h"))}[which]
    before = snapshot(folder)
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--resume", str(folder), "--steps", "30"])
    assert e.value.code == 2
    assert f"--resume {folder}: not a training run" in last_err(capsys)
    assert snapshot(folder) == before


def test_output_dir_refuses_a_non_empty_folder_that_is_not_a_run(model_copy, no_training):
    before = snapshot(model_copy)
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--output-dir", str(model_copy), "--steps", "2"])
    assert e.value.code == (f"error: --output-dir {model_copy}: holds files and is not a "
                            f"training run (LICENSE, SOURCE.md, ...); give a new or empty "
                            f"folder")
    assert snapshot(model_copy) == before


def test_output_dir_that_is_a_file_is_one_line(tmp_path, no_training):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--output-dir", str(f), "--steps", "2"])
    assert e.value.code == f"error: --output-dir {f}: is a file, not a folder"
    assert f.read_text() == "x"


def test_output_dir_accepts_a_new_an_empty_and_an_unfinished_run_folder(tmp_path, no_training):
    empty = tmp_path / "empty"
    empty.mkdir()
    unfinished = tmp_path / "unfinished"  # stopped during self-distillation: no checkpoint
    unfinished.mkdir()
    (unfinished / "config.json").write_text(json.dumps(
        {"method": "medusa1", **dataclasses.asdict(Medusa1Config())}))
    (unfinished / "distill").mkdir()
    for d in (tmp_path / "new", empty, unfinished):
        with pytest.raises(TrainingStarted):
            medusa1.command.main(["--output-dir", str(d), "--steps", "2"])


@pytest.mark.parametrize("marker", [True, False])
def test_medusa2_refuses_to_resume_a_medusa1_run_naming_its_method(tmp_path, marker, capsys,
                                                                    no_training):
    run = tmp_path / "R"
    make_run(run)
    if not marker:  # a run written before config.json recorded its method
        conf = json.loads((run / "config.json").read_text())
        conf.pop("method")
        (run / "config.json").write_text(json.dumps(conf))
    before = snapshot(run)
    with pytest.raises(SystemExit) as e:
        medusa2.command.main(["--resume", str(run)])
    assert e.value.code == 2
    assert last_err(capsys).endswith(f"--resume {run}: a medusa1 run; continue it with "
                                     f"python -m train.medusa1 --resume {run}")
    assert snapshot(run) == before


# ---- bad case 3 and its relatives: --resume continues the run as it was trained


def test_resume_of_an_unchanged_run_starts(tmp_path, no_training):
    run = tmp_path / "R"
    make_run(run)
    with pytest.raises(TrainingStarted):
        medusa1.command.main(["--resume", str(run), "--steps", "30", "--eval-prompts", "0"])


@pytest.mark.parametrize("field, value", [("lr", 0.5), ("batch_size", 4), ("seq_len", 64),
                                          ("distill_samples", 32), ("num_heads", 6)])
def test_resume_refuses_a_config_json_edited_after_the_checkpoint(tmp_path, field, value,
                                                                  no_training):
    run = tmp_path / "R"
    saved = make_run(run)
    edit_config(run, **{field: value})
    before = snapshot(run)
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--resume", str(run), "--steps", "30"])
    assert e.value.code == (f"error: {run}/config.json: {field} is {value!r}, but checkpoint "
                            f"20 was trained with {saved[field]!r} (only "
                            f"{', '.join(sorted(Medusa1Config.RESUMABLE))} may change on "
                            f"--resume); restore it, or start a new run")
    assert snapshot(run) == before


def test_resume_refuses_unknown_keys_in_config_json(tmp_path, capsys, no_training):
    run = tmp_path / "R"
    make_run(run)
    edit_config(run, learning_rate=0.1)
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--resume", str(run)])
    assert e.value.code == 2
    assert last_err(capsys).endswith(f"--resume {run}: config.json has unknown field "
                                     f"learning_rate")


def test_resume_refuses_steps_below_the_checkpoint(tmp_path, no_training):
    run = tmp_path / "R"
    make_run(run, step=20)
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--resume", str(run), "--steps", "10"])
    assert e.value.code == (f"error: --steps 10: the run in {run} is already at step 20 "
                            f"(give more steps to continue it)")


# ---- checked before any work


@pytest.mark.parametrize("argv, message", [
    (["--tree", "dynamic:abc"], "dynamic:abc"),
    (["--num-heads", "2", "--tree", "mc_sim_7b_63"], "only 2 Medusa heads"),
    (["--num-heads", "2"], "only 2 Medusa heads"),  # the default tree, benchmarked
    (["--mesh", "data=2,data=4"], "axis 'data' given twice"),
    (["--init-timeout", "-1"], "--init-timeout must be >= 1"),
    (["--num-processes", "0"], "--num-processes must be >= 1"),
    (["--seed", str(2**70)], "--seed must be in -2**63..2**63-1"),
])
def test_flags_that_cannot_work_are_refused_before_training(argv, message, capsys, no_training):
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(argv)
    assert e.value.code == 2
    assert message in last_err(capsys)


def test_a_model_axis_that_splits_nothing_is_refused_for_training_too(tmp_path, no_training):
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--mesh", "model=3", "--output-dir", str(tmp_path / "r")])
    assert e.value.code.startswith("error: mesh model=3 splits none of this model's tensors")
    assert not (tmp_path / "r").exists()


def test_run_dir_rule_is_the_library_s(tmp_path, model_copy):
    run = tmp_path / "R"
    make_run(run)
    assert rundir.is_run_dir(run) and rundir.run_method(run) == "medusa1"
    assert not rundir.is_run_dir(model_copy) and not rundir.is_run_dir(tmp_path / "none")
    # the fields that identify a run are TrainConfig's own
    assert set(rundir.RUN_FIELDS) <= {f.name for f in dataclasses.fields(trainer.TrainConfig)}


def test_each_method_resumes_its_own_runs_only(tmp_path, capsys, no_training):
    from medusa_jax.training.recipes.medusa2 import Medusa2Config

    run = tmp_path / "R2"
    run.mkdir()
    cfg = Medusa2Config(steps=5, eval_prompts=0, output_dir=str(run))
    (run / "config.json").write_text(json.dumps({"method": "medusa2",
                                                 **dataclasses.asdict(cfg)}))
    with pytest.raises(TrainingStarted):
        medusa2.command.main(["--resume", str(run), "--steps", "6"])
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--resume", str(run)])
    assert e.value.code == 2
    assert last_err(capsys).endswith(f"--resume {run}: a medusa2 run; continue it with "
                                     f"python -m train.medusa2 --resume {run}")


@pytest.fixture
def read_only(monkeypatch):
    """`read_only(folder)`: creating a file or folder under `folder` fails with EROFS, as on
    a read-only mount (tests run as root, whom chmod does not stop)."""
    import errno
    import os

    folders = []
    real_open, real_mkdir = os.open, os.mkdir

    def blocked(path):
        return any(Path(os.path.abspath(path)).is_relative_to(f) for f in folders)

    def ro_open(path, flags, *a, **k):
        if flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR) and blocked(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **k)

    def ro_mkdir(path, *a, **k):
        if blocked(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "open", ro_open)
    monkeypatch.setattr(os, "mkdir", ro_mkdir)
    return lambda folder: folders.append(Path(folder).absolute())


@pytest.mark.parametrize("where", ["new", "empty"])
def test_a_read_only_output_dir_is_refused_in_one_line_before_work(tmp_path, read_only, where,
                                                                  no_training):
    ro = tmp_path / "ro"
    ro.mkdir()
    run = ro / "run"
    if where == "empty":
        run.mkdir()
    read_only(ro)
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--output-dir", str(run), "--steps", "2"])
    assert str(e.value.code).startswith(f"error: --output-dir {run}: cannot write into ")
    assert str(e.value.code).endswith("(Read-only file system)")


def test_a_folder_that_turns_read_only_during_the_run_is_one_line(tmp_path, monkeypatch):
    import errno

    def fails(cfg, recipe, run_dir, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(run_dir / "metrics.jsonl"))

    monkeypatch.setattr(trainer, "_train", fails)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        medusa1.command.main(["--output-dir", str(run), "--steps", "2"])
    assert e.value.code == f"error: {run / 'metrics.jsonl'}: Read-only file system"
