"""A model folder that carries its own MTP modules (DeepSeek-V3's layout: the modules as
layers N .. N+D-1 of the model's weights, num_nextn_predict_layers in config.json): the
backbone loads from it with the modules left aside, it serves its own drafter with
`--model DIR --heads DIR` (or `--heads DIR` alone) greedy-identical to plain decoding, and
`train.export_heads --format deepseek-mtp --model M` writes such a folder that reads back
to the same modules and drafts."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from medusa_jax.drafters import formats
from medusa_jax.drafters.mtp import heads as mtp
from medusa_jax.drafters.mtp.drafter import bind
from medusa_jax.model import weights

PROMPTS = ["Once upon a time", "Lily", "Tom had a red ball."]
TREE = "mc_sim_7b_63:16"


def modules(cfg, d, seed=1):
    """Random modules that draft something like the backbone (the hidden half of eh_proj
    near the identity), as numpy arrays."""
    h = mtp.init_mtp(jax.random.key(seed), cfg, d, std=0.05)
    h["eh_proj"] = h["eh_proj"].at[:, cfg.hidden_size:].add(jnp.eye(cfg.hidden_size))
    return jax.tree.map(np.asarray, h)


def same(a, b):
    assert sorted(a) == sorted(b)
    for n in a:
        np.testing.assert_array_equal(np.asarray(a[n]), np.asarray(b[n]), err_msg=n)


def names(file):
    with safe_open(str(file), "numpy") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def folder(stories, tmp_path_factory):
    """The embedded model with two random modules written into its weights."""
    cfg, params, _ = stories
    out = tmp_path_factory.mktemp("with_mtp")
    weights.save_pretrained(cfg, params, out, source_dir=weights.default_model_dir())
    heads = modules(cfg, 2)
    formats.write(bind(heads, cfg), "deepseek-mtp", out)
    return out, heads


def test_the_modules_join_the_models_weights(stories, folder):
    cfg, params, _ = stories
    out, heads = folder
    n = cfg.num_layers
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    assert not (out / "mtp.safetensors").exists()
    held = names(out / "model.safetensors")
    assert {f"model.layers.{n}.eh_proj.weight", f"model.layers.{n + 1}.enorm.weight",
            f"model.layers.{n + 1}.self_attn.q_proj.weight", "model.embed_tokens.weight",
            f"model.layers.{n - 1}.mlp.down_proj.weight"} <= held
    # the backbone, its layers N.. left aside; the modules, the backbone's tensors left aside
    got_cfg, got = weights.load_pretrained(out)
    assert got_cfg.num_layers == n
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got),
                 jax.tree.map(np.asarray, params))
    loaded, meta = formats.load_heads(out, cfg)
    assert meta["format"] == "deepseek-mtp" and loaded.drafter.style == "deepseek"
    same(loaded, heads)
    assert formats.bundled_model(out)
    # written again: the earlier modules replaced, not doubled
    formats.write(bind(modules(cfg, 1, seed=2), cfg), "deepseek-mtp", out)
    assert f"model.layers.{n + 1}.enorm.weight" not in names(out / "model.safetensors")
    formats.write(bind(heads, cfg), "deepseek-mtp", out)
    same(formats.load_heads(out, cfg)[0], heads)


def test_without_the_count_the_extra_layers_are_refused(folder, tmp_path, one_line_error):
    import shutil

    out, _ = folder
    for f in out.iterdir():
        shutil.copy(f, tmp_path / f.name)
    conf = json.loads((tmp_path / "config.json").read_text())
    for value, needle in ((None, "unexpected tensor model.layers.5."),
                          ("2", "num_nextn_predict_layers='2'"),
                          (1, "unexpected tensor model.layers.6.")):
        conf["num_nextn_predict_layers"] = value
        if value is None:
            del conf["num_nextn_predict_layers"]
        (tmp_path / "config.json").write_text(json.dumps(conf))
        one_line_error(weights.WeightsError, lambda: weights.load_pretrained(tmp_path),
                       needle)


@pytest.mark.slow
def test_the_folder_serves_its_own_drafter_greedy_as_plain(folder):
    from medusa_jax.api import Medusa

    out, heads = folder
    both = Medusa.load(out, out)
    alone = Medusa.load(heads=out)  # the folder is the model too
    assert both.cfg.num_layers == alone.cfg.num_layers == 5
    same(dict(both.heads), heads)
    kw = dict(max_new_tokens=40, tree=TREE)
    plain = [g.token_ids for g in both.generate(PROMPTS, medusa=False, **kw)]
    got = both.generate(PROMPTS, **kw)
    assert [g.token_ids for g in got] == plain
    assert [g.token_ids for g in alone.generate(PROMPTS, **kw)] == plain
    assert sum(g.steps for g in got) < sum(g.new_tokens for g in got)  # drafts accepted


@pytest.mark.slow
def test_export_writes_a_model_folder_that_reads_back_to_the_same_drafts(stories, folder,
                                                                          tmp_path):
    from medusa_jax.api import Medusa
    from train.export_heads import main

    cfg, params, _ = stories
    src, heads = folder
    artifact = formats.save_heads(tmp_path / "artifact", bind(heads, cfg), cfg)
    out = tmp_path / "exported"
    model = str(weights.default_model_dir())
    assert main([str(artifact), "--format", "deepseek-mtp", "--model", model,
                 "--output", str(out)]) == 0
    assert (out / "tokenizer.json").is_file()
    conf = json.loads((out / "config.json").read_text())
    assert conf["num_nextn_predict_layers"] == 2 and conf["num_hidden_layers"] == 5
    same(formats.load_heads(out, cfg)[0], heads)
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(np.asarray, weights.load_pretrained(out)[1]),
                 jax.tree.map(np.asarray, params))
    kw = dict(max_new_tokens=40, tree=TREE)
    a, b = Medusa.load(src, src).generate(PROMPTS, **kw), Medusa.load(out, out).generate(
        PROMPTS, **kw)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.accept_hist for g in a] == [g.accept_hist for g in b]
    # a second export into it needs --force, and then replaces it
    assert main([str(artifact), "--format", "deepseek-mtp", "--model", model,
                 "--output", str(out)]) == 1
    assert main([str(artifact), "--format", "deepseek-mtp", "--model", model,
                 "--output", str(out), "--force"]) == 0
    same(formats.load_heads(out, cfg)[0], heads)
