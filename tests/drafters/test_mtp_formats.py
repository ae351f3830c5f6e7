"""MTP modules' files: our artifact (the style and reuse recorded), DeepSeek-V3's layout
(model.layers.{N+k}.enorm / hnorm / eh_proj / shared_head.norm / <layer>, with
num_nextn_predict_layers) and MiMo's (model.mtp_layers.{k}.token_layernorm / ...), written
and read back to the same tensors, and bad input refused in one line naming the file and
tensor before anything compiles."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from medusa_jax.decoding.drafter import BoundParams
from medusa_jax.drafters import formats
from medusa_jax.drafters.io import HeadsFormatError
from medusa_jax.drafters.mtp import heads as mtp
from medusa_jax.drafters.mtp.drafter import bind
from medusa_jax.model.config import ModelConfig

CFG = ModelConfig(model_type="qwen2", vocab_size=50, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=64, rms_norm_eps=1e-5, attention_bias=True)


@pytest.fixture(scope="module")
def heads():
    return jax.tree.map(np.asarray, mtp.init_mtp(jax.random.key(0), CFG, 2, std=0.3))


def same(a, b):
    assert sorted(a) == sorted(b)
    for n in a:
        np.testing.assert_array_equal(np.asarray(a[n]), np.asarray(b[n]), err_msg=n)


def test_our_artifact_keeps_the_style_and_reuse(tmp_path, heads):
    formats.save_heads(tmp_path, bind(heads, CFG, "mimo", reuse_last=False), CFG)
    assert formats.kind_at(tmp_path) == "mtp"
    got, meta = formats.load_heads(tmp_path, CFG)
    assert isinstance(got, BoundParams) and meta["kind"] == "mtp"
    assert got.drafter.style == "mimo" and not got.drafter.reuse_last
    assert got.drafter.model_cfg == CFG
    same(got, heads)


@pytest.mark.parametrize("layout,style,name", [
    ("deepseek-mtp", "deepseek", "model.layers.3.eh_proj.weight"),
    ("mimo-mtp", "mimo", "model.mtp_layers.1.input_proj.weight"),
])
def test_published_layouts_round_trip(tmp_path, heads, layout, style, name):
    formats.write(bind(heads, CFG, style), layout, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["num_nextn_predict_layers"] == 2
    names = load_file(tmp_path / "mtp.safetensors")
    assert name in names and names[name].shape == (32, 64)  # torch's [out, in]
    assert any(".self_attn.q_proj.bias" in n for n in names)  # the qwen2 layer's biases
    assert formats.detect(tmp_path).layout == layout
    got, meta = formats.load_heads(tmp_path, CFG)
    assert got.drafter.style == style and meta["format"] == layout
    same(got, heads)
    if style == "deepseek":  # without a backbone: its config is the folder's
        again, _ = formats.read(formats.detect(tmp_path), None)
        assert again.drafter.model_cfg.hidden_size == 32
        same(again, heads)


def test_a_whole_model_folder_with_shared_copies_reads_only_the_modules(tmp_path, heads):
    formats.write(bind(heads, CFG, "deepseek"), "deepseek-mtp", tmp_path)
    t = load_file(tmp_path / "mtp.safetensors")
    t["model.layers.2.shared_head.head.weight"] = np.zeros((50, 32), np.float32)
    t["model.layers.2.embed_tokens.weight"] = np.zeros((50, 32), np.float32)
    t["model.layers.0.input_layernorm.weight"] = np.ones(32, np.float32)  # the backbone's
    t["model.norm.weight"] = np.ones(32, np.float32)
    save_file(t, tmp_path / "mtp.safetensors")
    got, _ = formats.load_heads(tmp_path, CFG)
    same(got, heads)


@pytest.fixture
def written(tmp_path, heads):
    formats.write(bind(heads, CFG, "deepseek"), "deepseek-mtp", tmp_path)
    return tmp_path


def rewrite(p, tensors=None, conf=None):
    if tensors is not None:
        save_file(tensors, p / "mtp.safetensors")
    if conf is not None:
        (p / "config.json").write_text(json.dumps(conf))


def test_bad_config(written, one_line_error):
    conf = json.loads((written / "config.json").read_text())
    for value in (0, None, "2"):
        rewrite(written, conf={**conf, "num_nextn_predict_layers": value})
        one_line_error(HeadsFormatError, lambda: formats.load_heads(written, CFG),
                       "config.json", "num_nextn_predict_layers")
    rewrite(written, conf={**conf, "hidden_size": 64})
    one_line_error(HeadsFormatError, lambda: formats.load_heads(written, CFG),
                   "config.json", "hidden_size=64", "32")
    rewrite(written, conf={**conf, "num_nextn_predict_layers": 3})
    one_line_error(HeadsFormatError, lambda: formats.load_heads(written, CFG),
                   "mtp.safetensors", "missing tensor model.layers.4.enorm.weight")


@pytest.mark.parametrize("case", ["missing", "shape", "nan", "extra", "vocab"])
def test_bad_tensors(written, case, one_line_error):
    t = load_file(written / "mtp.safetensors")
    name = "model.layers.3.self_attn.k_proj.weight"
    needle = name
    if case == "missing":
        del t[name]
    elif case == "shape":
        t[name] = np.zeros((8, 32), np.float32)
    elif case == "nan":
        t[name] = t[name].copy()
        t[name][0, 0] = np.nan
    elif case == "extra":
        t["model.layers.4.enorm.weight"] = np.ones(32, np.float32)
        needle = "model.layers.4.enorm.weight"
    else:  # a shared head of another vocabulary
        needle = "model.layers.2.shared_head.head.weight"
        t[needle] = np.zeros((64, 32), np.float32)
    rewrite(written, t)
    one_line_error(HeadsFormatError, lambda: formats.load_heads(written, CFG),
                   "mtp.safetensors", needle)


def test_writing_needs_bound_modules_of_the_layouts_style(tmp_path, heads, one_line_error):
    one_line_error(HeadsFormatError,
                   lambda: formats.write(heads, "deepseek-mtp", tmp_path / "a"), "bind")
    one_line_error(HeadsFormatError, lambda: formats.write(bind(heads, CFG, "mimo"),
                                                           "deepseek-mtp", tmp_path / "b"),
                   "mimo style")
    one_line_error(HeadsFormatError, lambda: formats.save_heads(tmp_path / "c", heads, CFG),
                   "bind")
    saved = formats.save_heads(tmp_path / "d", bind(heads, CFG), CFG)
    one_line_error(HeadsFormatError, lambda: formats.load_heads(
        saved, CFG.replace(hidden_size=64)), "medusa_heads.safetensors", "hidden_size=32", "64")
    one_line_error(HeadsFormatError, lambda: formats.load_heads(
        saved, CFG.replace(vocab_size=60)), "medusa_heads.safetensors", "vocab_size=50", "60")
    t = load_file(saved)
    t["eh_proj"] = t["eh_proj"].copy()
    t["eh_proj"][1, 0, 0] = np.inf
    save_file(t, saved, metadata=dict(formats.safetensors_names(saved)[1]))
    one_line_error(HeadsFormatError, lambda: formats.load_heads(saved, CFG),
                   "medusa_heads.safetensors", "eh_proj", "non-finite")
