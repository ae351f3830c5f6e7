"""The CPU kernels (`medusa_jax.kernels`): exact few-row products and few-query attention,
rows independent of how many share a call, gradients, the decoders with them on, and every
way their build can fail falling back to XLA with a one-line notice."""

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


@pytest.mark.slow
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


def _drafts_as_xlas_plain(m):
    """Greedy decoding of `m` (its drafter on the kernel) gives XLA's plain tokens for two
    prompts, and its drafter drafts (more than 1.5 tokens a step)."""
    prompts = ["Once upon a time", "The little dog"]
    drafted = m.generate(prompts, max_new_tokens=48)
    m.params = kernels.unwrap(m.params)
    plain = m.generate(prompts, max_new_tokens=48, medusa=False)
    for a, b in zip(drafted, plain):
        assert a.token_ids == b.token_ids
    assert sum(g.tokens_per_step for g in drafted) / 2 > 1.5


@pytest.mark.slow
@pytest.mark.parametrize("heads_dtype", ["float32", "bfloat16"])
def test_greedy_hydra_equals_plain_with_the_kernel(stories, small_weights_too, heads_dtype):
    """bfloat16 heads: the kernel reads their matrices as they are (float32 sums)."""
    from medusa_jax.api import Medusa

    _drafts_as_xlas_plain(Medusa.load(heads="hydra", heads_dtype=heads_dtype))


