"""Medusa heads in other layouts (the reference's, a Medusa-2 model folder, vLLM's): bit-identical
round trips, logits equal to PyTorch implementations of those heads, decoding, bad input.

The files are written here the way the upstream code names them (FasterDecoding/Medusa's
`medusa_head.state_dict()`, vLLM's `Medusa` module), with safetensors.torch or torch.save.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.numpy import load_file  # noqa: E402
from safetensors.torch import save_file as save_torch  # noqa: E402

from medusa_jax.api import Medusa, default_heads_dir  # noqa: E402
from medusa_jax.drafters import formats as hf  # noqa: E402
from medusa_jax.drafters.formats import load_heads, save_heads  # noqa: E402
from medusa_jax.drafters.medusa.heads import apply_heads  # noqa: E402
from medusa_jax.model.weights import default_model_dir, load_pretrained, save_pretrained  # noqa: E402
from train import export_heads  # noqa: E402

K = 3
H, V = 64, 512  # stories260K


# ----------------------------------------------------------------------------- PyTorch heads


class ResBlock(torch.nn.Module):
    """FasterDecoding/Medusa's block: x + SiLU(Linear(x)), the Linear with a bias."""

    def __init__(self, hidden):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def reference_heads(lyr, seed, shared_block=False):
    """The reference's `medusa_head`: per head Sequential(ResBlock x L, Linear(H, V, bias=False)).
    `shared_block`: the reference's own `[ResBlock(h)] * L` (one block object repeated)."""
    torch.manual_seed(seed)
    heads = []
    for _ in range(K):
        blocks = [ResBlock(H)] * lyr if shared_block else [ResBlock(H) for _ in range(lyr)]
        heads.append(torch.nn.Sequential(*blocks, torch.nn.Linear(H, V, bias=False)))
    heads = torch.nn.ModuleList(heads)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, 0.2)
    return heads


class VllmMedusa(torch.nn.Module):
    """vLLM's Medusa draft model: blocks[i].layers[j] Linear(H, H, bias=medusa_fc_bias),
    lm_heads[i] (or one lm_head with original_lm_head) over T tokens, token_map -> ids."""

    def __init__(self, lyr, bias, shared, t, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList([torch.nn.Module() for _ in range(K)])
        for blk in self.blocks:
            blk.layers = torch.nn.ModuleList(
                [torch.nn.Linear(H, H, bias=bias) for _ in range(lyr)])
        if shared:
            self.lm_head = torch.nn.Linear(H, t, bias=False)
        else:
            self.lm_heads = torch.nn.ModuleList(
                [torch.nn.Linear(H, t, bias=False) for _ in range(K)])
        self.shared = shared
        self.token_map = torch.randperm(V)[:t] if t < V else None
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.2)

    def forward(self, x):
        out = []
        for i, blk in enumerate(self.blocks):
            y = x
            for layer in blk.layers:
                y = y + torch.nn.functional.silu(layer(y))
            logits = (self.lm_head if self.shared else self.lm_heads[i])(y)
            if self.token_map is not None:
                full = torch.full((*logits.shape[:-1], V), -torch.inf)
                full[..., self.token_map] = logits
                logits = full
            out.append(logits)
        return torch.stack(out)

    def files(self, path, lyr, bias, prefix=""):
        sd = {prefix + n: t.contiguous() for n, t in self.state_dict().items()}
        if self.token_map is not None:
            sd[prefix + "token_map"] = self.token_map.clone()
        path.mkdir(parents=True, exist_ok=True)
        save_torch(sd, str(path / "model.safetensors"))
        conf = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H,
                "vocab_size": V, "num_heads": K, "num_hidden_layers": lyr}
        if bias:
            conf["medusa_fc_bias"] = True
        if self.shared:
            conf["original_lm_head"] = True
        if self.token_map is not None:
            conf["truncated_vocab_size"] = len(self.token_map)
        (path / "config.json").write_text(json.dumps(conf))


def write_reference(path, heads, lyr, pickle=False, base="stories260K", conf_extra=None):
    path.mkdir(parents=True, exist_ok=True)
    sd = {n: t.contiguous() for n, t in heads.state_dict().items()}
    if pickle:
        torch.save(sd, str(path / "medusa_lm_head.pt"))
    else:
        save_torch(sd, str(path / "medusa_lm_head.safetensors"))
    conf = {"medusa_num_heads": K, "medusa_num_layers": lyr, "base_model_name_or_path": base,
            **(conf_extra or {})}
    (path / "config.json").write_text(json.dumps(conf))


