"""Serving engine: continuous batching over S static slots; the scheduler side only.

The decoding step is `decoding.step`'s, the same the offline decoders run: every slot is a
row of its `DecodeState`, live or free, with its own sampling, stop tokens and token limit
(`sampling.Rows`). Any drafter (Medusa or Hydra heads), any tree (static or "dynamic:N"),
and greedy rows beside sampled ones (temperature > 0: rejection sampling, lossless, or
typical acceptance: `Engine(acceptance=...)`). Plain decoding is the same engine with the
plain step.

The serving loop of JetStream / jax-llm-examples, three jitted programs, each compiled once
per shape it uses (all before serving, or in the background while the first requests are
served with the first shapes compiled, or each when first needed: `Engine.start`'s warmup):
  - `prefill` (N waiting requests together, N a prefill batch bucket, their prompts
    right-padded to a length bucket): an N-row state (their caches, their first tokens
    chosen with their own sampling, the drafter started);
  - `insert` (the decode state donated): puts row j of a prefilled batch into slot b;
  - `extend` (the prefix cache): a prompt whose first tokens are in a slot's cache already
    (a live slot's prompt, or what a finished request left in its slot) is prefilled only
    after them, from a copy of that slot's cache row, then `insert`ed into a free slot;
    `move` copies a free slot's cache row to another before its slot takes a request;
  - `step`: K shared steps for the first R slots in one call (R a slot bucket holding the
    highest slot in use), each slot at its own length; returns a fixed [R, K*W] token
    buffer and per-slot counts (W: a step's tokens at most). Under load (`plain_above`) a
    Medusa engine's calls are plain steps.
The first token is handed out as soon as prefill has chosen it; the slot's first step
emits it again (as every step emits its root), and the host skips that copy, so the stream
is the offline decoders' stream.

`Engine` is the host side: one thread dispatches step N+1, then reads step N's tokens
(`copy_to_host_async`), hands them to their requests, and admits waiting requests into
freed slots. Each dispatched step records which request held each slot; tokens go only to
that request, and only while it is live, so a reused slot never receives stale tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.decoding import sampling, step
from medusa_jax.decoding.decode import MIN_BUCKET
from medusa_jax.decoding.drafter import drafter_for
from medusa_jax.decoding.sampling import Rows, Sampling
from medusa_jax.decoding.step import DecodeState, batch_axis, static_tree
from medusa_jax.model.backbone import KVCache, is_decoding_layout
from medusa_jax.model.config import ModelConfig
from medusa_jax.runtime import pytree as struct
from medusa_jax.runtime import xla_options

MAX_STOP = 8  # stop token ids per request (EOS included), padded with -1
ACCEPTANCE = ("rejection", "typical")  # how a Medusa engine's sampled rows accept a tree
WARMUPS = ("all", "background", "lazy")  # `Engine.start`: when the programs compile
# the rest of a prompt after a cached prefix is padded to these or a shorter prefill bucket:
# a repeated prompt feeds one token
EXTEND_BUCKETS = (1, 4)
# the background warm-up waits while requests run (compiling competes with them for the
# CPU and the GIL), but no longer than this per program under a steady load
BACKGROUND_YIELD_S = 2.0


# ----------------------------------------------------------------------------- device programs


@struct.dataclass
class StepOut:
    tokens: jax.Array  # [S, K*W] int32: tokens[b, :counts[b]] are slot b's new tokens
    counts: jax.Array  # [S] int32
    steps: jax.Array  # [S] int32: steps slot b was live for
    lengths: jax.Array  # [S] int32: cache lengths after the call
    done: jax.Array  # [S] bool


def init_state(cfg: ModelConfig, params, slots: int, capacity: int, width: int,
               rows: Rows, draft) -> DecodeState:
    """S free slots: rows (one row) and draft (a carry's shapes, one row on its batch axis,
    None: plain) say what each slot holds once a request is inserted."""
    zeros = jnp.zeros((slots,), jnp.int32)
    wide = lambda x: jnp.zeros(x.shape, x.dtype)  # noqa: E731
    return DecodeState(
        cache=KVCache.init(cfg, slots, capacity, per_layer=is_decoding_layout(params)),
        root=zeros, draft=None if draft is None else jax.tree.map(wide, draft), count=zeros,
        steps=zeros, hist=jnp.zeros((slots, width + 1), jnp.int32),
        done=jnp.ones((slots,), bool), keys=jax.random.split(jax.random.key(0), slots),
        rows=jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x), slots, axis=0), rows))


def prefill(params, heads, tokens: jax.Array, lengths: jax.Array, keys: jax.Array, rows: Rows,
            *, cfg: ModelConfig, drafter, tree, capacity: int | None = None) -> DecodeState:
    """N requests at once: tokens [N, P] right-padded, lengths [N], keys [N, ...] key data
    (uint32), rows: their N rows. An N-row state whose roots are their first tokens (drafter
    None: plain); `capacity`: a slot's cache length, which a drafter's own carry is sized
    to."""
    width = 1 if drafter is None else static_tree(tree).depth + 1
    return step.start(params, cfg, tokens, lengths, jax.random.wrap_key_data(keys), rows,
                      tokens.shape[1], drafter, heads, width, draft_capacity=capacity)


def cache_row(c: KVCache, row: jax.Array) -> KVCache:
    """Row `row` (int32 scalar) of a cache, as a one-row cache (a copy)."""
    if isinstance(c.k, tuple):  # per layer [B*KVH, C, D]: row b's heads at b*KVH ..
        kvh = c.k[0].shape[0] // c.lengths.shape[0]
        heads = lambda a: jax.lax.dynamic_slice_in_dim(a, row * kvh, kvh, 0)  # noqa: E731
        k, v = tuple(map(heads, c.k)), tuple(map(heads, c.v))
    else:  # [L, B, KVH, C, D]
        k, v = (jax.lax.dynamic_slice_in_dim(a, row, 1, 1) for a in (c.k, c.v))
    return c.replace(k=k, v=v, lengths=jax.lax.dynamic_slice_in_dim(c.lengths, row, 1, 0))


def put_cache_row(c: KVCache, one: KVCache, row: jax.Array) -> KVCache:
    """`c` with row `row` (int32 scalar) overwritten by the one-row cache `one`'s
    keys/values, over its first `one.capacity` slots (its length is left as it was)."""
    if isinstance(c.k, tuple):  # per layer [B*KVH, C, D]
        at = (row * one.k[0].shape[0], jnp.int32(0), jnp.int32(0))
        k = tuple(jax.lax.dynamic_update_slice(a, b, at) for a, b in zip(c.k, one.k))
        v = tuple(jax.lax.dynamic_update_slice(a, b, at) for a, b in zip(c.v, one.v))
    else:  # [L, B, KVH, C, D]
        z = jnp.int32(0)
        k = jax.lax.dynamic_update_slice(c.k, one.k, (z, row, z, z, z))
        v = jax.lax.dynamic_update_slice(c.v, one.v, (z, row, z, z, z))
    return c.replace(k=k, v=v)


def move(state: DecodeState, src: jax.Array, dst: jax.Array) -> DecodeState:
    """Copy slot `src`'s cache row over slot `dst`'s (int32 scalars; the state donated):
    a finished request's cache kept as a prefix while its slot takes a new request. Its
    length goes along (a free slot's steps still write at its length, past what it holds),
    and `dst` is marked done (it may have held a cancelled request, still running)."""
    c = state.cache
    c = put_cache_row(c, cache_row(c, src), dst)
    return state.replace(cache=c.replace(lengths=c.lengths.at[dst].set(c.lengths[src])),
                         done=state.done.at[dst].set(True))


def take_row(pre: DecodeState, row: jax.Array, axis: int) -> DecodeState:
    """Row `row` (int32 scalar) of a prefilled batch, as a one-row state; `axis`: the
    drafter carry's batch axis."""
    one = lambda a, ax=0: jax.lax.dynamic_slice_in_dim(a, row, 1, ax)  # noqa: E731
    draft = None if pre.draft is None else jax.tree.map(lambda a: one(a, axis), pre.draft)
    fields = {f: jax.tree.map(one, getattr(pre, f)) for f in _ROW_FIELDS}
    return pre.replace(cache=cache_row(pre.cache, row), draft=draft, **fields)


def insert(state: DecodeState, pre: DecodeState, slot: jax.Array, row: jax.Array, *,
           axis: int) -> DecodeState:
    """Put row `row` of a prefilled batch into slot `slot` (int32 scalars); `axis`: the
    drafter carry's batch axis. A first token that ends the request leaves the slot idle
    (the host hands it out)."""
    pre = take_row(pre, row, axis)
    cache = put_cache_row(state.cache, pre.cache, slot)  # its first P slots: a prefill's
    cache = cache.replace(lengths=cache.lengths.at[slot].set(pre.cache.lengths[0]))
    set_row = lambda a, b: a.at[slot].set(b[0])  # noqa: E731
    draft = None if state.draft is None else jax.tree.map(
        lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), slot, axis),
        state.draft, pre.draft)
    rows = pre.rows
    ended = jnp.any(pre.root[0] == rows.stop[0]) | (rows.max_tokens[0] <= 1)
    fields = ("root", "count", "steps", "hist", "keys", "rows")
    put = {f: jax.tree.map(set_row, getattr(state, f), getattr(pre, f)) for f in fields}
    return state.replace(cache=cache, draft=draft, done=state.done.at[slot].set(ended), **put)


