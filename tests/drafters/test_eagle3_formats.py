"""Every EAGLE-3 folder users have loads through `load_heads`: SafeAILab's `traineagle3`
output as it saves it (DeepSpeed's fp16 pytorch_model.bin beside the training config.json,
which names the plain LlamaForCausalLM), the published yuhuili/EAGLE3-* drafters (the same
config, read by the reference's rule for the aux layers), SGLang's converted copies
(LlamaForCausalLMEagle3 without eagle_config) and SpecForge's save_pretrained output
(eagle_config with its output-of-layer ids). Each config is written as its source writes it,
with the shipped stories260K drafter's tensors under that source's names; the loaded drafter
must hold the shipped tensors and decode as the shipped drafter does. Also the one-line
errors where the aux layers cannot be known, and a pickle without PyTorch."""

import json
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from medusa_jax.decoding.decode import medusa_generate, pad_prompts
from medusa_jax.decoding.tree import Tree
from medusa_jax.drafters import formats as heads_formats
from medusa_jax.drafters import shipped as shipped_drafters
from medusa_jax.drafters.eagle3 import formats
from medusa_jax.drafters.eagle3 import heads as eagle3
from medusa_jax.drafters.io import HeadsFormatError

SHIPPED_AUX = (1, 2, 4)  # the shipped drafter's: stories260K has 5 layers, below the rule's 7


@pytest.fixture(scope="module")
def shipped(stories):
    """(the shipped drafter, its configuration, its tensors under the published names)."""
    cfg, _, _ = stories
    heads, _ = heads_formats.load_heads(shipped_drafters.folder(shipped_drafters.EAGLE), cfg)
    c = heads.drafter.config
    assert c.aux_layers == SHIPPED_AUX
    return heads, c, formats.eagle3_tensors(dict(heads))


def traineagle3_config(c: eagle3.Eagle3Config) -> dict:
    """eagle/traineagle3/config.json with this drafter's sizes: the keys and order of the
    reference's file (its copy of a Llama-3.1-8B config plus draft_vocab_size); the
    published yuhuili/EAGLE3-LLaMA3.1-Instruct-8B config is the same file."""
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "hidden_size": c.hidden_size, "initializer_range": 0.02,
            "intermediate_size": c.intermediate_size, "max_position_embeddings": 2048,
            "model_type": "llama", "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "num_hidden_layers": 1, "pad_token_id": 0,
            "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": False,
            "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
            "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size}


def specforge_config(c: eagle3.Eagle3Config, aux_ids=None) -> dict:
    """What SpecForge's export (`save_pretrained` of its LlamaForCausalLMEagle3, then
    `apply_legacy_rope_scaling`) writes for a configs/*-eagle3.json draft config:
    transformers' LlamaConfig fields, the draft config's architectures, draft_vocab_size and,
    when it has them, eagle_config's output-of-layer ids (configs/gpt-oss-20B-eagle3.json)."""
    conf = {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 1, "draft_vocab_size": c.draft_vocab_size,
            "eos_token_id": 2, "head_dim": c.head_dim, "hidden_act": "silu",
            "hidden_size": c.hidden_size, "initializer_range": 0.02,
            "intermediate_size": c.intermediate_size, "max_position_embeddings": 2048,
            "mlp_bias": False, "model_type": "llama", "num_attention_heads": c.num_heads,
            "num_hidden_layers": 1, "num_key_value_heads": c.num_kv_heads, "pad_token_id": 0,
            "pretraining_tp": 1, "rms_norm_eps": c.rms_norm_eps, "rope_scaling": None,
            "rope_theta": c.rope_theta, "tie_word_embeddings": False,
            "torch_dtype": "float32", "transformers_version": "4.57.1", "use_cache": True,
            "vocab_size": c.vocab_size}
    if aux_ids is not None:
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    return conf


def folder(path, tensors: dict, conf: dict, pickle_fp16=False):
    """A drafter folder: DeepSpeed's save_16bit_model (pytorch_model.bin, fp16 weights,
    d2t int64, t2d bool) or save_pretrained's model.safetensors, then config.json."""
    path.mkdir(parents=True)
    if pickle_fp16:
        torch = pytest.importorskip("torch")

        torch.save({n: torch.from_numpy(np.array(a, np.float16 if a.dtype.kind == "f"
                                                  else a.dtype)) for n, a in tensors.items()},
                   str(path / "pytorch_model.bin"))
    else:
        save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(conf, indent=2))
    return path


