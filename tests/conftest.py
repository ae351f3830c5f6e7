"""Test setup: 8 simulated CPU devices for the sharding tests (must precede jax's first use)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def stories():
    """(cfg, backbone params, tokenizer) of the embedded stories260K model."""
    from transformers import AutoTokenizer

    from medusa_jax.weights import default_model_dir, load_pretrained

    cfg, params = load_pretrained()
    return cfg, params, AutoTokenizer.from_pretrained(default_model_dir())