def torch_logits(heads, hidden):
    with torch.no_grad():
        x = torch.from_numpy(np.asarray(hidden))
        if isinstance(heads, VllmMedusa):
            return heads(x).numpy()
        return torch.stack([h(x) for h in heads]).numpy()


@pytest.fixture(scope="module")
def hidden():
    return np.random.default_rng(0).normal(size=(4, H)).astype(np.float32)


def random_heads(lyr, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(0, 0.2, (K, lyr, H, H)).astype(np.float32),
            "b": (rng.normal(0, 0.2, (K, lyr, H)) * bias).astype(np.float32),
            "proj": rng.normal(0, 0.2, (K, H, V)).astype(np.float32)}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for n in a:
        x, y = np.asarray(a[n]), np.asarray(b[n])
        assert x.dtype == y.dtype and x.shape == y.shape, n
        np.testing.assert_array_equal(x, y, err_msg=n)


def tensors_of(folder):
    return {f.name: load_file(str(f)) for f in sorted(folder.glob("*.safetensors"))}


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", ["reference-L1-safetensors", "reference-L2-pt",
                                  "reference-L2-shared-block-pt", "medusa2-L2"])
def test_reference_layouts_give_the_logits_of_the_pytorch_heads(case, tmp_path, stories, hidden):
    cfg, params, _ = stories
    lyr = 2 if "L2" in case else 1
    heads = reference_heads(lyr, seed=1, shared_block="shared" in case)
    if case.startswith("medusa2"):
        save_pretrained(cfg, params, tmp_path, source_dir=default_model_dir())
        model = load_file(str(tmp_path / "model.safetensors"))
        model = {n: torch.from_numpy(a) for n, a in model.items()}
        model.update({f"medusa_head.{n}": t.contiguous() for n, t in heads.state_dict().items()})
        save_torch(model, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        conf = json.loads((tmp_path / "config.json").read_text())
        conf.update(medusa_num_heads=K, medusa_num_layers=lyr)
        (tmp_path / "config.json").write_text(json.dumps(conf))
    else:
        write_reference(tmp_path, heads, lyr, pickle="pt" in case)
    ours, meta = load_heads(tmp_path, cfg)
    assert meta["format"] == case.split("-")[0] and meta["num_layers"] == str(lyr)
    np.testing.assert_allclose(apply_heads(ours, jnp.asarray(hidden)),
                               torch_logits(heads, hidden), rtol=1e-5, atol=1e-5)
    if case.startswith("medusa2"):  # the backbone comes from the same folder
        m = Medusa.load(heads=tmp_path)
        assert m.model_dir == tmp_path
        np.testing.assert_array_equal(m.params["embed"], params["embed"])


@pytest.mark.parametrize("lyr,bias,shared,t,prefix", [
    (1, False, False, V, ""),
    (2, True, False, 300, ""),
    (2, True, True, 300, "medusa_heads."),
])
def test_vllm_layout_gives_the_logits_of_vllms_medusa(lyr, bias, shared, t, prefix, tmp_path,
                                                       stories, hidden):
    cfg = stories[0]
    model = VllmMedusa(lyr, bias, shared, t, seed=2)
    model.files(tmp_path, lyr, bias, prefix)
    ours, meta = load_heads(tmp_path, cfg)
    assert meta["format"] == "vllm"
    assert ours["proj"].shape == ((1 if shared else K), H, t)
    assert ("token_index" in ours) == (t < V)
    got, want = np.asarray(apply_heads(ours, jnp.asarray(hidden))), torch_logits(model, hidden)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_vllm_full_rows_with_a_token_map_are_cut_to_the_map(tmp_path, stories, hidden):
    """vLLM keeps lm_heads rows token_map when the file holds all V rows."""
    model = VllmMedusa(1, True, False, 200, seed=3)
    model.files(tmp_path, 1, True)
    sd = load_file(str(tmp_path / "model.safetensors"))
    for i in range(K):
        full = np.zeros((V, H), np.float32)
        full[model.token_map.numpy()] = sd[f"lm_heads.{i}.weight"]
        sd[f"lm_heads.{i}.weight"] = full
    save_torch({n: torch.from_numpy(a) for n, a in sd.items()},
               str(tmp_path / "model.safetensors"))
    ours, _ = load_heads(tmp_path, stories[0])
    np.testing.assert_allclose(apply_heads(ours, jnp.asarray(hidden)),
                               torch_logits(model, hidden), rtol=1e-5, atol=1e-5)


def test_shared_and_reduced_projections_of_our_heads(hidden):
    heads = random_heads(1)
    full = apply_heads(heads, hidden)
    shared = dict(heads, proj=heads["proj"][:1])
    copies = dict(heads, proj=np.repeat(heads["proj"][:1], K, axis=0))
    np.testing.assert_allclose(apply_heads(shared, hidden), apply_heads(copies, hidden),
                               rtol=1e-6, atol=1e-6)
    keep = np.sort(np.random.default_rng(1).permutation(V)[:100])[::-1]  # any column order
    index = np.full((1, V), -1, np.int32)
    index[0, keep] = np.arange(len(keep))
    reduced = dict(heads, proj=heads["proj"][:, :, keep], token_index=index)
    got = np.asarray(apply_heads(reduced, hidden))
    np.testing.assert_allclose(got[..., keep], np.asarray(full)[..., keep], rtol=1e-6, atol=1e-6)
    assert np.all(np.isneginf(np.delete(got, keep, axis=-1)))


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("lyr", [1, 2])
def test_round_trips_through_every_layout_are_bit_identical(lyr, tmp_path, stories):
    cfg, params, _ = stories
    heads = random_heads(lyr, seed=lyr)
    # non-contiguous inputs (Fortran order): the writers must still write logical order
    heads_nc = {n: np.asfortranarray(a) for n, a in heads.items()}
    for layout in ("reference", "vllm", "medusa_jax"):
        with pytest.warns(UserWarning) if layout == "reference" and lyr > 1 else _nothing():
            hf.write(heads_nc, layout, tmp_path / layout, cfg=cfg, base_model="stories260K")
        back, _ = load_heads(tmp_path / layout, cfg)
        assert_same(back, heads)
        again = tmp_path / (layout + "-again")
        with pytest.warns(UserWarning) if layout == "reference" and lyr > 1 else _nothing():
            hf.write({n: np.asarray(a) for n, a in back.items()}, layout, again, cfg=cfg,
                     base_model="stories260K")
        for (n1, t1), (n2, t2) in zip(tensors_of(tmp_path / layout).items(),
                                      tensors_of(again).items()):
            assert n1 == n2
            assert_same(t1, t2)
        if layout != "medusa_jax":
            assert (tmp_path / layout / "config.json").read_text() == \
                (again / "config.json").read_text()
    pt = torch.load(str(tmp_path / "reference" / "medusa_lm_head.pt"), weights_only=True)
    st = load_file(str(tmp_path / "reference" / "medusa_lm_head.safetensors"))
    assert_same({n: t.numpy() for n, t in pt.items()}, st)
    hf.write_medusa2_model(tmp_path / "m2", cfg, params, heads_nc,
                           source_dir=default_model_dir())
    assert_same(load_heads(tmp_path / "m2", cfg)[0], heads)
    jax.tree.map(np.testing.assert_array_equal, load_pretrained(tmp_path / "m2")[1], params)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("variant", ["no-bias", "shared", "reduced", "shared+reduced"])
def test_vllm_variants_round_trip(variant, tmp_path, stories):
    cfg = stories[0]
    heads = random_heads(2, seed=5, bias=variant != "no-bias")
    if "shared" in variant:
        heads["proj"] = heads["proj"][:1]
    if "reduced" in variant:
        keep = np.random.default_rng(2).permutation(V)[:77]
        heads["proj"] = heads["proj"][:, :, :77]
        heads["token_index"] = np.full((1, V), -1, np.int32)
        heads["token_index"][0, keep] = np.arange(77)
    hf.write_vllm(heads, tmp_path / "a")
    conf = json.loads((tmp_path / "a" / "config.json").read_text())
    assert conf["medusa_fc_bias"] == (variant != "no-bias")
    assert conf.get("original_lm_head", False) == ("shared" in variant)
    assert conf.get("truncated_vocab_size", V) == (77 if "reduced" in variant else V)
    back, _ = load_heads(tmp_path / "a", cfg)
    assert_same(back, heads)
    hf.write_vllm({n: np.asarray(a) for n, a in back.items()}, tmp_path / "b")
    assert_same(load_file(str(tmp_path / "a" / "model.safetensors")),
                load_file(str(tmp_path / "b" / "model.safetensors")))
    save_heads(tmp_path / "ours", heads, cfg)  # and in our own artifact
    assert_same(load_heads(tmp_path / "ours", cfg)[0], heads)


# ----------------------------------------------------------------------------- decoding


PROMPTS = ["Once upon a time", "Lily and Tom", "The dog"]


@pytest.mark.slow
def test_greedy_with_reference_heads_equals_plain_and_our_format(tmp_path):
    shipped = load_heads(default_heads_dir(), load_pretrained()[0])[0]
    sd = {n: torch.from_numpy(np.array(a))
          for n, a in hf.reference_tensors(shipped).items()}
    save_torch(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 5, "medusa_num_layers": int(np.shape(shipped["w"])[1]),
         "base_model_name_or_path": str(default_model_dir())}))
    ref = Medusa.load(heads=tmp_path)
    ours = Medusa(ref.cfg, ref.params, ref.tokenizer, shipped, ref.model_dir, ref.default_tree)
    kw = dict(max_new_tokens=40, batch_size=3)
    plain = ref.generate(PROMPTS, medusa=False, **kw)
    a, b = ref.generate(PROMPTS, **kw), ours.generate(PROMPTS, **kw)
    assert [g.token_ids for g in a] == [g.token_ids for g in plain] == [g.token_ids for g in b]
    assert [g.steps for g in a] == [g.steps for g in b]
    assert sum(g.new_tokens for g in a) / sum(g.steps for g in a) > 1.5