_ROW_FIELDS = ("root", "count", "steps", "hist", "done", "keys", "rows")  # besides cache, draft


def extend(params, heads, cache: KVCache, tokens: jax.Array, start: jax.Array,
           length: jax.Array, key: jax.Array, rows: Rows, src: jax.Array, *,
           cfg: ModelConfig, drafter, tree, capacity: int) -> DecodeState:
    """A prompt whose first `start` tokens are in slot `src`'s row of the slots' `cache`
    (int32 scalars; read only): the rest, tokens [1, Q] (right-padded; start + Q within
    the cache), prefilled after a copy of that row. length [1]: the whole prompt's; key
    [1, ...]: its key data. A one-row state, as `prefill`'s, for `insert`. (Updating the
    slots' cache here too would make XLA copy all of it, to read the row first.)"""
    width = 1 if drafter is None else static_tree(tree).depth + 1
    row = cache_row(cache, src).replace(lengths=start[None])
    return step.start_after_prefix(params, cfg, row, tokens, length,
                                   jax.random.wrap_key_data(key), rows, drafter, heads, width,
                                   draft_capacity=capacity)


def leading_rows(s: DecodeState, rows: int, window: int, axis: int) -> DecodeState:
    """The first `rows` slots of `s`, their caches cut to the first `window` slots (all a
    step attends or writes there); `axis`: the drafter carry's batch axis."""
    head = lambda a: a[:rows]  # noqa: E731
    draft = None if s.draft is None else jax.tree.map(
        lambda a: jax.lax.slice_in_dim(a, 0, rows, axis=axis), s.draft)
    return s.replace(cache=s.cache.leading(rows, window), draft=draft,
                     **{f: jax.tree.map(head, getattr(s, f)) for f in _ROW_FIELDS})


def put_leading_rows(full: DecodeState, sub: DecodeState, axis: int) -> DecodeState:
    """`leading_rows`' inverse: write `sub` back over the first slots of `full` (donated,
    so in place)."""
    draft = None if full.draft is None else jax.tree.map(
        lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, 0, axis), full.draft, sub.draft)
    put = {f: jax.tree.map(lambda a, b: a.at[:b.shape[0]].set(b), getattr(full, f),
                           getattr(sub, f)) for f in _ROW_FIELDS}
    return full.replace(cache=full.cache.put_leading(sub.cache), draft=draft, **put)


def resize(s: DecodeState, *, capacity: int) -> DecodeState:
    """`s` with each slot's cache `capacity` slots long: cut, or zero-padded at the end
    (only a slot's first `lengths` cache slots hold anything; the drafter carry keeps its
    own length)."""
    def fit(a, axis):
        if capacity <= a.shape[axis]:
            return jax.lax.slice_in_dim(a, 0, capacity, axis=axis)
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, capacity - a.shape[axis])
        return jnp.pad(a, pad)

    c = s.cache
    if isinstance(c.k, tuple):  # per layer [S*KVH, C, D]
        k, v = tuple(fit(a, 1) for a in c.k), tuple(fit(a, 1) for a in c.v)
    else:  # [L, S, KVH, C, D]
        k, v = fit(c.k, 3), fit(c.v, 3)
    return s.replace(cache=c.replace(k=k, v=v))


def engine_step(params, heads, s: DecodeState, steps: jax.Array, *, cfg: ModelConfig, drafter,
                tree, k: int, window: int, rows: int | None = None,
                plain: bool = False) -> tuple[DecodeState, StepOut]:
    """`steps` (int32 scalar, 1..k) shared steps (`decoding.step`) in one call, fewer once
    every slot has finished, the token buffer sized for `k` (one program serves every
    count): Medusa steps (a drafter and its prepared `heads`, `tree`) or plain steps
    (drafter None), attending over the first `window` cache slots, for the first `rows`
    slots (default all: the others must be free).
    `plain`: plain steps on a Medusa engine's state (its drafter carry left as it is: the
    next Medusa step drafts from it once, verification keeps the tokens exact, and then
    drafts from its own state again). Returns the state and those slots' tokens (`rows`
    rows)."""
    if drafter is not None and not plain:
        one = functools.partial(step.medusa_step, params, cfg, drafter, heads, tree,
                                window=window)
        width = static_tree(tree).depth + 1
    else:
        one, width = functools.partial(step.plain_step, params, cfg, window=window), 1
    full, axis = s, batch_axis(drafter)
    rows = s.root.shape[0] if rows is None else rows
    # One client pays for one row, not S; and the loop carries only the window it attends
    # over: a cache read through a narrower window inside the loop makes XLA copy the whole
    # cache at every step, the window cut once per call does not.
    part = rows < s.root.shape[0] or window < s.cache.capacity
    if part:
        s = leading_rows(s, rows, window, axis)
    b = s.root.shape[0]

    def more(carry):  # a call whose slots have all finished stops: its other steps are idle
        i, s, _, _ = carry
        return (i < jnp.clip(steps, 1, k)) & ~jnp.all(s.done)

    def body(carry):
        i, s, buf, counts = carry
        new, chunk, n = one(s)
        return i + 1, new, step.append(buf, chunk, counts, ~s.done), counts + n

    zeros = jnp.zeros((b,), jnp.int32)
    s0 = s
    _, s, buf, counts = jax.lax.while_loop(
        more, body, (jnp.int32(0), s, jnp.zeros((b, k * width), jnp.int32), zeros))
    out = StepOut(tokens=buf, counts=counts, steps=s.steps - s0.steps,
                  lengths=s.cache.lengths, done=s.done)
    return (put_leading_rows(full, s, axis) if part else s), out


# ----------------------------------------------------------------------------- host side


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


