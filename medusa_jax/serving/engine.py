"""Serving engine: continuous batching over S static slots.

The decoding step is `decoding.step`'s, the same the offline decoders run: every slot is a
row of its `DecodeState`, live or free, with its own sampling, stop tokens and token limit
(`sampling.Rows`). Any drafter, any tree (static or "dynamic:N"), and greedy rows beside
sampled ones (temperature > 0: rejection sampling, lossless, or typical acceptance:
`Engine(acceptance=...)`). Plain decoding is the same engine with the plain step.

Three parts, as JetStream's: `programs` (the device programs and their compilation),
`scheduler` (every decision, no JAX: slots, queue, prefix cache, call sizing) and this
module's `Engine`, the loop between them: one thread asks the scheduler for a plan, runs
its actions (prefill, insert, extend, move, resize, step), dispatches step N+1 before it
reads step N's tokens (`copy_to_host_async`), and hands the tokens to their requests. The
first token is handed out as soon as prefill has chosen it; the slot's first step emits it
again (as every step emits its root), and that copy is skipped, so the stream is the
offline decoders' stream. Each dispatched step records which request held each slot;
tokens go only to that request, and only while it is live, so a reused slot never
receives stale tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Callable

import jax
import numpy as np

from medusa_jax.decoding.decode import MIN_BUCKET
from medusa_jax.decoding.sampling import Rows, Sampling
from medusa_jax.decoding.step import follows_plain_steps, rebuilds_from_tokens, static_tree
from medusa_jax.drafters import resolve
from medusa_jax.serving.checks import check_fits, check_request
from medusa_jax.serving.config import ACCEPTANCE, MAX_STOP, WARMUPS, EngineConfig
from medusa_jax.serving.layout import Layout
from medusa_jax.serving.layout import auto_plain_above as _auto_plain_above
from medusa_jax.serving.metrics import Metrics
from medusa_jax.serving.programs import Programs, key_data, stack_rows
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

__all__ = ["ACCEPTANCE", "WARMUPS", "MAX_STOP", "Engine", "EngineConfig", "QueueFull",
           "Request", "auto_plain_above", "generate_offline"]


def auto_plain_above(drafter, slots: int, backend: str) -> int | None:
    """The default `plain_above` for `drafter` (None: plain): see `layout.auto_plain_above`."""
    return _auto_plain_above(None if drafter is None else drafter.keeps_context, slots, backend,
                             follows_plain_steps(drafter))


def _layout(name: str) -> property:
    return property(lambda self: getattr(self.layout, name), doc=f"`Layout.{name}`")


def _scheduler(name: str, settable: bool = False) -> property:
    """The scheduler's setting `name`, read (and, `settable`, changed) on the engine."""
    def write(self, value):
        setattr(self.scheduler, name, value)

    return property(lambda self: getattr(self.scheduler, name), write if settable else None,
                    doc=f"`Scheduler.{name}`")