@pytest.mark.slow
def test_greedy_with_reduced_shared_vllm_heads_equals_plain(tmp_path):
    cfg = load_pretrained()[0]
    shipped = {n: np.asarray(a) for n, a in load_heads(default_heads_dir(), cfg)[0].items()}
    keep = np.arange(V)[::2]  # half the vocabulary
    heads = dict(shipped, proj=shipped["proj"][:1][:, :, keep],
                 token_index=np.full((1, V), -1, np.int32))
    heads["token_index"][0, keep] = np.arange(len(keep))
    hf.write_vllm(heads, tmp_path)
    m = Medusa.load(heads=tmp_path)
    assert m.heads["proj"].shape == (1, H, len(keep))
    kw = dict(max_new_tokens=24, batch_size=3)
    assert [g.token_ids for g in m.generate(PROMPTS, **kw)] == \
        [g.token_ids for g in m.generate(PROMPTS, medusa=False, **kw)]


# ----------------------------------------------------------------------------- bad input


def test_folder_without_heads_lists_the_layouts_looked_for(tmp_path, stories, one_line_error):
    (tmp_path / "notes.txt").write_text("x")
    one_line_error(ValueError, lambda: load_heads(tmp_path, stories[0]), str(tmp_path),
                   "no Medusa heads in any known layout", "medusa_heads.safetensors",
                   "medusa_lm_head.safetensors", "medusa_lm_head.pt", "Medusa-2", "vLLM",
                   "model_type medusa")
    (tmp_path / "config.json").write_text(json.dumps(json.loads(
        (default_model_dir() / "config.json").read_text())))  # a plain model folder
    one_line_error(ValueError, lambda: load_heads(tmp_path, stories[0]), "looked for")


