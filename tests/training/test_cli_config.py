"""Command-line plumbing: flags generated from the config dataclasses, --resume merging, the
shipped defaults in one place, one stop-token rule for every caller."""

import dataclasses
import json

import pytest

from medusa_jax.model.config import stop_tokens
from medusa_jax.runtime import assets, options
from medusa_jax.training.command import Command
from medusa_jax.training.recipes.medusa1 import Medusa1Config
from medusa_jax.training.recipes.medusa2 import Medusa2Config
from medusa_jax.training.trainer import Recipe, TrainConfig


@pytest.mark.parametrize("cls", [Medusa1Config, Medusa2Config])
def test_every_config_field_is_a_flag_of_its_type(cls):
    ap = Command("prog", "doc", cls, Recipe).build_parser()
    flags = {a.dest: a for a in ap._actions}
    for f in dataclasses.fields(cls):
        assert f.name in flags, f.name
    cfg, resume, stop = options.parse_config(ap, cls, [
        "--steps", "7", "--lr", "0.5", "--data", "a.jsonl", "--data", "b.jsonl",
        "--template", "plain", "--mesh", "data=1,fsdp=1", "--stop-after", "3"])
    assert (cfg.steps, cfg.lr, cfg.data, cfg.template) == (7, 0.5, ("a.jsonl", "b.jsonl"),
                                                           "plain")
    assert resume is None and stop == 3
    # fields not given keep the dataclass defaults
    assert cfg.batch_size == cls.batch_size and cfg.seq_len == cls.seq_len


def test_medusa2_adds_its_fields_to_the_shared_ones():
    shared = {f.name for f in dataclasses.fields(TrainConfig)}
    own = {f.name for f in dataclasses.fields(Medusa2Config)} - shared
    assert {"init", "stage1_steps", "head_lr_ratio", "lm_loss", "anchor_text"} <= own
    # Medusa-1 adds only the reduced vocabulary (its heads; Medusa-2 refuses such heads)
    assert {f.name for f in dataclasses.fields(Medusa1Config)} == shared | {"reduced_vocab"}
    stage1 = Medusa2Config(stage1_steps=11, seed=4).stage1_config(__import__("pathlib").Path("r"))
    assert isinstance(stage1, Medusa1Config)
    assert (stage1.steps, stage1.seed, stage1.eval_prompts, stage1.output_dir) == \
        (11, 4, 0, "r/stage1")


