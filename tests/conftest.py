"""Test setup (before jax's first use): 8 simulated CPU devices for the sharding tests, and
one persistent compilation cache for the whole session, shared with the commands the tests
launch (they inherit it through the environment): .pytest_cache/jax-cache, or
$MEDUSA_JAX_TEST_CACHE_DIR. Set MEDUSA_JAX_NO_COMPILE_CACHE=1 to run without it.

The folders mirror the package (kernels/, runtime/, text/, model/, decoding/, drafters/,
tools/, training/, serving/; commands/ for the train/ and infer/ entry points; the notebook
API and the layering at the top). No test module imports another: what several files share
is a fixture, here or in a folder's conftest.py. Markers (pyproject.toml): slow, subprocess,
multihost; the fast loop is `python -m pytest -q -n 2 --dist loadfile -m "not slow" tests`."""

import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    """JAX's own cache settings, which `compile_cache.enable` (the commands, `Medusa.load`)
    keeps as they are."""
    import sys

    from medusa_jax.runtime import compile_cache  # stdlib only: jax is not imported here

    if compile_cache.off_by_env():
        return
    cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
    folder = os.environ.get("MEDUSA_JAX_TEST_CACHE_DIR") or (
        cache.mkdir("jax-cache") if cache is not None
        else Path(config.rootpath) / ".pytest_cache" / "jax-cache")
    Path(folder).mkdir(parents=True, exist_ok=True)
    settings = {"jax_compilation_cache_dir": str(folder),
                "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": -1}
    for name, value in settings.items():
        os.environ[name.upper()] = str(value)  # read by jax at import, here and in subprocesses
    if "jax" in sys.modules:  # imported before this hook: set its config directly
        import jax

        for name, value in settings.items():
            jax.config.update(name, value)


# The files that hold the suite's longest tests (--durations of whole runs on an empty
# compilation cache), longest first. `--dist loadfile` hands them out before the others:
# xdist's own order (most tests first) leaves files of a few long tests for the end, where
# one worker can be left running one of them while the other has nothing to do.
LONG_FILES = (
    "tests/serving/test_engine.py",
    "tests/drafters/test_eagle3_decoding.py",
    "tests/decoding/test_tensor_parallel.py",
    "tests/training/test_multihost.py",
    "tests/decoding/test_acceptance.py",
    "tests/training/test_train_scale.py",
    "tests/tools/test_bench_report.py",
    "tests/commands/test_interrupts.py",
    "tests/training/test_eagle_train.py",
    "tests/tools/test_enlarge.py",
    "tests/training/test_medusa2.py",
    "tests/serving/test_engine_step.py",
    "tests/commands/test_train_e2e.py",
    "tests/serving/test_engine_ngram.py",
    "tests/training/test_hydra_train.py",
    "tests/test_api_ngram.py",
    "tests/serving/test_serve.py",
    "tests/decoding/test_bfloat16.py",
    "tests/test_api_compiles.py",
    "tests/decoding/test_decode_stages.py",
    "tests/tools/test_bench_ngram.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with LONG_FILES first (other modes: xdist's own scheduler)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    if not hasattr(LoadFileScheduling, "_assign_work_unit"):  # xdist's internals moved:
        return None  # its own order (slower, never wrong)

    class LongFilesFirst(LoadFileScheduling):
        ordered = False

        def _assign_work_unit(self, node):
            queue = getattr(self, "workqueue", None)
            if not self.ordered and hasattr(queue, "move_to_end"):
                self.ordered = True  # the first call: the queue of files is complete
                for scope in reversed(LONG_FILES):
                    if scope in queue:
                        queue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongFilesFirst(config, log)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test file, drop the programs JAX keeps compiled in this process (the
    persistent cache still holds them). XLA:CPU maps a few memory regions per loaded
    program, and a worker that kept every program of its files reached the kernel's limit
    on mappings (vm.max_map_count, 65,530 here) and aborted inside a compile. Dropping the
    caches frees the programs they alone hold; a full garbage collection (for programs a
    reference cycle still holds) walks the whole heap of torch, transformers and JAX, so it
    runs only once the mappings near half the limit."""
    yield
    import gc
    import sys

    jax = sys.modules.get("jax")  # files that never import JAX stay without it
    if jax is not None:
        jax.clear_caches()
        if _mappings() > 32_000:
            gc.collect()


def _mappings() -> int:
    """This process's memory mappings (Linux), or a large number where they cannot be read
    (so the collection runs after every file, as it would without the count)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 1 << 30


@pytest.fixture(scope="session")
def stories():
    """(cfg, backbone params, tokenizer) of the embedded stories260K model."""
    from transformers import AutoTokenizer

    from medusa_jax.model.weights import default_model_dir, load_pretrained

    cfg, params = load_pretrained()
    return cfg, params, AutoTokenizer.from_pretrained(default_model_dir())


# ---- helpers shared by several folders, as fixtures: no test module imports another


def _chi_square_ok(counts, probs, z=4.0):
    """Pearson chi-square with small cells pooled; accept unless p < ~3e-5 (z = 4)."""
    import numpy as np

    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    if np.any(obs[~keep] > 0):
        return False, np.inf
    stat = np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep])
    df = keep.sum() - 1
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    return stat < crit, stat / crit


