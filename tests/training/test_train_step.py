"""Training step: frozen backbone, label alignment, loss/metrics, sharded == single device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.drafters.medusa import heads as heads_lib
from medusa_jax.runtime import sharding
from medusa_jax.training import step as ts
from medusa_jax.training.recipes import eagle3 as eagle3_recipe
from medusa_jax.training.recipes import medusa_loss as ml
from medusa_jax.training.recipes import mtp as mtp_recipe

# CFG, K, make_params, random_batch and setup: tests/training/conftest.py's toy_train


def bits(x):
    return np.asarray(x).view(np.uint32)


@pytest.mark.slow
def test_backbone_frozen_heads_trained_and_no_backbone_optimizer_state(toy_train):
    make_params, random_batch = toy_train.make_params, toy_train.random_batch
    setup = toy_train.setup
    params = make_params()
    before = jax.tree.map(np.asarray, params)
    state, step, _, _ = setup(params=params)
    for i in range(4):
        state, m = step(state, random_batch(seed=i))
    for a, b in zip(jax.tree.leaves(before["backbone"]), jax.tree.leaves(state.params["backbone"])):
        np.testing.assert_array_equal(bits(a), bits(b))  # bit-identical
    for name in ("w", "b", "proj"):
        assert not np.array_equal(before["heads"][name], state.params["heads"][name]), name
    # optimizer state: Adam moments for head leaves only, nothing shaped like the backbone
    head_shapes = sorted(tuple(x.shape) for x in jax.tree.leaves(params["heads"]))
    bb_shapes = {tuple(x.shape) for x in jax.tree.leaves(params["backbone"])}
    assert not bb_shapes & set(head_shapes)  # the check below can tell them apart
    arrays = [tuple(x.shape) for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
    assert sorted(arrays) == sorted(head_shapes * 2)  # mu and nu, one per head leaf
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu"))
            if hasattr(s, "mu")]
    assert len(adam) == 1
    assert len(jax.tree.leaves(adam[0].mu)) == len(jax.tree.leaves(params["heads"]))


@pytest.mark.slow
def test_no_backbone_gradient(toy_train):
    CFG, make_params, random_batch = toy_train.CFG, toy_train.make_params, toy_train.random_batch
    params = make_params()
    grads = jax.jit(jax.grad(lambda p, b: ml.medusa1_loss_fn(CFG)(p, b)[0]))(params,
                                                                            random_batch())
    assert all(not np.any(g) for g in jax.tree.leaves(grads["backbone"]))
    assert any(np.any(g) for g in jax.tree.leaves(grads["heads"]))


def test_label_alignment_on_hand_made_batch():
    # row 0: [BOS, u, u, a, a, a, a, a | BOS, u, a, a] (u = user token, a = answer token)
    tokens = np.array([[1, 10, 11, 20, 21, 22, 23, 24, 1, 12, 30, 31]], np.int32)
    segments = np.array([[1] * 8 + [2] * 4], np.int32)
    mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1]], bool)
    batch = {"tokens": tokens, "segments": segments, "loss_mask": mask,
             "positions": np.zeros_like(tokens)}
    targets, valid = jax.device_get(ml.medusa_targets(batch, 3))
    t = tokens.shape[1]
    for k in (1, 2, 3):  # head k: token k+1 positions ahead, same example, a label
        for pos in range(t):
            src = pos + k + 1
            want = src < t and segments[0, src] == segments[0, pos] and mask[0, src]
            assert valid[k - 1, 0, pos] == want, (k, pos)
            if want:
                assert targets[k - 1, 0, pos] == tokens[0, src]
    # head 1 from position 1 (a user token) targets token 3 (the first answer token)
    assert valid[0, 0, 1] and targets[0, 0, 1] == 20
    # user tokens are never targets; nothing crosses into the second example
    assert not valid[0, 0, 0]  # would be token 11 (user)
    assert not valid[0, 0, 6] and not valid[0, 0, 7]  # would be BOS / user of example 2
    assert valid[0, 0, 8] and targets[0, 0, 8] == 30


def test_loss_matches_manual_cross_entropy_and_decay():
    rng = np.random.default_rng(0)
    k, b, t, v = 2, 1, 5, 7
    logits = rng.normal(size=(k, b, t, v)).astype(np.float32)
    targets = rng.integers(0, v, (k, b, t)).astype(np.int32)
    valid = rng.random((k, b, t)) < 0.6
    valid[:, 0, 0] = True
    loss, m = jax.device_get(ml.medusa_loss(jnp.asarray(logits), targets, valid, 0.5))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    head = np.array([(ce[i] * valid[i]).sum() / valid[i].sum() for i in range(k)])
    np.testing.assert_allclose(m["head_loss"], head, rtol=1e-5)
    np.testing.assert_allclose(loss, 0.5 * head[0] + 0.25 * head[1], rtol=1e-5)
    order = np.argsort(-logits, -1)
    rank = np.argmax(order == targets[..., None], -1)
    for i in range(k):
        np.testing.assert_allclose(m["top1"][i], ((rank[i] == 0) & valid[i]).sum() / valid[i].sum())
        np.testing.assert_allclose(m["top5"][i], ((rank[i] < 5) & valid[i]).sum() / valid[i].sum())


def test_no_valid_positions_gives_zero_not_nan(toy_train):
    CFG, make_params, random_batch = toy_train.CFG, toy_train.make_params, toy_train.random_batch
    setup = toy_train.setup
    params = make_params()
    batch = random_batch()
    batch["loss_mask"] = np.zeros_like(batch["loss_mask"])
    loss, m = jax.jit(ml.medusa1_loss_fn(CFG))(params, batch)
    assert float(loss) == 0.0
    assert np.all(np.isfinite(np.asarray(m["top1"]))) and np.all(np.asarray(m["count"]) == 0)
    state, step, _, _ = setup(params=params)
    state, m = step(state, batch)
    for leaf in jax.tree.leaves(state.params["heads"]):
        assert np.all(np.isfinite(np.asarray(leaf)))


def test_sharding_rules_shard_only_divisible_dims():
    mesh = sharding.make_mesh("data=2,fsdp=4")
    proj = heads_lib.heads_axes()["proj"]
    assert sharding.spec_for(proj, (3, 16, 64), mesh) == jax.sharding.PartitionSpec(
        None, None, "fsdp")
    # vocab 30 does not divide by 4: fall back to the hidden dim, then to replication
    assert sharding.spec_for(proj, (3, 16, 30), mesh) == jax.sharding.PartitionSpec(
        None, "fsdp", None)
    assert sharding.spec_for(proj, (3, 6, 30), mesh) == jax.sharding.PartitionSpec(
        None, None, None)
    assert sharding.spec_for(None, (), mesh) == jax.sharding.PartitionSpec()
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh("4,4")
    with pytest.raises(ValueError, match="not divisible"):
        sharding.check_batch_size(6, mesh)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sharded_step_equals_single_device(toy_train):
    random_batch, setup = toy_train.random_batch, toy_train.setup
    batches = [random_batch(b=8, seed=i) for i in range(3)]
    one, step1, _, _ = setup("1,1")
    many, step8, shard8, mesh8 = setup("data=2,fsdp=4")
    assert shard8.params["heads"]["proj"].spec == jax.sharding.PartitionSpec(None, None, "fsdp")
    assert len(many.params["heads"]["proj"].sharding.device_set) == 8
    for batch in batches:
        one, m1 = step1(one, batch)
        many, m8 = step8(many, batch)
        np.testing.assert_allclose(float(m1["loss"]), float(m8["loss"]), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(m1["top1"]), np.asarray(m8["top1"]), atol=1e-6)
    for name in ("w", "b", "proj"):
        np.testing.assert_allclose(np.asarray(one.params["heads"][name]),
                                   np.asarray(many.params["heads"][name]), atol=1e-5)
    # the optimizer state stayed sharded like the params
    mu = [s for s in jax.tree.leaves(many.opt_state, is_leaf=lambda s: hasattr(s, "mu"))
          if hasattr(s, "mu")][0].mu
    assert mu["heads"]["proj"].sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp")


def test_a_prediction_ahead_counts_where_its_target_is_a_label_of_its_example():
    """ahead_masks (EAGLE-3's training-time steps, MTP's depths): the prediction at t of
    token t+i+2 counts exactly when that token is a label of t's own example (so never past
    its end, nor in the next example of a packed row)."""
    assert eagle3_recipe.step_masks is ts.ahead_masks is mtp_recipe.depth_masks
    t = 12
    seg = np.array([[1] * 6 + [2] * 4 + [0] * 2])
    lab = np.array([[0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0, 0]], bool)
    masks = np.asarray(ts.ahead_masks(
        {"loss_mask": jnp.asarray(lab), "segments": jnp.asarray(seg)}, 3))
    for i in range(3):
        want = [bool(p + i + 2 < t and lab[0, p + i + 2] and seg[0, p + i + 2] == seg[0, p])
                for p in range(t)]
        assert masks[i, 0].astype(bool).tolist() == want, i
        assert any(want)
