"""Serving tests' shared helpers: `exact_pairs` (test_engine, test_serve), `patient` (waits
that a busy machine makes longer, not failures) and a stub engine (`stub_engine`,
test_http_contract)."""

import threading
import time

import pytest

STALL_S = 600.0  # a wait fails only after this long without any progress


def wait_progressing(done, progress, what: str, stall: float = STALL_S, poll: float = 0.02):
    """Wait until `done` (a callable, or a threading.Event) holds, for as long as
    `progress` changes: a callable (programs compiled, tokens handed out, lines logged) or
    an engine (its compiled programs, prefills and step tokens). A loaded machine makes the
    wait longer, not a failure; only `stall` seconds without any change fail it, naming
    `what`. `poll`: seconds between looks (more for a look over HTTP)."""
    if isinstance(done, threading.Event):
        done = done.is_set
    if hasattr(progress, "status"):
        engine = progress

        def progress():
            m = engine.metrics
            return engine.status()["compiled"], m.prefill_calls, m.step_tokens

    last, since = progress(), time.monotonic()
    while not done():
        time.sleep(poll)
        now = progress()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > stall:
            pytest.fail(f"{what}: nothing changed for {stall:g} s (last: {last})")


@pytest.fixture(scope="session")
def patient():
    """`wait_progressing`: `patient(done, progress, what)`."""
    return wait_progressing


@pytest.fixture(scope="session")
def exact_pairs():
    """`exact_pairs(model, prompt, sampling)`: P(x1, x2) of plain sampling after `prompt`,
    [V, V] (acceptance.log_probs)."""
    def exact_pairs(model, prompt, sampling):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from medusa_jax.decoding.acceptance import log_probs
        from medusa_jax.model.backbone import KVCache, causal_mask, forward, standard_layout

        cfg, v = model.cfg, model.cfg.vocab_size

        @jax.jit
        def last_logprobs(params, seqs):
            b, t = seqs.shape
            cache = KVCache.init(cfg, b, t)
            logits, _, _ = forward(params, cfg, seqs, jnp.broadcast_to(jnp.arange(t), (b, t)),
                                   causal_mask(cache.lengths, t, t), cache, empty_cache=True)
            return log_probs(logits[:, -1], sampling)

        def next_probs(seqs):
            params = standard_layout(cfg, model.params)
            return np.exp(np.asarray(last_logprobs(params, np.asarray(seqs, np.int32)),
                                     np.float64))

        p1 = next_probs([prompt])[0]
        return p1[:, None] * next_probs([prompt + [x] for x in range(v)])

    return exact_pairs


# ----------------------------------------------------------------------------- a stub engine
#
# The HTTP contract (test_http_contract) runs the server's app over this engine in process:
# no model, no JAX compile, answers computable by hand.


class ByteTokenizer:
    """A tokenizer a test can run in its head: ids 0-2 are <unk>, <s>, </s>; byte b is id
    3 + b. A prompt gets BOS; decoding skips the special ids and reads the bytes as UTF-8."""

    SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}
    bos_token_id, eos_token_id, vocab_size = 1, 2, 3 + 256
    chat_template = None

    def __call__(self, text, add_special_tokens=True, split_special_tokens=True):
        ids = [3 + b for b in text.encode()]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def get_added_vocab(self):
        return dict(self.SPECIALS)

    def get_vocab(self):
        return {**self.SPECIALS, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}


