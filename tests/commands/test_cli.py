"""The inference entry points, run as a user runs them."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from medusa_jax.drafters.formats import save_heads
from medusa_jax.drafters.medusa.heads import HeadsConfig, init_heads

ROOT = Path(__file__).resolve().parents[2]  # the repository


def _run(*args, ok=True):
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def heads_dir(stories, tmp_path_factory):
    cfg, params, _ = stories
    heads = init_heads(cfg, params, HeadsConfig(num_heads=5))
    heads = dict(heads, b=heads["b"] + 0.01 * jax.random.normal(jax.random.key(0), heads["b"].shape))
    return save_heads(tmp_path_factory.mktemp("heads"), heads, cfg).parent


@pytest.mark.slow
@pytest.mark.subprocess
def test_generate_json(heads_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Lily"}\n{"turns": ["Once upon a time", "ignored"]}\n')
    proc = _run("infer.generate", "--heads", str(heads_dir), "--prompts-file", str(prompts),
                "--prompt", "Tom", "--prompt", "Tom", "--max-new-tokens", "12", "--json",
                "--tree", "mc_sim_7b_63:8")
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Tom", "Tom", "Lily", "Once upon a time"]
    assert rows[0] == rows[1]  # the same prompt twice: two equal rows, paired by position
    for r in rows:
        assert r["new_tokens"] == len(r["token_ids"]) <= 12 and r["steps"] >= 1
        assert r["tokens_per_step"] == pytest.approx(r["new_tokens"] / r["steps"])
        assert isinstance(r["text"], str) and r["text"]
    assert "tokens/step" in proc.stderr and "compiled in" in proc.stderr
    assert f"{sum(r['new_tokens'] for r in rows)} tokens in" in proc.stderr  # compile apart


@pytest.mark.subprocess
@pytest.mark.parametrize("args, message", [
    (["--prompts-file", "/no/such/file"], "--prompts-file /no/such/file: no such file"),
    (["--heads", "/no/such/heads"], "no Medusa heads artifact"),
    (["--tree", "nonsense", "--heads", "HEADS"], "neither a file nor a known tree"),
    (["--max-new-tokens", "600"], "exceeds the model's context of 512"),
])
def test_generate_errors_are_one_line(heads_dir, args, message):
    args = [str(heads_dir) if a == "HEADS" else a for a in args]
    proc = _run("infer.generate", *args, ok=False)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_bench_reports_identical_greedy_output(heads_dir):
    proc = _run("infer.bench", "--heads", str(heads_dir), "--num-prompts", "2",
                "--max-new-tokens", "16", "--reps", "1", "--no-transformers", "--json",
                "--trees", "mc_sim_7b_63:4", "--cache-phases", "1,4")
    rows = json.loads(proc.stdout)
    assert [r["config"] for r in rows] == ["plain jax (1 ph.)", "medusa (1 ph.)",
                                           "plain jax (4 ph.)", "medusa (4 ph.)"]
    med = [r for r in rows if r["config"].startswith("medusa")]
    assert len(med) == 2 and all(r["identical_to_plain"] for r in med)
    assert all(r["tokens_per_step"] >= 1 and r["step_vs_plain"] > 0 for r in med)
