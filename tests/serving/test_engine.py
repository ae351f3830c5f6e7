"""The serving engine: greedy slots are token-identical to offline decoding (Medusa and
plain), whatever else shares the batch; max_tokens / stop tokens cut inside an accepted span;
sampled slots are reproducible by seed and keep plain sampling's distribution; a reused slot
never sees its previous request's tokens."""

import collections
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.decoding.acceptance import Sampling, log_probs
from medusa_jax.decoding.sampling import row_log_probs
from medusa_jax.runtime import assets
from medusa_jax.serving.engine import (
    Engine,
    QueueFull,
    Request,
    auto_plain_above,
    generate_offline,
)
from medusa_jax.serving.layout import InsertKey, PrefillKey, StepKey
from medusa_jax.serving.programs import key_data, stack_rows
from medusa_jax.serving.scheduler import Step

# the server tests use the same engine shapes: their compiled programs come from the cache
SLOTS, CONTEXT, BUCKETS, WINDOW, NEW = 4, 128, (64,), 64, 24


@pytest.fixture(scope="module")
def model(medusa_default):
    return medusa_default  # Medusa.load(heads="default"), shared by the session


@pytest.fixture(scope="module")
def prompts(model):
    return [model.encode(p) for p in assets.heldout_prompts()[:10]]


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Greedy tokens of `Medusa.generate` (test_decode checks they are plain greedy's)."""
    return [g.token_ids for g in model.generate(prompts, max_new_tokens=NEW)]


@pytest.fixture(scope="module")
def medusa_engine(model):
    e = Engine(model, slots=SLOTS, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW,
               max_queue=4096).start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def plain_engine(model):
    e = Engine(model, slots=SLOTS, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW,
               medusa=False).start()
    yield e
    e.stop()


def _submit(engine, prompt, max_tokens, **kw):
    """Submit; returns (request, tokens list, finished event, [finish reason])."""
    out, done, reason = [], threading.Event(), []

    def on_event(tokens, finish, error):
        out.extend(tokens)
        if finish is not None:
            reason.append(error or finish)
            done.set()

    req = engine.submit(Request(prompt=list(prompt), max_tokens=max_tokens, on_event=on_event,
                                **kw))
    return req, out, done, reason


@pytest.mark.slow
@pytest.mark.parametrize("which", ["medusa", "plain"])
def test_staggered_greedy_requests_match_offline_decoding(which, request, prompts, reference,
                                                          patient):
    engine = request.getfixturevalue(f"{which}_engine")
    runs = []
    for i, p in enumerate(prompts):  # more requests than slots, arriving while others run
        runs.append(_submit(engine, p, NEW))
        if i % 3 == 2:
            time.sleep(0.01)
    for (_, out, done, reason), ref in zip(runs, reference):
        patient(done, engine, "a staggered request")
        assert out == ref
        assert reason == ["stop" if ref[-1] in engine.eos else "length"]


def _cache_width(e) -> int:
    return e.state.cache.capacity


@pytest.mark.slow
def test_long_generations_cross_attention_windows_alike(medusa_engine, plain_engine, prompts,
                                                        reference):
    """90 new tokens: both engines move from the 64-slot window to the 128-slot one, the
    slots' cache resized with it; a short request alone afterwards shrinks it back."""
    assert medusa_engine.windows == plain_engine.windows == [64, 128]
    long = generate_offline(medusa_engine, prompts[:2], 90)
    assert long == generate_offline(plain_engine, prompts[:2], 90)
    assert all(len(t) == 90 for t in long)
    for e in (medusa_engine, plain_engine):
        assert len(prompts[0]) + 4 + e.fed <= 64  # a request that fits the narrow window
        assert _cache_width(e) == e.cache_window == 128 and e.metrics.resizes >= 1
        resizes = e.metrics.resizes
        assert generate_offline(e, [prompts[0]], 4) == [reference[0][:4]]
        assert _cache_width(e) == e.cache_window == 64 and e.metrics.resizes == resizes + 1


@pytest.mark.slow
def test_max_tokens_and_stop_tokens_cut_inside_accepted_spans(medusa_engine, prompts,
                                                              reference):
    ref = reference[1]
    for n in range(1, 8):
        assert generate_offline(medusa_engine, [prompts[1]], n)[0] == ref[:n]
    for j in range(1, 8):  # a stop token wherever it first appears, included
        first = ref.index(ref[j])
        out = generate_offline(medusa_engine, [prompts[1]], NEW, stop_ids=(ref[j],))[0]
        assert out == ref[:first + 1]
    assert medusa_engine.metrics.step_tokens > 1.3 * medusa_engine.metrics.slot_steps


@pytest.mark.slow
def test_cancelled_requests_free_slots_without_stale_tokens(medusa_engine, prompts, reference,
                                                            patient):
    long = [_submit(medusa_engine, p, NEW) for p in prompts[:SLOTS]]
    time.sleep(0.02)
    for req, *_ in long:
        medusa_engine.cancel(req)
    out = generate_offline(medusa_engine, prompts[4:4 + 2 * SLOTS], NEW)
    assert out == reference[4:4 + 2 * SLOTS]
    for _, _, done, reason in long:
        patient(done, medusa_engine, "a cancelled request")
        assert reason[0] in ("cancelled", "length", "stop")


def _started(out, engine, patient):
    """Wait until a request has tokens from a step call (past its prefill's first token)."""
    patient(lambda: len(out) >= 2, engine, "the request's first step tokens")


@pytest.mark.slow
def test_slots_entering_and_leaving_buckets_keep_offline_tokens(medusa_engine, plain_engine,
                                                                prompts, reference, patient):
    """Requests take the lowest free slot and a call computes the fewest leading slots that
    hold the highest one in use: as clients arrive, finish and cancel mid-stream the calls
    move across slot buckets 1, 2 and 4, and every request keeps offline decoding's tokens."""
    e = medusa_engine
    assert e.slot_buckets == [1, 2, 4]
    before = collections.Counter(e.metrics.calls_by_slots)
    a = _submit(e, prompts[0], 90)  # slot 0, alone: bucket 1
    _started(a[1], e, patient)
    b = _submit(e, prompts[1], 90)  # slot 1: bucket 2
    _started(b[1], e, patient)
    c = _submit(e, prompts[2], NEW)  # slot 2: bucket 4, and back to 2 when it ends
    d = _submit(e, prompts[3], 90)  # slot 3, cancelled mid-stream
    _started(d[1], e, patient)
    e.cancel(d[0])
    for _, _, done, _ in (a, b, c, d):
        patient(done, e, "a request across slot buckets")
    last = generate_offline(e, [prompts[4]], NEW)  # alone again: slot 0, bucket 1
    used = collections.Counter(e.metrics.calls_by_slots)
    used.subtract(before)
    assert all(used[n] > 0 for n in (1, 2, 4)), used
    *long, long_d = generate_offline(plain_engine, [prompts[0], prompts[1], prompts[3]], 90)
    assert [a[1], b[1]] == long and [t[:NEW] for t in long] == reference[:2]
    assert c[1] == reference[2] and last == [reference[4]]
    assert d[3][0] in ("cancelled", "length") and d[1] == long_d[:len(d[1])]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["medusa", "plain"])
