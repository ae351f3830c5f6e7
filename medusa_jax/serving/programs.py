"""The serving engine's device programs, and `Programs`, which compiles them.

The serving loop of JetStream / jax-llm-examples: jitted programs, each compiled once per
shape it uses (`layout`'s typed keys), all before serving, in the background while the
first requests are served, or each when first needed:
  - `prefill` (N waiting requests together, N a prefill batch bucket, their prompts
    right-padded to a length bucket): an N-row state (their caches, their first tokens
    chosen with their own sampling, the drafter started);
  - `insert` (the decode state donated): puts row j of a prefilled batch into slot b;
  - `extend` (the prefix cache): a prompt whose first tokens are in a slot's cache already
    is prefilled only after them, from a copy of that slot's cache row, then `insert`ed;
    `move` copies a slot's cache row to another;
  - `resize`: the slots' cache (and a drafter's own cache, `Drafter.window`) to another
    attention window;
  - `engine_step`: K shared steps (`decoding.step`, the offline decoders' step) for the
    first R slots in one call, each slot at its own length; returns a fixed [R, K*W] token
    buffer and per-slot counts (W: a step's tokens at most).
Every slot is a row of one `DecodeState`, live or free, with its own sampling, stop tokens
and token limit (`sampling.Rows`).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.decoding import step
from medusa_jax.decoding.drafter import carry_window, put_leading
from medusa_jax.decoding.sampling import Rows
from medusa_jax.decoding.step import DecodeState, batch_axis, follows_plain_steps, static_tree
from medusa_jax.model.backbone import is_decoding_layout
from medusa_jax.model.cache import KVCache
from medusa_jax.model.config import ModelConfig
from medusa_jax.runtime import pytree as struct
from medusa_jax.runtime import xla_options
from medusa_jax.serving import layout as lo  # the program keys and sizes

# the background warm-up waits while requests run (compiling competes with them for the
# CPU and the GIL), but no longer than this per program under a steady load
BACKGROUND_YIELD_S = 2.0


@struct.dataclass
class StepOut:
    tokens: jax.Array  # [S, K*W] int32: tokens[b, :counts[b]] are slot b's new tokens
    counts: jax.Array  # [S] int32
    steps: jax.Array  # [S] int32: steps slot b was live for
    lengths: jax.Array  # [S] int32: cache lengths after the call
    done: jax.Array  # [S] bool
    pool_hits: jax.Array | None  # int32 scalar: shared-pool lookups that hit (None: no pool)


_ROW_FIELDS = ("root", "count", "steps", "hist", "done", "keys", "rows")  # besides cache, draft


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


def move(state: DecodeState, src: jax.Array, dst: jax.Array) -> DecodeState:
    """Copy slot `src`'s cache row over slot `dst`'s (int32 scalars; the state donated):
    a finished request's cache kept as a prefix while its slot takes a new request. Its
    length goes along (a free slot's steps still write at its length, past what it holds),
    and `dst` is marked done (it may have held a cancelled request, still running)."""
    return state.replace(cache=state.cache.copy_row(src, dst),
                         done=state.done.at[dst].set(True))


def take_row(pre: DecodeState, row: jax.Array, axis: int) -> DecodeState:
    """Row `row` (int32 scalar) of a prefilled batch, as a one-row state; `axis`: the
    drafter carry's batch axis."""
    one = lambda a, ax=0: jax.lax.dynamic_slice_in_dim(a, row, 1, ax)  # noqa: E731
    draft = None if pre.draft is None else jax.tree.map(lambda a: one(a, axis), pre.draft)
    fields = {f: jax.tree.map(one, getattr(pre, f)) for f in _ROW_FIELDS}
    return pre.replace(cache=pre.cache.row(row), draft=draft, **fields)


def insert(state: DecodeState, pre: DecodeState, slot: jax.Array, row: jax.Array, *,
           axis: int, drafter=None) -> DecodeState:
    """Put row `row` of a prefilled batch into slot `slot` (int32 scalars); `axis`: the
    drafter carry's batch axis; `drafter`'s carry is fitted to the slots' window
    (`Drafter.window`: the prompt is within it). A first token that ends the request leaves
    the slot idle (the host hands it out)."""
    pre = take_row(pre, row, axis)
    pre = pre.replace(draft=carry_window(drafter, pre.draft, state.cache.capacity))
    cache = state.cache.put_row(pre.cache, slot)  # its first P slots: a prefill's
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


def extend(params, heads, cache: KVCache, tokens: jax.Array, start: jax.Array,
           length: jax.Array, key: jax.Array, rows: Rows, src: jax.Array,
           prompt: jax.Array | None = None, *, cfg: ModelConfig, drafter, tree,
           capacity: int) -> DecodeState:
    """A prompt whose first `start` tokens are in slot `src`'s row of the slots' `cache`
    (int32 scalars; read only): the rest, tokens [1, Q] (right-padded; start + Q within
    the cache), prefilled after a copy of that row. length [1]: the whole prompt's; key
    [1, ...]: its key data. prompt [1, W]: the whole prompt (right-padded), for a drafter
    that keeps context and is begun on it again (None otherwise). A one-row state, as
    `prefill`'s, for `insert`. (Updating the
    slots' cache here too would make XLA copy all of it, to read the row first.)"""
    width = 1 if drafter is None else static_tree(tree).depth + 1
    row = cache.row(src).replace(lengths=start[None])
    return step.start_after_prefix(params, cfg, row, tokens, length,
                                   jax.random.wrap_key_data(key), rows, drafter, heads, width,
                                   draft_capacity=capacity, prompt=prompt)


def leading_rows(s: DecodeState, rows: int, window: int, axis: int,
                 drafter=None) -> DecodeState:
    """The first `rows` slots of `s`, their caches cut to the first `window` slots (all a
    step attends or writes there), `drafter`'s own cache too (`Drafter.window`); `axis`:
    the drafter carry's batch axis."""
    head = lambda a: a[:rows]  # noqa: E731
    draft = None if s.draft is None else carry_window(drafter, jax.tree.map(
        lambda a: jax.lax.slice_in_dim(a, 0, rows, axis=axis), s.draft), window)
    return s.replace(cache=s.cache.leading(rows, window), draft=draft,
                     **{f: jax.tree.map(head, getattr(s, f)) for f in _ROW_FIELDS})


def put_leading_rows(full: DecodeState, sub: DecodeState) -> DecodeState:
    """`leading_rows`' inverse: write `sub` back over the first slots of `full` (donated,
    so in place)."""
    draft = put_leading(full.draft, sub.draft)
    put = {f: jax.tree.map(lambda a, b: a.at[:b.shape[0]].set(b), getattr(full, f),
                           getattr(sub, f)) for f in _ROW_FIELDS}
    return full.replace(cache=full.cache.put_leading(sub.cache), draft=draft, **put)


def resize(s: DecodeState, *, capacity: int, drafter=None) -> DecodeState:
    """`s` with each slot's cache `capacity` slots long, `drafter`'s own cache too
    (`Drafter.window`): the slots' memory follows the window."""
    return s.replace(cache=s.cache.resized(capacity),
                     draft=carry_window(drafter, s.draft, capacity))


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
    drafts from its own state again; a drafter that follows plain steps is handed their
    tokens instead). Returns the state and those slots' tokens (`rows`
    rows)."""
    if drafter is not None and not plain:
        one = functools.partial(step.medusa_step, params, cfg, drafter, heads, tree,
                                window=window)
        width = static_tree(tree).depth + 1
    else:
        # a drafter that follows plain steps is handed their tokens
        one = functools.partial(step.plain_step, params, cfg, window=window,
                                drafter=drafter if follows_plain_steps(drafter) else None)
        width = 1
    full, axis = s, batch_axis(drafter)
    rows = s.root.shape[0] if rows is None else rows
    # One client pays for one row, not S; and the loop carries only the window it attends
    # over: a cache read through a narrower window inside the loop makes XLA copy the whole
    # cache at every step, the window cut once per call does not.
    part = rows < s.root.shape[0] or window < s.cache.capacity
    if part:
        s = leading_rows(s, rows, window, axis, drafter)
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
    hits = None if drafter is None else drafter.pool_hits(s.draft)  # a shared pool's
    if hits is not None:
        hits = jnp.sum(hits - drafter.pool_hits(s0.draft))
    out = StepOut(tokens=buf, counts=counts, steps=s.steps - s0.steps,
                  lengths=s.cache.lengths, done=s.done, pool_hits=hits)
    return (put_leading_rows(full, s) if part else s), out


def stack_rows(rows: list[Rows]) -> Rows:
    """Rows of one request each (host arrays), as one batch."""
    return jax.tree.map(lambda *x: np.concatenate(x), *rows)


@functools.cache
def _key_shape() -> tuple[int, ...]:
    return jax.random.key_data(jax.random.key(0)).shape


def key_data(seed: int | None) -> np.ndarray:
    """[1, ...] uint32 key data of a request's PRNG stream (all 64 bits of the seed)."""
    if seed is None:
        seed = int(np.random.randint(2**63))
    if _key_shape() == (2,):  # threefry: the seed's high and low words
        seed &= 2**64 - 1
        return np.array([[seed >> 32, seed & 0xFFFFFFFF]], np.uint32)
    return np.asarray(jax.random.key_data(jax.random.key(seed)))[None]


