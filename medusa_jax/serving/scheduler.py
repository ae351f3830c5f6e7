"""The serving engine's decisions, as plain Python (no JAX): what to run next.

A `Scheduler` keeps the host's picture of the slots (which request holds each, its cache
length at the last read, the steps dispatched since), the waiting queue, the prefix-cache
index (the tokens a free slot's cache still holds) and the step times measured so far. It
plans in typed actions the loop (`engine.Engine`) runs in order:

  - `Prefill` waiting requests together, then `Insert` each row into a free slot;
  - `Extend`: a prompt prefilled after the prefix a slot's cache holds, into a free slot;
  - `Move`: a free slot's cache row copied to another before its slot takes a request;
  - `Resize`: the slots' cache to the neighbouring attention window;
  - `Step`: K steps (or fewer) over the leading slots; `Cancel`: a request that went away
    while waiting.

Planning books its effect at once (a planned insert holds its slot, a planned step counts
as dispatched), so plans follow one another without the device. What comes back from the
device is booked by `after_step` (cache lengths, the tokens to hand out). It asks its
`programs` only `compiled(key)` (and `lazy`): a fake of a few lines stands for the compiled
programs in the tests.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable

from medusa_jax.serving.layout import (
    ExtendKey,
    InsertKey,
    Layout,
    MoveKey,
    PrefillKey,
    ResizeKey,
    StepKey,
)


class QueueFull(Exception):
    """The engine's waiting queue is at its bound."""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation. `on_event(tokens, finish_reason, error)` is called from the engine
    thread: new tokens (a list), then finish_reason "stop" / "length" once, or an error
    message (finish_reason "error") when the engine stops or fails this request alone."""

    prompt: list[int]
    max_tokens: int
    on_event: Callable[[list[int], str | None, str | None], None]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()  # beyond the model's EOS
    cache_prompt: bool = True  # may start from a cached prefix (the engine's `prefix_cache`)
    epsilon: float | None = None  # typical acceptance's thresholds (None: `Sampling`'s)
    delta: float | None = None
    # filled in by the engine
    id: int = -1
    cancelled: bool = False
    emitted: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)  # handed out so far
    cached: int = 0  # prompt tokens taken from the prefix cache
    t_submit: float = 0.0
    t_first: float | None = None
    finished: bool = False

    def cached_tokens(self) -> list[int]:
        """The tokens whose keys/values its slot holds for certain: its prompt and every
        token handed out but the last (each step feeds the tokens it emits; the last one
        may not have been fed)."""
        return self.prompt + self.tokens[:-1]


@dataclasses.dataclass
class Slot:
    """The host's view of one slot."""
    req: Request | None = None
    known_len: int = 0  # cache length at the last read
    unread: int = 0  # steps dispatched since then (in calls not read yet)
    limit: int = 0  # prompt + max_tokens: the length never exceeds it while live
    skip: int = 0  # tokens the device will emit that the host has handed out already


# ----------------------------------------------------------------------------- actions


@dataclasses.dataclass
class Cancel:
    """A waiting request that was cancelled: finish it (nothing runs)."""
    request: Request


@dataclasses.dataclass
class Prefill:
    """Prefill `requests` together (`key.batch` of them, padded to `key.bucket`)."""
    requests: list[Request]
    key: PrefillKey


@dataclasses.dataclass
class Insert:
    """Row `row` of the last `Prefill` (`request`'s) into slot `slot`."""
    request: Request
    slot: int
    row: int
    key: InsertKey


@dataclasses.dataclass
class Extend:
    """`request`'s prompt after its first `start` tokens, which slot `src`'s cache holds,
    prefilled into slot `slot`; then, if `stash` is another slot, `slot`'s cache row is
    moved there (`move`) before the insert."""
    request: Request
    slot: int
    src: int
    start: int
    key: ExtendKey
    stash: int
    move: MoveKey | None


@dataclasses.dataclass
class Move:
    """Copy slot `src`'s cache row (and length) over slot `dst`'s."""
    src: int
    dst: int
    key: MoveKey


@dataclasses.dataclass
class Resize:
    key: ResizeKey