class QueueFull(Exception):
    """The engine's waiting queue is at its bound."""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation. `on_event(tokens, finish_reason, error)` is called from the engine
    thread: new tokens (a list), then finish_reason "stop" / "length" once, or an error
    message (finish_reason "error") when the engine stops."""

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


@dataclasses.dataclass
class _Slot:
    req: Request | None = None
    known_len: int = 0  # cache length at the last read
    unread: int = 0  # steps dispatched since then (in calls not read yet)
    limit: int = 0  # prompt + max_tokens: the length never exceeds it while live
    skip: int = 0  # tokens the device will emit that the host has handed out already


class Metrics:
    """Counters the server's /metrics reports (updated by the engine thread)."""

    def __init__(self):
        self.requests = collections.Counter()  # finish reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.slot_steps = 0  # live slot-steps
        self.step_tokens = 0  # tokens those steps emitted
        self.calls = 0
        self.calls_by_slots = collections.Counter()  # slot bucket -> step calls computing it
        self.calls_by_steps = collections.Counter()  # steps in a call -> calls
        self.plain_calls = 0  # of a Medusa engine, under load (`plain_above`)
        self.prefill_calls = 0
        self.resizes = 0  # the slots' cache resized to another window
        self.prefix_hits = 0  # prompts prefilled after a cached prefix (`extend`)
        self.prefix_tokens = 0  # prompt tokens those took from the cache
        self.prefills_by_batch = collections.Counter()  # prompts in a call -> calls
        self.ttft = []  # seconds, recent
        self.ttft_sum = 0.0
        self.ttft_count = 0


# On CPU a tree step over many slots is compute-bound (S slots verify S x tree rows) and
# costs more than the tokens it accepts; around this many slots plain and tree steps give
# the same throughput (measured: docs/serving.md, "Against llama-server").
AUTO_PLAIN_ABOVE = 4


def auto_plain_above(drafter, slots: int, backend: str) -> int | None:
    """The default `plain_above`: on CPU, plain steps while more than AUTO_PLAIN_ABOVE
    slots are live; elsewhere, with fewer slots, or for a drafter that plain steps cannot
    carry along (one with its own cache, `keeps_context`), always Medusa (None)."""
    if drafter is None or drafter.keeps_context or backend != "cpu" or slots <= AUTO_PLAIN_ABOVE:
        return None
    return AUTO_PLAIN_ABOVE


