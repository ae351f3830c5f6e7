"""The serving scheduler on its own (no model, no JAX, no compile): a layout small enough to
work out by hand and a fake of `Programs` that says which keys are compiled. Each test
plans, books what the device would have answered, and checks the typed actions."""

import subprocess
import sys

import pytest

from medusa_jax.serving.config import EngineConfig
from medusa_jax.serving.layout import (
    ExtendKey,
    InsertKey,
    Layout,
    MoveKey,
    PrefillKey,
    ResizeKey,
    StepKey,
)
from medusa_jax.serving.scheduler import (
    Cancel,
    Extend,
    Handout,
    Insert,
    Move,
    Prefill,
    QueueFull,
    Request,
    Resize,
    Scheduler,
    Step,
)


class FakePrograms:
    """`Programs` as the scheduler sees it: every key compiled, or those in `only`."""

    def __init__(self, only=None, lazy=False):
        self.only, self.lazy = only, lazy

    def compiled(self, key) -> bool:
        return self.only is None or key in self.only


def layout(**options) -> Layout:
    """4 slots, K=4, a plain-sized step (width 1, fed 1) unless given; context 128 in
    windows of 64; prompt buckets 16 and 64 (extend buckets 1, 4, 16)."""
    facts = dict(model_context=128, width=1, fed=1, eos=(2,), keeps_context=None,
                 min_bucket=16, backend="cpu", drafter_kind="")
    for name in list(facts):
        if name in options:
            facts[name] = options.pop(name)
    config = EngineConfig(**{**dict(slots=4, max_context=128, window_block=64,
                                    buckets=(16, 64)), **options})
    return Layout.build(config, **facts)


def scheduler(programs=None, **options) -> Scheduler:
    short, overlap = options.pop("short_call_ms", None), options.pop("overlap_ms", None)
    return Scheduler(layout(**options), programs or FakePrograms(), max_queue=8,
                     short_call_ms=short, overlap_ms=overlap)


def req(n: int, max_tokens: int = 8, start: int = 10, **kw) -> Request:
    return Request(prompt=list(range(start, start + n)), max_tokens=max_tokens,
                   on_event=lambda *a: None, **kw)


def admit_all(s: Scheduler) -> list:
    out = []
    while actions := s.admit():
        out += actions
    return out


