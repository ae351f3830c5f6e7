"""Bad input is refused before any work, in one line naming the file, field or flag,
by the commands: a bad config.json or broken weights fail infer.generate before
JAX, output paths before benchmarking, flags before work; and nothing written where the user
did not ask (train.export_heads --force, train.enlarge --output). The library's own checks
sit beside their modules' tests: model/test_config_values.py, model/test_weights_bad_input.py,
drafters/test_heads_metadata.py."""

import shutil
import subprocess
import sys

import pytest

from medusa_jax import cli
from medusa_jax.runtime import assets



def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# ---- config.json and weights: fail infer.generate before JAX


def _generate_in_child(model_dir):
    """`infer.generate --model model_dir` in a fresh process; it prints whether JAX got
    imported and the exit status."""
    code = ("import sys\nfrom infer import generate\n"
            f"rc = generate.main(['--model', {str(model_dir)!r}])\n"
            "print('jax imported' if 'jax' in sys.modules else 'no jax', rc)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.subprocess
def test_a_bad_config_value_fails_generate_before_jax(model_folder):
    """`infer.generate` names config.json and the field, and never imports JAX for it."""
    d = model_folder(rope_theta=-10000)
    proc = _generate_in_child(d)
    assert proc.stdout.split() == ["no", "jax", "2"], proc.stderr
    assert one_line(proc.stderr) == (f"error: {d / 'config.json'}: rope_theta must be a "
                                     f"finite number > 0, got -10000")


@pytest.mark.subprocess
def test_a_truncated_file_fails_generate_before_jax(model_folder):
    d = model_folder()
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:5000])
    proc = _generate_in_child(d)
    assert proc.stdout.split() == ["no", "jax", "2"], proc.stderr
    assert "model.safetensors: corrupt or truncated" in one_line(proc.stderr)


# ---- outputs and flags before work


@pytest.fixture
def no_work(monkeypatch):
    """Any model loading means the checks came too late."""
    def fail(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(cli, "load_with_heads", fail)
    from medusa_jax.model import weights

    monkeypatch.setattr(weights, "load_pretrained", fail)


@pytest.mark.parametrize("argv, message", [
    (["--json", "{tmp}"], "--json {tmp}: is a folder; give a file name"),
    (["--plot", "{tmp}/missing/dir/p.png"], "--plot {tmp}/missing/dir/p.png: its folder "
                                            "{tmp}/missing/dir does not exist"),
    (["--modes", "rejection", "--temperature", "-1"], "--temperature must be > 0 for --modes "
                                                      "rejection, got -1.0"),
    (["--modes", "greedy,fast"], "--modes: 'fast' is not one of greedy, typical, rejection"),
    (["--model", "{tmp}/nope"], "--model {tmp}/nope: no such folder"),
])
def test_bench_checks_outputs_and_flags_first(tmp_path, capsys, no_work, argv, message):
    from infer import bench

    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as e:
        bench.main(["--no-transformers", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: {message.replace('{tmp}', str(tmp_path))}")


def test_generate_refuses_a_bad_temperature_in_one_line(capsys):
    from infer import generate

    with pytest.raises(SystemExit) as e:
        generate.main(["--mode", "rejection", "--temperature", "-1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --temperature must be > 0 for --mode rejection, got -1.0")


def test_enlarge_names_rotate_before_work(capsys, tmp_path, no_work):
    from train import enlarge

    with pytest.raises(SystemExit) as e:
        enlarge.main(["--shape", "llama-110m", "--rotate", "-1", "--output",
                      str(tmp_path / "big")])
    assert e.value.code == 2
    assert "argument --rotate: must be in 0..2**63-1, got -1" in capsys.readouterr().err
    assert not (tmp_path / "big").exists()


@pytest.mark.parametrize("where", ["/proc/medusa-jax-test/big", "/sys/big"])
def test_enlarge_refuses_an_unwritable_output_before_work(where, no_work):
    from train import enlarge

    with pytest.raises(SystemExit) as e:
        enlarge.main(["--shape", "llama-110m", "--output", where])
    assert str(e.value).startswith(f"error: --output {where}: cannot write into ")
    assert "\n" not in str(e.value)


def test_enlarge_never_writes_into_the_package(no_work):
    from train import enlarge

    out = assets.root() / "big"
    with pytest.raises(SystemExit) as e:
        enlarge.main(["--shape", "llama-110m", "--output", str(out)])
    assert "inside the installed package's assets" in str(e.value)
    assert not out.exists()


def test_memory_report_checks_seq_len_against_the_shape(capsys):
    from train.medusa1 import command

    with pytest.raises(SystemExit) as e:
        command.main(["--memory-report", "--shape", "llama-2-7b", "--seq-len", "100000"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --seq-len 100000 is longer than the context of --shape llama-2-7b "
        "(max_position_embeddings 4096)")


def test_training_checks_seq_len_against_the_model_before_work(capsys, tmp_path):
    from train.medusa1 import command

    with pytest.raises(SystemExit) as e:
        command.main(["--seq-len", "4096", "--output-dir", str(tmp_path / "run")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --seq-len 4096 is longer than the context of --model stories260K "
        "(max_position_embeddings 512)")
    assert not (tmp_path / "run").exists()


# ---- train.export_heads --force


def test_export_never_writes_into_the_package_assets(tmp_path, monkeypatch, capsys):
    """Against a copy of the assets (so a regression cannot damage the real ones)."""
    from train import export_heads

    fake = tmp_path / "assets"
    shutil.copytree(assets.heads_dir(), fake / "stories260K_heads")
    monkeypatch.setattr(assets, "root", lambda: fake)
    target = fake / "stories260K_heads"
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    rc = export_heads.main([str(assets.heads_dir()), "--format", "medusa_jax", "--output",
                            str(target), "--force"])
    assert rc == 1
    assert "inside the installed package's assets" in one_line(capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_force_replaces_only_a_folder_holding_nothing_but_an_export(tmp_path, capsys):
    from train import export_heads

    out = tmp_path / "vllm"
    src = str(assets.heads_dir())
    assert export_heads.main([src, "--format", "vllm", "--output", str(out)]) == 0
    (out / "mynotes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert export_heads.main([src, "--format", "vllm", "--output", str(out), "--force"]) == 1
    assert one_line(capsys.readouterr().err) == (
        f"error: --output {out}: it holds files a vllm export does not write (mynotes.txt); "
        f"not replaced even with --force")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / "mynotes.txt").unlink()
    assert export_heads.main([src, "--format", "vllm", "--output", str(out), "--force"]) == 0