class Engine:
    """Continuous batching over `slots` slots of `model` (a `medusa_jax.api.Medusa`).

    - medusa: use the heads (Medusa or Hydra: any registered drafter) and `tree` (a static
      tree or "dynamic:N"; default: with heads).
    - acceptance: how a Medusa engine's sampled rows (temperature > 0) accept a tree:
      "rejection" (lossless) or "typical" (the paper's typical acceptance; epsilon and delta
      as `Sampling`'s).
    - steps_per_call: K, the steps of a `step` call (at most, with `short_call_ms`).
    - short_call_ms: while a slot is free or a request waits, a call runs only as many of
      its K steps as fit this many milliseconds at the measured step time (at least one;
      one compiled program runs any count up to K), so a request arriving meanwhile waits
      less for its prefill; None (default): always K.
    - overlap_ms: the next call is dispatched before the current one's tokens are read (the
      host's work overlaps the device's) while calls take less than this many milliseconds
      at the measured step time; a longer call is read first, so a request arriving during
      it is prefilled behind it alone, not behind the call queued after it too. None:
      always overlap.
    - max_context: the KV cache's length per slot (default: the model's context).
    - window_block: attention windows are compiled in multiples of this. The slots' KV
      cache is kept as long as the current window (resized when the live requests need a
      longer one, or fit a shorter one to their ends), so a call attends over the whole
      cache it holds and copies none of it.
    - max_queue: waiting requests past which `submit` raises QueueFull.
    - buckets: the prompt lengths prefill is compiled for (default: powers of two from 16,
      and the context); a prompt is padded to the smallest that holds it.
    - prefill_batch: at most this many waiting requests are prefilled in one call (batches
      of powers of two below it, and it; 1: one at a time): the weights are read once for
      all of them.
    - slot_buckets: the slot counts `step` is compiled for (default: powers of two below
      `slots`, and `slots`): a call computes the smallest that holds the highest slot in
      use (requests take the lowest free slot), so one client pays for one row.
    - plain_above: a Medusa engine's calls are plain steps while more than this many slots
      are live (where a batch of trees costs more than it gains; default None: always
      Medusa); "auto": `auto_plain_above`'s choice for this drafter, slot count and
      backend.
    - prefix_cache: a request (with `cache_prompt`) whose prompt begins with tokens some
      slot's cache holds (a live request's prompt and output so far, or what a finished
      request left in its slot) is prefilled only after them, when that takes a shorter
      prompt bucket (`extend`; compiled last in a warm-up, and used once compiled). Not
      with one prompt bucket, nor for a drafter with its own cache of every token
      (`keeps_context`). A free slot's cache is moved to another free one (the least recently
      used) before its slot takes a new request, so the slots keep what they held."""

    def __init__(self, model, *, slots: int = 8, medusa: bool | None = None, tree=None,
                 steps_per_call: int = 4, max_context: int | None = None,
                 window_block: int = 128, max_queue: int = 64,
                 buckets: tuple[int, ...] | None = None, acceptance: str = "rejection",
                 slot_buckets: tuple[int, ...] | None = None,
                 plain_above: int | str | None = None,
                 prefill_batch: int = 4, short_call_ms: float | None = None,
                 overlap_ms: float | None = 20.0, prefix_cache: bool = True,
                 log: Callable[[str], None] | None = None):
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCE)}, "
                             f"got {acceptance!r}")
        if slots < 1 or steps_per_call < 1 or window_block < 1 or max_queue < 0:
            raise ValueError(f"need slots, steps_per_call, window_block >= 1 and max_queue >= 0,"
                             f" got {slots}, {steps_per_call}, {window_block}, {max_queue}")
        self.model, self.cfg = model, model.cfg
        use_medusa = model.heads is not None if medusa is None else bool(medusa)
        if use_medusa and model.heads is None:
            raise ValueError("a Medusa engine needs heads (load the model with heads)")
        self.drafter = drafter_for(model.heads) if use_medusa else None
        self.tree = model.tree(tree) if use_medusa else None
        self.medusa = use_medusa
        # the modes a slot may follow: greedy (temperature 0), else the acceptance setting
        # (plain decoding samples either way); one compiled step serves both
        self.acceptance = acceptance
        self.modes = ("greedy", acceptance)
        self.slots, self.k, self.max_queue = slots, steps_per_call, max_queue
        model_context = self.cfg.max_position_embeddings
        if max_context is not None and max_context > model_context:
            raise ValueError(f"max_context {max_context} is longer than the model's context "
                             f"({model_context} tokens, max_position_embeddings)")
        self.capacity = max_context or model_context
        static = static_tree(self.tree) if use_medusa else None
        self.width = static.depth + 1 if use_medusa else 1  # tokens a step emits at most
        self.fed = self.tree.num_nodes if use_medusa else 1  # tokens a step feeds
        if self.capacity < MIN_BUCKET + self.fed + 1:
            raise ValueError(f"max_context {self.capacity} is too small (need at least "
                             f"{MIN_BUCKET + self.fed + 1})")
        self.eos = tuple(model.eos)
        self.windows = sorted({min(w, self.capacity)
                               for w in range(window_block, self.capacity + window_block,
                                              window_block)})
        self._width = self.windows[0]  # the slots' cache length now: one of the windows
        if buckets is None:
            buckets, b = [self.capacity], MIN_BUCKET
            while b < self.capacity:
                buckets.append(b)
                b *= 2
        if not buckets or any(not 1 <= b <= self.capacity for b in buckets):
            raise ValueError(f"prefill buckets must be in 1..{self.capacity} (the context), "
                             f"got {list(buckets)}")
        self.buckets = sorted(set(int(b) for b in buckets))
        # a cached prefix pays where the rest of a prompt takes a shorter bucket than the
        # whole prompt (so never the longest)
        self.extend_buckets = sorted({b for b in EXTEND_BUCKETS if b < self.buckets[-1]}
                                     | set(self.buckets[:-1]))
        self.prefix_cache = (bool(prefix_cache) and bool(self.extend_buckets)
                             and not (self.drafter is not None and self.drafter.keeps_context))
        if slot_buckets is None:
            slot_buckets = [slots] + [2**i for i in range(slots.bit_length()) if 2**i < slots]
        if not slot_buckets or any(not 1 <= int(r) <= slots for r in slot_buckets):
            raise ValueError(f"slot buckets must be in 1..{slots} (the slots), "
                             f"got {list(slot_buckets)}")
        self.slot_buckets = sorted({int(r) for r in slot_buckets} | {slots})
        if not isinstance(prefill_batch, int) or prefill_batch < 1:
            raise ValueError(f"prefill_batch must be an integer >= 1, got {prefill_batch!r}")
        most = min(prefill_batch, slots)  # more than the slots never fit at once
        self.prefill_batches = sorted({2**i for i in range(most.bit_length())} | {most})
        if isinstance(plain_above, str) and plain_above != "auto":
            raise ValueError(f"plain_above must be a slot count, \"auto\" or None, "
                             f"got {plain_above!r}")
        if plain_above == "auto":
            plain_above = auto_plain_above(self.drafter, slots, jax.default_backend())
        if plain_above is not None and self.drafter is not None and self.drafter.keeps_context:
            raise ValueError(f"plain_above={plain_above}: a {self.drafter.kind} drafter keeps "
                             f"its own cache of every committed token, which plain steps do "
                             f"not feed; leave plain_above unset with these heads")
        if plain_above is not None and not (use_medusa and 0 <= plain_above < slots):
            raise ValueError(f"plain_above must be in 0..{slots - 1} (below the slots) on a "
                             f"Medusa engine, got {plain_above!r}"
                             + ("" if use_medusa else " on a plain engine"))
        self.plain_above = plain_above
        # the tokens whose keys/values a free slot's cache holds from its last request, and
        # when that request ended (the least recently used goes first)
        self._kept: list[list[int]] = [[] for _ in range(slots)]
        self._kept_at = [0] * slots
        self._ticks = itertools.count(1)
        self._lazy = False  # `start(warmup="lazy")`: compile `extend` when first needed
        if short_call_ms is not None and not short_call_ms > 0:
            raise ValueError(f"short_call_ms must be > 0 (or None: always K steps), "
                             f"got {short_call_ms!r}")
        if overlap_ms is not None and not overlap_ms > 0:
            raise ValueError(f"overlap_ms must be > 0 (or None: always overlap), "
                             f"got {overlap_ms!r}")
        self.short_call_ms, self.overlap_ms = short_call_ms, overlap_ms
        self._step_ms: dict[tuple[str, int], float] = {}  # (kind, slot bucket) -> ms a step
        self._last_done = 0.0  # when the last call read was seen done
        self.metrics = Metrics()
        self._waiting: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()
        self._slots = [_Slot() for _ in range(slots)]
        self._ids = itertools.count()
        self._stop_reason: str | None = None
        self._thread: threading.Thread | None = None
        self._warm_thread: threading.Thread | None = None
        self.compile_seconds = 0.0  # summed over the programs compiled so far
        self._key_shape = jax.random.key_data(jax.random.key(0)).shape
        # compiled programs by (kind, size): ("prefill", (bucket, batch)), ("insert",
        # (bucket, batch, window)), ("step" | "plain", (window, slot bucket)), ("resize",
        # (window, the next window up or down)), ("extend", (bucket, window)): the extend
        # and its insert, ("move", window)
        self._programs: dict[tuple[str, object], object] = {}
        self._compile_lock = threading.RLock()  # one compile at a time
        self._demand_cv = threading.Condition()
        self._demand = 0  # requests' compiles waiting for the lock
        self._finish_lock = threading.Lock()
        self._unfinished = 0  # requests submitted and not finished
        self._held = 0  # requests the caller is handling (`hold`)
        self._jits = None  # the jitted functions and abstract state, once `_setup` ran
        self._ready = threading.Event()  # the first requests' programs are compiled
        self._all_compiled = threading.Event()
        self.compiling: tuple[str, int] | None = None  # the program being compiled now
        self._program_list: list | None = None  # `programs()`, once planned
        self.log = log

    # --- limits and compile

    def check(self, prompt_len: int, max_tokens: int):
        """Raise ValueError when a request cannot fit a slot."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        if prompt_len > self.buckets[-1]:
            raise ValueError(f"the prompt ({prompt_len} tokens) is longer than the longest "
                             f"prompt this server prefills ({self.buckets[-1]} tokens)")
        tree = self.fed if self.medusa else 0
        need = prompt_len + max_tokens + tree
        if need > self.capacity:
            extra = f" + tree ({tree} tokens)" if tree else ""
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}){extra} "
                             f"= {need} exceeds the context of {self.capacity} tokens; "
                             f"shorten the prompt or lower max_tokens")

    def _rows(self, temperature=0.0, top_k=0, top_p=1.0, max_tokens=1, stop=(),
              epsilon=None, delta=None) -> Rows:
        """One row's sampling (host arrays): temperature 0 is greedy, else the engine's
        acceptance mode (typical's thresholds default to `Sampling`'s)."""
        stop_arr = np.full((1, MAX_STOP), -1, np.int32)
        stop_arr[0, :len(stop)] = stop
        d = Sampling()
        epsilon = d.epsilon if epsilon is None else epsilon
        delta = d.delta if delta is None else delta
        full = lambda x, dtype: np.full((1,), x, dtype)  # noqa: E731
        return Rows(mode=full(1 if temperature > 0 else 0, np.int32),
                    temperature=full(temperature, np.float32), top_k=full(top_k, np.int32),
                    top_p=full(top_p, np.float32), epsilon=full(epsilon, np.float32),
                    delta=full(delta, np.float32), max_tokens=full(max_tokens, np.int32),
                    stop=stop_arr, modes=self.modes)

    def _request_rows(self, req: "Request") -> Rows:
        """A request's row: its sampling, token limit and stop tokens (EOS included)."""
        stop = tuple(sorted(set(self.eos) | set(req.stop_ids)))
        return self._rows(req.temperature if req.temperature > 0 else 0.0, req.top_k,
                          req.top_p, req.max_tokens, stop, req.epsilon, req.delta)

    # --- compile: each program once, when it is first needed or ahead of time

    def programs(self) -> list[tuple[str, int]]:
        """Every program the engine can use, in the order a warm-up compiles them: what a
        first short request needs (`first_programs`), then what serves any request (the
        longest bucket, the widest window), then the rest from small to large. Built once
        (what it depends on is fixed at construction): /health counts it at every probe."""
        if self._program_list is None:
            self._program_list = self._plan()
        return list(self._program_list)

    def _plan(self) -> list[tuple[str, int]]:
        b, w, r, n = self.buckets, self.windows, self.slot_buckets, self.prefill_batches
        resizes = [("resize", p) for p in zip(w, w[1:])] + [("resize", p) for p in
                                                            zip(w[1:], w)]
        cover = [("step", (w[-1], r[-1])), ("prefill", (b[-1], 1)),
                 ("insert", (b[-1], 1, w[-1]))] + resizes
        rest = [x for y in n for x1 in b for x in
                [("prefill", (x1, y))] + [("insert", (x1, y, v)) for v in w if v >= x1]] + \
            [("step", (x, y)) for y in r for x in w] + \
            [("plain", (x, y)) for y in r for x in w
             if self.plain_above is not None and y > self.plain_above]
        if self.prefix_cache:  # after at least one cached token
            rest += [("move", x) for x in w]
            rest += [("extend", (q, x)) for x in w for q in self.extend_buckets if q < x]
        return list(dict.fromkeys(self.first_programs() + cover + rest))

    def _program_count(self) -> int:
        if self._program_list is None:
            self._program_list = self._plan()
        return len(self._program_list)

    def first_programs(self) -> list[tuple[str, int]]:
        """The programs a request with a short prompt needs: the smallest prefill bucket,
        its insert, the step over the narrowest window and the fewest slots."""
        first = (self.buckets[0], 1)
        return [("prefill", first), ("insert", first + (self._fit(self.buckets[0]),)),
                ("step", (self.windows[0], self.slot_buckets[0]))]

    def _fit(self, n: int) -> int:
        """The narrowest window of at least n cache slots (the widest if none is)."""
        return next((w for w in self.windows if w >= n), self.windows[-1])

    def status(self) -> dict:
        """Compile progress: ready (the first requests' programs are compiled), compiled /
        programs (counts), compiling (the program being compiled, or None)."""
        now = self.compiling
        return {"ready": self._ready.is_set(), "compiled": len(self._programs),
                "programs": self._program_count(),
                "compiling": None if now is None else f"{now[0]} {self._size_name(*now)}"}

    def _setup(self):
        """The decode state and the jitted functions (under the compile lock)."""
        if self._jits is not None:
            return
        t0 = time.perf_counter()
        m, cfg = self.model, self.cfg
        heads_d = None  # the drafter's parameters as its steps use them
        if self.medusa:
            heads_d = self.drafter.prepare(m.heads, self.tree,
                                           cpu_kernels=kernels.active(m.params))
        self._heads_d = heads_d
        prefill_fn = jax.jit(functools.partial(prefill, cfg=cfg, drafter=self.drafter,
                                               tree=self.tree, capacity=self.capacity))
        row1 = self._rows()
        with m.under_mesh():
            # the slots' drafter carry has the shapes a prefilled request's has
            pre = jax.eval_shape(prefill_fn, m.params, heads_d,
                                 np.zeros((1, self.buckets[0]), np.int32),
                                 np.ones((1,), np.int32), self._key_data(0), row1)
            draft = None
            if self.medusa:
                axis = batch_axis(self.drafter)
                draft = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                    x.shape[:axis] + (self.slots,) + x.shape[axis + 1:], x.dtype), pre.draft)
            state = jax.jit(init_state, static_argnums=(0, 2, 3, 4, 6))(
                cfg, m.params, self.slots, self._width, self.width, row1, draft)
        # the programs are lowered against the state's shapes at each window, never the
        # live (donated) state
        specs = {w: jax.tree.map(lambda a, x: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                   sharding=x.sharding),
                                 jax.eval_shape(functools.partial(resize, capacity=w), state),
                                 state)
                 for w in self.windows}
        self._state = state
        self._jits = dict(
            states=specs, pre_info={}, prefill=prefill_fn,
            insert=jax.jit(functools.partial(insert, axis=batch_axis(self.drafter)),
                           donate_argnums=(0,)),
            extend=jax.jit(functools.partial(extend, cfg=cfg, drafter=self.drafter,
                                             tree=self.tree, capacity=self.capacity)),
            move=jax.jit(move, donate_argnums=(0,)),
            step=jax.jit(engine_step, donate_argnums=(2,),
                         static_argnames=("cfg", "drafter", "tree", "k", "window", "rows",
                                          "plain"),
                         compiler_options=xla_options.for_backend()))
        self.compile_seconds += time.perf_counter() - t0

    def _program(self, kind: str, size: int, background: bool = False):
        """The compiled program (kind, size), compiled now if it is not yet. A request's
        need goes first: the background warm-up waits between its programs while one is
        pending (the lock alone would let it take every turn)."""
        prog = self._programs.get((kind, size))
        if prog is not None:
            return prog
        with self._demand_cv:
            if background:  # after requests' compiles, and not while requests run
                deadline = time.perf_counter() + BACKGROUND_YIELD_S
                while self._demand or (self._busy() and time.perf_counter() < deadline
                                       and self._stop_reason is None):
                    self._demand_cv.wait(0.02)
            else:
                self._demand += 1
        try:
            with self._compile_lock:
                prog = self._programs.get((kind, size))
                if prog is None:
                    prog = self._build(kind, size)
        finally:
            if not background:
                with self._demand_cv:
                    self._demand -= 1
                    self._demand_cv.notify_all()
        return prog

    def _size_name(self, kind: str, size) -> str:
        if kind in ("step", "plain"):
            return f"window {size[0]}, {size[1]} slot{'s' if size[1] > 1 else ''}"
        if kind == "resize":
            return f"window {size[0]} to {size[1]}"
        if kind == "extend":
            return f"bucket {size[0]}, window {size[1]}"
        if kind == "move":
            return f"window {size}"
        bucket, n = size[:2]
        return (f"bucket {bucket}" + (f", {n} prompts" if n > 1 else "")
                + (f", window {size[2]}" if kind == "insert" else ""))

    def _build(self, kind: str, size):
        self._setup()
        j, m = self._jits, self.model
        if kind == "insert" and size[:2] not in j["pre_info"]:
            self._program("prefill", size[:2])  # insert is lowered against its output
        self.compiling = (kind, size)
        t0 = time.perf_counter()
        try:
            if kind == "prefill":
                bucket, n = size
                lowered = j["prefill"].lower(
                    m.params, self._heads_d, np.zeros((n, bucket), np.int32),
                    np.ones((n,), np.int32), np.concatenate([self._key_data(0)] * n),
                    self._stack_rows([self._rows()] * n))
                prog, j["pre_info"][size] = lowered.compile(), lowered.out_info
            elif kind == "insert":
                prog = j["insert"].lower(j["states"][size[2]], j["pre_info"][size[:2]],
                                         np.int32(0), np.int32(0)).compile()
            elif kind == "extend":  # and the insert of what it prefilled
                bucket, window = size
                state = j["states"][window]
                lowered = j["extend"].lower(m.params, self._heads_d, state.cache,
                                            np.zeros((1, bucket), np.int32), np.int32(1),
                                            np.full((1,), 2, np.int32), self._key_data(0),
                                            self._rows(), np.int32(0))
                prog = (lowered.compile(), j["insert"].lower(
                    state, lowered.out_info, np.int32(0), np.int32(0)).compile())
            elif kind == "move":
                prog = j["move"].lower(j["states"][size], np.int32(0), np.int32(0)).compile()
            elif kind == "resize":
                out = j["states"][size[1]]
                prog = jax.jit(functools.partial(resize, capacity=size[1]),
                               out_shardings=jax.tree.map(lambda x: x.sharding, out)).lower(
                    j["states"][size[0]]).compile()
            elif kind in ("step", "plain"):
                window, rows = size
                prog = j["step"].lower(m.params, self._heads_d, j["states"][window],
                                       np.int32(1),
                                       cfg=self.cfg,
                                       drafter=self.drafter, tree=self.tree, k=self.k,
                                       window=window, rows=rows,
                                       plain=kind == "plain").compile()
            else:
                raise ValueError(f"no program {kind!r}")
        finally:
            self.compiling = None
        seconds = time.perf_counter() - t0
        self.compile_seconds += seconds
        self._programs[(kind, size)] = prog
        if self.log is not None:
            self.log(f"compiled {kind} ({self._size_name(kind, size)}) in {seconds:.1f} s "
                     f"[{len(self._programs)}/{self._program_count()}]")
        if all(p in self._programs for p in self.first_programs()):
            self._ready.set()
        if len(self._programs) == self._program_count():
            self._all_compiled.set()
        return prog

    def compile(self, programs: list[tuple[str, int]] | None = None,
                background: bool = False):
        """Compile `programs` (default: all of them) now; each is compiled once."""
        with self._compile_lock:
            self._setup()
        for kind, size in (self.programs() if programs is None else programs):
            if self._stop_reason is not None:
                return
            self._program(kind, size, background=background)

    def _warm(self, warmup: str):
        """The background warm-up: every program in `programs` order ("background"), or
        only the decode state ("lazy")."""
        try:
            if warmup == "lazy":
                with self._compile_lock:
                    self._setup()
                self._ready.set()
                return
            self.compile(background=True)
        except Exception as e:  # noqa: BLE001 - every request hears about it
            self.stop(f"compiling failed: {e!r}", timeout=0)
            if self.log is not None:
                self.log(f"error: compiling failed: {e!r}")

    def _busy(self) -> bool:
        """Requests submitted and not finished (waiting, being admitted, or running), or
        held by the caller (`hold`: a server still reading or answering one)."""
        return self._unfinished > 0 or self._held > 0

    def hold(self):
        """Count a request the caller is handling outside the engine (reading, tokenizing,
        sending the answer): the background warm-up waits for it as for a running one
        (its tracing would slow the caller's thread by holding the GIL). `release` ends it."""
        with self._finish_lock:
            self._held += 1

    def release(self):
        with self._finish_lock:
            self._held = max(0, self._held - 1)

    def _bucket(self, n: int, batch: int = 1) -> int:
        """The bucket a prompt of n tokens is prefilled in, in a batch of `batch`: the
        smallest compiled one that holds it, else the smallest that does (compiled now)."""
        fits = [b for b in self.buckets if b >= n]
        return next((b for b in fits if ("prefill", (b, batch)) in self._programs), fits[0])

    def _batch(self, waiting: int) -> int:
        """Prompts to prefill in one call when `waiting` can be admitted now: the largest
        batch bucket that holds no more than them, compiled ones first (a compile would
        hold every one of them back)."""
        fits = [n for n in self.prefill_batches if n <= waiting]
        compiled = [n for n in fits if any(("prefill", (b, n)) in self._programs
                                           for b in self.buckets)]
        return max(compiled or fits)

    @staticmethod
    def _stack_rows(rows: list[Rows]) -> Rows:
        return jax.tree.map(lambda *x: np.concatenate(x), *rows)

    # --- public

    def start(self, warmup: str = "all"):
        """Start the engine thread. warmup "all": compile every program first (returns
        when done); "background": return at once, a second thread compiles the programs
        (`first_programs` first; `status()["ready"]` says when they are in); "lazy": compile
        each program when a request first needs it. A request that needs a program not yet
        compiled waits for it, whatever the warm-up."""
        if warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {', '.join(WARMUPS)}, got {warmup!r}")
        self._lazy = warmup == "lazy"
        if warmup == "all":
            self.compile()
        else:
            self._warm_thread = threading.Thread(target=self._warm, args=(warmup,),
                                                 name="medusa-compile", daemon=True)
            self._warm_thread.start()
        self._thread = threading.Thread(target=self._loop, name="medusa-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, req: Request) -> Request:
        """Queue a request (checked first: ValueError; QueueFull past the bound)."""
        self.check(len(req.prompt), req.max_tokens)
        sampled = req.temperature > 0
        given = {"typical_epsilon": req.epsilon, "typical_delta": req.delta}
        for name, value in given.items():
            if value is not None and not (self.medusa and self.acceptance == "typical"):
                how = ("plain decoding" if not self.medusa
                       else f"{self.acceptance} acceptance")
                raise ValueError(f"{name} applies to typical acceptance (infer.serve "
                                 f"--acceptance typical); this server runs {how}")
        d = Sampling()
        sampling.check(self.acceptance if sampled else "greedy",
                       req.temperature if sampled else 1.0, req.top_k, req.top_p,
                       d.epsilon if req.epsilon is None else req.epsilon,
                       d.delta if req.delta is None else req.delta)
        if len(set(self.eos) | set(req.stop_ids)) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP - len(self.eos)} stop token ids")
        with self._cv:
            if self._stop_reason is not None:
                raise RuntimeError(f"the engine has stopped: {self._stop_reason}")
            if len(self._waiting) >= self.max_queue + self._free_slots():
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            req.id, req.t_submit = next(self._ids), time.perf_counter()
            with self._finish_lock:
                self._unfinished += 1
            self._waiting.append(req)
            self._cv.notify()
        return req

    def cancel(self, req: Request):
        """Stop a request (a client went away): its slot is freed at the next iteration."""
        req.cancelled = True
        with self._cv:
            self._cv.notify()

    def stop(self, reason: str = "the server is shutting down", timeout: float = 10.0):
        """End the loop; every waiting or running request gets an error event."""
        with self._cv:
            if self._stop_reason is None:
                self._stop_reason = reason
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():  # inside a device call or a compile: tell them now
                with self._cv:
                    waiting, self._waiting = list(self._waiting), collections.deque()
                for req in waiting + [s.req for s in self._slots if s.req is not None]:
                    self._finish(req, "error", error=self._stop_reason)

    def queue_depth(self) -> int:
        return len(self._waiting)

    def slots_in_use(self) -> int:
        return sum(s.req is not None for s in self._slots)

    def _free_slots(self) -> int:
        return sum(s.req is None for s in self._slots)

    # --- the loop (engine thread only)

    def _finish(self, req: Request, reason: str, error: str | None = None, tokens=()):
        with self._finish_lock:  # `stop` may finish requests from another thread
            if req.finished:
                return
            req.finished = True
            self._unfinished -= 1
        self.metrics.requests[reason] += 1
        try:
            req.on_event(list(tokens), reason, error)
        except Exception:  # a callback must not stop the engine
            pass

    def _deliver(self, req: Request, tokens: list[int]) -> bool:
        """Hand tokens to a live request; True when it has finished."""
        stops = set(self.eos) | set(req.stop_ids)
        out, reason = [], None
        for t in tokens:
            out.append(t)
            req.emitted += 1
            if t in stops:
                reason = "stop"
                break
            if req.emitted >= req.max_tokens:
                reason = "length"
                break
        self.metrics.generation_tokens += len(out)
        req.tokens.extend(out)
        if req.t_first is None:
            req.t_first = time.perf_counter()
            ttft = req.t_first - req.t_submit
            self.metrics.ttft_sum += ttft
            self.metrics.ttft_count += 1
            self.metrics.ttft = (self.metrics.ttft + [ttft])[-1000:]
        if reason is not None:
            self._finish(req, reason, tokens=out)
            return True
        try:
            req.on_event(out, None, None)
        except Exception:
            req.cancelled = True
        return False

    def _key_data(self, seed: int | None) -> np.ndarray:
        """[1, ...] uint32 key data of a request's PRNG stream (all 64 bits of the seed)."""
        if seed is None:
            seed = int(np.random.randint(2**63))
        if self._key_shape == (2,):  # threefry: the seed's high and low words
            seed &= 2**64 - 1
            return np.array([[seed >> 32, seed & 0xFFFFFFFF]], np.uint32)
        return np.asarray(jax.random.key_data(jax.random.key(seed)))[None]

    def _free(self, i: int, keep: bool = True, window: int | None = None):
        """Free slot i. keep: its cache goes on serving as a cached prefix (a request that
        finished: the device row is done). A cancelled request's row may still run on the
        device, so nothing of it is kept. A done row is still stepped: it writes at its
        length, or at the last `fed` slots of the cache where that is past the end, so only
        what lies before those is kept (`window`: the cache's length in the call the request
        ended in, if narrower than now)."""
        req = self._slots[i].req
        held = min(window or self._width, self._width) - self.fed
        self._kept[i] = self._slot_tokens(req)[:held] if keep and req is not None else []
        self._kept_at[i] = next(self._ticks)
        self._slots[i] = _Slot()

    def _usable(self, kind: str, size) -> bool:
        """A prefix-cache program runs only once compiled (a request never waits for one),
        but under the lazy warm-up, when first needed."""
        return self._lazy or (kind, size) in self._programs

    def _keep_elsewhere(self, i: int, taken: set[int]):
        """Slot i (free) is about to take a request: move what its cache holds to the free
        slot (not in `taken`) holding nothing, else the least recently used one."""
        if self._kept[i]:
            spare = [j for j, s in enumerate(self._slots)
                     if s.req is None and j != i and j not in taken]
            if spare and self._usable("move", self._width):
                j = min(spare, key=lambda j: (bool(self._kept[j]), self._kept_at[j]))
                self._state = self._program("move", self._width)(self._state, np.int32(i),
                                                                 np.int32(j))
                self._kept[j], self._kept_at[j] = self._kept[i], self._kept_at[i]
        self._kept[i] = []

    @staticmethod
    def _slot_tokens(req: Request) -> list[int]:
        """The tokens whose keys/values a request's slot holds for certain: its prompt and
        every token handed out but the last (each step feeds the tokens it emits; the last
        one may not have been fed)."""
        return req.prompt + req.tokens[:-1]

    def _prefix_hit(self, req: Request) -> tuple[int, int, int, int] | None:
        """Where to prefill `req` from a cached prefix: (source slot, cached tokens used,
        the rest's bucket, window), or None when no slot holds enough of its prompt to
        prefill the rest in a shorter bucket (or that program is not compiled yet)."""
        if not (self.prefix_cache and req.cache_prompt):
            return None
        n, best, src = len(req.prompt), 0, -1
        for i, s in enumerate(self._slots):
            same = common_prefix(self._slot_tokens(s.req) if s.req is not None
                                 else self._kept[i], req.prompt)
            if same > best:
                best, src = same, i
        start = min(best, n - 1)  # the last prompt token is fed: its logits choose the root
        if start < 1:
            return None
        bucket = next((q for q in self.extend_buckets if q >= n - start), self.capacity)
        if bucket >= next(q for q in self.buckets if q >= n):
            return None
        start = min(start, self.capacity - bucket)  # the cache must hold start + bucket
        window = max(self._width, self._fit(start + bucket))
        if not self._usable("extend", (bucket, window)):
            return None
        return src, start, bucket, window

    def _extend(self, req: Request, slot: int, hit: tuple[int, int, int, int]):
        """Prefill `req` into `slot` after its cached prefix (`_prefix_hit`'s `hit`)."""
        src, start, bucket, window = hit
        n = len(req.prompt)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n - start] = req.prompt[start:]
        rows = self._request_rows(req)
        self._resize(window)
        # where the slot's cached tokens go: into the source once it is read, if that is
        # free and this request goes on from all it holds (a repeated prompt, a next turn),
        # else to a spare slot now
        stash = slot
        continues = start >= min(n, len(self._kept[src])) - 1  # from all the source holds
        if src == slot:
            if continues:
                self._kept[slot] = []
            else:  # a copy first: the rest of what it holds is of use to others
                self._keep_elsewhere(slot, set())
        elif (self._kept[slot] and self._slots[src].req is None and continues
              and self._usable("move", self._width)):
            stash, self._kept[src] = src, self._kept[slot]
            self._kept_at[src] = self._kept_at[slot]
            self._kept[slot] = []
        else:
            self._keep_elsewhere(slot, {src})
        prefill_after, put = self._program("extend", (bucket, self._width))
        pre = prefill_after(self.model.params, self._heads_d, self._state.cache, tokens,
                            np.int32(start), np.full((1,), n, np.int32),
                            self._key_data(req.seed), rows, np.int32(src))
        pre.root.copy_to_host_async()
        if stash != slot:  # after the read above: the runtime orders it behind
            self._state = self._program("move", self._width)(self._state, np.int32(slot),
                                                             np.int32(stash))
        self._state = put(self._state, pre, np.int32(slot), np.int32(0))
        root = pre.root
        self._slots[slot] = _Slot(req=req, known_len=n, unread=0, limit=n + req.max_tokens,
                                  skip=1)
        req.cached = start
        m = self.metrics
        m.prompt_tokens += n
        m.prefix_hits += 1
        m.prefix_tokens += start
        return req, slot, root, 0

    def _admit(self) -> list[tuple[Request, int, jax.Array, int]]:
        """Prefill waiting requests, several in one call where they fit the same bucket, and
        insert them into free slots. Returns (request, slot, the batch's first tokens on the
        device, its row) for each: `_first_tokens` hands them out."""
        admitted = []
        while True:
            with self._cv:
                free = [i for i, s in enumerate(self._slots) if s.req is None]
                gone = []
                while self._waiting and self._waiting[0].cancelled:
                    gone.append(self._waiting.popleft())
                batch, hit = [], None
                if free and self._waiting:
                    hit = self._prefix_hit(self._waiting[0])
                if hit is not None:  # the head goes alone, after its cached prefix
                    batch = [self._waiting.popleft()]
                elif free and self._waiting:
                    # the head's bucket, and the requests behind it that fit there and
                    # have no cached prefix (one cancelled meanwhile is finished by
                    # `_first_tokens`)
                    n = self._batch(min(len(free), len(self._waiting)))
                    bucket = self._bucket(len(self._waiting[0].prompt), n)
                    batch = [r for j, r in enumerate(itertools.islice(self._waiting, len(free)))
                             if len(r.prompt) <= bucket
                             and (j == 0 or self._prefix_hit(r) is None)][:n]
                    batch = batch[:self._batch(len(batch))]
                    for r in batch:
                        self._waiting.remove(r)
            for r in gone:
                self._finish(r, "cancelled")
            if hit is not None:
                admitted.append(self._extend(batch[0], free[0], hit))
                continue
            if not batch:
                if gone:
                    continue
                return admitted
            n = len(batch)
            bucket = self._bucket(max(len(r.prompt) for r in batch), n)
            tokens = np.zeros((n, bucket), np.int32)
            lengths = np.array([len(r.prompt) for r in batch], np.int32)
            rows = []
            for j, req in enumerate(batch):
                tokens[j, :lengths[j]] = req.prompt
                rows.append(self._request_rows(req))
            keys = np.concatenate([self._key_data(r.seed) for r in batch])
            pre = self._program("prefill", (bucket, n))(self.model.params, self._heads_d,
                                                        tokens, lengths, keys,
                                                        self._stack_rows(rows))
            pre.root.copy_to_host_async()
            self.metrics.prefill_calls += 1
            self.metrics.prefills_by_batch[n] += 1
            self._resize(max(self._width, self._fit(bucket)))  # the prompts fit the cache
            insert = self._program("insert", (bucket, n, self._width))
            for j, (req, i) in enumerate(zip(batch, free)):
                self._keep_elsewhere(i, set(free[:n]))
                self._state = insert(self._state, pre, np.int32(i), np.int32(j))
                # the first token goes out now (`_first_tokens`); the slot's first step
                # emits it again, and that copy is skipped
                length = int(lengths[j])
                self._slots[i] = _Slot(req=req, known_len=length, unread=0,
                                       limit=length + req.max_tokens, skip=1)
                self.metrics.prompt_tokens += length
                admitted.append((req, i, pre.root, j))

    def _first_tokens(self, admitted):
        roots = {}  # one read per prefill batch
        for req, i, root, j in admitted:
            if self._slots[i].req is not req:
                continue
            if req.cancelled:
                self._finish(req, "cancelled")
                self._free(i, keep=False)
                continue
            if id(root) not in roots:
                roots[id(root)] = np.asarray(root)
            if self._deliver(req, [int(roots[id(root)][j])]):
                self._free(i)  # ended by its first token (the device slot is idle)

    def _step_kind(self) -> str:
        """"plain" while more than `plain_above` slots are live, else "step"."""
        live = sum(s.req is not None for s in self._slots)
        return "plain" if self.plain_above is not None and live > self.plain_above else "step"

    def _step_size(self, kind: str = "step", steps: int | None = None) -> tuple[int, int]:
        """(window, slot bucket) of the next call of `steps` steps (default K), over the
        fewest slots that hold the highest one in use. The window is the cache's length now
        if every live slot's steps fit in it; else the narrowest they fit in; and no wider
        than the narrowest that holds every live request to its end (a resize copies the
        cache once, where a call through a narrower window than the cache would copy it at
        every call). A compiled program that covers both if that one is not compiled yet."""
        steps = self.k if steps is None else steps
        need, hold, used = 0, 0, 0
        for i, s in enumerate(self._slots):
            if s.req is not None:
                used = i + 1
                start = min(s.known_len + s.unread * self.width, s.limit)
                need = max(need, min(start + (steps - 1) * self.width, s.limit) + self.fed)
                hold = max(hold, s.limit + self.fed)
        target = min(max(self._width, self._fit(need)), self._fit(hold))
        windows = [w for w in self.windows if w >= need] or self.windows[-1:]
        counts = [r for r in self.slot_buckets if r >= used]
        fits = [(w, r) for r in counts for w in windows]
        if kind == "plain":  # more live slots than plain_above: only those buckets hold them
            fits = [(w, r) for w, r in fits if r > self.plain_above]
        compiled = [x for x in fits if (kind, x) in self._programs]
        best = [x for x in fits if x[0] == target]
        if best and best[0] in compiled:
            return best[0]
        return min(compiled, key=lambda x: x[0] * x[1]) if compiled else (best or fits)[0]

    def _resize(self, window: int):
        """Resize the slots' cache to `window` slots, a window at a time."""
        while self._width != window:
            i = self.windows.index(self._width)
            shrink = window < self._width
            nxt = self.windows[i - 1 if shrink else i + 1]
            self._state = self._program("resize", (self._width, nxt))(self._state)
            self._width = nxt
            self.metrics.resizes += 1
            if shrink:  # a narrower cache keeps less; and a free slot's steps write at its
                # length, or at the last `fed` slots where that is past the end
                self._kept = [kept[:nxt - self.fed] for kept in self._kept]

    def _ending(self) -> bool:
        """Whether every live slot will most likely have ended within the calls already
        dispatched (at the tokens per step seen so far). Another call now would then compute
        for nobody, and the next request's prefill would wait for it; if a slot has not
        ended after all, the next iteration dispatches once its tokens are read (only the
        overlap of one call with the host's work is lost)."""
        m = self.metrics
        per_step = m.step_tokens / m.slot_steps if m.slot_steps else 1.0
        return all(s.unread > 0 and s.known_len + s.unread * per_step >= s.limit
                   for s in self._slots if s.req is not None)

    def _call_steps(self, kind: str, rows: int) -> int:
        """Steps for the next call: K while every slot is busy and nobody waits; else as
        many as keep the call within `short_call_ms` at the step time measured for this
        kind and slot bucket (1 until measured), so that a request arriving now waits less
        for the calls ahead of its prefill."""
        if self.short_call_ms is None or self.k == 1:
            return self.k
        if self._waiting or any(s.req is None for s in self._slots):
            step_ms = self._step_ms.get((kind, rows))
            if step_ms is None:
                return 1
            return int(min(self.k, max(1, self.short_call_ms // step_ms)))
        return self.k

    def _long(self, call: tuple) -> bool:
        """Whether a dispatched call most likely takes `overlap_ms` or more (at the step
        time measured for its kind and slot bucket)."""
        kind, rows, steps = call[:3]
        step_ms = self._step_ms.get((kind, rows))
        return (self.overlap_ms is not None and step_ms is not None
                and step_ms * steps >= self.overlap_ms)

    def _timed(self, call: tuple, done: float, out_steps=None):
        """Update the step time of a call read at `done` (perf_counter seconds): it ran
        from its dispatch or the previous call's end, whichever is later (calls run in
        order), for as many steps as its longest-live slot took (`out_steps` [S]; a call
        stops once all its slots have finished); a call queued behind a prefill is not
        timed."""
        kind, rows, steps, dispatched, behind_prefill = call[:5]
        began, self._last_done = max(dispatched, self._last_done), done
        if behind_prefill:
            return
        ran = int(np.max(out_steps)) if out_steps is not None else steps
        if ran < 1:  # every slot had finished before it: nothing ran
            return
        ms = (done - began) * 1e3 / ran
        old = self._step_ms.get((kind, rows))
        self._step_ms[(kind, rows)] = ms if old is None else 0.8 * old + 0.2 * ms

    def _process(self, out, owners: list[Request | None], call: tuple):
        tokens, counts, steps, lengths = (np.asarray(x) for x in
                                          (out.tokens, out.counts, out.steps, out.lengths))
        self._timed(call, time.perf_counter(), steps)
        for i, req in enumerate(owners[:len(counts)]):  # the call's slots: the others are free
            slot = self._slots[i]
            if req is None or slot.req is not req:
                continue  # the slot changed hands: these tokens belong to nobody now
            slot.known_len, slot.unread = int(lengths[i]), slot.unread - call[2]
            if req.cancelled:
                self._free(i, keep=False)
                self._finish(req, "cancelled")
                continue
            n = int(counts[i])
            self.metrics.slot_steps += int(steps[i])
            self.metrics.step_tokens += n
            skip = min(slot.skip, n)
            slot.skip -= skip
            if n > skip and self._deliver(req, [int(t) for t in tokens[i, skip:n]]):
                self._free(i, window=call[5])

    def _loop(self):
        pending = None
        try:
            while True:
                with self._cv:
                    if self._stop_reason is not None:
                        break
                    idle = (pending is None and not self._waiting
                            and all(s.req is None for s in self._slots))
                    if idle:
                        self._cv.wait(0.5)
                        continue
                for i, s in enumerate(self._slots):  # cancelled while running
                    if s.req is not None and s.req.cancelled:
                        self._finish(s.req, "cancelled")
                        self._free(i, keep=False)
                if pending is not None and self._long(pending[2]):
                    # read a long call before dispatching the next: a request arriving
                    # meanwhile is then prefilled behind one call, not two
                    self._process(*pending)
                    pending = None
                admitted = self._admit()
                nxt = None
                if any(s.req is not None for s in self._slots) and not self._ending():
                    owners = [s.req for s in self._slots]
                    kind = self._step_kind()
                    steps = self._call_steps(kind, self._step_size(kind)[1])
                    size = self._step_size(kind, steps)
                    step = self._program(kind, size)
                    self._resize(size[0])
                    dispatched = time.perf_counter()
                    self._state, out = step(self.model.params, self._heads_d, self._state,
                                            np.int32(steps))
                    for x in (out.tokens, out.counts, out.steps, out.lengths):
                        x.copy_to_host_async()
                    for s in self._slots:
                        if s.req is not None:
                            s.unread += steps
                    self.metrics.calls += 1
                    self.metrics.calls_by_slots[size[1]] += 1
                    self.metrics.calls_by_steps[steps] += 1
                    self.metrics.plain_calls += kind == "plain"
                    nxt = (out, owners, (kind, size[1], steps, dispatched, bool(admitted),
                                         size[0]))
                self._first_tokens(admitted)  # while the step runs
                if pending is not None:
                    self._process(*pending)
                pending = nxt
        except Exception as e:  # noqa: BLE001 - every request hears about it
            with self._cv:
                self._stop_reason = self._stop_reason or f"engine error: {e!r}"
            raise
        finally:
            reason = self._stop_reason or "stopped"
            with self._cv:
                waiting, self._waiting = list(self._waiting), collections.deque()
            for req in waiting + [s.req for s in self._slots if s.req is not None]:
                self._finish(req, "error", error=reason)
            self._slots = [_Slot() for _ in range(self.slots)]


def generate_offline(engine: Engine, prompts: list[list[int]], max_tokens: int,
                     **sampling) -> list[list[int]]:
    """Run prompts through a started engine and wait: each prompt's tokens (a helper for
    tests and checks)."""
    results = [[] for _ in prompts]
    done = threading.Semaphore(0)
    reasons = [None] * len(prompts)

    def cb(i):
        def on_event(tokens, finish, error):
            results[i].extend(tokens)
            if finish is not None:
                reasons[i] = error or finish
                done.release()
        return on_event

    for i, p in enumerate(prompts):
        engine.submit(Request(prompt=list(p), max_tokens=max_tokens, on_event=cb(i), **sampling))
    for _ in prompts:
        done.acquire()
    return results