@pytest.fixture(scope="session")
def chi_square_ok():
    """`chi_square_ok(counts, probs, z=4.0) -> (ok, stat / critical)`: do the counts follow
    the probabilities (the lossless-sampling tests: decoding, drafters, model, serving)?"""
    return _chi_square_ok


@pytest.fixture(scope="session")
def toy_lm():
    """The 8-word, 1-layer model of the lossless-sampling tests (decoding/test_acceptance,
    decoding/test_dynamic_tree, drafters/test_hydra): its config, a tree, a prompt, the row
    count and samplings, P(x1, x2) of plain sampling and the (x1, x2) counts of a run."""
    from types import SimpleNamespace

    import jax.numpy as jnp
    import numpy as np

    from medusa_jax.decoding.acceptance import Sampling, log_probs
    from medusa_jax.decoding.tree import Tree
    from medusa_jax.model.backbone import KVCache, causal_mask, forward
    from medusa_jax.model.config import ModelConfig

    V = 8
    CFG = ModelConfig(model_type="llama", vocab_size=V, hidden_size=16, intermediate_size=24,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      max_position_embeddings=64)
    PROMPT = [1, 3, 5]

    def next_logprobs(params, seqs, sampling, cfg):
        seqs = np.asarray(seqs)
        b, t = seqs.shape
        cache = KVCache.init(cfg, b, t)
        logits, _, _ = forward(params, cfg, jnp.asarray(seqs),
                               jnp.broadcast_to(jnp.arange(t), (b, t)),
                               causal_mask(cache.lengths, t, t), cache)
        return np.exp(np.asarray(log_probs(logits[:, -1], sampling), np.float64))

    def exact_pair_distribution(params, sampling, cfg=CFG):
        """P(x1, x2) of plain sampling, [V, V] (`cfg`: another config of this vocabulary,
        e.g. more layers)."""
        p1 = next_logprobs(params, [PROMPT], sampling, cfg)[0]
        p2 = next_logprobs(params, [PROMPT + [x] for x in range(V)], sampling, cfg)
        return p1[:, None] * p2

    def pair_counts(out):
        tokens = np.asarray(out.tokens)
        assert np.all(np.asarray(out.num_new) >= 2)
        counts = np.zeros((V, V))
        np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
        return counts

    def drafted_pairs(params, heads, tree, sampling, cfg=CFG, rows=4000):
        """Decode `rows` copies of PROMPT with `heads` over `tree` (3 new tokens) -> (ok,
        chi2 / critical) of their (x1, x2) against plain sampling's exact P(x1, x2), and the
        share of steps that accepted two drafts or more (a test with teeth needs some)."""
        import jax

        from medusa_jax.decoding.decode import medusa_generate, pad_prompts

        tokens, lengths = pad_prompts([PROMPT] * rows)
        out = medusa_generate(params, heads, cfg, tokens, lengths, jax.random.key(7), tree=tree,
                              sampling=sampling, max_new_tokens=3)
        exact = exact_pair_distribution(params, sampling, cfg)
        ok, ratio = _chi_square_ok(pair_counts(out).ravel(), exact.ravel())
        hist = np.asarray(out.accept_hist).sum(0)
        return ok, ratio, hist[2:].sum() / hist.sum()

    return SimpleNamespace(
        V=V, CFG=CFG, PROMPT=PROMPT, ROWS=20000,
        TREE=Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]]),
        SAMPLINGS=[Sampling(mode="rejection", temperature=1.0),
                   Sampling(mode="rejection", temperature=0.7, top_k=6, top_p=0.9)],
        exact_pair_distribution=exact_pair_distribution, pair_counts=pair_counts,
        drafted_pairs=drafted_pairs)


