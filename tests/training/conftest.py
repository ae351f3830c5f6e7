"""The training tests' toy model and its train step (test_train_step, test_checkpoint), as the
`toy_train` fixture. A child process that needs them (test_checkpoint's killed save) runs this
file with `runpy.run_path`: it holds plain functions and imports JAX only inside them."""

import functools

import pytest

from medusa_jax.model.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=24,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                  max_position_embeddings=128)
K = 3


def make_params(seed=0):
    import jax

    from medusa_jax.drafters.medusa import heads as heads_lib
    from medusa_jax.model import backbone

    bb = backbone.init_params(CFG, jax.random.key(seed), std=0.2)
    return {"backbone": bb, "heads": heads_lib.init_heads(CFG, bb, heads_lib.HeadsConfig(K, 1))}


def random_batch(b=8, t=16, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, (b, t)).astype(np.int32)
    # two examples per row: a 3-token prompt then an answer
    half = t // 2
    segments = np.repeat(np.array([[1] * half + [2] * (t - half)]), b, 0).astype(np.int32)
    positions = np.concatenate([np.arange(half), np.arange(t - half)])[None].repeat(b, 0)
    loss_mask = (positions >= 3)
    return {"tokens": tokens, "positions": positions.astype(np.int32), "segments": segments,
            "loss_mask": loss_mask}


@functools.cache
def _compiled(mesh_spec: str, lr: float, total: int):
    """Optimizer, shardings and jitted step, built once per setting: tests share compiles."""
    import jax

    from medusa_jax.runtime import sharding
    from medusa_jax.training import step as ts
    from medusa_jax.training.recipes import medusa_loss as ml

    params = make_params()
    labels = ml.medusa1_labels(params)
    tx, schedule = ts.make_optimizer(ts.OptimConfig(lr=lr, warmup_ratio=0.0), total, labels)
    mesh = sharding.make_mesh(mesh_spec)
    shardings = ts.state_shardings(jax.eval_shape(lambda p: ts.init_state(p, tx), params),
                                   ts.param_axes(CFG, params), mesh)
    step = ts.make_train_step(ml.medusa1_loss_fn(CFG, 0.8), tx, labels, shardings, mesh,
                              schedule)
    return tx, step, shardings, mesh


def setup(mesh_spec="1,1", lr=1e-2, total=20, params=None):
    """A fresh sharded TrainState and the (shared) jitted step."""
    import jax

    from medusa_jax.training import step as ts

    tx, step, shardings, mesh = _compiled(mesh_spec, lr, total)
    params = params if params is not None else make_params()
    state = jax.device_put(ts.init_state(params, tx), shardings)
    return state, step, shardings, mesh


def toy_rows(n=10, t=16, seed=0):
    import numpy as np

    from medusa_jax.text import data

    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, (n, t)).astype(np.int32)
    return data.Packed(tokens=tokens, positions=np.tile(np.arange(t, dtype=np.int32), (n, 1)),
                       segments=np.ones((n, t), np.int32),
                       loss_mask=np.tile(np.arange(t) >= 2, (n, 1)))


def train(state, step, it, n):
    for _ in range(n):
        state, _ = step(state, next(it))
    return state


@pytest.fixture(scope="session")
def toy_train():
    """CFG, K, make_params, random_batch, setup (a fresh TrainState and the shared jitted
    step), toy_rows (packed rows of CFG's vocabulary) and train (n steps of an iterator)."""
    from types import SimpleNamespace

    return SimpleNamespace(CFG=CFG, K=K, make_params=make_params, random_batch=random_batch,
                           setup=setup, toy_rows=toy_rows, train=train)


@pytest.fixture(scope="session")
def one_device_step():
    """`one_device_step(method, cfg)`: a recipe's `Method` on a 1-device mesh ->
    (fresh TrainState, its jitted train step)."""
    def build(method, cfg):
        import jax
        import numpy as np

        from medusa_jax.training import step as ts

        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                                 ("data", "fsdp", "model"))
        state, shardings = ts.create_state(method.params, method.tx, mesh,
                                           ts.param_axes(cfg, method.params))
        return state, ts.make_train_step(method.loss_fn, method.tx, method.labels, shardings,
                                         mesh, method.schedule)

    return build


@pytest.fixture
def refused_flags(tmp_path, capsys):
    """`refused_flags(recipe, flags) -> the error line`: `python -m train.<recipe> --output-dir
    D *flags` exits 2 with one `python -m train.<recipe>: error: ...` line last and creates no
    run directory D."""
    import importlib

    def run(recipe: str, flags: list) -> str:
        out = tmp_path / "run"
        with pytest.raises(SystemExit) as e:
            importlib.import_module(f"train.{recipe}").command.main(
                ["--output-dir", str(out), *flags])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"python -m train.{recipe}: error: "), err
        assert not out.exists()
        return err[-1]

    return run
