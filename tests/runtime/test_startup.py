"""The first minutes: the persistent compilation cache (on by default, off by flag or
environment, never fatal), compile time printed apart from decode speed, and what a
decoding command does not import."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.runtime import assets, compile_cache, timing
from medusa_jax.text import tokenizer as startup

ROOT = Path(__file__).resolve().parents[2]  # the repository

# A JAX program compiled with the cache as a command turns it on (`compile_cache.enable`).
SCRIPT = """
from medusa_jax.runtime import compile_cache
print("cache:", compile_cache.enable())
import jax, jax.numpy as jnp
print("result:", int(jax.jit(lambda x: (x * 3 + 1).sum())(jnp.arange(5))))
"""


def _env(xdg: Path, **extra) -> dict:
    """The environment of a user run: its own XDG cache home, not the test suite's cache."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("JAX_") and k != compile_cache.ENV_OFF}
    env["XDG_CACHE_HOME"] = str(xdg)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _run(args, env, ok=True):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*-cache")) if folder.is_dir() else []


# ----------------------------------------------------------------------------- timing


def test_speed_line():
    assert timing.speed_line(timing.Compile(1.7), 128, 0.02) == \
        "compiled in 1.7 s; 128 tokens in 0.020 s (6,400 tokens/s)"
    cached = timing.Compile(0.42, lookups=3, hits=3)
    assert timing.speed_line(cached, 12800, 2.0) == \
        "compiled in 0.42 s (from the compilation cache); 12,800 tokens in 2.0 s (6,400 tokens/s)"
    assert not (cached + timing.Compile(3.0, lookups=1, hits=0)).cached


