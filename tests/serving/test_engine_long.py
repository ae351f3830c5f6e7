"""A long prompt served: the embedded model with its context raised to 4096 serves a
~3,000-token prompt of real text greedily, token-identical to offline plain decoding (the
prompt takes the widest prefill bucket and the widest attention window)."""

import pytest

from medusa_jax.api import Medusa
from medusa_jax.runtime import assets
from medusa_jax.serving.engine import Engine, generate_offline

CONTEXT, PROMPT, NEW = 4096, 3000, 12

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import json
    import shutil

    folder = tmp_path_factory.mktemp("long") / "stories260K"
    shutil.copytree(assets.model_dir(), folder)
    conf = json.loads((folder / "config.json").read_text())
    conf["max_position_embeddings"] = CONTEXT
    (folder / "config.json").write_text(json.dumps(conf))
    return Medusa.load(folder, assets.heads_dir())


@pytest.fixture(scope="module")
def prompt(model):
    ids = model.encode(assets.text_file("heldout").read_text())
    assert len(ids) >= PROMPT
    return ids[:PROMPT]


def test_a_3000_token_prompt_served_greedily_is_offline_plain_decoding(model, prompt):
    want = model.generate([prompt], max_new_tokens=NEW, medusa=False)[0].token_ids
    e = Engine(model, slots=2, max_context=CONTEXT, prefill_batch=1).start("lazy")
    try:
        # the prompt needs the widest window and the longest bucket
        assert e.layout.fit(PROMPT + 1) == e.windows[-1] == e.buckets[-1] == CONTEXT
        assert generate_offline(e, [prompt], NEW) == [want]
        assert e.metrics.resizes >= 1  # grown from the narrowest window to the widest
    finally:
        e.stop()
