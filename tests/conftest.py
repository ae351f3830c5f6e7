"""Test setup (before jax's first use): 8 simulated CPU devices for the sharding tests, and
one persistent compilation cache for the whole session, shared with the commands the tests
launch (they inherit it through the environment): .pytest_cache/jax-cache, or
$MEDUSA_JAX_TEST_CACHE_DIR. Set MEDUSA_JAX_NO_COMPILE_CACHE=1 to run without it."""

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


@pytest.fixture(scope="session")
def stories():
    """(cfg, backbone params, tokenizer) of the embedded stories260K model."""
    from transformers import AutoTokenizer

    from medusa_jax.model.weights import default_model_dir, load_pretrained

    cfg, params = load_pretrained()
    return cfg, params, AutoTokenizer.from_pretrained(default_model_dir())