@pytest.mark.parametrize("which", ["medusa_lm_head.safetensors", "medusa_lm_head.pt",
                                   "vllm"])
def test_half_written_files(which, tmp_path, stories, one_line_error):
    heads = random_heads(1)
    if which == "vllm":
        hf.write_vllm(heads, tmp_path)
        file = tmp_path / "model.safetensors"
    else:
        hf.write_reference(heads, tmp_path, pickle=True)
        (tmp_path / ("medusa_lm_head.pt" if which.endswith("safetensors")
                     else "medusa_lm_head.safetensors")).unlink()
        file = tmp_path / which
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    one_line_error(ValueError, lambda: load_heads(tmp_path, stories[0]), file,
                   "corrupt or truncated")


def test_pickle_without_pytorch_says_how_to_convert(tmp_path, stories, monkeypatch, one_line_error):
    hf.write_reference(random_heads(1), tmp_path, pickle=True)
    (tmp_path / "medusa_lm_head.safetensors").unlink()
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    one_line_error(ValueError, lambda: load_heads(tmp_path, stories[0]),
                   tmp_path / "medusa_lm_head.pt", "PyTorch is not installed",
                   "save_file", "medusa_lm_head.safetensors")


def test_config_that_disagrees_with_the_tensors(tmp_path, stories, one_line_error):
    cfg = stories[0]
    write_reference(tmp_path, reference_heads(1, seed=0), 1, conf_extra={"medusa_num_heads": 4})
    one_line_error(ValueError, lambda: load_heads(tmp_path, cfg), tmp_path / "config.json",
                   "medusa_num_heads=4", "3 heads")
    write_reference(tmp_path, reference_heads(1, seed=0), 1, conf_extra={"medusa_num_layers": 2})
    one_line_error(ValueError, lambda: load_heads(tmp_path, cfg), "medusa_num_layers=2")
    # vLLM: biases in the file but the config does not set medusa_fc_bias
    model = VllmMedusa(1, True, False, V, seed=0)
    model.files(tmp_path / "v", 1, bias=False)
    one_line_error(ValueError, lambda: load_heads(tmp_path / "v", cfg),
                   tmp_path / "v" / "model.safetensors", "unexpected tensor blocks.0.layers.0.bias")
    # vLLM: token_map of the wrong length for truncated_vocab_size
    model = VllmMedusa(1, False, False, 100, seed=0)
    model.files(tmp_path / "t", 1, bias=False)
    conf = json.loads((tmp_path / "t" / "config.json").read_text())
    (tmp_path / "t" / "config.json").write_text(json.dumps(dict(conf, truncated_vocab_size=99)))
    one_line_error(ValueError, lambda: load_heads(tmp_path / "t", cfg), "tensor token_map",
                   "expected (99,)")