def test_a_step_at_every_window_copies_no_cache(which, request):
    """A step attends over the whole cache the slots hold (kept at the window's length), so
    its program copies no layer's cache: a cut per call would copy the window out and back,
    and a narrower read inside the loop would copy the cache at every step."""
    e = request.getfixturevalue(f"{which}_engine")
    for window in e.windows:
        k = e.state_shapes(window).cache.k
        shape = k[0].shape if isinstance(k, tuple) else k.shape
        assert shape[-2] == window
        text = e.program(StepKey(window, e.slots)).as_text()
        f32 = "f32[" + ",".join(map(str, shape)) + "]"
        copies = [line for line in text.splitlines() if f"= {f32}" in line and " copy(" in line]
        assert copies == [], copies[:2]


@pytest.mark.slow
def test_plain_steps_under_load_keep_offline_tokens(model, medusa_engine, prompts, reference,
                                                    patient):
    """plain_above=1: one live slot gets Medusa steps, more get plain steps on the same state
    (the drafter's carry left as it was); as requests come and go the calls switch both
    ways, and every request keeps offline decoding's tokens."""
    e = Engine(model, slots=SLOTS, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW,
               plain_above=1).start()
    try:
        a = _submit(e, prompts[0], 90)  # alone: Medusa steps
        _started(a[1], e, patient)
        plain_before = e.metrics.plain_calls
        rest = [_submit(e, p, NEW) for p in prompts[1:4]]  # four live: plain steps
        for _, _, done, _ in rest + [a]:
            patient(done, e, "a request beside plain steps")
        last = generate_offline(e, [prompts[4]], NEW)  # alone again: Medusa steps
        assert plain_before == 0 < e.metrics.plain_calls < e.metrics.calls
        assert [r[1] for r in rest] == reference[1:4] and last == [reference[4]]
        assert a[1] == generate_offline(medusa_engine, [prompts[0]], 90)[0]
        assert e.metrics.step_tokens > e.metrics.slot_steps  # the Medusa steps accepted
    finally:
        e.stop()


