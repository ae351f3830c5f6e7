"""One step, two drivers: the serving engine runs `decoding.step`, the offline decoders'
step, so its slots decode exactly as `generate` / `medusa_generate` do, for every drafter
(Medusa and Hydra heads), every acceptance mode and dynamic trees; the engine has no step
of its own and neither layer branches on a drafter's kind."""

import pathlib
import re
import time

import jax
import numpy as np
import pytest

import medusa_jax
from medusa_jax.decoding import decode, sampling
from medusa_jax.decoding.sampling import Sampling
from medusa_jax.runtime import assets
from medusa_jax.serving import engine as engine_mod
from medusa_jax.serving.engine import Engine, generate_offline

CONTEXT, BUCKETS, WINDOW, NEW = 128, (64,), 64, 24
# these tests check what a drafter and an acceptance rule do in slots, not the engine's
# buckets (test_engine.py): one slot count, one prefill batch, programs compiled as needed
FEW_PROGRAMS = dict(prefill_batch=1, prefix_cache=False)


@pytest.fixture(scope="module")
def medusa():
    from medusa_jax.api import Medusa

    return Medusa.load(heads="default")


@pytest.fixture(scope="module")
def hydra():
    from medusa_jax.api import Medusa

    return Medusa.load(heads="hydra")


def _prompts(model, n=7):
    """Prompts of different lengths (a few tokens of each held-out prompt, cut unevenly)."""
    ids = [model.encode(p) for p in assets.heldout_prompts()[:n]]
    return [p[:max(1, len(p) - 3 * i)] for i, p in enumerate(ids)]


def _plain_greedy(model, prompts, n):
    out = []
    for p in prompts:
        tokens, lengths = decode.pad_prompts([p])
        o = decode.generate(model.params, model.cfg, tokens, lengths, jax.random.key(0),
                            max_new_tokens=n, eos=tuple(model.eos))
        out.append(np.asarray(o.tokens[0, :int(o.num_new[0])]).tolist())
    return out


def _staggered(engine, prompts, n, patient, **kw):
    """Submit while others run (more requests than slots); each request's tokens."""
    import threading

    results, events = [[] for _ in prompts], []
    for i, p in enumerate(prompts):
        done = threading.Event()

        def on_event(tokens, finish, error, i=i, done=done):
            results[i].extend(tokens)
            if finish is not None:
                done.set()

        engine.submit(engine_mod.Request(prompt=list(p), max_tokens=n, on_event=on_event,
                                         **kw))
        events.append(done)
        if i % 2:
            time.sleep(0.01)
    for e in events:
        patient(e, engine, "a staggered request")
    return results


@pytest.mark.slow
@pytest.mark.parametrize("heads", ["hydra"])
def test_greedy_slots_equal_offline_greedy_for_every_drafter(heads, request, patient):
    """3 slots, 7 prompts of different lengths arriving while others decode: each
    request's tokens are offline `medusa_generate`'s (via `Medusa.generate`), which are
    plain greedy decoding's. Medusa heads: tests/serving/test_engine.py's staggered
    requests; EAGLE-3: tests/drafters/test_eagle3_decoding.py; n-gram:
    tests/serving/test_engine_ngram.py."""
    model = request.getfixturevalue(heads)
    prompts = _prompts(model)
    assert len({len(p) for p in prompts}) > 3
    offline = [g.token_ids for g in model.generate(prompts, max_new_tokens=NEW)]
    assert offline == _plain_greedy(model, prompts, NEW)
    e = Engine(model, slots=3, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW,
               max_queue=64, slot_buckets=(3,), **FEW_PROGRAMS).start("lazy")
    try:
        assert type(e.drafter).kind == heads
        assert _staggered(e, prompts, NEW, patient) == offline
        assert e.metrics.step_tokens > 1.3 * e.metrics.slot_steps  # the drafts were accepted
    finally:
        e.stop()


@pytest.mark.slow
def test_dynamic_tree_slots_equal_offline_greedy(medusa):
    prompts = _prompts(medusa, 4)
    e = Engine(medusa, slots=2, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW,
               tree="dynamic:8", slot_buckets=(2,), **FEW_PROGRAMS).start("lazy")
    try:
        assert generate_offline(e, prompts, NEW) == _plain_greedy(medusa, prompts, NEW)
    finally:
        e.stop()


