"""`python -m train.export_heads` never writes into a folder that holds something else, and
what it writes has the permissions of any other file (train/export_heads.py, rundir.py)."""

import os
import shutil
import stat

import pytest

from medusa_jax.api import Medusa, default_heads_dir
from medusa_jax.drafters import formats as hf
from medusa_jax.drafters.formats import load_heads, save_heads
from medusa_jax.model.weights import default_model_dir, load_pretrained
from train import export_heads

SOURCE = str(default_heads_dir())


def export(fmt, out, *extra):
    return export_heads.main([SOURCE, "--format", fmt, "--output", str(out), *extra])


def tree(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def last_err(capsys):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def test_an_export_never_mixes_two_layouts_in_one_folder(tmp_path, capsys):
    out = tmp_path / "V"
    assert export("vllm", out) == 0
    before = tree(out)
    assert export("reference", out) == 1
    assert last_err(capsys) == (f"error: --output {out}: the folder holds files (config.json, "
                                f"model.safetensors); give a new or empty folder, or --force "
                                f"to replace an earlier export")
    assert export("reference", out, "--force") == 1
    assert last_err(capsys) == (f"error: --output {out}: it holds the vllm layout, not "
                                f"reference; not replaced even with --force")
    assert tree(out) == before
    assert hf.detect(out).layout == "vllm"
    assert export("vllm", out, "--force") == 0  # replacing an earlier export of the same kind
    assert hf.detect(out).layout == "vllm"


def test_force_does_not_replace_a_folder_of_other_files(tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert export("vllm", out, "--force") == 1
    assert "no Medusa heads in any known layout" in last_err(capsys)
    assert tree(out) == {"notes.txt": b"mine"}


def test_an_output_that_is_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert export("reference", f) == 1
    assert last_err(capsys) == f"error: --output {f}: is a file, not a folder"


def test_a_folder_mixing_reference_and_vllm_files_loads_as_detect_reads_it(tmp_path):
    # what an export into a used folder left before it was refused
    assert export("vllm", tmp_path / "V") == 0 and export("reference", tmp_path / "ref") == 0
    for f in (tmp_path / "ref").iterdir():
        shutil.copy(f, tmp_path / "V" / f.name)
    assert hf.detect(tmp_path / "V").layout == "reference"
    assert not hf.is_medusa2_model(tmp_path / "V")  # not a model folder without a tokenizer
    m = Medusa.load(heads=tmp_path / "V")
    cfg = load_pretrained()[0]
    assert (m.heads["proj"] == load_heads(default_heads_dir(), cfg)[0]["proj"]).all()


def test_written_files_get_the_permissions_of_other_files(tmp_path):
    umask = os.umask(0o022)
    try:
        for fmt in ("reference", "vllm", "medusa_jax"):
            assert export(fmt, tmp_path / fmt) == 0
        cfg, params = load_pretrained()
        heads, _ = load_heads(default_heads_dir(), cfg)
        save_heads(tmp_path / "artifact", heads, cfg)
        from medusa_jax.model.weights import save_pretrained

        save_pretrained(cfg, params, tmp_path / "model", source_dir=default_model_dir())
        files = [p for p in tmp_path.rglob("*") if p.is_file()]
        assert len(files) >= 6
        for p in files:
            assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    finally:
        os.umask(umask)


@pytest.mark.parametrize("kind, says", [
    ("eagle", "an EAGLE-3 drafter is written in the eagle3 or medusa_jax layout, not "
              "'medusa2'"),
    ("hydra", "these are Hydra heads; the medusa2 layout holds only Medusa heads"),
])
def test_a_drafter_the_layout_cannot_hold_is_refused_before_the_backbone_loads(
        tmp_path, capsys, monkeypatch, kind, says):
    from medusa_jax.model import weights
    from medusa_jax.runtime import assets

    def no_backbone(*a, **k):
        raise AssertionError("the backbone was loaded before the layout was checked")

    monkeypatch.setattr(weights, "load_pretrained", no_backbone)
    source = str(assets.shipped_heads_dir(kind))
    assert export_heads.main([source, "--format", "medusa2", "--output",
                              str(tmp_path / "m2")]) == 1
    assert last_err(capsys).startswith(f"error: {says}")
    assert not (tmp_path / "m2").exists() or not any((tmp_path / "m2").iterdir())


def test_an_eagle3_folder_with_another_embedding_is_not_exported(tmp_path, capsys):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from medusa_jax.model.weights import read_embedding
    from medusa_jax.runtime import assets

    cfg = load_pretrained()[0]
    heads, _ = load_heads(assets.shipped_heads_dir("eagle"), cfg)
    hf.write(heads, "eagle3", tmp_path / "d", cfg=cfg)
    st = tmp_path / "d" / "model.safetensors"
    table = read_embedding(default_model_dir())
    save_file({**load_file(str(st)), "embed_tokens.weight": table + 1.0}, str(st))
    argv = [str(tmp_path / "d"), "--model", str(default_model_dir()), "--format"]
    assert export_heads.main(argv + ["medusa_jax", "--output", str(tmp_path / "o")]) == 1
    assert last_err(capsys).startswith(f"error: {st}: tensor embed_tokens.weight is not the "
                                       f"backbone's embedding (max abs difference 1)")
    save_file({**load_file(str(st)), "embed_tokens.weight": table}, str(st))
    assert export_heads.main(argv + ["medusa_jax", "--output", str(tmp_path / "o")]) == 0
    assert np.array_equal(load_heads(tmp_path / "o", cfg)[0]["fc"], heads["fc"])