def test_plain_above_out_of_range_is_refused_in_one_line(model):
    with pytest.raises(ValueError, match=r"plain_above must be in 0..3 \(below the slots\) on "
                                         r"a Medusa engine, got 4"):
        Engine(model, slots=4, max_context=CONTEXT, plain_above=4)
    with pytest.raises(ValueError, match="got 1 on a plain engine"):
        Engine(model, slots=4, max_context=CONTEXT, medusa=False, plain_above=1)
    with pytest.raises(ValueError, match=r"plain_above must be a slot count, \"auto\" or "
                                         r"None, got 'sometimes'"):
        Engine(model, slots=4, max_context=CONTEXT, plain_above="sometimes")


def test_auto_plain_above_is_plain_steps_above_four_live_slots_on_cpu(model):
    """plain_above="auto" (the server's default): on CPU a Medusa engine of more than 4 slots
    takes plain steps above 4 live slots; with 4 slots or fewer, on another backend, on a
    plain engine or with a drafter that keeps its own cache (EAGLE-3), always Medusa."""
    from medusa_jax.api import Medusa

    assert jax.default_backend() == "cpu"
    auto = dict(max_context=CONTEXT, plain_above="auto")
    assert Engine(model, slots=8, **auto).plain_above == 4
    assert Engine(model, slots=4, **auto).plain_above is None
    assert Engine(model, slots=8, medusa=False, **auto).plain_above is None
    drafter = Engine(model, slots=8, max_context=CONTEXT).drafter
    assert auto_plain_above(drafter, 8, "cpu") == 4
    assert auto_plain_above(drafter, 8, "gpu") is None
    assert auto_plain_above(drafter, 8, "tpu") is None
    assert auto_plain_above(None, 8, "cpu") is None
    assert Engine(Medusa.load(heads="eagle"), slots=8, **auto).plain_above is None


def test_slot_buckets_out_of_range_are_refused_in_one_line(model):
    with pytest.raises(ValueError,
                       match=r"slot buckets must be in 1..4 \(the slots\), got \[0, 2\]"):
        Engine(model, slots=4, max_context=CONTEXT, slot_buckets=(0, 2))
    with pytest.raises(ValueError, match=r"got \[8\]"):
        Engine(model, slots=4, max_context=CONTEXT, slot_buckets=(8,))


