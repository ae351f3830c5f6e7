"""Compile time and decode time, measured apart, and the one way the commands print them:

    compiled in 1.7 s; 128 tokens in 0.02 s (6,400 tokens/s)

`precompile(fn, *args, **kwargs)` compiles a jitted function ahead of time for exactly the
call `fn(*args, **kwargs)` (trace, lower, XLA compile or a load from the persistent
compilation cache) and returns how long that took; the call that follows runs the compiled
program, so timing it measures decoding alone, and nothing runs twice. The first run of
a freshly compiled program carries some one-time set-up (on the 2-core CPU about 0.1 s for
the decoders of the embedded model), which is counted in the decode time.
"""

from __future__ import annotations

import dataclasses
import time

_counts = {"requests": 0, "hits": 0}
_listening = False

_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
_HIT = "/jax/compilation_cache/cache_hits"


def _listen():
    global _listening
    if _listening:
        return
    import jax

    def on_event(event: str, **kwargs):
        if event == _REQUEST:
            _counts["requests"] += 1
        elif event == _HIT:
            _counts["hits"] += 1

    try:
        jax.monitoring.register_event_listener(on_event)
    except AttributeError:  # no monitoring API: compile times are still measured
        pass
    _listening = True


@dataclasses.dataclass
class Compile:
    """How long one or more `precompile`s took, and how many programs they looked up in the
    persistent compilation cache (`lookups`) and found there (`hits`)."""

    seconds: float = 0.0
    lookups: int = 0
    hits: int = 0

    @property
    def cached(self) -> bool:
        """Every program that had to be compiled came from the persistent cache."""
        return self.lookups > 0 and self.hits == self.lookups

    def __add__(self, other: "Compile") -> "Compile":
        return Compile(self.seconds + other.seconds, self.lookups + other.lookups,
                       self.hits + other.hits)


def precompile(fn, *args, **kwargs) -> Compile:
    """Compile `fn(*args, **kwargs)` (a `jax.jit` function) without running it; the compiled
    program stays in JAX's caches, so the call itself then only runs."""
    _listen()
    before = dict(_counts)
    t0 = time.perf_counter()
    fn.lower(*args, **kwargs).compile()
    seconds = time.perf_counter() - t0
    return Compile(seconds, _counts["requests"] - before["requests"],
                   _counts["hits"] - before["hits"])


def fmt_seconds(s: float) -> str:
    if s < 0.1:
        return f"{s:.3f} s"
    if s < 1:
        return f"{s:.2f} s"
    return f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


def speed_line(compiled: Compile | float, tokens: int, seconds: float) -> str:
    """'compiled in 1.7 s; 128 tokens in 0.02 s (6,400 tokens/s)'."""
    c = compiled if isinstance(compiled, Compile) else Compile(float(compiled))
    rate = f"{tokens / seconds:,.0f} tokens/s" if seconds > 0 else "- tokens/s"
    note = " (from the compilation cache)" if c.cached else ""
    return (f"compiled in {fmt_seconds(c.seconds)}{note}; {tokens:,} tokens in "
            f"{fmt_seconds(seconds)} ({rate})")


@dataclasses.dataclass
class Timed:
    """Compile time, decode time and new tokens of one or more decoding calls."""

    compile: Compile = dataclasses.field(default_factory=Compile)
    seconds: float = 0.0
    tokens: int = 0

    def __add__(self, other: "Timed") -> "Timed":
        return Timed(self.compile + other.compile, self.seconds + other.seconds,
                     self.tokens + other.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return speed_line(self.compile, self.tokens, self.seconds)