class StubEngine:
    """The engine surface `medusa_jax.serving.server` uses, and no more: a plain engine of
    `slots` slots, prompts of up to `bucket` tokens in a context of `capacity`, whose answer
    to a prompt of n tokens is the alphabet from its (n % 26)-th letter, `answer_len`
    letters then EOS (`answer`), cut by max_tokens and the stop ids as `Engine._deliver`
    cuts them, handed out `chunk` tokens per event.

    Requests are answered at once when submitted; after `pause()` they wait (up to
    `max_queue`, then QueueFull) until `resume()`. `stop()` ends them with an error event
    and refuses new ones, as `Engine.stop` does. A request whose seed is in `failing_seeds`
    ends with an error, as one does that fails in the engine (which runs on). `submitted`
    holds every Request queued (the sampling values the server passed)."""

    ANSWER_LEN = 20

    def __init__(self, *, slots=4, bucket=64, capacity=128, max_queue=2, chunk=3):
        from types import SimpleNamespace

        from medusa_jax.serving.metrics import Metrics

        self.tokenizer = ByteTokenizer()
        self.model = SimpleNamespace(tokenizer=self.tokenizer, eos=(2,),
                                     cfg=SimpleNamespace(vocab_size=ByteTokenizer.vocab_size))
        self.medusa, self.fed, self.drafter, self.tree, self.pool = False, 0, None, None, None
        self.eos, self.cfg, self.acceptance = self.model.eos, self.model.cfg, "rejection"
        self.slots, self.buckets, self.capacity = slots, (bucket,), capacity
        self.slot_buckets, self.prefill_batches = (1, slots), (1,)
        self.metrics = Metrics(self.slot_buckets, self.prefill_batches)
        self.max_queue, self.chunk = max_queue, chunk
        self.ready, self.programs = True, 3
        self.stop_reason = None
        self.submitted, self.waiting, self.held = [], [], 0
        self.paused = False
        self.failing_seeds = set()  # requests of these seeds fail in the "engine"

    def check(self, prompt_len: int, max_tokens: int):
        """The real engine's limits (`Engine.check`), on these sizes."""
        from medusa_jax.serving.engine import Engine

        Engine.check(self, prompt_len, max_tokens)

    @classmethod
    def answer(cls, n_prompt: int) -> list[int]:
        start = n_prompt % 26
        return [3 + ord("a") + (start + i) % 26 for i in range(cls.ANSWER_LEN)] + [2]

    @classmethod
    def answer_text(cls, n_prompt: int, n: int) -> str:
        return ByteTokenizer().decode(cls.answer(n_prompt)[:n])

    def status(self):
        return {"ready": self.ready, "compiled": self.programs if self.ready else 1,
                "programs": self.programs, "compiling": None if self.ready else "step"}

    def queue_depth(self):
        return len(self.waiting)

    def slots_in_use(self):
        return 0

    def hold(self):
        self.held += 1

    def release(self):
        self.held = max(0, self.held - 1)

    def submit(self, req):
        from medusa_jax.serving.engine import QueueFull

        from medusa_jax.serving.checks import check_request

        check_request(self, req)  # Engine.submit's rules, on this plain engine
        self.check(len(req.prompt), req.max_tokens)
        if self.stop_reason is not None:
            raise RuntimeError(f"the engine has stopped: {self.stop_reason}")
        if self.paused and len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
        self.submitted.append(req)
        if self.paused:
            self.waiting.append(req)
        else:
            self._run(req)
        return req

    def _run(self, req):
        if req.cancelled:
            return self._finish(req, "cancelled")
        if req.seed in self.failing_seeds:  # as `Engine` fails one request and runs on
            return self._finish(req, "error", error="the engine could not run this request: "
                                                    "OverflowError()")
        stops = set(self.model.eos) | set(req.stop_ids)
        out = []
        for t in self.answer(len(req.prompt)):
            out.append(t)
            if t in stops or len(out) >= req.max_tokens:
                break
        finish = "stop" if out[-1] in stops else "length"
        while len(out) > self.chunk:
            req.on_event(out[:self.chunk], None, None)
            out = out[self.chunk:]
        self._finish(req, finish, out)

    def _finish(self, req, reason, tokens=(), error=None):
        if req.finished:
            return
        req.finished = True
        req.on_event(list(tokens), reason, error)

    def cancel(self, req):
        req.cancelled = True

    def pause(self):
        self.paused = True

    def resume(self):
        self.paused = False
        waiting, self.waiting = self.waiting, []
        for req in waiting:
            self._run(req)

    def stop(self, reason="the server is shutting down"):
        self.stop_reason = reason
        waiting, self.waiting = self.waiting, []
        for req in waiting:
            self._finish(req, "error", error=reason)


@pytest.fixture
def stub_engine():
    """A fresh `StubEngine` (no model, nothing compiled)."""
    return StubEngine()