def _burst(engine, prompts, max_tokens, patient, **kw):
    """Submit every prompt before the engine thread looks (it waits on the lock we hold), so
    they are admitted together; each one's tokens. max_tokens: one for all, or a list."""
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    with engine.scheduler.lock:
        runs = [_submit(engine, p, n, **kw) for p, n in zip(prompts, limits)]
    for _, _, done, _ in runs:
        patient(done, engine, "a request of a burst")
    return [out for _, out, _, _ in runs]


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(medusa_engine, prompts, patient):
    kw = dict(temperature=0.9, top_k=20, seed=1234)
    a = generate_offline(medusa_engine, [prompts[0]], NEW, **kw)[0]
    # the same request again, sharing its batch with others (started after its cached
    # prompt), then prefilled beside them
    b = generate_offline(medusa_engine, [prompts[2], prompts[0], prompts[3]], NEW, **kw)[1]
    before = medusa_engine.metrics.prefills_by_batch[SLOTS]
    burst = _burst(medusa_engine, [prompts[2], prompts[0], prompts[3], prompts[5]], NEW,
                   patient, cache_prompt=False, **kw)
    assert medusa_engine.metrics.prefills_by_batch[SLOTS] == before + 1
    c = generate_offline(medusa_engine, [prompts[0]], NEW, **dict(kw, seed=99))[0]
    assert a == b == burst[1] and a != c


@pytest.mark.slow
@pytest.mark.parametrize("which", ["medusa", "plain"])
def test_a_burst_is_prefilled_together_and_keeps_offline_tokens(which, request, prompts,
                                                                reference, patient):
    """More waiting requests than slots, of different lengths: the free slots' requests are
    prefilled in one call (a batch of SLOTS), the rest in batches as slots free up, and every
    request keeps offline decoding's tokens."""
    e = request.getfixturevalue(f"{which}_engine")
    assert e.prefill_batches == [1, 2, 4] == [1, 2, SLOTS]
    before = collections.Counter(e.metrics.prefills_by_batch)
    calls = e.metrics.prefill_calls
    n = 2 * SLOTS + 1
    assert len({len(p) for p in prompts[:n]}) > 3
    assert _burst(e, prompts[:n], NEW, patient, cache_prompt=False) == reference[:n]
    used = collections.Counter(e.metrics.prefills_by_batch)
    used.subtract(before)
    assert used[SLOTS] >= 1 and sum(k * v for k, v in used.items()) == n, used
    assert e.metrics.prefill_calls - calls < n


@pytest.mark.slow
@pytest.mark.parametrize("which", ["medusa", "plain"])
def test_short_calls_while_slots_are_free_keep_offline_tokens(which, request, model, prompts,
                                                              reference, patient):
    """With a slot free or a request waiting, a call runs as few steps as fit
    `short_call_ms` (here: one); with every slot busy and nobody waiting, all K. The same
    compiled programs serve both, and the tokens stay offline decoding's."""
    e = request.getfixturevalue(f"{which}_engine")
    assert e.k == 4
    before = collections.Counter(e.metrics.calls_by_steps)
    compiled = e.status()["compiled"]
    e.short_call_ms = 1e-9  # shorter than any step: one step a call while a slot is free
    long = 3 * NEW  # every slot busy at first, then one alone
    try:
        out = _burst(e, prompts[:SLOTS], [NEW] * (SLOTS - 1) + [long], patient)
    finally:
        e.short_call_ms = None
    assert out[:-1] == reference[:SLOTS - 1]
    assert out[-1] == model.generate([prompts[SLOTS - 1]], max_new_tokens=long)[0].token_ids
    used = collections.Counter(e.metrics.calls_by_steps)
    used.subtract(before)
    assert used[1] > 0 and used[e.k] > 0 and set(+used) <= {1, e.k}, used
    assert e.status()["compiled"] == compiled


