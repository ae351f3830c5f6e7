"""The CPU few-row product kernel (`medusa_jax.kernels`): exact products, rows independent of
how many share a product, gradients, the decoders with it on, and every way its build can
fail falling back to XLA with a one-line notice."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax import kernels
from medusa_jax.kernels import KernelWeight, build, fewrow

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="the CPU kernel could not be built here")


def _reference(x, w):  # float64 product and the sum of |terms| (the rounding scale)
    x, w = np.asarray(x, np.float64), np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    return x @ w, np.abs(x) @ np.abs(w)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_products_equal_xla_to_float32_rounding(dtype, transposed):
    rng = np.random.default_rng(0)
    f = jax.jit(kernels.matmul)
    for m in list(range(1, 18)) + [24, 33, 64, 65]:
        k, n = [(7, 5), (77, 129), (64, 172), (129, 64), (33, 1)][m % 5]
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n)), dtype)
        kw = KernelWeight.of_transposed(w.T) if transposed else KernelWeight.pack(w)
        assert kw.shape == (k, n)
        y = np.asarray(f(x, kw))
        ref, scale = _reference(x, w)
        xla = np.asarray(x @ w.astype(jnp.float32))
        assert y.dtype == np.float32 and y.shape == (m, n)
        # both within float32 rounding of the exact product, as XLA's own is
        assert np.all(np.abs(y - ref) <= 2 * k * 2.0 ** -24 * scale + 1e-30), (m, k, n)
        assert np.all(np.abs(y - xla) <= 4 * k * 2.0 ** -24 * scale + 1e-30), (m, k, n)


def test_a_row_does_not_depend_on_the_other_rows():
    """Bit for bit: a token's result is the same in a 1-token pass and in a 65-token one,
    whichever tile and thread it falls in (what keeps greedy Medusa equal to plain)."""
    rng = np.random.default_rng(1)
    for k, n in [(768, 2304), (100, 70)]:
        w = KernelWeight.pack(jnp.asarray(rng.standard_normal((k, n)), jnp.float32))
        x = jnp.asarray(rng.standard_normal((65, k)), jnp.float32)
        full = np.asarray(jax.jit(kernels.matmul)(x, w))
        for m in (1, 2, 5, 9, 17):
            part = np.asarray(jax.jit(kernels.matmul)(x[:m], w))
            np.testing.assert_array_equal(part, full[:m])


def test_stacked_heads_and_a_shared_weight():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((5, 3, 64)), jnp.float32)  # [heads, rows, H]
    w = jnp.asarray(rng.standard_normal((5, 64, 90)), jnp.float32)
    np.testing.assert_allclose(kernels.matmul(x, KernelWeight.pack(w)),
                               jnp.einsum("gmk,gkn->gmn", x, w), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(kernels.matmul(x, KernelWeight.pack(w[:1])),
                               jnp.einsum("gmk,kn->gmn", x, w[0]), rtol=1e-5, atol=1e-4)


def test_packing_round_trips_and_indexes_leading_axes():
    w = jnp.arange(2 * 3 * 7 * 70, dtype=jnp.float32).reshape(2, 3, 7, 70)
    kw = KernelWeight.pack(w)
    assert kw.shape == w.shape and kw.w.shape == (2, 3, 2, 7, 64)
    np.testing.assert_array_equal(kw.array(), w)
    np.testing.assert_array_equal(kw[:, 1].array(), w[:, 1])
    np.testing.assert_array_equal(kernels.unwrap({"a": kw})["a"], w)
    with pytest.raises(IndexError, match="leading"):
        kw[0, 0, 1]


def test_gradient_is_xlas():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 33)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((33, 20)), jnp.float32)
    got = jax.grad(lambda x, w: jnp.sum(kernels.matmul(x, KernelWeight.pack(w)) ** 2),
                   argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), argnums=(0, 1))(x, w)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-4)


def test_other_platforms_lower_to_xlas_product():
    """A wrapped weight that reaches a GPU program lowers to XLA's own product."""
    x = jnp.ones((5, 64), jnp.float32)
    kw = KernelWeight.pack(jnp.ones((64, 32), jnp.float32))
    cpu = jax.jit(kernels.matmul).trace(x, kw).lower(lowering_platforms=("cpu",)).as_text()
    gpu = jax.jit(kernels.matmul).trace(x, kw).lower(lowering_platforms=("cuda",)).as_text()
    assert kernels.TARGET in cpu
    assert kernels.TARGET not in gpu and "dot_general" in gpu


@pytest.fixture
def small_weights_too(monkeypatch):
    """The embedded model's matrices are below `MIN_BYTES`: wrap them anyway, so the tests
    run the decoders with the kernel on a real model."""
    monkeypatch.setattr(fewrow, "MIN_BYTES", 0)


