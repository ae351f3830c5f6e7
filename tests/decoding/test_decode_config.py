"""`decoding.config.DecodeConfig`: infer.generate's decoding options, checked once in
one-line errors, its flags generated from the fields, and no JAX imported for any of it."""

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from medusa_jax.decoding.config import DecodeConfig
from medusa_jax.runtime import options


def parse(*argv) -> DecodeConfig:
    ap = argparse.ArgumentParser()
    options.add_config_flags(ap, DecodeConfig)
    return options.config_from_flags(DecodeConfig, ap.parse_args(list(argv)))


def test_no_flags_give_the_defaults():
    assert parse() == DecodeConfig()
    assert DecodeConfig() == DecodeConfig(mode="greedy", tree=None, max_new_tokens=128,
                                          temperature=0.7, top_k=0, top_p=1.0, seed=0,
                                          batch_size=8, dtype="float32")


def test_flags_reach_their_fields():
    cfg = parse("--mode", "rejection", "--tree", "dynamic:4", "--max-new-tokens", "16",
                "--temperature", "0.5", "--top-k", "20", "--top-p", "0.9", "--seed", "-3",
                "--batch-size", "2", "--dtype", "bfloat16")
    assert cfg == DecodeConfig("rejection", "dynamic:4", 16, 0.5, 20, 0.9, -3, 2, "bfloat16")
    assert "dtype" not in cfg.generate_args()
    assert cfg.generate_args()["tree"] == "dynamic:4"


@pytest.mark.parametrize("fields, message", [
    (dict(mode="rejection", temperature=-1.0),
     "--temperature must be > 0 for --mode rejection, got -1.0"),
    (dict(mode="typical", temperature=0.0), "--temperature must be > 0 for --mode typical"),
    (dict(temperature=float("nan")), "--temperature must be a finite number, got nan"),
    (dict(mode="fast"), "--mode must be one of greedy, typical, rejection, got 'fast'"),
    (dict(top_k=-1), "--top-k must be an integer >= 0 (0: off), got -1"),
    (dict(top_p=0.0), "--top-p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "--top-p must be in (0, 1], got 1.5"),
    (dict(max_new_tokens=0), "--max-new-tokens must be an integer >= 1, got 0"),
    (dict(batch_size=0), "--batch-size must be an integer >= 1, got 0"),
    (dict(dtype="float16"), "--dtype must be one of float32, bfloat16, got 'float16'"),
])
def test_a_bad_value_is_one_line_naming_it(fields, message, one_line_error):
    assert one_line_error(ValueError, lambda: DecodeConfig(**fields), message)


def test_greedy_takes_any_positive_or_zero_temperature():
    assert DecodeConfig(temperature=0.0).temperature == 0.0


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DecodeConfig().mode = "typical"


@pytest.mark.subprocess
def test_the_config_modules_import_no_jax():
    code = ("import json, sys\n"
            "import medusa_jax.decoding.config, medusa_jax.tools.bench_config\n"
            "import medusa_jax.serving.config\n"
            "print(json.dumps([m for m in ('jax', 'flax') if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