def test_strict_shapes_against_the_backbone(tmp_path, stories, one_line_error):
    cfg = stories[0]
    heads = reference_heads(1, seed=0)
    sd = {n: t.contiguous() for n, t in heads.state_dict().items()}
    sd["1.1.weight"] = torch.zeros(V - 12, H)
    write_reference(tmp_path, heads, 1)
    save_torch(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    one_line_error(ValueError, lambda: load_heads(tmp_path, cfg),
                   tmp_path / "medusa_lm_head.safetensors", "tensor 1.1.weight",
                   f"({V - 12}, {H})", f"expected ({V}, {H})")
    del sd["1.1.weight"], sd["2.0.linear.bias"]
    sd["1.1.weight"] = torch.zeros(V, H)
    save_torch(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    one_line_error(ValueError, lambda: load_heads(tmp_path, cfg),
                   "missing tensor 2.0.linear.bias", f"expected shape ({H},)")
    VllmMedusa(1, False, False, V, seed=0).files(tmp_path / "v", 1, False)
    one_line_error(ValueError, lambda: load_heads(tmp_path / "v", cfg.replace(hidden_size=32)),
                   tmp_path / "v" / "config.json", "hidden_size=64", "hidden 32")
    # a Medusa-2 folder whose shards hold no heads
    save_pretrained(cfg, stories[1], tmp_path / "m2", source_dir=default_model_dir())
    conf = json.loads((tmp_path / "m2" / "config.json").read_text())
    (tmp_path / "m2" / "config.json").write_text(json.dumps(dict(conf, medusa_num_heads=3)))
    one_line_error(ValueError, lambda: load_heads(tmp_path / "m2", cfg), "no medusa_head.")


def test_heads_for_another_base_model_warn_with_both_names(tmp_path, stories):
    write_reference(tmp_path, reference_heads(1, seed=0), 1, base="lmsys/vicuna-7b-v1.3")
    with pytest.warns(UserWarning, match=r"vicuna-7b-v1\.3.*stories260K"):
        load_heads(tmp_path, stories[0], base_model=default_model_dir())
    write_reference(tmp_path, reference_heads(1, seed=0), 1, base="karpathy/stories260K")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_heads(tmp_path, stories[0], base_model=default_model_dir())


# ----------------------------------------------------------------------------- the CLI


def test_export_cli(tmp_path, capsys):
    for fmt in ("reference", "vllm"):
        assert export_heads.main([str(default_heads_dir()), "--format", fmt,
                                  "--output", str(tmp_path / fmt)]) == 0
    conf = json.loads((tmp_path / "reference" / "config.json").read_text())
    assert conf["medusa_num_heads"] == 5 and conf["base_model_name_or_path"].endswith("stories260K")
    assert export_heads.main([str(tmp_path / "vllm"), "--format", "medusa_jax",
                              "--output", str(tmp_path / "ours")]) == 0
    cfg = load_pretrained()[0]
    assert_same(load_heads(tmp_path / "ours", cfg)[0], load_heads(default_heads_dir(), cfg)[0])
    capsys.readouterr()
    assert export_heads.main([str(tmp_path / "nowhere"), "--format", "vllm",
                              "--output", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "nowhere" in err