class Engine:
    """Continuous batching over `slots` slots of `model` (a `medusa_jax.api.Medusa`); the
    options are `EngineConfig`'s (pass one as `config`, or its fields as keywords).

    - medusa: use the heads (any registered drafter) and `tree` (a static tree or
      "dynamic:N"; default: with heads).
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
    - window_block: the narrowest attention window, each next one twice as wide. The KV
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
      (`keeps_context`) unless it is begun again on the whole prompt's tokens
      (`rebuilds_from_tokens`). A free slot's cache is moved to another free one (the least
      recently used) before its slot takes a new request, so the slots keep what they
      held.
    - ngram_shared / ngram_shared_size: the drafter reads a pool shared across requests
      (its `shared_pool(size)`; `pool`), which the engine writes from each finished
      request's prompt and output on the host, and hands to the device between calls."""

    def __init__(self, model, config: EngineConfig | None = None, *,
                 log: Callable[[str], None] | None = None, **options):
        config = EngineConfig(**options) if config is None else \
            dataclasses.replace(config, **options)
        self.config, self.model, self.cfg = config, model, model.cfg
        use_medusa = model.heads is not None if config.medusa is None else bool(config.medusa)
        if use_medusa and model.heads is None:
            raise ValueError("a Medusa engine needs heads (load the model with heads)")
        # the drafter with n-gram drafts merged (`Medusa.load(ngram=N)`) and a shared pool
        # (`ngram_shared`), resolved as the API and the benchmark resolve them
        decoding = resolve.resolve(
            model.heads if use_medusa else None,
            model.tree(config.tree) if use_medusa else None, model.ngram, model.ngram_sizes,
            config.ngram_shared_size if config.ngram_shared else None)
        self.drafter, self.tree = decoding.drafter, decoding.tree
        self.pool = decoding.pool  # the drafter's pool shared across requests
        self.medusa = use_medusa
        # the modes a slot may follow: greedy (temperature 0), else the acceptance setting
        # (plain decoding samples either way); one compiled step serves both
        self.acceptance = config.acceptance
        self.modes = ("greedy", config.acceptance)
        self.layout = Layout.build(
            config, model_context=self.cfg.max_position_embeddings,
            width=static_tree(self.tree).depth + 1 if use_medusa else 1,
            fed=self.tree.num_nodes if use_medusa else 1, eos=tuple(model.eos),
            keeps_context=self.drafter.keeps_context if use_medusa else None,
            min_bucket=MIN_BUCKET, backend=jax.default_backend(),
            drafter_kind=self.drafter.kind if use_medusa else "",
            follows_plain_steps=follows_plain_steps(self.drafter),
            rebuilds_from_tokens=rebuilds_from_tokens(self.drafter))
        self.log = log
        self.metrics = Metrics(self.layout.slot_buckets, self.layout.prefill_batches)
        self._finish_lock = threading.Lock()  # `stop` may finish requests from another thread
        self._unfinished = 0  # requests submitted and not finished
        self._held = 0  # requests the caller is handling (`hold`)
        self._stop_reason: str | None = None
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._warm_thread: threading.Thread | None = None
        self.programs = Programs(model, self.layout, drafter=self.drafter, tree=self.tree,
                                 row=self.sampling_rows, busy=self._busy,
                                 stopped=lambda: self._stop_reason is not None, log=log)
        self.scheduler = Scheduler(self.layout, self.programs, max_queue=config.max_queue,
                                   short_call_ms=config.short_call_ms,
                                   overlap_ms=config.overlap_ms)
        self._state = None  # the slots' decode state (donated at each call)

    # --- sizes (the layout's) and settings

    slots, k, capacity = _layout("slots"), _layout("k"), _layout("capacity")
    width, fed, eos = _layout("width"), _layout("fed"), _layout("eos")
    windows, buckets = _layout("windows"), _layout("buckets")
    extend_buckets, slot_buckets = _layout("extend_buckets"), _layout("slot_buckets")
    prefill_batches, plain_above = _layout("prefill_batches"), _layout("plain_above")
    prefix_cache = _layout("prefix_cache")

    max_queue = _scheduler("max_queue")
    short_call_ms = _scheduler("short_call_ms", settable=True)
    overlap_ms = _scheduler("overlap_ms", settable=True)

    @property
    def cache_window(self) -> int:
        """The slots' cache length now (one of `windows`)."""
        return self.scheduler.window

    @property
    def state(self):
        """The slots' decode state now (None before the programs are set up)."""
        return self._state if self._state is not None else self.programs.state

    @property
    def compile_seconds(self) -> float:
        return self.programs.compile_seconds

    @property
    def stop_reason(self) -> str | None:
        """Why the engine stopped (None while it runs)."""
        return self._stop_reason

    # --- requests

    def check(self, prompt_len: int, max_tokens: int):
        """Raise ValueError when a request cannot fit a slot (`checks.check_fits`)."""
        check_fits(prompt_len, max_tokens, longest_prompt=self.buckets[-1],
                   capacity=self.capacity, tree=self.fed if self.medusa else 0)

    def sampling_rows(self, temperature=0.0, top_k=0, top_p=1.0, max_tokens=1, stop=(),
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

    def request_rows(self, req: Request) -> Rows:
        """A request's row: its sampling, token limit and stop tokens (EOS included)."""
        stop = tuple(sorted(set(self.eos) | set(req.stop_ids)))
        return self.sampling_rows(req.temperature if req.temperature > 0 else 0.0, req.top_k,
                                  req.top_p, req.max_tokens, stop, req.epsilon, req.delta)

    # --- programs

    def first_programs(self) -> list:
        """The programs a request with a short prompt needs."""
        return self.layout.first_programs()

    def program(self, key):
        """The compiled program `key` (compiled now if it is not yet)."""
        return self.programs.get(key)

    def state_shapes(self, window: int):
        """The slots' state's shapes with a `window` cache (what programs are lowered for)."""
        return self.programs.state_shapes(window)

    def status(self) -> dict:
        """Compile progress: ready (the first requests' programs are compiled), compiled /
        programs (counts), compiling (the program being compiled, or None)."""
        return self.programs.status()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the first requests' programs are compiled (or the engine stopped)."""
        return self.programs.ready.wait(timeout)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until every program is compiled."""
        return self.programs.all_compiled.wait(timeout)

    def compile(self, programs: list | None = None, background: bool = False):
        """Compile `programs` (default: all of them) now; each is compiled once."""
        self.programs.compile(programs, background=background)

    def _warm(self, warmup: str):
        """The background warm-up: every program in `programs` order ("background"), or
        only the decode state ("lazy")."""
        try:
            if warmup == "lazy":
                self.programs.setup()
                self.programs.ready.set()
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

    # --- public

    def start(self, warmup: str = "all"):
        """Start the engine thread. warmup "all": compile every program first (returns
        when done); "background": return at once, a second thread compiles the programs
        (`first_programs` first; `status()["ready"]` says when they are in); "lazy": compile
        each program when a request first needs it. A request that needs a program not yet
        compiled waits for it, whatever the warm-up."""
        if warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {', '.join(WARMUPS)}, got {warmup!r}")
        self.programs.lazy = warmup == "lazy"
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
        """Queue a request (checked first, `checks`: ValueError; QueueFull past the bound)."""
        check_request(self, req)
        self.check(len(req.prompt), req.max_tokens)
        sched = self.scheduler
        with sched.lock:
            if self._stop_reason is not None:
                raise RuntimeError(f"the engine has stopped: {self._stop_reason}")
            sched.enqueue(req)
            req.id, req.t_submit = next(self._ids), time.perf_counter()
            with self._finish_lock:
                self._unfinished += 1
            sched.lock.notify()
        return req

    def cancel(self, req: Request):
        """Stop a request (a client went away): its slot is freed at the next iteration."""
        req.cancelled = True
        with self.scheduler.lock:
            self.scheduler.lock.notify()

    def stop(self, reason: str = "the server is shutting down", timeout: float = 10.0):
        """End the loop; every waiting or running request gets an error event."""
        sched = self.scheduler
        with sched.lock:
            if self._stop_reason is None:
                self._stop_reason = reason
            sched.lock.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():  # inside a device call or a compile: tell them now
                for req in sched.clear(slots=False):
                    self._finish(req, "error", error=self._stop_reason)

    def queue_depth(self) -> int:
        return len(self.scheduler.waiting)

    def slots_in_use(self) -> int:
        return self.scheduler.live()

    # --- the loop (engine thread only)

    def _finish(self, req: Request, reason: str, error: str | None = None, tokens=()):
        with self._finish_lock:
            if req.finished:
                return
            req.finished = True
            self._unfinished -= 1
        if self.pool is not None and reason in ("stop", "length"):
            try:  # host-side; the device gets the table before the next call (`_loop`)
                self.metrics.pooled(ngrams=self.pool.add_request(req.prompt, req.tokens))
            except Exception as e:  # noqa: BLE001 - the pool misses this request, no more
                self._fail(req, e)
        try:
            req.on_event(list(tokens), reason, error)
        except Exception:  # a callback must not stop the engine
            pass

    def _fail(self, req: Request, e: Exception):
        """`e` is `req`'s alone (its admission, its row, its tokens' bookkeeping): `req`
        ends with an error and is freed as a cancelled request is; the engine runs on."""
        req.cancelled = True
        self._finish(req, "error", error=f"the engine could not run this request: {e!r}")
        if self.log is not None:
            self.log(f"error: request {req.id} failed in the engine: {e!r}")

    def _inputs(self, req: Request):
        """`req`'s prompt ids, row and PRNG key (host arrays); placeholders where they raise."""
        try:
            return np.asarray(req.prompt, np.int32), self.request_rows(req), key_data(req.seed)
        except Exception as e:  # noqa: BLE001 - that request's, not the engine's
            self._fail(req, e)
            return np.zeros(len(req.prompt), np.int32), self.sampling_rows(), key_data(0)

    def _hand(self, req: Request, tokens: list[int]) -> bool:
        """`_deliver`; an exception fails `req` alone (False: freed as a cancelled one)."""
        try:
            return self._deliver(req, tokens)
        except Exception as e:  # noqa: BLE001 - that request's, not the engine's
            self._fail(req, e)
            return False

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
        req.tokens.extend(out)
        if req.t_first is None:
            req.t_first = time.perf_counter()
        if reason is not None:
            self._finish(req, reason, tokens=out)
            return True
        try:
            req.on_event(out, None, None)
        except Exception:
            req.cancelled = True
        return False

    def _run(self, actions: list, admitted: list):
        """Run admission or step-preparing actions in order, on the slots' state; the
        requests prefilled go to `admitted` as (request, slot, first tokens on the device,
        row)."""
        m, params, heads = self.metrics, self.model.params, self.programs.heads
        pre = None
        for a in actions:
            if isinstance(a, Cancel):
                self._finish(a.request, "cancelled")
            elif isinstance(a, Prefill):
                reqs, key = a.requests, a.key
                ids, rows, keys = zip(*[self._inputs(r) for r in reqs])
                tokens = np.zeros((key.batch, key.bucket), np.int32)
                lengths = np.array([len(x) for x in ids], np.int32)
                for j, x in enumerate(ids):
                    tokens[j, :len(x)] = x
                pre = self.program(key)(params, heads, tokens, lengths, np.concatenate(keys),
                                        stack_rows(rows))
                pre.root.copy_to_host_async()
                m.prefilled(key.batch)
            elif isinstance(a, Insert):
                req = a.request
                self._state = self.program(a.key)(self._state, pre, np.int32(a.slot),
                                                  np.int32(a.row))
                admitted.append((req, a.slot, pre.root, a.row))
            elif isinstance(a, Move):
                self._state = self.program(a.key)(self._state, np.int32(a.src),
                                                  np.int32(a.dst))
            elif isinstance(a, Resize):
                self._state = self.program(a.key)(self._state)
                m.resized()
            elif isinstance(a, Extend):
                req, n = a.request, len(a.request.prompt)
                ids, row, seed = self._inputs(req)
                tokens = np.zeros((1, a.key.bucket), np.int32)
                tokens[0, :n - a.start] = ids[a.start:]
                prompt = None  # the whole prompt, for a drafter begun on it again
                if self.drafter is not None and self.drafter.keeps_context:
                    prompt = np.zeros((1, a.key.window), np.int32)
                    prompt[0, :n] = ids
                prefill_after, put = self.program(a.key)
                one = prefill_after(params, heads, self._state.cache, tokens,
                                    np.int32(a.start), np.full((1,), n, np.int32), seed,
                                    row, np.int32(a.src), prompt)
                one.root.copy_to_host_async()
                if a.move is not None:  # after the read above: the runtime orders it behind
                    self._state = self.program(a.move)(self._state, np.int32(a.slot),
                                                       np.int32(a.stash))
                self._state = put(self._state, one, np.int32(a.slot), np.int32(0))
                m.extended(a.start)
                admitted.append((req, a.slot, one.root, 0))
            else:
                raise TypeError(f"not an action to run here: {a!r}")

    def _dispatch(self, call: Step, program):
        call.dispatched = time.perf_counter()
        self._state, out = program(self.model.params, self.programs.heads, self._state,
                                   np.int32(call.steps))
        for x in (out.tokens, out.counts, out.steps, out.lengths):
            x.copy_to_host_async()
        if out.pool_hits is not None:
            out.pool_hits.copy_to_host_async()
        self.metrics.dispatched(call.key.slots, call.steps, call.key.plain)
        return out

    def _first_tokens(self, admitted):
        roots = {}  # one read per prefill batch
        sched = self.scheduler
        for req, i, root, j in admitted:
            if sched.holder(i) is not req:
                continue
            if req.cancelled:  # or failed at its admission (`_fail`)
                self._finish(req, "cancelled")
                sched.free(i, keep=False)
                continue
            if id(root) not in roots:
                roots[id(root)] = np.asarray(root)
            if self._hand(req, [int(roots[id(root)][j])]):
                sched.free(i)  # ended by its first token (the device slot is idle)

    def _read(self, out, call: Step):
        """Read a dispatched call's tokens and hand them to their requests."""
        tokens, counts, steps, lengths = (np.asarray(x) for x in
                                          (out.tokens, out.counts, out.steps, out.lengths))
        sched = self.scheduler
        before = sched.slot_steps, sched.step_tokens
        for a in sched.after_step(call, counts, steps, lengths, time.perf_counter()):
            if isinstance(a, Cancel):
                self._finish(a.request, "cancelled")
            elif isinstance(a, Handout) and self._hand(
                    a.request, [int(t) for t in tokens[a.slot, a.start:a.stop]]):
                sched.free(a.slot, window=call.key.window)
        self.metrics.stepped(sched.slot_steps - before[0], sched.step_tokens - before[1])
        if out.pool_hits is not None:
            self.metrics.pooled(hits=int(out.pool_hits))

    def _loop(self):
        sched = self.scheduler
        pending = None  # (out, call): dispatched, not read yet
        try:
            self.programs.setup()
            self._state = self.programs.state
            while True:
                with sched.lock:
                    if self._stop_reason is not None:
                        break
                    if pending is None and sched.idle():
                        sched.lock.wait(0.5)
                        continue
                for req in sched.cancelled_running():
                    self._finish(req, "cancelled")
                if pending is not None and sched.long(pending[1]):
                    # read a long call before dispatching the next: a request arriving
                    # meanwhile is then prefilled behind one call, not two
                    self._read(*pending)
                    pending = None
                admitted = []
                while actions := sched.admit():
                    self._run(actions, admitted)
                if self.pool is not None and self.pool.dirty:  # between calls, never inside
                    self.programs.heads = self.pool.into(self.programs.heads)
                nxt = None
                plan = sched.plan_step(behind_prefill=bool(admitted))
                if plan:
                    call = plan[-1]
                    program = self.program(call.key)
                    self._run(plan[:-1], admitted)  # its resizes
                    nxt = (self._dispatch(call, program), call)
                self._first_tokens(admitted)  # while the step runs
                if pending is not None:
                    self._read(*pending)
                pending = nxt
        except Exception as e:  # noqa: BLE001 - every request hears about it
            with sched.lock:
                self._stop_reason = self._stop_reason or f"engine error: {e!r}"
            raise
        finally:
            reason = self._stop_reason or "stopped"
            for req in sched.clear():
                self._finish(req, "error", error=reason)


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