def same_drafter(back, shipped_heads, c, fp16=False):
    """The loaded drafter holds the shipped tensors (rounded to fp16 when saved so) and the
    shipped configuration (max_position_embeddings is the file's own)."""
    got = back.drafter.config
    assert got.replace(max_position_embeddings=c.max_position_embeddings) == c, got
    for n in eagle3.NAMES:
        want = np.asarray(shipped_heads[n])
        if fp16 and want.dtype.kind == "f":
            want = want.astype(np.float16).astype(np.float32)
        assert np.array_equal(np.asarray(back[n]), want), n


def decode_rows(stories, story_plain, heads):
    cfg, params, _ = stories
    tokens, lengths = pad_prompts(story_plain.prompts)
    out = medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(0),
                          tree=Tree.load("stories260K_cpu"), max_new_tokens=story_plain.max_new,
                          eos=(2,))
    return story_plain.rows(out), np.asarray(out.accept_hist).sum(0).tolist()


@pytest.mark.slow
def test_traineagle3_output_loads(tmp_path, stories, story_plain, shipped, one_line_error):
    """The reference trainer's own output: refused with a one-line error on the 5-layer
    backbone (its config names no aux layers, the rule needs 7), loaded with the aux layers
    given, and by the rule on a backbone deep enough."""
    cfg, _, _ = stories
    heads, c, tensors = shipped
    p = folder(tmp_path / "state_0", tensors, traineagle3_config(c), pickle_fp16=True)
    assert heads_formats.kind_at(p) == "eagle3"
    msg = one_line_error(HeadsFormatError, lambda: heads_formats.load_heads(p, cfg),
                         str(p / "config.json"), "eagle_config.eagle_aux_hidden_state_layer_ids",
                         "7 layers or more", "has 5", "aux_layers")
    assert "load_eagle3" in msg
    fixed = tmp_path / "fixed"  # what the error says to set: SpecForge's output-of-layer ids
    fixed.mkdir()
    (fixed / "pytorch_model.bin").write_bytes((p / "pytorch_model.bin").read_bytes())
    conf = dict(traineagle3_config(c), eagle_config={
        "eagle_aux_hidden_state_layer_ids": [i - 1 for i in SHIPPED_AUX]})
    (fixed / "config.json").write_text(json.dumps(conf))
    back, _ = heads_formats.load_heads(fixed, cfg)
    same_drafter(back, heads, c, fp16=True)

    back, meta = formats.load_eagle3(p, cfg, aux_layers=SHIPPED_AUX)
    same_drafter(back, heads, c, fp16=True)
    assert meta["source_layout"] == "traineagle3" and "given" in meta["aux_layers_source"]
    # the weights file named itself reads the folder
    assert heads_formats.kind_at(p / "pytorch_model.bin") == "eagle3"

    deep = cfg.replace(num_layers=8)  # the reference's rule: inputs of layers 2, 4, 5
    back, meta = heads_formats.load_heads(p, deep)
    assert back.drafter.config.aux_layers == (2, 4, 5)
    assert meta["aux_layers_source"].startswith("default")

    # model.safetensors in place of the pickle, full precision: decodes as the shipped one
    q = folder(tmp_path / "st", tensors, traineagle3_config(c))
    back, _ = formats.load_eagle3(q, cfg, aux_layers=list(SHIPPED_AUX))
    same_drafter(back, heads, c)
    assert decode_rows(stories, story_plain, back) == decode_rows(stories, story_plain, heads)
    # the aux layers given must agree with a file that names its own
    r = folder(tmp_path / "named", tensors, specforge_config(c, [0, 1, 3]))
    one_line_error(HeadsFormatError, lambda: formats.load_eagle3(r, cfg, aux_layers=(1, 2, 3)),
                   "aux layers [1, 2, 4]", "given [1, 2, 3]", "config.json")


