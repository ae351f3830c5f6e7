"""The note after a run's decoding benchmark says only what holds for the run's own model:
that a step is bound by per-kernel overhead on the embedded stories260K, not elsewhere."""

import time

import pytest

from medusa_jax.drafters import registry as drafter
from medusa_jax.tools import bench
from medusa_jax.training import report
from medusa_jax.training.trainer import DecodingCheck, TrainResult


class _Comparison:
    def to_json(self):
        return {}


@pytest.mark.parametrize("embedded", [True, False])
def test_the_note_after_training_fits_the_model(tmp_path, monkeypatch, capsys, embedded):
    monkeypatch.setattr(bench, "compare_decoding", lambda *a, **k: _Comparison())
    monkeypatch.setattr(bench, "print_comparison", lambda *a, **k: None)
    monkeypatch.setattr(drafter, "kind_of", lambda heads: "medusa")
    check = DecodingCheck(backbone={}, heads={}, cfg=None, prompts=[], trees=["t"], eos=(),
                          max_new_tokens=1, name="medusa1", embedded=embedded)
    result = TrainResult({"run_dir": str(tmp_path)}, time.perf_counter(), finished=True,
                         decoding=check)
    report.finish(result)
    out = capsys.readouterr().out
    assert ("per-kernel overhead" in out) == embedded
    assert "where Medusa pays: docs/performance.md" in out
