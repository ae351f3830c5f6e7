"""The serving layout's sizes: attention windows double from --window-block up to the
context, so the programs a server can compile grow with log(context), not with it
(counted from the layout's key enumeration, nothing compiled)."""

import collections

import pytest

from medusa_jax.serving.config import EngineConfig
from medusa_jax.serving.layout import Layout, attention_windows


def medusa_layout(context: int, **options) -> Layout:
    """The default flags' layout of a model of `context` tokens with Medusa heads (a drafter
    without its own cache: prefix cache on; CPU: plain steps above 4 of the 8 slots)."""
    config = EngineConfig(**{**dict(max_context=context, plain_above="auto"), **options})
    return Layout.build(config, model_context=context, width=4, fed=40, eos=(2,),
                        keeps_context=False, min_bucket=16, backend="cpu",
                        drafter_kind="medusa")


@pytest.mark.parametrize("smallest, capacity, windows", [
    (128, 512, [128, 256, 512]),
    (128, 1000, [128, 256, 512, 1000]),  # the widest is the context, a power of two or not
    (64, 128, [64, 128]),
    (128, 128, [128]),
    (128, 100, [100]),  # a context under the narrowest window is the only window
])
def test_windows_double_up_to_the_context(smallest, capacity, windows):
    assert attention_windows(smallest, capacity) == windows


def test_window_block_is_the_narrowest_window():
    assert medusa_layout(32768).windows[:2] == [128, 256]
    assert medusa_layout(32768, window_block=512).windows[:2] == [512, 1024]
    assert medusa_layout(32768).windows[-1] == 32768


def test_a_step_attends_over_at_most_twice_what_it_needs():
    lay = medusa_layout(32768)
    for need in (1, 129, 300, 1025, 5000, 16385, 32768):
        assert need <= lay.fit(need) <= max(2 * need, lay.windows[0])


def test_the_programs_grow_with_log_of_the_context():
    counts = {c: len(medusa_layout(c).programs()) for c in (512, 1024, 2048, 4096, 8192,
                                                             16384, 32768)}
    for c in list(counts)[1:]:
        added = counts[c] - counts[c // 2]
        # one more window per doubling: a window's programs (a step per slot bucket, its
        # resizes, a move, the inserts and extends of the shorter buckets), not twice the
        # count as windows in steps of --window-block gave
        assert 0 < added < 0.5 * counts[c // 2], (c, counts)
    # 64 times the context, not 64 times the programs
    assert counts[32768] < 4 * counts[512], counts


def test_every_window_has_its_step_programs_and_no_key_twice():
    lay = medusa_layout(8192)
    keys = lay.programs()
    assert len(keys) == len(set(keys))
    steps = collections.Counter(k.window for k in keys if k.kind == "step")
    assert sorted(steps) == lay.windows
    assert set(steps.values()) == {len(lay.slot_buckets)}