@pytest.mark.slow
@pytest.mark.parametrize("which", ["medusa", "plain"])
def test_calls_read_one_at_a_time_keep_offline_tokens(which, request, prompts, reference,
                                                      patient):
    """With every call counted long (each read before the next is dispatched), staggered
    requests still get offline decoding's tokens."""
    e = request.getfixturevalue(f"{which}_engine")
    old = e.overlap_ms
    e.overlap_ms = 1e-9
    try:
        assert _burst(e, prompts[:SLOTS + 1], NEW, patient) == reference[:SLOTS + 1]
        assert any(e.scheduler.long(Step(StepKey(e.windows[0], r), 1, [], False))
                   for r in e.slot_buckets)
    finally:
        e.overlap_ms = old


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["decoding", "standard"])
def test_insert_puts_each_row_of_a_batched_prefill_as_its_own_prefill(model, prompts, layout):
    """Row j of a prefill over several prompts, inserted into a slot, gives that slot what a
    prefill of prompt j alone gives it (caches, first token, drafter carry), in both cache
    layouts (the decoding layout's per-layer buffers, the stacked one of meshes)."""
    from medusa_jax.decoding.step import batch_axis
    from medusa_jax.model.backbone import standard_layout
    from medusa_jax.serving import programs

    e = Engine(model, slots=3, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW)
    cfg, tree, drafter = model.cfg, e.tree, e.drafter
    params = model.params if layout == "decoding" else standard_layout(cfg, model.params)
    heads = drafter.prepare(model.heads, tree, cpu_kernels=False)
    pre = jax.jit(functools.partial(programs.prefill, cfg=cfg, drafter=drafter, tree=tree,
                                    capacity=CONTEXT))
    ins = jax.jit(functools.partial(programs.insert, axis=batch_axis(drafter)))
    ps = prompts[:3]
    rows = [e.sampling_rows(0.9 if j == 1 else 0.0, 0, 1.0, NEW, tuple(e.eos)) for j in range(3)]
    keys = [key_data(7 + j) for j in range(3)]

    def prefilled(js):
        tokens = np.zeros((len(js), 64), np.int32)
        for i, j in enumerate(js):
            tokens[i, :len(ps[j])] = ps[j]
        return pre(params, heads, tokens, np.array([len(ps[j]) for j in js], np.int32),
                   np.concatenate([keys[j] for j in js]), stack_rows([rows[j] for j in js]))

    row1 = e.sampling_rows()
    draft = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                         prefilled([0]).draft)
    axis = batch_axis(drafter)
    draft = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape[:axis] + (3,) + x.shape[axis + 1:], x.dtype), draft)
    empty = lambda: programs.init_state(cfg, params, 3, CONTEXT, e.width, row1, draft)  # noqa: E731
    together, alone = empty(), empty()
    batch = prefilled([0, 1, 2])
    for slot, j in ((2, 0), (0, 1), (1, 2)):  # rows into other slots, out of order
        together = ins(together, batch, np.int32(slot), np.int32(j))
        alone = ins(alone, prefilled([j]), np.int32(slot), np.int32(0))
    assert np.asarray(together.root).tolist() == np.asarray(alone.root).tolist()
    assert np.asarray(together.cache.lengths).tolist() == [len(ps[1]), len(ps[2]), len(ps[0])]
    for a, b in zip(jax.tree.leaves(together), jax.tree.leaves(alone)):
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        else:
            assert np.array_equal(np.asarray(jax.random.key_data(a) if
                                             jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                                             else a),
                                  np.asarray(jax.random.key_data(b) if
                                             jnp.issubdtype(b.dtype, jax.dtypes.prng_key)
                                             else b))


@pytest.mark.slow
def test_sampled_rows_keep_plain_sampling_distribution(model, medusa_engine, prompts,
                                                       reference, exact_pairs, chi_square_ok,
                                                       patient):
    """Two per-row samplings interleaved with greedy rows in the same batches: each sampled
    configuration's (x1, x2) follows plain sampling (x2 comes out of the tree's rejection
    sampling), and the greedy rows stay identical."""
    configs = [dict(temperature=1.0, top_k=4), dict(temperature=0.8, top_p=0.7)]
    n = 400
    prompt = prompts[0]
    runs = []
    for i in range(n):
        for c in configs:
            runs.append((c, _submit(medusa_engine, prompt, 3, seed=10_000 + i, **c)))
        if i % 50 == 0:
            runs.append((None, _submit(medusa_engine, prompts[1], NEW)))
    v = model.cfg.vocab_size
    counts = {i: np.zeros((v, v)) for i in range(len(configs))}
    for c, (_, out, done, _) in runs:
        patient(done, medusa_engine, "a sampled request")
        if c is None:
            assert out == reference[1]
        else:
            counts[configs.index(c)][out[0], out[1]] += 1
    for i, c in enumerate(configs):
        exact = exact_pairs(model, prompt, Sampling(mode="rejection", **c))
        ok, ratio = chi_square_ok(counts[i].ravel(), exact.ravel())
        assert ok, f"{c}: not plain sampling's distribution (chi2/critical = {ratio:.2f})"


