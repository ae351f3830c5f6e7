"""`tools.bench_config.BenchConfig`: infer.bench's options, checked once in one-line
errors, its flags (spellings and defaults) generated from the fields."""

import argparse
import dataclasses

import pytest

from medusa_jax.decoding.config import DecodeConfig
from medusa_jax.runtime import options
from medusa_jax.tools.bench_config import BenchConfig


def parse(*argv) -> BenchConfig:
    ap = argparse.ArgumentParser()
    options.add_config_flags(ap, BenchConfig)
    return options.config_from_flags(BenchConfig, ap.parse_args(list(argv)))


def test_no_flags_give_the_defaults():
    cfg = parse()
    assert cfg == BenchConfig()
    assert (cfg.num_prompts, cfg.max_new_tokens, cfg.modes, cfg.batch_sizes, cfg.reps,
            cfg.temperature, cfg.shape, cfg.dtype, cfg.prefix, cfg.context) == \
        (16, 128, "greedy", (1,), 3, 0.7, "llama-110m", "float32", 256, 2048)
    assert cfg.transformers and not cfg.breakdown and cfg.json is None
    assert cfg.tree_sizes == (0, 4, 8, 16, 32, 64, 128)
    assert cfg.report_tokens == (1, 5, 9, 17, 33, 65)


def test_the_options_it_shares_with_generate_are_declared_once():
    shared = {f.name: f for f in dataclasses.fields(DecodeConfig)}
    for f in dataclasses.fields(BenchConfig):
        if f.name in ("max_new_tokens", "temperature", "dtype"):
            assert (f.default, f.metadata) == (shared[f.name].default, shared[f.name].metadata)


@pytest.mark.parametrize("argv, field, value", [
    (["--batch-size", "1,4"], "batch_sizes", (1, 4)),
    (["--batch-sizes", "2"], "batch_sizes", (2,)),
    (["--no-transformers"], "transformers", False),
    (["--json"], "json", "-"),
    (["--json", "out.json"], "json", "out.json"),
    (["--cache-phases", "1,4"], "cache_phases", (1, 4)),
    (["--breakdown"], "breakdown", True),
    (["--tree-sizes", "0,16"], "tree_sizes", (0, 16)),
    (["--modes", "greedy, typical"], "mode_list", ["greedy", "typical"]),
])
def test_every_flag_spelling_still_works(argv, field, value):
    assert getattr(parse(*argv), field) == value


@pytest.mark.parametrize("fields, message", [
    (dict(modes="greedy,fast"), "--modes: 'fast' is not one of greedy, typical, rejection"),
    (dict(modes=" , "), "--modes ' , ': give at least one of greedy, typical, rejection"),
    (dict(modes="rejection", temperature=-1.0),
     "--temperature must be > 0 for --modes rejection, got -1.0"),
])
def test_a_bad_value_is_one_line_naming_it(fields, message, one_line_error):
    assert one_line_error(ValueError, lambda: BenchConfig(**fields), message)


def test_a_bad_flag_value_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--batch-size", "0")
    assert e.value.code == 2
    assert "every value must be >= 1, got 0" in capsys.readouterr().err