@dataclasses.dataclass
class Step:
    """`steps` steps of program `key`; owners: the request each slot held when planned
    (tokens go to that request only); dispatched: when the loop dispatched it."""
    key: StepKey
    steps: int
    owners: list
    behind_prefill: bool
    dispatched: float = 0.0


@dataclasses.dataclass
class Handout:
    """Tokens [start, stop) of slot `slot`'s row of a read call go to `request`."""
    slot: int
    request: Request
    start: int
    stop: int


# ----------------------------------------------------------------------------- the scheduler


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common beginning of a and b (list slices compare at C
    speed: a bisection over them, not a Python loop over tokens)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


class Scheduler:
    """Plans for `layout`'s slots. programs: `compiled(key) -> bool` and `lazy` (a
    prefix-cache program is used only once compiled, or under the lazy warm-up);
    short_call_ms / overlap_ms: call sizing (see `engine.Engine`), settable."""

    def __init__(self, layout: Layout, programs, *, max_queue: int,
                 short_call_ms: float | None = None, overlap_ms: float | None = None):
        self.layout, self.programs = layout, programs
        self.max_queue = max_queue
        self.short_call_ms, self.overlap_ms = short_call_ms, overlap_ms
        self.slots = [Slot() for _ in range(layout.slots)]
        self.waiting: collections.deque[Request] = collections.deque()
        # guards `waiting` (and the engine's stop reason): `submit` runs on other threads
        self.lock = threading.Condition()
        self.window = layout.windows[0]  # the slots' cache length now: one of the windows
        # the tokens whose keys/values a free slot's cache holds from its last request, and
        # when that request ended (the least recently used goes first)
        self.kept: list[list[int]] = [[] for _ in range(layout.slots)]
        self.kept_at = [0] * layout.slots
        self._ticks = itertools.count(1)
        self.step_ms: dict[tuple[bool, int], float] = {}  # (plain, slot bucket) -> ms a step
        self.last_done = 0.0  # when the last call read was seen done
        self.slot_steps = 0  # live slot-steps read so far
        self.step_tokens = 0  # tokens those emitted

    # --- the slot table

    def live(self) -> int:
        return sum(s.req is not None for s in self.slots)

    def free_count(self) -> int:
        return sum(s.req is None for s in self.slots)

    def holder(self, i: int) -> Request | None:
        return self.slots[i].req

    def running(self) -> list[Request]:
        return [s.req for s in self.slots if s.req is not None]

    def idle(self) -> bool:
        return not self.waiting and all(s.req is None for s in self.slots)

    def clear(self, slots: bool = True) -> list[Request]:
        """Empty the queue (and the slots): the requests they held."""
        with self.lock:
            waiting, self.waiting = list(self.waiting), collections.deque()
        out = waiting + self.running()
        if slots:
            self.slots = [Slot() for _ in range(self.layout.slots)]
        return out

    def enqueue(self, req: Request):
        """Queue `req` (under `lock`); QueueFull past the bound."""
        if len(self.waiting) >= self.max_queue + self.free_count():
            raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
        self.waiting.append(req)

    def free(self, i: int, keep: bool = True, window: int | None = None):
        """Free slot i. keep: its cache goes on serving as a cached prefix (a request that
        finished: the device row is done). A cancelled request's row may still run on the
        device, so nothing of it is kept. A done row is still stepped: it writes at its
        length, or at the last `fed` slots of the cache where that is past the end, so only
        what lies before those is kept (`window`: the cache's length in the call the request
        ended in, if narrower than now)."""
        req = self.slots[i].req
        held = min(window or self.window, self.window) - self.layout.fed
        self.kept[i] = req.cached_tokens()[:held] if keep and req is not None else []
        self.kept_at[i] = next(self._ticks)
        self.slots[i] = Slot()

    def cancelled_running(self) -> list[Request]:
        """Free the slots of running requests that were cancelled; those requests."""
        out = []
        for i, s in enumerate(self.slots):
            if s.req is not None and s.req.cancelled:
                out.append(s.req)
                self.free(i, keep=False)
        return out

    # --- admission

    def _usable(self, key) -> bool:
        return self.programs.lazy or self.programs.compiled(key)

    def _bucket(self, n: int, batch: int = 1) -> int:
        """The bucket a prompt of n tokens is prefilled in, in a batch of `batch`: the
        smallest compiled one that holds it, else the smallest that does (compiled then)."""
        fits = [b for b in self.layout.buckets if b >= n]
        return next((b for b in fits if self.programs.compiled(PrefillKey(b, batch))), fits[0])

    def _batch(self, waiting: int) -> int:
        """Prompts to prefill in one call when `waiting` can be admitted now: the largest
        batch bucket that holds no more than them, compiled ones first (a compile would
        hold every one of them back)."""
        fits = [n for n in self.layout.prefill_batches if n <= waiting]
        compiled = [n for n in fits if any(self.programs.compiled(PrefillKey(b, n))
                                           for b in self.layout.buckets)]
        return max(compiled or fits)

    def prefix_hit(self, req: Request) -> tuple[int, int, int, int] | None:
        """Where to prefill `req` from a cached prefix: (source slot, cached tokens used,
        the rest's bucket, window), or None when no slot holds enough of its prompt to
        prefill the rest in a shorter bucket (or that program is not compiled yet)."""
        lay = self.layout
        if not (lay.prefix_cache and req.cache_prompt):
            return None
        n, best, src = len(req.prompt), 0, -1
        for i, s in enumerate(self.slots):
            same = common_prefix(s.req.cached_tokens() if s.req is not None else self.kept[i],
                                 req.prompt)
            if same > best:
                best, src = same, i
        start = min(best, n - 1)  # the last prompt token is fed: its logits choose the root
        if start < 1:
            return None
        bucket = next((q for q in lay.extend_buckets if q >= n - start), lay.capacity)
        if bucket >= next(q for q in lay.buckets if q >= n):
            return None
        start = min(start, lay.capacity - bucket)  # the cache must hold start + bucket
        window = max(self.window, lay.fit(start + bucket))
        if not self._usable(ExtendKey(bucket, window)):
            return None
        return src, start, bucket, window

    def _keep_elsewhere(self, i: int, taken: set[int]) -> list:
        """Slot i (free) is about to take a request: move what its cache holds to the free
        slot (not in `taken`) holding nothing, else the least recently used one."""
        out = []
        if self.kept[i]:
            spare = [j for j, s in enumerate(self.slots)
                     if s.req is None and j != i and j not in taken]
            if spare and self._usable(MoveKey(self.window)):
                j = min(spare, key=lambda j: (bool(self.kept[j]), self.kept_at[j]))
                out.append(Move(i, j, MoveKey(self.window)))
                self.kept[j], self.kept_at[j] = self.kept[i], self.kept_at[i]
        self.kept[i] = []
        return out

    def _take(self, slot: int, req: Request, length: int):
        # the first token goes out at once; the slot's first step emits it again (skipped)
        self.slots[slot] = Slot(req=req, known_len=length, unread=0,
                                limit=length + req.max_tokens, skip=1)

    def _extend(self, req: Request, slot: int, hit: tuple[int, int, int, int]) -> list:
        """Prefill `req` into `slot` after its cached prefix (`prefix_hit`'s `hit`)."""
        src, start, bucket, window = hit
        n = len(req.prompt)
        out = self.resize_to(window)
        # where the slot's cached tokens go: into the source once it is read, if that is
        # free and this request goes on from all it holds (a repeated prompt, a next turn),
        # else to a spare slot now
        stash = slot
        continues = start >= min(n, len(self.kept[src])) - 1  # from all the source holds
        if src == slot:
            if continues:
                self.kept[slot] = []
            else:  # a copy first: the rest of what it holds is of use to others
                out += self._keep_elsewhere(slot, set())
        elif (self.kept[slot] and self.slots[src].req is None and continues
              and self._usable(MoveKey(self.window))):
            stash, self.kept[src] = src, self.kept[slot]
            self.kept_at[src] = self.kept_at[slot]
            self.kept[slot] = []
        else:
            out += self._keep_elsewhere(slot, {src})
        out.append(Extend(req, slot, src, start, ExtendKey(bucket, self.window), stash,
                          MoveKey(self.window) if stash != slot else None))
        self._take(slot, req, n)
        req.cached = start
        return out

    def admit(self) -> list:
        """One round of admission: the actions that prefill waiting requests (several in one
        call where they fit the same bucket) into free slots. Empty: nothing to admit."""
        lay = self.layout
        with self.lock:
            free = [i for i, s in enumerate(self.slots) if s.req is None]
            gone = []
            while self.waiting and self.waiting[0].cancelled:
                gone.append(self.waiting.popleft())
            batch, hit = [], None
            if free and self.waiting:
                hit = self.prefix_hit(self.waiting[0])
            if hit is not None:  # the head goes alone, after its cached prefix
                batch = [self.waiting.popleft()]
            elif free and self.waiting:
                # the head's bucket, and the requests behind it that fit there and have no
                # cached prefix (one cancelled meanwhile is finished on its first token)
                n = self._batch(min(len(free), len(self.waiting)))
                bucket = self._bucket(len(self.waiting[0].prompt), n)
                batch = [r for j, r in enumerate(itertools.islice(self.waiting, len(free)))
                         if len(r.prompt) <= bucket
                         and (j == 0 or self.prefix_hit(r) is None)][:n]
                batch = batch[:self._batch(len(batch))]
                for r in batch:
                    self.waiting.remove(r)
        out: list = [Cancel(r) for r in gone]
        if hit is not None:
            return out + self._extend(batch[0], free[0], hit)
        if not batch:
            return out
        n = len(batch)
        bucket = self._bucket(max(len(r.prompt) for r in batch), n)
        out.append(Prefill(batch, PrefillKey(bucket, n)))
        out += self.resize_to(max(self.window, lay.fit(bucket)))  # the prompts fit the cache
        insert = InsertKey(bucket, n, self.window)
        for j, (req, i) in enumerate(zip(batch, free)):
            out += self._keep_elsewhere(i, set(free[:n]))
            out.append(Insert(req, i, j, insert))
            self._take(i, req, len(req.prompt))
        return out

    # --- steps

    def resize_to(self, window: int) -> list:
        """The resizes (a window at a time) that bring the slots' cache to `window`."""
        lay, out = self.layout, []
        while self.window != window:
            i = lay.windows.index(self.window)
            shrink = window < self.window
            nxt = lay.windows[i - 1 if shrink else i + 1]
            out.append(Resize(ResizeKey(self.window, nxt)))
            self.window = nxt
            if shrink:  # a narrower cache keeps less; and a free slot's steps write at its
                # length, or at the last `fed` slots where that is past the end
                self.kept = [kept[:nxt - lay.fed] for kept in self.kept]
        return out

    def plain_now(self) -> bool:
        """Plain steps while more than `plain_above` slots are live."""
        return self.layout.plain_above is not None and self.live() > self.layout.plain_above

    def step_size(self, plain: bool = False, steps: int | None = None) -> StepKey:
        """The next call of `steps` steps (default K), over the fewest slots that hold the
        highest one in use. The window is the cache's length now if every live slot's steps
        fit in it; else the narrowest they fit in; and no wider than the narrowest that
        holds every live request to its end (a resize copies the cache once, where a call
        through a narrower window than the cache would copy it at every call). A compiled
        program that covers both if that one is not compiled yet."""
        lay = self.layout
        steps = lay.k if steps is None else steps
        need, hold, used = 0, 0, 0
        for i, s in enumerate(self.slots):
            if s.req is not None:
                used = i + 1
                start = min(s.known_len + s.unread * lay.width, s.limit)
                need = max(need, min(start + (steps - 1) * lay.width, s.limit) + lay.fed)
                hold = max(hold, s.limit + lay.fed)
        target = min(max(self.window, lay.fit(need)), lay.fit(hold))
        windows = [w for w in lay.windows if w >= need] or lay.windows[-1:]
        counts = [r for r in lay.slot_buckets if r >= used]
        fits = [StepKey(w, r, plain) for r in counts for w in windows]
        if plain:  # more live slots than plain_above: only those buckets hold them
            fits = [x for x in fits if x.slots > lay.plain_above]
        compiled = [x for x in fits if self.programs.compiled(x)]
        best = [x for x in fits if x.window == target]
        if best and best[0] in compiled:
            return best[0]
        return (min(compiled, key=lambda x: x.window * x.slots) if compiled
                else (best or fits)[0])

    def ending(self) -> bool:
        """Whether every live slot will most likely have ended within the calls already
        dispatched (at the tokens per step seen so far). Another call now would then compute
        for nobody, and the next request's prefill would wait for it; if a slot has not
        ended after all, the next plan dispatches once its tokens are read (only the
        overlap of one call with the host's work is lost)."""
        per_step = self.step_tokens / self.slot_steps if self.slot_steps else 1.0
        return all(s.unread > 0 and s.known_len + s.unread * per_step >= s.limit
                   for s in self.slots if s.req is not None)

    def call_steps(self, plain: bool, rows: int) -> int:
        """Steps for the next call: K while every slot is busy and nobody waits; else as
        many as keep the call within `short_call_ms` at the step time measured for this
        kind and slot bucket (1 until measured), so that a request arriving now waits less
        for the calls ahead of its prefill."""
        k = self.layout.k
        if self.short_call_ms is None or k == 1:
            return k
        if self.waiting or any(s.req is None for s in self.slots):
            step_ms = self.step_ms.get((plain, rows))
            if step_ms is None:
                return 1
            return int(min(k, max(1, self.short_call_ms // step_ms)))
        return k

    def plan_step(self, behind_prefill: bool) -> list:
        """The next call (its resizes, then the `Step`), or [] when no slot is live or every
        live one is most likely ending within the calls dispatched. behind_prefill: a
        prefill was dispatched just before it (the call is then not timed)."""
        if self.live() == 0 or self.ending():
            return []
        plain = self.plain_now()
        steps = self.call_steps(plain, self.step_size(plain).slots)
        key = self.step_size(plain, steps)
        out = self.resize_to(key.window)
        out.append(Step(key, steps, [s.req for s in self.slots], behind_prefill))
        for s in self.slots:
            if s.req is not None:
                s.unread += steps
        return out

    # --- what comes back

    def long(self, call: Step) -> bool:
        """Whether a dispatched call most likely takes `overlap_ms` or more (at the step
        time measured for its kind and slot bucket)."""
        step_ms = self.step_ms.get((call.key.plain, call.key.slots))
        return (self.overlap_ms is not None and step_ms is not None
                and step_ms * call.steps >= self.overlap_ms)

    def timed(self, call: Step, done: float, ran: int | None = None):
        """Update the step time of a call read at `done` (perf_counter seconds): it ran
        from its dispatch or the previous call's end, whichever is later (calls run in
        order), for `ran` steps (its longest-live slot's; default all of them: a call stops
        once all its slots have finished); a call queued behind a prefill is not timed."""
        began, self.last_done = max(call.dispatched, self.last_done), done
        if call.behind_prefill:
            return
        ran = call.steps if ran is None else ran
        if ran < 1:  # every slot had finished before it: nothing ran
            return
        ms = (done - began) * 1e3 / ran
        key = (call.key.plain, call.key.slots)
        old = self.step_ms.get(key)
        self.step_ms[key] = ms if old is None else 0.8 * old + 0.2 * ms

    def after_step(self, call: Step, counts, steps, lengths, done: float | None = None) -> list:
        """Book a call's results read back (per slot of the call: counts, steps, cache
        lengths; sequences of ints): what to hand out (`Handout`s) and the running requests
        that were cancelled (`Cancel`s, their slots freed)."""
        self.timed(call, time.perf_counter() if done is None else done,
                   max((int(x) for x in steps), default=0))
        out = []
        for i, req in enumerate(call.owners[:len(counts)]):  # the others are free
            slot = self.slots[i]
            if req is None or slot.req is not req:
                continue  # the slot changed hands: these tokens belong to nobody now
            slot.known_len, slot.unread = int(lengths[i]), slot.unread - call.steps
            if req.cancelled:
                self.free(i, keep=False)
                out.append(Cancel(req))
                continue
            n = int(counts[i])
            self.slot_steps += int(steps[i])
            self.step_tokens += n
            skip = min(slot.skip, n)
            slot.skip -= skip
            if n > skip:
                out.append(Handout(i, req, skip, n))
        return out