@pytest.fixture(scope="session")
def toy_medusa(toy_lm):
    """(params, heads) of `toy_lm`: random weights and 2 perturbed Medusa heads."""
    import jax

    from medusa_jax.drafters.medusa.heads import HeadsConfig, init_heads
    from medusa_jax.model.backbone import init_params

    params = init_params(toy_lm.CFG, jax.random.key(0), std=0.6)
    heads = init_heads(toy_lm.CFG, params, HeadsConfig(num_heads=2))
    noise = jax.random.split(jax.random.key(1), 3)
    heads = {k: v + 0.3 * jax.random.normal(n, v.shape) for (k, v), n in zip(heads.items(), noise)}
    return params, heads


@pytest.fixture(scope="session")
def noisy_hydra():
    """`noisy_hydra(heads, scale, seed)`: Hydra heads with every tensor randomly perturbed
    (the unused input slots stay zero)."""
    def noisy(heads, scale, seed):
        import jax

        from medusa_jax.drafters.hydra import heads as hydra

        keys = jax.random.split(jax.random.key(seed), len(heads))
        k = hydra.config_of(heads)[0]
        out = {}
        for (name, v), key in zip(heads.items(), keys):
            noise = scale * jax.random.normal(key, v.shape)
            if name in ("in_w", "res_w"):
                noise = noise * hydra.slot_mask(k)[:, :, None, None]
            out[name] = v + noise
        return out

    return noisy


@pytest.fixture(scope="session")
def medusa_default():
    """`Medusa.load(heads="default")`: the embedded model and its shipped heads, loaded once
    per worker for the files that only decode with it (leave its attributes as they are; a
    test that needs a fresh one, or its first compile, calls `Medusa.load` itself)."""
    from medusa_jax.api import Medusa

    return Medusa.load(heads="default")


@pytest.fixture
def model_folder(tmp_path):
    """A copy of the embedded model's folder to break: `model_folder(name="m", **changes)`
    copies it into tmp_path and sets the given config.json fields."""
    import json
    import shutil

    from medusa_jax.runtime import assets

    def make(name="m", **changes):
        d = tmp_path / name
        shutil.copytree(assets.model_dir(), d)
        if changes:
            conf = json.loads((d / "config.json").read_text())
            conf.update(changes)
            (d / "config.json").write_text(json.dumps(conf))
        return d

    return make



class OneLineError:
    """The project's bad-input contract: an error message is one line with no traceback.

    `check(exc_type, fn, *needles)` (the fixture called): `fn()` raises `exc_type` with a
    one-line message holding every needle; returns the message.
    `.message(msg_or_excinfo)`: asserts a message (a string or `pytest.raises`' ExceptionInfo)
    is one line with no traceback; returns it."""

    def __call__(self, exc_type, fn, *needles) -> str:
        with pytest.raises(exc_type) as e:
            fn()
        msg = self.message(e)
        for n in needles:
            assert str(n) in msg, (n, msg)
        return msg

    @staticmethod
    def message(msg) -> str:
        if isinstance(msg, pytest.ExceptionInfo):
            msg = str(msg.value)
        assert "\n" not in msg.strip() and "Traceback" not in msg, msg
        return msg


@pytest.fixture(scope="session")
def one_line_error():
    """`OneLineError`: checks that an error is one line naming what it should."""
    return OneLineError()
