"""The engine's prefix cache: a prompt whose beginning a slot's cache holds (a finished
request's prompt and answer, or a live request's prompt) is prefilled only after it, and its
tokens are offline decoding's; `cache_prompt=False`, a cancelled request's slot and the part
of a cache cut by a narrower window give nothing."""

import threading

import pytest

from medusa_jax.api import Medusa, shipped_heads_dir
from medusa_jax.runtime import assets
from medusa_jax.serving.engine import Engine, Request
from medusa_jax.serving.scheduler import common_prefix

# prompts of 15-30 tokens take the 64-token bucket; after a cached prefix the rest takes 1,
# 4 or 16 (the 96-token bucket holds a prompt longer than the narrow window)
SLOTS, CONTEXT, BUCKETS, WINDOW, NEW = 4, 128, (16, 64, 96), 64, 24


@pytest.fixture(scope="module")
def model(medusa_default):
    return medusa_default


@pytest.fixture(scope="module")
def prompts(model):
    return [model.encode(p) for p in assets.heldout_prompts()[:10]]


@pytest.fixture(scope="module", params=["medusa", "plain"])
def engine(request, model):
    e = Engine(model, slots=SLOTS, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW,
               prefill_batch=1, slot_buckets=(SLOTS,), medusa=request.param == "medusa")
    e.start("lazy")  # `extend` compiles when a hit first needs it
    yield e
    e.stop()


def offline(model, prompt, n=NEW):
    return model.generate([prompt], max_new_tokens=n, medusa=False)[0].token_ids


@pytest.fixture
def run(patient):
    """`run(engine, prompt, n, **request)`: submit and wait (`patient`): (request, tokens)."""
    def run(engine, prompt, n=NEW, **kw):
        out, done = [], threading.Event()

        def on_event(tokens, finish, error):
            out.extend(tokens)
            if finish is not None:
                done.set()

        req = engine.submit(Request(prompt=list(prompt), max_tokens=n, on_event=on_event,
                                    **kw))
        patient(done, engine, "a request")
        return req, out

    return run


@pytest.mark.slow
def test_a_repeated_prompt_and_a_follow_up_turn_start_after_their_cached_prefix(engine, model,
                                                                              prompts, run):
    p = prompts[0]
    _, first = run(engine, p)
    assert first == offline(model, p)
    hits = engine.metrics.prefix_hits
    again, out = run(engine, p)
    assert out == first
    assert again.cached == len(p) - 1  # the last prompt token is fed again for its logits
    # the next turn: the prompt, the answer and more; the answer's last token was not fed
    follow = p + first + prompts[1][1:9]
    turn, out = run(engine, follow)
    assert out == offline(model, follow)
    assert turn.cached == len(p) + len(first) - 1
    m = engine.metrics
    assert m.prefix_hits == hits + 2 and m.prefix_tokens >= again.cached + turn.cached


@pytest.mark.slow
def test_prompts_taking_turns_keep_each_others_cache(engine, model, prompts, run):
    """A, then B in A's slot (A's cache moves to a free slot first), then A again: it reads
    that slot while B's cache moves into it (after the read), so B again finds it there."""
    a, b = prompts[8], prompts[9]
    run(engine, a)
    run(engine, b)
    for p in (a, b, a, b):
        req, out = run(engine, p)
        assert req.cached == len(p) - 1 and out == offline(model, p)


@pytest.mark.slow
def test_a_prompt_starting_with_a_live_requests_prompt_reads_that_slot(engine, model, prompts,
                                                                       run, patient):
    p = prompts[2]
    follow = p + prompts[3][1:6]
    out = {}

    def ask(key, prompt, n):
        out[key] = run(engine, prompt, n)

    long = threading.Thread(target=ask, args=("long", p, 90))
    long.start()
    while not engine.slots_in_use():  # admitted: its prompt is in its slot
        pass
    follow_thread = threading.Thread(target=ask, args=("follow", follow, NEW))
    follow_thread.start()
    patient(lambda: len(out) == 2 or not (long.is_alive() or follow_thread.is_alive()),
            engine, "two requests")
    assert out["long"][1] == offline(model, p, 90)
    assert out["follow"][1] == offline(model, follow)
    assert out["follow"][0].cached >= len(p)


@pytest.mark.slow
def test_cache_prompt_false_and_a_cancelled_request_take_nothing(engine, model, prompts,
                                                                 run, patient):
    p = prompts[4]
    run(engine, p)
    req, out = run(engine, p, cache_prompt=False)
    assert req.cached == 0 and out == offline(model, p)

    q = prompts[5]  # a prompt no slot holds, cancelled once running
    got, started = [], threading.Event()

    def on_event(tokens, finish, error):
        got.extend(tokens)
        started.set()

    first = engine.submit(Request(prompt=list(q), max_tokens=100, on_event=on_event))
    patient(started, engine, "the request's first tokens")
    engine.cancel(first)
    while not first.finished:
        pass
    # its device row may run on after the host let it go: nothing of it is reused
    req, out = run(engine, q)
    assert req.cached == 0 and out == offline(model, q)


@pytest.mark.slow
def test_a_narrower_cache_keeps_only_what_it_holds(engine, model, prompts, run):
    p = prompts[6]
    _, long = run(engine, p, 90)  # the cache grows to the 128-slot window
    assert engine.cache_window == 128
    run(engine, prompts[7], 2)  # alone and short: the cache shrinks to 64 slots
    assert engine.cache_window == 64
    # a free slot's steps may write the last `fed` slots of the narrower cache
    assert all(len(kept) <= 64 - engine.fed for kept in engine.scheduler.kept)
    follow = p + long[:50]  # its slot held all of these tokens before the cut
    req, out = run(engine, follow, 20)
    assert req.cached == 64 - engine.fed and out == offline(model, follow, 20)


@pytest.mark.parametrize("a, b, n", [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3),
                                     ([1, 2], [1, 2, 3], 2), ([7], [1], 0),
                                     ([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], 2),
                                     (list(range(100)), list(range(99)) + [0], 99)])
def test_common_prefix_is_the_longest_shared_beginning(a, b, n):
    assert common_prefix(a, b) == common_prefix(b, a) == n


def test_an_eagle3_engine_keeps_no_prefix_cache():
    """EAGLE-3 keeps its own cache of every token's features, which a cached prefix skips."""
    e = Engine(Medusa.load(heads=shipped_heads_dir("eagle")), slots=2)
    assert not e.prefix_cache
    assert not [p for p in e.programs.keys if p.kind == "extend"]
