"""`python -m train.medusa1` end to end on the embedded model (tiny settings), and its errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from medusa_jax.decoding import decode
from medusa_jax.decoding.acceptance import Sampling
from medusa_jax.decoding.tree import Tree
from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters.medusa import heads as heads_lib
from train import medusa1

ROOT = Path(__file__).resolve().parents[2]  # the repository
TINY = ["--steps", "4", "--distill-samples", "8", "--distill-max-new-tokens", "24",
        "--distill-batch-size", "8", "--batch-size", "4", "--seq-len", "64",
        "--eval-prompts", "2", "--eval-max-new-tokens", "16", "--save-every", "2",
        "--log-every", "1", "--eval-every", "2", "--num-heads", "4", "--keep", "2"]


def cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "train.medusa1", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.subprocess
def test_train_stop_resume_and_use_the_heads(tmp_path, stories):
    run = tmp_path / "run"
    first = cli("--output-dir", str(run), "--stop-after", "2", *TINY)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stopped at step 2 of 4" in first.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    assert not (run / "heads").exists()

    second = cli("--resume", str(run))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed at step 2" in second.stdout and "(cached)" in second.stdout
    assert "tokens/step" in second.stdout and "speedup" in second.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]
    train_steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()
                   if json.loads(line)["split"] == "train"]
    assert train_steps == [1, 2, 3, 4]
    assert (run / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 4 and len(summary["heldout_top1"]) == 4
    assert summary["benchmark"]["tokens_per_step"] >= 1.0

    # the artifact loads, matches the last checkpoint and decodes losslessly
    cfg, params, tok = stories
    heads, meta = heads_formats.load_heads(run / "heads", cfg)
    assert heads_lib.heads_config_of(heads) == heads_lib.HeadsConfig(4, 2)  # default: 2 blocks
    assert meta["extra"]["step"] == 4
    saved = ocp.StandardCheckpointer().restore((run / "checkpoints" / "4" / "params").absolute())
    for name in ("w", "b", "proj"):
        np.testing.assert_array_equal(np.asarray(saved["heads"][name]), np.asarray(heads[name]))
    init = heads_lib.init_heads(cfg, params, heads_lib.HeadsConfig(4, 2))
    assert not np.array_equal(np.asarray(init["proj"]), np.asarray(heads["proj"]))  # trained
    prompt = [tok.bos_token_id] + tok("Once upon a time", add_special_tokens=False)["input_ids"]
    tokens, lengths = decode.pad_prompts([prompt])
    med = decode.medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0),
                                 tree=Tree.load("mc_sim_7b_63"), sampling=Sampling(),
                                 max_new_tokens=16)
    ref = decode.generate(params, cfg, tokens, lengths, jax.random.key(0),
                          sampling=Sampling(), max_new_tokens=16)
    assert int(med.num_new[0]) == 16
    np.testing.assert_array_equal(np.asarray(med.tokens), np.asarray(ref.tokens))


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--steps", "3", "--epochs", "1"], "not both"),
    (["--mesh", "data=x"], "bad mesh"),
    (["--template", "fancy"], "invalid choice"),
    (["--resume", "/nonexistent/run"], "no config.json"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        medusa1.command.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def test_bad_data_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": []}\n{oops\n')
    for data_file, message in ((tmp_path / "missing.jsonl", "missing.jsonl: no such data file"),
                               (bad, "bad.jsonl:2: invalid JSON")):
        with pytest.raises(SystemExit) as e:
            medusa1.command.main(["--data", str(data_file), "--output-dir", str(tmp_path / "run")])
        assert isinstance(e.value.code, str) and e.value.code.startswith("error: ")
        assert message in e.value.code and "\n" not in e.value.code
