"""The first five minutes: `--help` and flag errors import no JAX, Flax,
transformers or the model code; transformers' PyTorch notice silenced. (The notebook API
saying when it compiles: test_api.py.) (Help timing is measured, not asserted here:
see the README.)"""

import json
import logging
import os
import subprocess
import sys

import pytest

COMMANDS = ["infer.generate", "infer.bench", "infer.tree", "infer.search_tree",
            "train.medusa1", "train.medusa2", "train.hydra", "train.distill", "train.enlarge",
            "train.export_heads", "train.make_openings"]
HEAVY = ("jax", "flax", "transformers", "torch", "medusa_jax.model.backbone", "medusa_jax.decoding.decode")

PROBE = """
import json, runpy, sys
sys.argv = [{module!r}, *{argv!r}]
code = 0
try:
    runpy.run_module({module!r}, run_name="__main__")
except SystemExit as e:  # sys.exit("error: ...") prints its message as the process ends
    code = e.code if isinstance(e.code, int) or e.code is None else 1
    if code == 1 and not isinstance(e.code, int):
        print(e.code, file=sys.stderr)
print(json.dumps({{"rc": code, "heavy": [m for m in {heavy!r} if m in sys.modules]}}),
      file=sys.stderr)
"""


def probe(module, *argv):
    proc = subprocess.run([sys.executable, "-c", PROBE.format(module=module, argv=list(argv),
                                                              heavy=HEAVY)],
                          capture_output=True, text=True, timeout=120)
    return json.loads(proc.stderr.strip().splitlines()[-1]), proc


@pytest.mark.subprocess
@pytest.mark.parametrize("module", COMMANDS)
def test_help_imports_nothing_heavy(module):
    result, proc = probe(module, "--help")
    assert result == {"rc": 0, "heavy": []}, proc.stderr
    assert proc.stdout.startswith("usage: ")


@pytest.mark.subprocess
@pytest.mark.parametrize("module, argv", [
    ("infer.generate", ["--model", "/nonexistent/model"]),
    ("infer.bench", ["--model", "/nonexistent/model"]),
    ("train.medusa1", ["--model", "/nonexistent/model"]),
    ("train.medusa2", ["--model", "/nonexistent/model"]),
    ("train.hydra", ["--model", "/nonexistent/model"]),
    ("train.enlarge", ["--shape", "llama-110m", "--model", "/nonexistent/model",
                       "--output", "/nonexistent/out"]),
    ("train.distill", ["--prompts", "p.txt", "--model", "/nonexistent/model", "--output",
                       "/nonexistent/a.jsonl"]),
    ("infer.search_tree", ["--model", "/nonexistent/model"]),
    ("train.export_heads", ["/nonexistent/model", "--format", "vllm", "--output",
                            "/nonexistent/out"]),
])
def test_a_wrong_model_path_is_one_line_before_heavy_imports(module, argv):
    result, proc = probe(module, *argv)
    assert result["rc"] in (1, 2) and result["heavy"] == [], proc.stderr
    lines = [x for x in proc.stderr.strip().splitlines()[:-1] if not x.startswith("usage")
             and not x.startswith(" ")]
    assert len(lines) == 1 and "/nonexistent/model" in lines[0], proc.stderr


def test_the_pytorch_notice_of_transformers_is_silenced(monkeypatch, capsys):
    """transformers prints it through `warning_advice`, which this environment switch
    silences; `quiet.imports` sets it (unless the user chose otherwise)."""
    from medusa_jax.runtime import quiet

    monkeypatch.delenv(quiet.ADVISORY, raising=False)
    quiet.imports()
    assert os.environ[quiet.ADVISORY] == "1"
    import transformers  # noqa: F401 - installs warning_advice on loggers
    from transformers.utils import logging as tlog

    log = tlog.get_logger("transformers")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    try:
        log.warning_advice("PyTorch was not found. Models won't be available ...")
    finally:
        log.removeHandler(handler)
    assert records == []
    monkeypatch.setenv(quiet.ADVISORY, "")  # a user's own choice is kept
    quiet.imports()
    assert os.environ[quiet.ADVISORY] == ""


@pytest.mark.slow
@pytest.mark.subprocess
def test_decoding_sets_the_switch_before_transformers_is_imported():
    code = ("import os, sys\nfrom medusa_jax.text.tokenizer import tokenizer_class\n"
            "from medusa_jax.runtime import assets\n"
            "os.environ.pop('TRANSFORMERS_NO_ADVISORY_WARNINGS', None)\n"
            "assert 'transformers' not in sys.modules\n"
            "tokenizer_class(assets.model_dir() / 'x')\n"
            "print(os.environ.get('TRANSFORMERS_NO_ADVISORY_WARNINGS'))")
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.stdout.strip() == "1", proc.stderr


@pytest.mark.slow
def test_bench_reports_progress_per_compile_warm_up_and_repetition(stories):
    from medusa_jax.tools.bench import run_decoder

    cfg, params, tok = stories
    from medusa_jax.model.backbone import decoding_layout

    seen = []
    run_decoder(decoding_layout(cfg, params), cfg, [tok.encode("Lily")], batch_size=1,
                max_new_tokens=4, eos=(), reps=2, progress=seen.append)
    assert [s.split()[0] for s in seen] == ["compiled", "warm-up", "rep", "rep"]
    assert seen[2].startswith("rep 1/2: ") and seen[3].startswith("rep 2/2: ")


def test_the_step_ratio_column_says_what_it_is(capsys):
    from infer import bench

    row = {"config": "medusa", "mode": "greedy", "tree": "t", "batch_size": 1,
           "tokens_per_step": 2.0, "step_ms": 1.0, "step_vs_plain": 2.5,
           "tokens_per_second": 10.0, "speedup": 0.8, "identical_to_plain": True,
           "by_category": None}
    bench._print_table([row])
    head = capsys.readouterr().out.splitlines()[0]
    assert "step/plain" in head and "overhead" not in head


@pytest.mark.subprocess
@pytest.mark.parametrize("module, argv", [
    ("infer.generate", ["--prompts-file", "/nonexistent/p.txt"]),
    ("infer.bench", ["--prompts", "/nonexistent/p.txt"]),
])
def test_a_missing_prompts_file_is_one_line_before_heavy_imports(module, argv):
    result, proc = probe(module, *argv)
    assert result["rc"] in (1, 2) and result["heavy"] == [], proc.stderr
    assert "/nonexistent/p.txt: no such" in proc.stderr