@pytest.mark.slow
def test_typical_acceptance_slots_equal_offline_typical(medusa, patient):
    """Typical acceptance draws nothing (its roots are greedy), so a typical slot's tokens
    are offline `medusa_generate(sampling=Sampling("typical", ...))`'s whatever the keys,
    and greedy slots sharing its batches stay greedy."""
    prompts = _prompts(medusa, 4)
    tree = medusa.tree(None)
    s = Sampling("typical", temperature=0.7)
    offline = []
    for p in prompts:
        tokens, lengths = decode.pad_prompts([p])
        o = decode.medusa_generate(medusa.params, medusa.heads, medusa.cfg, tokens, lengths,
                                   jax.random.key(1), tree=tree, sampling=s,
                                   max_new_tokens=NEW, eos=tuple(medusa.eos))
        offline.append(np.asarray(o.tokens[0, :int(o.num_new[0])]).tolist())
    greedy = _plain_greedy(medusa, prompts, NEW)
    e = Engine(medusa, slots=3, max_context=CONTEXT, buckets=BUCKETS, window_block=WINDOW,
               acceptance="typical", slot_buckets=(3,), **FEW_PROGRAMS).start("lazy")
    try:
        both = generate_offline(e, prompts + prompts, NEW)  # all greedy first
        assert both == greedy + greedy
        typ = _staggered(e, prompts, NEW, patient, temperature=0.7, seed=5)
        assert typ == offline
        assert typ != greedy  # typical acceptance really ran (it is lossy)
        # each request's own thresholds: at epsilon 1 no drafted token passes (p > 1 is
        # impossible) and the greedy roots alone are emitted; at 0 every drafted token does
        strict = _staggered(e, prompts, NEW, patient, temperature=0.7, seed=5, epsilon=1.0,
                            delta=1e9)
        assert strict == greedy
        loose = _staggered(e, prompts, NEW, patient, temperature=0.7, seed=5, epsilon=0.0,
                           delta=0.0)
        assert loose != typ and loose != greedy
    finally:
        e.stop()


def test_typical_thresholds_are_refused_where_typical_acceptance_does_not_run(medusa):
    e = Engine(medusa, slots=2, max_context=CONTEXT)  # rejection; not started: nothing runs
    req = engine_mod.Request(prompt=[1, 2], max_tokens=4, on_event=lambda *a: None,
                             temperature=0.7, epsilon=0.2)
    with pytest.raises(ValueError, match=r"^typical_epsilon applies to typical acceptance "
                                         r"\(infer.serve --acceptance typical\); this server "
                                         r"runs rejection acceptance$"):
        e.submit(req)
    typical = Engine(medusa, slots=2, max_context=CONTEXT, acceptance="typical")
    req = engine_mod.Request(prompt=[1, 2], max_tokens=4, on_event=lambda *a: None,
                             temperature=0.7, delta=-1.0)
    with pytest.raises(ValueError, match=r"^delta must be a finite number >= 0, got -1.0$"):
        typical.submit(req)


def test_sampling_check_names_the_field_in_one_line():
    cases = [(dict(mode="beam"), "mode 'beam' is not one of greedy, typical, rejection"),
             (dict(mode="rejection", temperature=0.0), "temperature must be > 0"),
             (dict(top_k=-1), "top_k must be an integer in 0..2147483647 (0: off)"),
             (dict(top_p=0.0), "top_p must be in (0, 1]"),
             (dict(epsilon=-0.1), "epsilon must be a finite number >= 0"),
             (dict(delta=-1.0), "delta must be a finite number >= 0")]
    for kw, msg in cases:
        with pytest.raises(ValueError) as err:
            sampling.check(**kw)
        assert str(err.value).startswith(msg) and "\n" not in str(err.value)
        with pytest.raises(ValueError, match=msg.split(" ")[0]):
            Sampling(**kw)
    sampling.check("typical", 0.7, 5, 0.9)  # in range: no error


def test_the_engine_has_no_decoder_and_no_layer_branches_on_a_drafter_kind():
    for name in ("medusa_step", "plain_step", "row_log_probs", "pick_rows", "_split_rows",
                 "RowParams", "_emit"):
        assert not hasattr(engine_mod, name), name
    root = pathlib.Path(medusa_jax.__file__).parent
    for folder in ("decoding", "serving"):
        for f in (root / folder).glob("*.py"):
            # the registry names the kinds ("...drafters.hydra.drafter:HydraDrafter")
            assert not re.search(r"is_hydra|hydra\.(?!drafter:)", f.read_text()), f


@pytest.mark.slow
def test_greedy_offline_programs_hold_no_sampling(medusa):
    """Offline rows that all decode greedily compile without the filters of sampling (no
    sort) and without per-step PRNG work; a sampled decode has them."""
    tokens, lengths = decode.pad_prompts([medusa.encode("Lily")])
    args = (medusa.params, medusa.cfg, tokens, lengths, jax.random.key(0))
    tree = medusa.tree(None)

    def hlo(sampling_, fn="generate"):
        if fn == "generate":
            low = decode.generate.lower(*args, sampling=sampling_, max_new_tokens=8)
        else:
            low = decode.medusa_generate.lower(args[0], medusa.heads, *args[1:], tree=tree,
                                               sampling=sampling_, max_new_tokens=8)
        return low.as_text()

    sampled = Sampling("rejection", temperature=0.8, top_p=0.9)
    for fn in ("generate", "medusa_generate"):
        greedy, drawn = hlo(Sampling(), fn), hlo(sampled, fn)
        assert "stablehlo.sort" not in greedy and "stablehlo.sort" in drawn
        assert greedy.count("threefry") < drawn.count("threefry")


def test_serve_takes_the_acceptance_setting():
    from infer.serve import build_parser, engine_config

    assert engine_config(build_parser().parse_args([])).acceptance == "rejection"
    typical = build_parser().parse_args(["--acceptance", "typical"])
    assert engine_config(typical).acceptance == "typical"