# ----------------------------------------------------------------------------- Programs


class Programs:
    """The compiled programs of one engine, by typed key (`layout`), each compiled once:
    `get(key)` compiles it when missing (a request's compile goes before the background
    warm-up's, which also waits while `busy()` says requests run). Holds the slots' decode
    state as built (`state`) and the drafter's prepared parameters (`heads`).

    model: a `medusa_jax.api.Medusa`; drafter / tree: the engine's (None: plain); row:
    `() -> Rows`, a default one-row sampling; busy: `() -> bool`; stopped: `() -> bool`
    (a warm-up gives up); log: a line per compiled program."""

    def __init__(self, model, layout: lo.Layout, *, drafter, tree, row: Callable[[], Rows],
                 busy: Callable[[], bool], stopped: Callable[[], bool],
                 log: Callable[[str], None] | None = None):
        self.model, self.cfg, self.layout = model, model.cfg, layout
        self.drafter, self.tree = drafter, tree
        self._row, self._busy, self._stopped, self.log = row, busy, stopped, log
        self.lazy = False  # `Engine.start(warmup="lazy")`: prefix-cache programs when needed
        self.keys = layout.programs()  # every program, in warm-up order
        self._compiled: dict = {}
        self._lock = threading.RLock()  # one compile at a time
        self._demand_cv = threading.Condition()
        self._demand = 0  # requests' compiles waiting for the lock
        self._jits = None  # the jitted functions and abstract states, once `setup` ran
        self.ready = threading.Event()  # the first requests' programs are compiled
        self.all_compiled = threading.Event()
        self.compiling = None  # the key being compiled now
        self.compile_seconds = 0.0  # summed over the programs compiled so far
        self.heads = None  # the drafter's parameters as its steps use them
        self.state: DecodeState | None = None  # the slots' state as built (then donated)

    def compiled(self, key) -> bool:
        return key in self._compiled

    def count(self) -> int:
        """Programs compiled so far."""
        return len(self._compiled)

    def setup(self):
        """The decode state and the jitted functions (once)."""
        with self._lock:
            if self._jits is None:
                self._setup()

    def _setup(self):
        t0 = time.perf_counter()
        m, cfg, lay = self.model, self.cfg, self.layout
        if self.drafter is not None:
            self.heads = self.drafter.prepare(m.heads, self.tree,
                                              cpu_kernels=kernels.active(m.params))
        prefill_fn = jax.jit(functools.partial(prefill, cfg=cfg, drafter=self.drafter,
                                               tree=self.tree, capacity=lay.capacity))
        row1 = self._row()
        with m.under_mesh():
            # the slots' drafter carry has the shapes a prefilled request's has
            pre = jax.eval_shape(prefill_fn, m.params, self.heads,
                                 np.zeros((1, lay.buckets[0]), np.int32),
                                 np.ones((1,), np.int32), key_data(0), row1)
            # (its own cache, if any, as wide as the slots' first window)
            draft = None
            if self.drafter is not None:
                axis = batch_axis(self.drafter)
                pre_draft = jax.eval_shape(
                    lambda d: carry_window(self.drafter, d, lay.windows[0]), pre.draft)
                draft = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                    x.shape[:axis] + (lay.slots,) + x.shape[axis + 1:], x.dtype), pre_draft)
            state = jax.jit(init_state, static_argnums=(0, 2, 3, 4, 6))(
                cfg, m.params, lay.slots, lay.windows[0], lay.width, row1, draft)
        # the programs are lowered against the state's shapes at each window, never the
        # live (donated) state
        specs = {w: jax.tree.map(lambda a, x: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                   sharding=x.sharding),
                                 jax.eval_shape(functools.partial(
                                     resize, capacity=w, drafter=self.drafter), state),
                                 state)
                 for w in lay.windows}
        self.state = state
        self._jits = dict(
            states=specs, pre_info={}, prefill=prefill_fn,
            insert=jax.jit(functools.partial(insert, axis=batch_axis(self.drafter),
                                             drafter=self.drafter),
                           donate_argnums=(0,)),
            extend=jax.jit(functools.partial(extend, cfg=cfg, drafter=self.drafter,
                                             tree=self.tree, capacity=lay.capacity)),
            move=jax.jit(move, donate_argnums=(0,)),
            step=jax.jit(engine_step, donate_argnums=(2,),
                         static_argnames=("cfg", "drafter", "tree", "k", "window", "rows",
                                          "plain"),
                         compiler_options=xla_options.for_backend()))
        self.compile_seconds += time.perf_counter() - t0

    def state_shapes(self, window: int) -> DecodeState:
        """The slots' state's shapes (and shardings) with a `window` cache."""
        self.setup()
        return self._jits["states"][window]

    def get(self, key, background: bool = False):
        """The compiled program `key`, compiled now if it is not yet. A request's need goes
        first: the background warm-up waits between its programs while one is pending (the
        lock alone would let it take every turn)."""
        prog = self._compiled.get(key)
        if prog is not None:
            return prog
        with self._demand_cv:
            if background:  # after requests' compiles, and not while requests run
                deadline = time.perf_counter() + BACKGROUND_YIELD_S
                while self._demand or (self._busy() and time.perf_counter() < deadline
                                       and not self._stopped()):
                    self._demand_cv.wait(0.02)
            else:
                self._demand += 1
        try:
            with self._lock:
                prog = self._compiled.get(key)
                if prog is None:
                    prog = self._build(key)
        finally:
            if not background:
                with self._demand_cv:
                    self._demand -= 1
                    self._demand_cv.notify_all()
        return prog

    def _build(self, key):
        if self._jits is None:
            self._setup()
        j, m = self._jits, self.model
        if isinstance(key, lo.InsertKey) and key.prefill not in j["pre_info"]:
            self.get(key.prefill)  # insert is lowered against its output
        self.compiling = key
        t0 = time.perf_counter()
        try:
            prog = self._lower(key, j, m)
        finally:
            self.compiling = None
        seconds = time.perf_counter() - t0
        self.compile_seconds += seconds
        self._compiled[key] = prog
        if self.log is not None:
            self.log(f"compiled {key.kind} ({key.describe()}) in {seconds:.1f} s "
                     f"[{len(self._compiled)}/{len(self.keys)}]")
        if all(p in self._compiled for p in self.layout.first_programs()):
            self.ready.set()
        if len(self._compiled) == len(self.keys):
            self.all_compiled.set()
        return prog

    def _lower(self, key, j: dict, m):
        """Lower and compile `key`'s program against abstract shapes."""
        if isinstance(key, lo.PrefillKey):
            n = key.batch
            lowered = j["prefill"].lower(
                m.params, self.heads, np.zeros((n, key.bucket), np.int32),
                np.ones((n,), np.int32), np.concatenate([key_data(0)] * n),
                stack_rows([self._row()] * n))
            j["pre_info"][key] = lowered.out_info
            return lowered.compile()
        if isinstance(key, lo.InsertKey):
            return j["insert"].lower(j["states"][key.window], j["pre_info"][key.prefill],
                                     np.int32(0), np.int32(0)).compile()
        if isinstance(key, lo.ExtendKey):  # and the insert of what it prefilled
            state = j["states"][key.window]
            lowered = j["extend"].lower(m.params, self.heads, state.cache,
                                        np.zeros((1, key.bucket), np.int32), np.int32(1),
                                        np.full((1,), 2, np.int32), key_data(0),
                                        self._row(), np.int32(0),
                                        np.zeros((1, key.window), np.int32)
                                        if self.drafter is not None and
                                        self.drafter.keeps_context else None)
            return (lowered.compile(), j["insert"].lower(
                state, lowered.out_info, np.int32(0), np.int32(0)).compile())
        if isinstance(key, lo.MoveKey):
            return j["move"].lower(j["states"][key.window], np.int32(0), np.int32(0)).compile()
        if isinstance(key, lo.ResizeKey):
            out = j["states"][key.dst]
            return jax.jit(functools.partial(resize, capacity=key.dst, drafter=self.drafter),
                           out_shardings=jax.tree.map(lambda x: x.sharding, out)).lower(
                j["states"][key.src]).compile()
        if isinstance(key, lo.StepKey):
            return j["step"].lower(m.params, self.heads, j["states"][key.window], np.int32(1),
                                   cfg=self.cfg, drafter=self.drafter, tree=self.tree,
                                   k=self.layout.k, window=key.window, rows=key.slots,
                                   plain=key.plain).compile()
        raise ValueError(f"no program {key!r}")

    def compile(self, keys=None, background: bool = False):
        """Compile `keys` (default: all of them) now; each is compiled once."""
        self.setup()
        for key in (self.keys if keys is None else keys):
            if self._stopped():
                return
            self.get(key, background=background)

    def status(self) -> dict:
        """ready (the first requests' programs are compiled), compiled / programs (counts),
        compiling (the program being compiled, or None)."""
        now = self.compiling
        return {"ready": self.ready.is_set(), "compiled": len(self._compiled),
                "programs": len(self.keys),
                "compiling": None if now is None else lo.describe(now)}
