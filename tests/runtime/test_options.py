"""`runtime.options.add_config_flags` / `config_from_flags`: a flag named otherwise than its
field, a flag with a default of its own, a value that stands for None, and a bool field's
--no- form, as infer.serve's engine flags use them (parsed here, no server started)."""

import pytest

from infer.serve import build_parser, engine_config
from medusa_jax.serving.config import EngineConfig


def engine(*argv) -> EngineConfig:
    return engine_config(build_parser().parse_args(list(argv)))


def test_no_flags_give_the_servers_defaults():
    """The engine's defaults, but for plain steps: "auto" on the server, never (None) for a
    bare `EngineConfig`."""
    assert engine() == EngineConfig(plain_above="auto")
    assert EngineConfig().plain_above is None


@pytest.mark.parametrize("argv, field, value", [
    (["--prefill-buckets", "16,64"], "buckets", (16, 64)),
    (["--slot-buckets", "1,4"], "slot_buckets", (1, 4)),
    (["--plain-above-slots", "3"], "plain_above", 3),
    (["--plain-above-slots", "never"], "plain_above", None),
    (["--plain-above-slots", "auto"], "plain_above", "auto"),
    (["--short-call-ms", "5"], "short_call_ms", 5.0),
    (["--short-call-ms", "0"], "short_call_ms", None),  # 0: off
    (["--overlap-ms", "0"], "overlap_ms", None),  # 0: always overlap
    (["--overlap-ms", "7.5"], "overlap_ms", 7.5),
    (["--no-prefix-cache"], "prefix_cache", False),
    (["--prefix-cache"], "prefix_cache", True),
    (["--tree", "dynamic:4"], "tree", "dynamic:4"),
    (["--max-context", "128"], "max_context", 128),
])
def test_each_engine_flag_reaches_its_field(argv, field, value):
    assert getattr(engine(*argv), field) == value


@pytest.mark.parametrize("argv, message", [
    (["--plain-above-slots", "some"],
     "--plain-above-slots: expected a slot count, 'auto' or 'never', got 'some'"),
    (["--slot-buckets", "0,4"], "--slot-buckets: expected positive integers"),
    (["--short-call-ms", "nan"], "--short-call-ms: must be a finite number >= 0, got nan"),
    (["--overlap-ms", "-2"], "--overlap-ms: must be a finite number >= 0, got -2"),
    (["--max-context", "0"], "--max-context: must be >= 1, got 0"),
])
def test_a_bad_engine_flag_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