@pytest.mark.slow
def test_greedy_eagle3_equals_plain_with_the_kernel(stories, small_weights_too):
    """The EAGLE-3 drafter in the backbone's decoding layout (`eagle3.decoding_layout`):
    its layer's, fc's and lm_head's products on the kernel, its drafts those of XLA's
    products to float32 rounding, and greedy decoding plain's."""
    from medusa_jax.api import Medusa
    from medusa_jax.drafters.eagle3 import heads as eagle3

    m = Medusa.load(heads="eagle")
    assert kernels.active(m.params)
    fast = eagle3.decoding_layout(m.heads)
    wrapped = [k for k, w in {**fast, **fast[eagle3.LAYER]}.items()
               if kernels.is_kernel_weight(w)]
    assert sorted(wrapped) == ["fc", "lm_head", "w_down", "w_gate_up", "wo", "wqkv"]
    c = eagle3.config_of(m.heads)
    rng = np.random.default_rng(0)
    t, h = 3, c.hidden_size
    emb = jnp.asarray(rng.standard_normal((1, t, h)), jnp.float32)
    hid = jnp.asarray(rng.standard_normal((1, t, h)), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    empty = jnp.zeros((1, c.num_kv_heads, 0, c.head_dim), jnp.float32)
    outs = [eagle3.draft_logits(p, c, eagle3.layer(p, c, emb, hid, pos, empty, empty,
                                                   eagle3.causal_mask(t))[0])
            for p in (fast, dict(m.heads))]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    _drafts_as_xlas_plain(m)


# ----------------------------------------------------------------------------- attention


def _attention_case(rng, b, kvh, g, t, w, d, holes=True):
    """Random q [B*KVH, G*T, D] (scaled), k, v [B*KVH, W, D] and a mask [B, T, W] that
    hides some slots (holes) and, in row 0, every slot past its token's own."""
    h, r = b * kvh, g * t
    q = rng.standard_normal((h, r, d)).astype(np.float32)
    k = rng.standard_normal((h, w, d)).astype(np.float32)
    v = rng.standard_normal((h, w, d)).astype(np.float32)
    mask = rng.random((b, t, w)) > (0.3 if holes else -1.0)
    mask[:, :, 0] = True  # every row attends at least one slot
    mask[0] &= np.arange(w)[None, :] <= np.arange(w - t, w)[:, None]  # causal-like in row 0
    return q, k, v, mask


def _attention_reference(q, k, v, mask):  # float64, row r of KV head h is token r % T
    b, t, w = mask.shape
    h, r, d = q.shape
    s = np.einsum("hrd,hwd->hrw", q.astype(np.float64), k.astype(np.float64))
    m = mask[np.arange(h)[:, None] // (h // b), np.arange(r)[None, :] % t]  # [H, R, W]
    s = np.where(m, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hrw,hwd->hrd", p / p.sum(-1, keepdims=True), v.astype(np.float64))


@pytest.mark.parametrize("b, kvh, g, t, w, d", [
    (1, 12, 1, 1, 150, 64), (1, 12, 1, 5, 150, 64), (1, 4, 2, 9, 37, 16),
    (2, 3, 2, 17, 64, 32), (3, 2, 4, 65, 200, 16), (1, 2, 1, 3, 19, 7), (2, 1, 3, 2, 5, 8)])
def test_attention_equals_xla_to_float32_rounding(b, kvh, g, t, w, d):
    """Heads of 16 and 64 (the paths the kernel unrolls), odd sizes (its scalar path),
    1 to 65 query tokens, several batch rows, masks with holes: within float32 rounding of
    the exact attention, as XLA's own is."""
    rng = np.random.default_rng(b * 1000 + t * 10 + d)
    q, k, v, mask = _attention_case(rng, b, kvh, g, t, w, d)
    out = np.asarray(jax.jit(kernels.attention)(q, k, v, mask))
    xla = np.asarray(jax.jit(fewrow._xla_attention)(q, k, v, mask))
    ref = _attention_reference(q, k, v, mask)
    assert out.dtype == np.float32 and out.shape == q.shape
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(out, xla, atol=4e-5, rtol=0)


def test_attention_of_a_row_does_not_depend_on_the_other_rows():
    """Bit for bit: token j's attention in a pass over T tokens is its attention in a pass
    over token j alone (with the same mask row), as in a 1-token decoding step."""
    rng = np.random.default_rng(7)
    b, kvh, g, t, w, d = 1, 4, 2, 5, 150, 64
    q, k, v, mask = _attention_case(rng, b, kvh, g, t, w, d)
    full = np.asarray(jax.jit(kernels.attention)(q, k, v, mask)).reshape(b * kvh, g, t, d)
    q4 = q.reshape(b * kvh, g, t, d)
    for j in range(t):
        one = np.asarray(jax.jit(kernels.attention)(
            np.ascontiguousarray(q4[:, :, j]), k, v, mask[:, j:j + 1]))
        np.testing.assert_array_equal(one, full[:, :, j])


def test_attention_lowers_to_xla_on_other_platforms():
    q = jnp.ones((4, 10, 16), jnp.float32)
    kv = jnp.ones((4, 40, 16), jnp.float32)
    mask = jnp.ones((1, 5, 40), bool)
    fn = jax.jit(kernels.attention).trace(q, kv, kv, mask)
    assert kernels.ATTENTION_TARGET in fn.lower(lowering_platforms=("cpu",)).as_text()
    gpu = fn.lower(lowering_platforms=("cuda",)).as_text()
    assert kernels.ATTENTION_TARGET not in gpu and "dot_general" in gpu


@pytest.mark.slow
def test_attention_is_marked_for_wide_heads_of_wrapped_backbones(stories, small_weights_too):
    """The embedded model's heads are 8 wide: its products may be wrapped, but it attends
    with XLA; a backbone with 16-wide heads attends with the kernel, and unwrapping drops
    the mark."""
    from medusa_jax.model.backbone import decoding_layout, init_params
    from medusa_jax.model.config import ModelConfig

    cfg, params, _ = stories
    assert not kernels.attends_with_kernel(decoding_layout(cfg, params))
    wide = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                       num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                       max_position_embeddings=64)
    fast = decoding_layout(wide, init_params(wide, jax.random.key(0)))
    assert kernels.attends_with_kernel(fast) and "attention" in kernels.describe(fast)
    assert not kernels.attends_with_kernel(kernels.unwrap(fast))


@pytest.mark.slow
def test_greedy_medusa_equals_plain_with_the_attention_kernel(stories, medusa_default,
                                                              small_weights_too):
    """The embedded model and its heads enlarged to 16-wide heads (the same function): with
    every product and the attention on the kernels, greedy Medusa and plain decoding give
    the embedded model's own tokens."""
    from medusa_jax.decoding.decode import generate, medusa_generate, pad_prompts
    from medusa_jax.model.backbone import decoding_layout
    from medusa_jax.tools import enlarge

    cfg, params, _ = stories
    shape = dict(hidden_size=96, intermediate_size=256, num_layers=5, num_heads=12,
                 num_kv_heads=6, head_dim=16)
    big_cfg, big = enlarge.enlarge_backbone(cfg, jax.tree.map(np.asarray, params), shape)
    big_heads = jax.tree.map(jnp.asarray, enlarge.enlarge_heads(
        jax.tree.map(np.asarray, medusa_default.heads), cfg, big_cfg))
    fast = decoding_layout(big_cfg, jax.tree.map(jnp.asarray, big))
    assert kernels.attends_with_kernel(fast) and kernels.active(fast)
    tree = medusa_default.tree("stories260K_cpu")
    prompts = [medusa_default.encode(p) for p in ("Once upon a time", "The little dog")]
    tokens, lengths = pad_prompts(prompts)
    key = jax.random.key(0)
    want = np.asarray(generate(medusa_default.params, cfg, tokens, lengths, key,
                               max_new_tokens=40).tokens)
    plain = generate(fast, big_cfg, tokens, lengths, key, max_new_tokens=40)
    spec = medusa_generate(fast, big_heads, big_cfg, tokens, lengths, key, tree=tree,
                           max_new_tokens=40)
    np.testing.assert_array_equal(np.asarray(plain.tokens), want)
    np.testing.assert_array_equal(np.asarray(spec.tokens), want)
    assert int(spec.steps.sum()) < int(spec.num_new.sum())  # the heads do draft


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
    ("no compiler", {"CXX": "/nonexistent/g++"},
     "CXX=/nonexistent/g++: no such C++ compiler (not found, or not executable)"),
    ("bad timeout", {"MEDUSA_JAX_KERNEL_TIMEOUT": "soon"},
     "MEDUSA_JAX_KERNEL_TIMEOUT='soon' is not a number of seconds > 0"),
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
@pytest.mark.parametrize("hangs_in", ["probe", "compile"])
def test_a_hanging_compiler_is_named_and_given_up_on(tmp_path, hangs_in):
    import time

    cxx = tmp_path / "g++"
    real = build.compiler()
    if hangs_in == "compile" and real is None:
        pytest.skip("no C++ compiler here to answer the probes")
    # the shell stays the parent of `sleep`, which holds the output pipe: killing the
    # shell alone would leave the build waiting for it
    answer = "" if hangs_in == "probe" else \
        f'case "$*" in *-dM*|*--version*) exec {real} "$@";; esac\n'
    cxx.write_text(f"#!/bin/sh\n{answer}sleep 60\n")
    cxx.chmod(0o755)
    t0 = time.perf_counter()
    r = _child({"MEDUSA_JAX_KERNEL_CACHE": str(tmp_path / "k"), "CXX": str(cxx),
                "MEDUSA_JAX_KERNEL_TIMEOUT": "3"})
    assert time.perf_counter() - t0 < 45, r.stderr
    assert r.returncode == 0 and r.stdout.strip() == "xla", r.stderr
    waiting = [line for line in r.stderr.splitlines() if line.startswith("note: waiting for")]
    assert len(waiting) == 1 and str(cxx) in waiting[0] and "giving up after 3 s" in waiting[0]
    says = (f"the compiler {cxx} did not answer within 3 s" if hangs_in == "probe" else
            f"compiling the CPU kernels with {cxx} took over 3 s (MEDUSA_JAX_KERNEL_TIMEOUT "
            f"sets the limit)")
    notes = _notes(r.stderr)
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
