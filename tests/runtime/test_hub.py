"""Hugging Face hub ids wherever a model or heads folder is taken (`medusa_jax.runtime.hub`), tested
offline against a cache folder laid out as huggingface_hub lays it out:

    $HF_HUB_CACHE/models--owner--name/blobs/<sha256>
                                      refs/main                  (the commit hash)
                                      snapshots/<commit>/<file> -> ../../blobs/<sha256>
"""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from medusa_jax.model.config import ModelConfig
from medusa_jax.model.paths import check_model_paths
from medusa_jax.runtime import assets, hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out(cache: Path, repo_id: str, source: Path) -> Path:
    """`source`'s files as huggingface_hub caches a download of `repo_id`; the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshot.mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for f in sorted(source.iterdir()):
        if f.is_file():
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    assert hub.is_repo_id("HuggingFaceTB/SmolLM2-135M")
    assert hub.is_repo_id("acme/tiny_model.v2")
    for not_id in ("big", "runs/medusa1-x/heads", "./acme/tiny", "/abs/x", "~/x", "a/../b",
                   "acme/", "-x/y", "acme/tiny-"):
        assert not hub.is_repo_id(not_id), not_id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    assert not hub.is_repo_id("acme/tiny")  # an existing path always wins
    assert hub.local("acme/tiny") == "acme/tiny"
    assert hub.local(None) is None


def test_a_model_id_is_found_in_the_cache_offline(cache):
    snapshot = lay_out(cache, "acme/stories", assets.model_dir())
    assert hub.local("acme/stories") == snapshot
    assert ModelConfig.from_dir("acme/stories") == ModelConfig.from_dir(assets.model_dir())
    check_model_paths("acme/stories", None)


def test_a_missing_id_offline_is_one_line_saying_so(cache):
    with pytest.raises(FileNotFoundError) as e:
        hub.local("acme/missing", "--model")
    assert str(e.value) == (f"--model acme/missing: no such file or folder here, and as a "
                            f"Hugging Face hub id: not in the cache ({cache}), and "
                            f"HF_HUB_OFFLINE=1 forbids downloading it")


@pytest.mark.slow
def test_model_and_heads_ids_load_and_decode_as_the_folders_do(cache):
    from medusa_jax.api import Medusa

    lay_out(cache, "acme/stories", assets.model_dir())
    lay_out(cache, "acme/stories-heads", assets.heads_dir())
    m = Medusa.load("acme/stories", heads="acme/stories-heads")
    ref = Medusa.load(None, heads="default")
    kw = dict(max_new_tokens=12, tree=assets.EMBEDDED_DEFAULT_TREE)
    assert [g.token_ids for g in m.generate(["Lily"], **kw)] == \
        [g.token_ids for g in ref.generate(["Lily"], **kw)]


@pytest.mark.subprocess
def test_generate_takes_a_hub_id_and_names_a_missing_one_in_one_line(cache):
    env = dict(os.environ)
    snapshot = lay_out(cache, "acme/stories", assets.model_dir())
    code = ("import sys\nfrom infer import generate\n"
            "rc = generate.main(['--model', 'acme/missing'])\n"
            "print('jax imported' if 'jax' in sys.modules else 'no jax', rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.stdout.split() == ["no", "jax", "2"], proc.stderr
    assert proc.stderr.strip() == (f"error: --model acme/missing: no such file or folder "
                                   f"here, and as a Hugging Face hub id: not in the cache "
                                   f"({cache}), and HF_HUB_OFFLINE=1 forbids downloading it")
    assert snapshot.is_dir()


@pytest.mark.subprocess
def test_online_without_a_network_says_the_hub_could_not_be_reached(tmp_path):
    """HF_HUB_OFFLINE=0 and a hub that does not answer (a closed local port)."""
    env = dict(os.environ, HF_HUB_OFFLINE="0", HF_HUB_CACHE=str(tmp_path / "hub"),
               HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2",
               HF_HUB_DISABLE_TELEMETRY="1")
    code = ("from medusa_jax.runtime import hub\n"
            "try:\n    hub.local('acme/stories', '--model')\n"
            "except FileNotFoundError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    out = proc.stdout.strip()
    assert out.startswith("--model acme/stories: no such file or folder here, and as a "
                          "Hugging Face hub id: the hub could not be reached and it is not "
                          "in the cache"), (out, proc.stderr)
    assert "\n" not in out
