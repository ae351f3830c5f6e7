"""The decoders and train steps lower for GPU and TPU without the hardware.

`jax.export` lowers for other platforms on this CPU machine. It refuses custom calls that are
not stable across platforms (host callbacks among them); on top of that the lowered module
must hold no callback and only static shapes. Sharded variants lower with their shardings.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from medusa_jax import api
from medusa_jax.decoding.acceptance import Sampling
from medusa_jax.decoding.decode import generate, medusa_generate
from medusa_jax.decoding.tree import Tree
from medusa_jax.drafters.medusa.heads import HeadsConfig, init_heads
from medusa_jax.model.backbone import init_params
from medusa_jax.model.config import ModelConfig
from medusa_jax.runtime import sharding
from medusa_jax.training import step as ts
from medusa_jax.training.recipes import medusa2
from medusa_jax.training.recipes import medusa_loss as ml

PLATFORMS = ("cuda", "tpu")
CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                  max_position_embeddings=128)
TREE = Tree.load("mc_sim_7b_63:8")
B, P, NEW = 4, 16, 8


def _check(exp):
    assert tuple(exp.platforms) == PLATFORMS
    text = exp.mlir_module()
    assert not re.search(r"callback", text, re.I), "host callback in the lowered module"
    assert "?" not in "".join(str(a.shape) for a in exp.in_avals), "dynamic shape"
    assert all(isinstance(d, int) for a in exp.in_avals for d in a.shape)
    return text


def _abstract(tree, shardings=None):
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


@pytest.fixture(scope="module")
def model():
    params = jax.eval_shape(lambda k: init_params(CFG, k), jax.random.key(0))
    heads = jax.eval_shape(lambda p: init_heads(CFG, p, HeadsConfig(4)), params)
    return params, heads


def _inputs():
    return (jax.ShapeDtypeStruct((B, P), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32),
            jax.eval_shape(lambda: jax.random.key(0)))


@pytest.mark.slow
def test_generate_lowers_for_gpu_and_tpu(model):
    params, _ = model
    exp = jax.export.export(generate, platforms=PLATFORMS)(
        _abstract(params), CFG, *_inputs(), sampling=Sampling("rejection", temperature=0.7),
        max_new_tokens=NEW, eos=(2,))
    assert "stablehlo.while" in _check(exp)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["greedy", "typical", "rejection"])
def test_medusa_generate_lowers_for_gpu_and_tpu(model, mode):
    params, heads = model
    exp = jax.export.export(medusa_generate, platforms=PLATFORMS)(
        _abstract(params), _abstract(heads), CFG, *_inputs(), tree=TREE,
        sampling=Sampling(mode, temperature=0.7), max_new_tokens=NEW, eos=(2,))
    assert _check(exp).count("stablehlo.while") >= 1


@pytest.mark.slow
def test_sharded_medusa_generate_lowers_for_gpu_and_tpu(model):
    params, heads = model
    mesh = sharding.make_mesh("data=2,model=4")
    bb, hd = api.decode_shardings(CFG, mesh, heads)
    with jax.set_mesh(mesh):
        exp = jax.export.export(medusa_generate, platforms=PLATFORMS)(
            _abstract(params, bb), _abstract(heads, hd), CFG, *_inputs(), tree=TREE,
            max_new_tokens=NEW, eos=(2,))
    text = _check(exp)
    assert exp.nr_devices == 8
    assert "mhlo.sharding" in text or "sdy.sharding" in text


def _batch():
    s = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    return {"tokens": s, "positions": s, "segments": s,
            "loss_mask": jax.ShapeDtypeStruct((8, 16), jnp.bool_)}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["medusa1", "medusa2"])
def test_train_steps_lower_for_gpu_and_tpu(method):
    params = jax.eval_shape(lambda k: init_params(CFG, k), jax.random.key(0))
    heads = jax.eval_shape(lambda q: init_heads(CFG, q, HeadsConfig(3)), params)
    mesh = sharding.make_mesh("data=2,fsdp=2,model=2")
    batch = _batch()
    if method == "medusa1":
        p = {"backbone": params, "heads": heads}
        labels = ml.medusa1_labels(p)
        tx, schedule = ts.make_optimizer(ts.OptimConfig(), 10, labels)
        loss_fn = ml.medusa1_loss_fn(CFG)
    else:
        p = jax.eval_shape(lambda a, b: medusa2.make_params(a, b, "kl"), params, heads)
        labels = medusa2.labels(p)
        tx, schedule = medusa2.make_joint_optimizer(ts.OptimConfig(), 10, labels)
        loss_fn = medusa2.make_loss_fn(CFG)
        batch["step"] = jax.ShapeDtypeStruct((8,), jnp.int32)
    abstract = jax.eval_shape(lambda q: ts.init_state(q, tx), p)
    shardings = ts.state_shardings(abstract, ts.param_axes(CFG, p), mesh)
    step = ts.make_train_step(loss_fn, tx, labels, shardings, mesh, schedule)
    bsh = NamedSharding(mesh, sharding.batch_sharding(mesh).spec)
    exp = jax.export.export(step, platforms=PLATFORMS)(
        _abstract(abstract, shardings),
        {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bsh) for k, v in batch.items()})
    _check(exp)
    assert exp.nr_devices == 8


def test_a_host_callback_is_refused():
    """What the checks above guard against: a CPU-only construct fails the export."""
    def f(x):
        return jax.pure_callback(lambda a: np.asarray(a) * 2, x, x)

    with pytest.raises(Exception, match="(?i)callback|custom call"):
        jax.export.export(jax.jit(f), platforms=PLATFORMS)(jax.ShapeDtypeStruct((4,), jnp.float32))