def test_row_log_probs_match_the_static_rule():
    logits = np.random.default_rng(0).normal(size=(5, 3, 50)).astype(np.float32) * 3
    cases = [Sampling("rejection", 1.0), Sampling("rejection", 0.7, top_k=5),
             Sampling("rejection", 1.3, top_p=0.6), Sampling("rejection", 0.5, 7, 0.8),
             Sampling("rejection", 2.0, 1, 1.0)]
    t = np.array([c.temperature for c in cases], np.float32)
    k = np.array([c.top_k for c in cases], np.int32)
    p = np.array([c.top_p for c in cases], np.float32)
    got = np.asarray(jax.jit(row_log_probs)(jnp.asarray(logits), t, k, p))
    for i, c in enumerate(cases):
        want = np.asarray(log_probs(jnp.asarray(logits[i]), c))
        np.testing.assert_allclose(np.exp(got[i]), np.exp(want), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["admission", "tokens"])
def test_a_request_that_raises_in_the_engine_fails_alone(medusa_engine, prompts, reference,
                                                         where, patient):
    """An exception attributable to one request (its row at admission, or the bookkeeping
    of its tokens after a step) ends that request with an error; the requests batched
    beside it and later ones get their offline tokens, and the engine runs on. The failing
    request is changed after `submit` checked it, as a caller could (the engine thread
    reads it later)."""
    e = medusa_engine
    bad_out, bad_done, bad_reason = [], threading.Event(), []

    def on_event(tokens, finish, error):
        bad_out.extend(tokens)
        if where == "tokens" and len(bad_out) >= 3:
            bad.stop_ids = ([0],)  # unhashable: its next hand-out raises
        if finish is not None:
            bad_reason.append(error or finish)
            bad_done.set()

    bad = Request(prompt=list(prompts[1]), max_tokens=NEW, on_event=on_event)
    with e.scheduler.lock:  # admitted together, in one prefill
        subs = [_submit(e, p, NEW) for p in (prompts[0], prompts[2], prompts[3])]
        e.submit(bad)
        if where == "admission":
            bad.top_k, bad.temperature = 2**31, 0.7  # an int32 row cannot hold it
    patient(bad_done, e, "the failing request")
    assert "the engine could not run this request" in bad_reason[0]
    assert "\n" not in bad_reason[0]
    for (_, out, done, reason), ref in zip(subs, (reference[0], reference[2], reference[3])):
        patient(done, e, "a request beside the failing one")
        assert reason == ["length"] and out == ref
    assert e.stop_reason is None
    assert generate_offline(e, prompts[4:8], NEW) == reference[4:8]
    assert e.slots_in_use() == 0


def test_limits_are_checked_before_queueing(model):
    e = Engine(model, slots=2, max_context=CONTEXT, max_queue=1)  # not started: nothing runs
    with pytest.raises(ValueError, match="exceeds the context of 128"):
        e.check(60, 70)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        e.check(5, 0)
    reqs = [Request(prompt=[1, 2], max_tokens=4, on_event=lambda *a: None) for _ in range(4)]
    for r in reqs[:3]:  # two free slots + a queue of one
        e.submit(r)
    with pytest.raises(QueueFull, match="queue is full"):
        e.submit(reqs[3])