def test_published_checkpoint_config_loads(tmp_path, stories, shipped):
    """yuhuili/EAGLE3-* as published (traineagle3's config, pytorch_model.bin; the target's
    num_hidden_layers copied in some, which the reference ignores), and SGLang's converted
    copies (the architecture renamed to LlamaForCausalLMEagle3, nothing else): the rule."""
    cfg, _, _ = stories
    heads, c, tensors = shipped
    deep = cfg.replace(num_layers=8)
    conf = traineagle3_config(c)
    conf["num_hidden_layers"] = 40  # yuhuili/EAGLE3-Vicuna1.3-13B's copy of its target's
    p = folder(tmp_path / "yuhuili", tensors, conf, pickle_fp16=True)
    back, meta = heads_formats.load_heads(p, deep)
    same_drafter(back, heads, c.replace(aux_layers=(2, 4, 5)), fp16=True)
    assert meta["source_layout"] == "traineagle3"

    conf = dict(traineagle3_config(c), architectures=["LlamaForCausalLMEagle3"])
    p = folder(tmp_path / "sglang", tensors, conf, pickle_fp16=True)
    back, meta = heads_formats.load_heads(p, deep)
    same_drafter(back, heads, c.replace(aux_layers=(2, 4, 5)), fp16=True)
    assert meta["source_layout"] == "eagle3"


@pytest.mark.slow
def test_specforge_output_loads_and_decodes_as_the_shipped_drafter(tmp_path, stories,
                                                                  story_plain, shipped):
    """SpecForge's export with eagle_config (ids of the layers whose output it reads: ours
    minus one) decodes on the embedded model exactly as the shipped drafter."""
    cfg, _, _ = stories
    heads, c, tensors = shipped
    conf = specforge_config(c, [i - 1 for i in SHIPPED_AUX])
    p = folder(tmp_path / "specforge", tensors, conf)
    back, meta = heads_formats.load_heads(p, cfg)
    same_drafter(back, heads, c)
    assert meta["aux_layers_source"] == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert decode_rows(stories, story_plain, back) == decode_rows(stories, story_plain, heads)


def test_a_backbone_folder_is_not_a_drafter(tmp_path, stories, shipped, one_line_error):
    """The plain-Llama config alone does not make a drafter: the backbone's own folder, and
    Llama tensors without fc.weight [H, 3H], are refused as before."""
    from medusa_jax.model.weights import default_model_dir

    one_line_error(HeadsFormatError, lambda: heads_formats.load_heads(
        default_model_dir(), stories[0]), "no Medusa heads in any known layout")
    _, c, tensors = shipped
    bad = dict(tensors, **{"fc.weight": np.zeros((c.hidden_size, 2 * c.hidden_size),
                                                 np.float32)})
    p = folder(tmp_path / "two", bad, traineagle3_config(c))
    one_line_error(HeadsFormatError, lambda: heads_formats.load_heads(p, stories[0]),
                   "no Medusa heads in any known layout")


def test_a_pickle_without_pytorch_says_how_to_convert(tmp_path, stories, shipped,
                                                      monkeypatch, one_line_error):
    """Found by its config's draft_vocab_size; the reader says how to convert it."""
    cfg, _, _ = stories
    _, c, _ = shipped
    p = folder(tmp_path / "state_0", {}, traineagle3_config(c))
    (p / "model.safetensors").unlink()
    (p / "pytorch_model.bin").write_bytes(b"a pickle, never opened: no PyTorch")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    one_line_error(HeadsFormatError, lambda: formats.load_eagle3(p, cfg, aux_layers=SHIPPED_AUX),
                   str(p / "pytorch_model.bin"), "PyTorch is not installed", "save_file")
    assert heads_formats.kind_at(p) == "eagle3"  # draft_vocab_size: a drafter's config


def test_no_backbone_config_names_what_to_set(tmp_path, shipped, one_line_error):
    _, c, tensors = shipped
    p = folder(tmp_path / "st", tensors, traineagle3_config(c))
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, None),
                   str(p / "config.json"), "needs the backbone's config",
                   "eagle_config.eagle_aux_hidden_state_layer_ids")
    back, c2, _ = formats.read_eagle3(p, None, aux_layers=SHIPPED_AUX)
    assert c2.aux_layers == SHIPPED_AUX