def test_resume_takes_the_saved_config_and_refuses_other_changes(tmp_path, capsys):
    saved = dataclasses.asdict(Medusa1Config(steps=10, lr=0.1, output_dir=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps(saved))
    ap = Command("prog", "doc", Medusa1Config, Recipe).build_parser()
    cfg, resume, _ = options.parse_config(ap, Medusa1Config, ["--resume", str(tmp_path),
                                                          "--steps", "20"])
    assert (cfg.steps, cfg.lr, resume) == (20, 0.1, str(tmp_path))
    with pytest.raises(SystemExit):
        options.parse_config(ap, Medusa1Config, ["--resume", str(tmp_path), "--lr", "0.2"])
    assert "cannot change --lr when resuming" in capsys.readouterr().err


def test_int_list_and_positive_int_reject_bad_values():
    import argparse

    assert options.int_list(1)("1,4,16") == [1, 4, 16]
    for bad in ("0,-3", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            options.int_list(1)(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
        options.positive_int("0")


def test_default_tree_and_heads_are_decided_in_one_place(tmp_path):
    assert assets.default_tree(None) == "stories260K_cpu"
    assert assets.default_tree(assets.model_dir()) == "stories260K_cpu"
    assert assets.default_tree(tmp_path) == "mc_sim_7b_63"
    assert assets.default_heads(None) == assets.heads_dir()
    assert assets.default_heads(tmp_path) is None
    assert assets.heldout_prompts() and assets.text_file("train").is_file()


def test_api_and_training_stop_on_the_same_tokens(stories):
    from medusa_jax.api import Medusa

    cfg, _, tok = stories
    stops = stop_tokens(cfg, tok)
    assert tok.bos_token_id in stops and tok.eos_token_id in stops
    assert Medusa.load().eos == stops


SOFT_AND_DISTILL_ERRORS = [
    ("medusa1", ["--target", "tv", "--target-temperature", "0"],
     "--target-temperature must be finite and > 0, got 0.0"),
    ("hydra", ["--target", "kl", "--target-temperature", "-0.5"],
     "--target-temperature must be finite and > 0, got -0.5"),
    ("eagle", ["--target-temperature", "nan"],
     "--target-temperature must be finite and > 0, got nan"),
    ("medusa1", ["--target", "tv", "--target-temperature", "inf"],
     "--target-temperature must be finite and > 0, got inf"),
    ("medusa1", ["--target", "js"], "argument --target: invalid choice: 'js'"),
    ("eagle", ["--target", "TV"], "argument --target: invalid choice: 'TV'"),
    ("medusa1", ["--target-temperature", "0.8"],
     "--target-temperature 0.8 applies to the soft targets (--target kl, tv, tv+kl)"),
    ("medusa2", ["--target", "tv"], "--target tv: Medusa-2 trains the backbone that would be "
                                    "the teacher"),
    ("hydra", ["--teacher-loss", "--target", "tv"], "--teacher-loss and --target tv: give one"),
    ("medusa1", ["--distill-temperatures", "0,-0.8"],
     "--distill-temperatures must be finite and >= 0, got -0.8"),
    ("eagle", ["--distill-temperatures", "0.8,nan"],
     "--distill-temperatures must be finite and >= 0, got nan"),
    ("hydra", ["--distill-temperature", "inf"],
     "--distill-temperature must be finite and >= 0, got inf"),
    ("medusa1", ["--distill-temperatures", "0.8,0.8"],
     "--distill-temperatures: a temperature given twice"),
    ("medusa1", ["--distill-temperatures", "0.8,"], "expected comma-separated numbers"),
    ("medusa1", ["--distill-temperature", "0.3", "--distill-temperatures", "0,0.8"],
     "give --distill-temperature or --distill-temperatures, not both"),
]


@pytest.mark.parametrize("method, flags, needle", SOFT_AND_DISTILL_ERRORS)
def test_bad_targets_and_distill_temperatures_are_one_line_errors(method, flags, needle,
                                                                   tmp_path, capsys):
    """Refused while the flags are read: before the model is loaded or any data distilled
    (no run directory is made)."""
    import importlib

    command = importlib.import_module(f"train.{method}").command
    with pytest.raises(SystemExit) as e:
        command.main(["--output-dir", str(tmp_path / "run"), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"python -m train.{method}: error: ") and needle in err[-1], err
    assert not (tmp_path / "run").exists()


def test_a_resumed_config_with_a_bad_target_is_refused(tmp_path, capsys):
    saved = dataclasses.asdict(Medusa1Config(steps=10, output_dir=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps(dict(saved, target="tv",
                                                          target_temperature=-1.0)))
    ap = Command("prog", "doc", Medusa1Config, Recipe).build_parser()
    with pytest.raises(SystemExit):
        options.parse_config(ap, Medusa1Config, ["--resume", str(tmp_path)])
    assert "--target-temperature must be finite and > 0, got -1.0" in capsys.readouterr().err


def test_soft_targets_and_distill_temperatures_parse_in_every_recipe():
    from medusa_jax.training.config import EagleConfig, HydraConfig

    for cls in (Medusa1Config, HydraConfig, EagleConfig):
        ap = Command("prog", "doc", cls, Recipe).build_parser()
        cfg, _, _ = options.parse_config(ap, cls, [
            "--target", "tv+kl", "--target-temperature", "0.8",
            "--distill-temperatures", "0,0.8,1"])
        assert (cfg.target, cfg.target_temperature, cfg.distill_temperatures) == \
            ("tv+kl", 0.8, (0.0, 0.8, 1.0))
    # each recipe's default is what it trained on before
    assert (Medusa1Config.target, HydraConfig.target, EagleConfig.target) == \
        ("hard", "hard", "kl")
    assert Medusa2Config.target == "hard"