@pytest.mark.slow
def test_generate_compiles_once_and_times_compile_apart(stories):
    """The decoder is compiled ahead of the call, not a second time by it; the call's time
    is decoding only."""
    from medusa_jax.api import Medusa

    cfg, params, tok = stories
    m = Medusa(cfg, params, tok)
    compiles = []

    def listen(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration" and \
                kw.get("fun_name") == "jit(generate)":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = m.generate(["Lily", "Tom"], max_new_tokens=7, batch_size=2)
        timed = m.last_timing
        again = m.generate(["Lily", "Tom"], max_new_tokens=7, batch_size=2)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(compiles) == 1  # not once for `precompile` and once more for the call
    assert timed.tokens == sum(g.new_tokens for g in first) == 14
    assert first[0].compile_seconds == timed.compile.seconds > 0 and timed.seconds > 0
    assert again[0].compile_seconds < first[0].compile_seconds
    assert [g.token_ids for g in again] == [g.token_ids for g in first]
    assert "compiled in" in timed.line() and "14 tokens in" in timed.line()


# ----------------------------------------------------------------------------- the cache


def test_cache_folder_and_switches(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert compile_cache.default_dir() == Path("/somewhere/medusa_jax/jax-cache")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.default_dir() == Path.home() / ".cache" / "medusa_jax" / "jax-cache"
    for value, off in (("1", True), ("yes", True), ("0", False), ("", False), ("off", False)):
        monkeypatch.setenv(compile_cache.ENV_OFF, value)
        assert compile_cache.off_by_env() is off
    from infer.generate import build_parser

    assert build_parser().parse_args(["--no-compile-cache"]).no_compile_cache
    assert not build_parser().parse_args([]).no_compile_cache


@pytest.mark.slow
@pytest.mark.subprocess
def test_generate_second_run_loads_from_the_cache(tmp_path):
    args = ["-m", "infer.generate", "--prompt", "Lily", "--max-new-tokens", "4"]
    folder = tmp_path / "xdg" / "medusa_jax" / "jax-cache"
    first = _run(args, _env(tmp_path / "xdg"))
    assert _entries(folder) and "compiled in" in first.stdout
    assert "(from the compilation cache)" not in first.stdout
    second = _run(args, _env(tmp_path / "xdg"))
    assert "(from the compilation cache)" in second.stdout
    text = lambda proc: proc.stdout.split("###")[1].splitlines()[:2]  # noqa: E731
    assert text(second) == text(first)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["--no-compile-cache", compile_cache.ENV_OFF])
def test_the_cache_can_be_turned_off(tmp_path, how):
    """Off, the cache folder is not even looked at (here it could not be used)."""
    (tmp_path / "medusa_jax").write_text("not a folder")
    if how == compile_cache.ENV_OFF:
        proc = _run(["-c", SCRIPT], _env(tmp_path, **{how: "1"}))
    else:  # as the commands pass their flag on
        script = SCRIPT.replace("enable()", "enable_from_args(__import__('infer.generate')"
                                ".generate.build_parser().parse_args(['--no-compile-cache']))")
        proc = _run(["-c", script], _env(tmp_path))
    assert "cache: None" in proc.stdout and "result: 35" in proc.stdout
    assert "note:" not in proc.stderr


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["a file", "read-only", "unwritable"])
def test_an_unusable_cache_folder_never_breaks_a_run(tmp_path, how):
    xdg = tmp_path / "xdg"
    if how == "a file":
        xdg.mkdir()
        (xdg / "medusa_jax").write_text("not a folder")
    elif how == "read-only":  # root may write there all the same: then the cache just works
        xdg.mkdir()
        xdg.chmod(0o555)
    else:  # no one can create a folder here, root included
        xdg = Path("/proc/self/no-such-place")
    try:
        proc = _run(["-c", SCRIPT], _env(xdg))
    finally:
        if how == "read-only":
            xdg.chmod(0o755)
    assert "result: 35" in proc.stdout and "Traceback" not in proc.stderr
    writable = how == "read-only" and os.access(xdg, os.W_OK)
    assert ("compilation cache off for this run" in proc.stderr) is not writable


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_corrupt_cache_entry_is_recompiled_and_replaced(tmp_path):
    folder = tmp_path / "medusa_jax" / "jax-cache"
    assert "result: 35" in _run(["-c", SCRIPT], _env(tmp_path)).stdout
    entries = _entries(folder)
    assert entries
    for i, entry in enumerate(entries):  # truncated (a killed write) or overwritten
        data = entry.read_bytes()
        entry.write_bytes(data[: len(data) // 2] if i % 2 else b"garbage" * 10)
    proc = _run(["-c", SCRIPT], _env(tmp_path))
    assert "result: 35" in proc.stdout and "Traceback" not in proc.stderr
    assert "removed a corrupt entry" in proc.stderr
    from jax._src import compilation_cache as cc

    for entry in _entries(folder):  # rewritten whole
        cc.decompress_executable(entry.read_bytes())
    assert "removed a corrupt entry" not in _run(["-c", SCRIPT], _env(tmp_path)).stderr


# ----------------------------------------------------------------------------- start-up


@pytest.mark.slow
@pytest.mark.subprocess
def test_decoding_the_embedded_model_imports_no_torch_transformers_or_flax():
    code = ("import sys\nfrom medusa_jax import Medusa\n"
            "m = Medusa.load(heads='default')\n"
            "m.generate('Once upon a time', max_new_tokens=4, medusa=False)\n"
            "print(sorted(n for n in ('torch', 'transformers', 'flax') if n in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = _run(["-c", code], env)  # the test suite's cache
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout


def test_embedded_tokenizer_agrees_with_transformers(stories):
    from transformers import AutoTokenizer

    path = assets.model_dir()
    auto = AutoTokenizer.from_pretrained(str(path))
    assert startup.tokenizer_class(path) is type(auto)
    light = startup.load_tokenizer(path)
    assert isinstance(light, startup.EmbeddedTokenizer)
    assert (light.bos_token_id, light.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
    texts = (assets.prompts_file("train").read_text().splitlines()
             + assets.heldout_prompts()
             + assets.text_file("heldout").read_text().split("\n\n")[:20]
             + ["", " ", "  two  spaces ", "Tab\tand\nnewline", "ünïcödé, ½ ☃", "<s>x</s>"])
    for text in texts:
        assert light.encode(text) == auto.encode(text), text
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, auto.vocab_size, rng.integers(1, 40)).tolist()
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == \
                auto.decode(ids, skip_special_tokens=skip), ids
    # anything else comes from the transformers tokenizer
    assert light.vocab_size == auto.vocab_size and len(light) == len(auto)
    assert light("Lily")["input_ids"] == auto("Lily")["input_ids"]


def test_bfloat16_checkpoint_loads(tmp_path):
    """Tensors stored as bfloat16, which numpy's safetensors reader cannot read, load as the
    float32 values they round to."""
    from safetensors.flax import save_file
    from safetensors.numpy import load_file

    from medusa_jax.model.weights import load_pretrained

    tensors = sorted(load_file(assets.model_dir() / "model.safetensors").items())
    bf16 = {n: jnp.asarray(a, jnp.bfloat16 if i % 2 else jnp.float32)
            for i, (n, a) in enumerate(tensors)}
    as_f32 = {n: jnp.asarray(a, jnp.float32) for n, a in bf16.items()}
    got, want = [], []
    for name, stored, out in (("bf16", bf16, got), ("f32", as_f32, want)):
        folder = tmp_path / name
        shutil.copytree(assets.model_dir(), folder)
        save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
        out.extend(jax.tree.leaves(load_pretrained(folder)[1]))
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_distill_prints_compile_apart(tmp_path, capsys):
    from train.distill import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Lily went\nTom saw\nThe sun\n")
    out = tmp_path / "answers.jsonl"
    main(["--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "5",
          "--batch-size", "2", "--temperature", "0"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    records = [json.loads(r) for r in out.read_text().splitlines()]
    tokens = int(line.split("; ")[1].split(" tokens in")[0].replace(",", ""))
    assert len(records) == 3 and line.startswith(f"wrote 3 answers to {out}: compiled in ")
    assert 3 <= tokens <= 15 and "tokens/s)" in line