def test_small_weights_stay_with_xla(stories):
    from medusa_jax.model.backbone import decoding_layout

    cfg, params, _ = stories
    assert not kernels.active(decoding_layout(cfg, params))


def test_backbone_is_wrapped_only_in_the_decoding_layout(stories, small_weights_too):
    from medusa_jax.model.backbone import decoding_layout, standard_layout

    cfg, params, _ = stories
    assert not kernels.active(params)  # the stacked (training) layout keeps XLA's products
    fast = decoding_layout(cfg, params)
    assert kernels.active(fast)
    assert not kernels.active(decoding_layout(cfg, params, cpu_kernels=False))
    back = standard_layout(cfg, fast)
    assert not kernels.active(back)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_greedy_medusa_equals_plain_with_the_kernel(stories, small_weights_too):
    """The shipped heads and the default tree, batch 3: kernel decoding equals itself
    plain, and equals XLA's plain decoding token for token."""
    from medusa_jax.api import Medusa

    m = Medusa.load(heads="default")
    assert kernels.active(m.params)
    prompts = ["Once upon a time", "The little dog", "Tom and Sue went to the park"]
    fast = m.generate(prompts, max_new_tokens=48)
    plain = m.generate(prompts, max_new_tokens=48, medusa=False)
    m.params = kernels.unwrap(m.params)
    xla = m.generate(prompts, max_new_tokens=48, medusa=False)
    for a, b, c in zip(fast, plain, xla):
        assert a.token_ids == b.token_ids == c.token_ids
    assert sum(g.tokens_per_step for g in fast) / 3 > 1.5  # the heads do draft


@pytest.mark.slow
def test_greedy_hydra_equals_plain_with_the_kernel(stories, small_weights_too):
    from medusa_jax.api import Medusa

    m = Medusa.load(heads="hydra")
    prompts = ["Once upon a time", "The little dog"]
    fast = m.generate(prompts, max_new_tokens=48)
    m.params = kernels.unwrap(m.params)
    plain = m.generate(prompts, max_new_tokens=48, medusa=False)
    for a, b in zip(fast, plain):
        assert a.token_ids == b.token_ids
    assert sum(g.tokens_per_step for g in fast) / 2 > 1.5


# ----------------------------------------------------------------------------- fallbacks


def _child(env: dict) -> subprocess.CompletedProcess:
    """A fresh process (the decision is made once per process): build or fail, then a
    product, which must be right either way."""
    code = textwrap.dedent("""
        import jax.numpy as jnp, numpy as np
        from medusa_jax import kernels
        ok = kernels.available()
        x = jnp.ones((3, 70)); w = jnp.full((70, 5), 0.5)
        y = kernels.matmul(x, kernels.KernelWeight.pack(w))
        assert np.allclose(y, 35.0), y
        print("kernel" if ok else "xla")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def _notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("note: CPU kernel")]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("case, env, says", [
    ("no compiler", {"CXX": "/nonexistent/g++"}, "no C++ compiler"),
    ("failing compile", {"MEDUSA_JAX_KERNEL_CXXFLAGS": "-march=native -fno-such-flag"},
     "compiling the CPU kernels failed"),
    ("missing instructions", {"MEDUSA_JAX_CPU_FLAGS": "fpu sse sse2"}, "this CPU lacks"),
    ("turned off", {"MEDUSA_JAX_CPU_KERNELS": "0"}, None),
])
def test_fallbacks_are_one_line_and_right(tmp_path, case, env, says):
    r = _child({"MEDUSA_JAX_KERNEL_CACHE": str(tmp_path / "k"), **env})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "xla", case
    notes = _notes(r.stderr)
    if says is None:
        assert notes == []
    else:
        assert len(notes) == 1 and says in notes[0], r.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_unwritable_cache_falls_back(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    r = _child({"MEDUSA_JAX_KERNEL_CACHE": str(blocker / "k")})
    assert r.returncode == 0 and r.stdout.strip() == "xla", r.stderr
    assert len(_notes(r.stderr)) == 1 and "not writable" in r.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_corrupt_build_is_rebuilt(tmp_path):
    cache = tmp_path / "k"
    first = _child({"MEDUSA_JAX_KERNEL_CACHE": str(cache)})
    assert first.stdout.strip() == "kernel", first.stderr
    (lib,) = cache.glob(f"*/{build.LIBRARY}")
    lib.write_bytes(b"\x7fELF garbage")  # a truncated or damaged library
    again = _child({"MEDUSA_JAX_KERNEL_CACHE": str(cache)})
    assert again.returncode == 0 and again.stdout.strip() == "kernel", again.stderr
    assert "unusable" in again.stderr and "building it again" in again.stderr