@pytest.mark.parametrize("kw, message", [
    (dict(top_k=2**31), r"^top_k must be an integer in 0\.\.2147483647 \(0: off\), "
                        r"got 2147483648$"),
    (dict(top_k=3.0), r"^top_k must be an integer in 0\.\.2147483647 \(0: off\), got 3\.0$"),
    (dict(max_tokens=2.5), r"^max_tokens must be an integer in 1\.\.2147483647, got 2\.5$"),
    (dict(max_tokens=True), r"^max_tokens must be an integer in 1\.\.2147483647, got True$"),
    (dict(max_tokens=2**31), r"^max_tokens must be an integer in 1\.\.2147483647"),
    (dict(temperature="0.7"), r"^temperature must be a number, got '0\.7'$"),
    (dict(temperature=float("nan")), r"^temperature must be a finite number >= 0 \(0: greedy\), "
                                     r"got nan$"),
    (dict(temperature=-1.0), r"^temperature must be a finite number >= 0"),
    (dict(temperature=0.7, top_p="1"), r"^top_p must be a number, got '1'$"),
    (dict(seed=2**64), r"^seed must be a 64-bit integer or None, got 18446744073709551616$"),
    (dict(seed=1.5), r"^seed must be a 64-bit integer or None, got 1\.5$"),
    (dict(stop_ids=(2**40,)), r"^stop_ids\[0\] = 1099511627776 is not a token id of this "
                              r"model \(0\.\.\d+\)$"),
    (dict(prompt=[1, 2**31]), r"^prompt\[1\] = 2147483648 is not a token id of this model"),
    (dict(prompt=[1, -1]), r"^prompt\[1\] = -1 is not a token id of this model"),
    (dict(prompt=[1, 2.0]), r"^prompt\[1\] = 2\.0 is not a token id of this model"),
    (dict(prompt=(1, 2)), r"^prompt must be a list of token ids, got tuple$"),
])
def test_what_the_engine_cannot_hold_is_refused_before_queueing(model, kw, message):
    """`Engine.submit` (any caller, not only the server): a value its int32 / float32 rows
    would wrap or truncate, or a token id outside the vocabulary, in one line naming it."""
    e = Engine(model, slots=2, max_context=CONTEXT)  # not started: nothing runs
    req = Request(**dict(dict(prompt=[1, 2], max_tokens=4, on_event=lambda *a: None), **kw))
    with pytest.raises(ValueError, match=message):
        e.submit(req)
    assert e.queue_depth() == 0


def test_unknown_acceptance_is_refused_in_one_line(model):
    with pytest.raises(ValueError, match="acceptance must be one of rejection, typical"):
        Engine(model, slots=2, max_context=CONTEXT, acceptance="beam")


def test_max_context_past_the_model_is_refused(model):
    with pytest.raises(ValueError, match="longer than the model's context"):
        Engine(model, slots=2, max_context=model.cfg.max_position_embeddings + 1)


@pytest.mark.slow
@pytest.mark.parametrize("warmup", ["background", "lazy"])
def test_warmups_serve_offline_tokens_and_compile_each_program_once(model, prompts, reference,
                                                                    warmup, patient):
    """A request sent at once waits for the programs it needs; once compiled, serving any
    prompt or length traces nothing again (static shapes, one compile per program)."""
    from jax._src import monitoring

    e = Engine(model, slots=SLOTS, max_context=CONTEXT, buckets=(16, 64),
               window_block=WINDOW, max_queue=64)
    assert e.programs.keys[:3] == e.first_programs() == [
        PrefillKey(16, 1), InsertKey(16, 1, 64), StepKey(64, 1)]
    e.start(warmup)
    try:
        if warmup == "lazy":
            patient(e.programs.ready, e, "the lazy warm-up's decode state")
            assert e.status()["compiled"] == 0
        assert generate_offline(e, prompts, NEW) == reference
        if warmup == "background":
            patient(e.programs.all_compiled, e, "the background warm-up")
        else:
            e.compile()  # the rest, now
        # prefill for 2 buckets x 3 prefill batches (1, 2, 4), insert for those at
        # 2 windows, a step for 2 windows x 3 slot buckets (1, 2, 4), a resize each way,
        # and the prefix cache's move, extend (buckets 1, 4, 16) at each window
        assert e.status()["compiled"] == e.status()["programs"] == len(e.programs.keys) == 34
        traced = []
        listener = lambda event, *a, **k: traced.append(event) \
            if "compile" in event else None  # noqa: E731
        monitoring.register_event_duration_secs_listener(listener)
        try:
            assert generate_offline(e, prompts, NEW) == reference
            generate_offline(e, prompts[:2], 90)  # the wider window, longer prompts
        finally:
            monitoring.unregister_event_duration_listener(listener)
        assert traced == []
    finally:
        e.stop()