def test_the_scheduler_imports_no_jax():
    code = ("import sys, medusa_jax.serving.scheduler, medusa_jax.serving.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_the_layout_and_its_programs_by_hand():
    lay = layout()
    assert lay.windows == [64, 128] and lay.buckets == [16, 64]
    assert lay.extend_buckets == [1, 4, 16] and lay.slot_buckets == [1, 2, 4]
    assert lay.prefill_batches == [1, 2, 4] and lay.prefix_cache
    assert lay.first_programs() == [PrefillKey(16, 1), InsertKey(16, 1, 64), StepKey(64, 1)]
    keys = lay.programs()
    assert keys[:3] == lay.first_programs() and len(keys) == len(set(keys))
    # prefill 2 buckets x 3 batches, inserts (16: 2 windows, 64: 2 windows) x 3, steps 2 x 3,
    # resizes 2, moves 2, extends (1, 4, 16 below 64; and below 128)
    assert len(keys) == 6 + 12 + 6 + 2 + 2 + 6
    assert PrefillKey(16, 2) != ExtendKey(16, 2)  # keys of two programs never compare equal


def test_one_request_prefills_inserts_and_steps():
    s = scheduler()
    r = req(10)
    s.enqueue(r)
    actions = admit_all(s)
    assert actions == [Prefill([r], PrefillKey(16, 1)), Insert(r, 0, 0, InsertKey(16, 1, 64))]
    assert s.holder(0) is r and s.live() == 1
    plan = s.plan_step(behind_prefill=True)
    assert plan == [Step(StepKey(64, 1), 4, [r, None, None, None], True)]
    # the device answers: 4 steps, the first token again (skipped) and three more
    out = s.after_step(plan[0], counts=[4], steps=[4], lengths=[14], done=1.0)
    assert out == [Handout(0, r, 1, 4)]
    assert s.slots[0].known_len == 14 and s.slots[0].unread == 0


def test_a_burst_is_prefilled_in_the_largest_batch_that_fits():
    s = scheduler()
    rs = [req(n, start=100 * i) for i, n in enumerate((5, 12, 40, 7, 9))]
    for r in rs:
        s.enqueue(r)
    first = s.admit()
    # the head's bucket is 16: the 40-token prompt waits; a batch of 2 (of the 3 that fit
    # and of the powers of two) goes first
    assert first[0] == Prefill(rs[:2], PrefillKey(16, 2))
    # then the 40-token prompt's bucket, 64, and the one behind it that fits there
    second = s.admit()
    assert second[0] == Prefill(rs[2:4], PrefillKey(64, 2))
    assert second[1:] == [Insert(rs[2], 2, 0, InsertKey(64, 2, 64)),
                          Insert(rs[3], 3, 1, InsertKey(64, 2, 64))]  # no resize: 64 holds 64
    assert s.admit() == [] and list(s.waiting) == [rs[4]]  # every slot taken


def test_the_queue_bound_counts_free_slots():
    s = scheduler()
    for i in range(8 + 4):
        s.enqueue(req(3, start=i))
    with pytest.raises(QueueFull, match=r"the request queue is full \(8 waiting\)"):
        s.enqueue(req(3))


def test_a_cancelled_waiting_request_is_finished_without_running():
    s = scheduler()
    a, b = req(3), req(4, start=50)
    s.enqueue(a), s.enqueue(b)
    a.cancelled = True
    actions = s.admit()
    assert actions[0] == Cancel(a) and actions[1] == Prefill([b], PrefillKey(16, 1))


def test_a_cancelled_running_request_frees_its_slot_and_keeps_nothing():
    s = scheduler()
    r = req(10)
    s.enqueue(r)
    admit_all(s)
    r.cancelled = True
    assert s.cancelled_running() == [r] and s.live() == 0 and s.kept[0] == []


def test_long_requests_grow_the_cache_and_a_short_one_alone_shrinks_it():
    s = scheduler()
    r = req(10, max_tokens=100)
    s.enqueue(r)
    admit_all(s)
    # 10 + 3 steps of 1 token + fed 1 fit 64 slots: no resize yet
    assert s.plan_step(False)[0].key == StepKey(64, 1)
    for _ in range(14):
        s.after_step(Step(StepKey(64, 1), 4, [r], False), [4], [4], [s.slots[0].known_len + 4],
                     done=0.0)
        plan = s.plan_step(False)
        if isinstance(plan[0], Resize):
            break
    assert plan[0] == Resize(ResizeKey(64, 128)) and plan[1].key == StepKey(128, 1)
    assert s.window == 128
    s.free(0)
    short = req(5, max_tokens=4, start=500)
    s.enqueue(short)
    admit_all(s)
    plan = s.plan_step(False)
    assert plan[0] == Resize(ResizeKey(128, 64)) and s.window == 64
    assert all(len(k) <= 64 - 1 for k in s.kept)  # a narrower cache keeps less


def test_a_repeated_prompt_is_extended_after_its_cached_prefix():
    s = scheduler()
    r = req(30)
    s.enqueue(r)
    admit_all(s)
    r.tokens = [7, 8]
    s.free(0)  # finished: its slot keeps the prompt and the first token
    assert s.kept[0] == r.prompt + [7]
    again = req(30)
    s.enqueue(again)
    actions = admit_all(s)
    # 29 tokens from slot 0 (the last prompt token is fed), the rest in a 1-token bucket,
    # into the lowest free slot, which is the source: nothing to move
    assert actions == [Extend(again, 0, 0, 29, ExtendKey(1, 64), 0, None)]
    assert again.cached == 29 and s.kept[0] == []


def test_a_slot_taken_by_another_request_moves_its_cache_to_a_spare_slot():
    s = scheduler()
    r = req(30)
    s.enqueue(r)
    admit_all(s)
    s.free(0)
    other = req(20, start=900)  # shares nothing: a prefill, into slot 0
    s.enqueue(other)
    actions = admit_all(s)
    assert actions[0] == Prefill([other], PrefillKey(16, 1)) or \
        actions[0].key.bucket == 64
    assert Move(0, 1, MoveKey(64)) in actions  # slot 0's cache kept in slot 1
    assert s.kept[1] == r.prompt and s.kept[0] == []


def test_prefix_cache_programs_are_used_only_once_compiled():
    compiled = set(layout().programs()) - {ExtendKey(1, 64)}
    s = scheduler(FakePrograms(compiled))
    r = req(30)
    s.enqueue(r)
    admit_all(s)
    r.tokens = [7]
    s.free(0)
    assert s.prefix_hit(req(30)) is None
    s.programs.lazy = True  # under the lazy warm-up: compiled when first needed
    assert s.prefix_hit(req(30)) == (0, 29, 1, 64)


def test_plain_steps_above_the_threshold():
    s = scheduler(width=3, fed=4, keeps_context=False, plain_above=1)
    a, b = req(5), req(6, start=40)
    s.enqueue(a)
    admit_all(s)
    assert s.plan_step(False)[-1].key == StepKey(64, 1)
    s.enqueue(b)
    admit_all(s)
    assert s.plan_step(False)[-1].key == StepKey(64, 2, plain=True)


def test_a_step_program_not_compiled_yet_gives_way_to_one_that_is():
    s = scheduler(FakePrograms({StepKey(64, 4)}))
    s.enqueue(req(5))
    admit_all(s)
    assert s.plan_step(False)[-1].key == StepKey(64, 4)
    s = scheduler(FakePrograms(set()))  # none compiled: the one to compile now
    s.enqueue(req(5))
    admit_all(s)
    assert s.plan_step(False)[-1].key == StepKey(64, 1)


def test_a_step_time_sets_the_steps_of_a_call():
    s = scheduler(steps_per_call=8, short_call_ms=20.0)
    assert s.call_steps(False, 1) == 1  # not measured yet: one step
    s.timed(Step(StepKey(64, 1), 2, [], False), 0.012)  # 2 steps in 12 ms
    assert s.step_ms[(False, 1)] == pytest.approx(6.0)
    assert s.call_steps(False, 1) == 3
    s.timed(Step(StepKey(64, 1), 8, [], True), 1.0)  # behind a prefill: not timed
    assert s.step_ms[(False, 1)] == pytest.approx(6.0)
    for i in range(4):  # every slot busy, nobody waiting: all K
        s.enqueue(req(3, start=10 * i))
    admit_all(s)
    assert s.call_steps(False, 1) == 8
    with pytest.raises(ValueError, match="short_call_ms must be > 0"):
        EngineConfig(short_call_ms=0)


def test_a_call_is_read_before_the_next_only_when_long():
    s = scheduler(steps_per_call=8, overlap_ms=20.0)
    call = lambda rows, steps: Step(StepKey(64, rows), steps, [], False)  # noqa: E731
    assert not s.long(call(1, 8))  # not measured yet: overlapped
    s.timed(call(1, 2), 0.012)  # 6 ms a step
    assert s.long(call(1, 4))  # 24 ms: read first
    assert not s.long(call(1, 3))  # 18 ms: overlapped
    assert not s.long(call(2, 8))  # another slot bucket: not measured
    s.overlap_ms = None
    assert not s.long(call(1, 8))  # None: always overlapped
    with pytest.raises(ValueError, match="overlap_ms must be > 0"):
        EngineConfig(overlap_ms=0)


def test_no_call_while_every_live_slot_is_most_likely_ending():
    s = scheduler()
    r = req(5, max_tokens=3)
    s.enqueue(r)
    admit_all(s)
    assert s.plan_step(False)  # 4 steps dispatched cover its 3 tokens
    assert s.ending() and s.plan_step(False) == []


def test_tokens_of_a_slot_that_changed_hands_go_to_nobody():
    s = scheduler()
    a = req(5)
    s.enqueue(a)
    admit_all(s)
    call = s.plan_step(False)[-1]
    s.free(0)
    b = req(6, start=70)
    s.enqueue(b)
    admit_all(s)
    assert s.holder(0) is b
    assert s.after_step(call, [3], [3], [9], done=0.0) == []


@pytest.mark.parametrize("config, message", [
    (dict(acceptance="greedy"), "acceptance must be one of rejection, typical"),
    (dict(slots=0), "need slots, steps_per_call, window_block >= 1"),
    (dict(prefill_batch=0), "prefill_batch must be an integer >= 1, got 0"),
    (dict(plain_above="sometimes"), "plain_above must be a slot count"),
])
def test_bad_options_are_refused_in_one_line(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**config)


def test_bad_sizes_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"slot buckets must be in 1..4 \(the slots\)"):
        layout(slot_buckets=(0, 2))
    with pytest.raises(ValueError, match="longer than the model's context"):
        layout(max_context=256)
    with pytest.raises(ValueError, match=r"prefill buckets must be in 1..128"):
        layout(buckets=(200,))
    with pytest.raises(ValueError, match=r"plain_above must be in 0..3 .* on a plain engine"):
        layout(plain_above=1)
    with pytest.raises(ValueError, match="keeps its own cache"):
        layout(keeps_context=True, plain_above=1, drafter_kind="eagle3")
