"""Counters, as prometheus_client objects: the engine's (`Metrics`) and the server's
(`ServerMetrics`, whose /metrics text includes the engine's).

Each counter is updated in one place: the engine's by `Metrics`' methods (called from the
engine thread), the server's by its request handling. The attributes of `Metrics` read the
current values back (tests and benchmarks), as plain numbers and `collections.Counter`s.
"""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

FINISH_REASONS = ("stop", "length", "cancelled", "error")

# The engine's counters without labels: the attribute of `Metrics` that reads one back ->
# (the metric's name, its help).
_TOTALS = {
    "slot_steps": ("medusa_slot_steps", "Decoding steps of live slots"),
    "step_tokens": ("medusa_step_tokens", "Tokens those steps emitted"),
    "calls": ("medusa_step_calls", "Engine step calls"),
    "plain_calls": ("medusa_plain_step_calls",
                    "Engine step calls of plain steps under load (--plain-above-slots)"),
    "resizes": ("medusa_cache_resizes",
                "Times the slots' KV cache was resized to the next attention window"),
    "prefix_hits": ("medusa_prefix_cache_hits",
                    "Prompts prefilled after a prefix a slot's cache held"),
    "prefix_tokens": ("medusa_prefix_cache_tokens", "Prompt tokens taken from the prefix cache"),
    "pool_hits": ("medusa_ngram_pool_hits",
                  "Decoding steps whose context the shared n-gram pool held (--ngram-shared)"),
    "pool_ngrams": ("medusa_ngram_pool_ngrams",
                    "N-grams of finished requests written to the shared pool"),
}


def _total(attr: str) -> property:
    """The value of `_TOTALS[attr]`'s counter."""
    name, doc = _TOTALS[attr]
    return property(lambda self: self._value(name), doc=doc)


class Metrics:
    """The engine's counters, in a registry of their own (`registry`). slot_buckets /
    prefill_batches: the labels shown from the start (at 0)."""

    def __init__(self, slot_buckets=(), prefill_batches=()):
        self.registry = r = CollectorRegistry()
        self._totals = {attr: Counter(name, doc, registry=r)
                        for attr, (name, doc) in _TOTALS.items()}
        self._by_slots = Counter("medusa_step_calls_by_slots", "Engine step calls by the "
                                 "slot bucket they computed (the rows a call pays for)",
                                 ["slots"], registry=r)
        self._by_steps = Counter("medusa_step_calls_by_steps", "Engine step calls by the "
                                 "steps they ran at most (--short-call-ms)", ["steps"],
                                 registry=r)
        self._by_batch = Counter("medusa_prefill_calls_by_batch", "Prefill calls by the "
                                 "prompts they prefilled together", ["prompts"], registry=r)
        for n in slot_buckets:
            self._by_slots.labels(slots=str(n))
        for n in prefill_batches:
            self._by_batch.labels(prompts=str(n))
        Gauge("medusa_tokens_per_step", "Tokens per live slot step (accepted length + 1)",
              registry=r).set_function(lambda: self.step_tokens / max(self.slot_steps, 1))

    # --- updates (the engine thread)

    def prefilled(self, prompts: int):
        """A prefill call of `prompts` prompts."""
        self._by_batch.labels(prompts=str(prompts)).inc()

    def extended(self, cached: int):
        """A prompt prefilled after `cached` tokens of the prefix cache."""
        self._totals["prefix_hits"].inc()
        self._totals["prefix_tokens"].inc(cached)

    def dispatched(self, slots: int, steps: int, plain: bool):
        """A step call over `slots` slots, of `steps` steps at most."""
        self._totals["calls"].inc()
        self._by_slots.labels(slots=str(slots)).inc()
        self._by_steps.labels(steps=str(steps)).inc()
        if plain:
            self._totals["plain_calls"].inc()

    def pooled(self, hits: int = 0, ngrams: int = 0):
        """The shared n-gram pool: lookups that hit, n-grams written."""
        self._totals["pool_hits"].inc(hits)
        self._totals["pool_ngrams"].inc(ngrams)

    def resized(self):
        self._totals["resizes"].inc()

    def stepped(self, slot_steps: int, tokens: int):
        """A call read back: its live slots' steps and the tokens they emitted."""
        self._totals["slot_steps"].inc(slot_steps)
        self._totals["step_tokens"].inc(tokens)

    # --- values

    def _value(self, name: str) -> int:
        return int(self.registry.get_sample_value(name + "_total") or 0)

    def _by(self, name: str, label: str) -> collections.Counter:
        out = collections.Counter()
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name == name + "_total" and s.value:
                    out[int(s.labels[label])] = int(s.value)
        return out

    slot_steps, step_tokens, calls = _total("slot_steps"), _total("step_tokens"), _total("calls")
    plain_calls, resizes = _total("plain_calls"), _total("resizes")
    prefix_hits, prefix_tokens = _total("prefix_hits"), _total("prefix_tokens")
    pool_hits, pool_ngrams = _total("pool_hits"), _total("pool_ngrams")
    calls_by_slots = property(lambda self: self._by("medusa_step_calls_by_slots", "slots"))
    calls_by_steps = property(lambda self: self._by("medusa_step_calls_by_steps", "steps"))
    prefills_by_batch = property(lambda self: self._by("medusa_prefill_calls_by_batch",
                                                       "prompts"))

    @property
    def prefill_calls(self) -> int:
        return sum(self.prefills_by_batch.values())


class _Included:
    """A collector that yields another registry's metrics (the engine's, in the server's)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        yield from self.registry.collect()


class ServerMetrics:
    """/metrics: the server's counters (each finished request once, under the finish_reason
    its response reported; "cancelled": its client left first, which also counts as a
    disconnect), latencies, gauges of the engine's state, and the engine's counters."""

    def __init__(self, engine):
        self.engine = e = engine
        self.registry = r = CollectorRegistry()
        self.requests = Counter("medusa_requests", "Finished requests by the finish_reason "
                                "their response reported (cancelled: the client left first)",
                                ["finish"], registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(finish=reason)
        self.disconnects = Counter("medusa_disconnects", "Clients that left before their "
                                   "request finished", registry=r)
        self.prompt_tokens = Counter("medusa_prompt_tokens", "Prompt tokens of the requests "
                                     "queued", registry=r)
        self.generation_tokens = Counter("medusa_generation_tokens", "Tokens generated for "
                                         "the requests", registry=r)
        Gauge("medusa_queue_depth", "Waiting requests", registry=r).set_function(
            e.queue_depth)
        Gauge("medusa_slots_in_use", "Slots holding a request", registry=r).set_function(
            e.slots_in_use)
        Gauge("medusa_slots", "Slots", registry=r).set(e.slots)
        Gauge("medusa_compiled_programs", "Engine programs compiled so far",
              registry=r).set_function(lambda: e.status()["compiled"])
        latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("medusa_time_to_first_token_seconds", "From the request's "
                              "arrival to its first token", buckets=latency, registry=r)
        self.latency = Histogram("medusa_request_seconds", "From the request's arrival to "
                                 "its end", buckets=latency, registry=r)
        r.register(_Included(e.metrics.registry))

    def text(self) -> str:
        return generate_latest(self.registry).decode()
