"""What the serving engine compiles: its sizes and a typed key per program (JAX-free).

`Layout` derives, once, from an `EngineConfig` and a few facts of the model and drafter,
every size the engine runs with: the attention windows (the slots' cache is always one of
them), the prompt buckets prefill is compiled for, the slot buckets a step computes, the
prefill batch sizes. The program keys are small frozen dataclasses (two keys of different
programs never compare equal); `Layout.programs` lists them in the order a warm-up
compiles them. The scheduler plans with these keys and `programs.Programs` compiles them.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from medusa_jax.serving.config import AUTO_PLAIN_ABOVE, EXTEND_BUCKETS, EngineConfig


def _slots(n: int) -> str:
    return f"{n} slot{'s' if n > 1 else ''}"


@dataclasses.dataclass(frozen=True)
class PrefillKey:
    """`batch` prompts right-padded to `bucket` tokens, prefilled together."""
    kind: ClassVar[str] = "prefill"
    bucket: int
    batch: int

    def describe(self) -> str:
        return f"bucket {self.bucket}" + (f", {self.batch} prompts" if self.batch > 1 else "")


@dataclasses.dataclass(frozen=True)
class InsertKey:
    """A row of a `PrefillKey(bucket, batch)` output put into a slot of a `window` cache."""
    kind: ClassVar[str] = "insert"
    bucket: int
    batch: int
    window: int

    @property
    def prefill(self) -> PrefillKey:
        return PrefillKey(self.bucket, self.batch)

    def describe(self) -> str:
        return f"{self.prefill.describe()}, window {self.window}"


@dataclasses.dataclass(frozen=True)
class StepKey:
    """K steps over the first `slots` slots of a `window` cache (`plain`: plain steps on a
    Medusa engine, under load)."""
    window: int
    slots: int
    plain: bool = False

    @property
    def kind(self) -> str:
        return "plain" if self.plain else "step"

    def describe(self) -> str:
        return f"window {self.window}, {_slots(self.slots)}"


@dataclasses.dataclass(frozen=True)
class ResizeKey:
    """The slots' cache from `src` to `dst` slots long (neighbouring windows)."""
    kind: ClassVar[str] = "resize"
    src: int
    dst: int

    def describe(self) -> str:
        return f"window {self.src} to {self.dst}"


@dataclasses.dataclass(frozen=True)
class ExtendKey:
    """A prompt's rest (`bucket` tokens) prefilled after a slot's cached prefix, and its
    insert, in a `window` cache."""
    kind: ClassVar[str] = "extend"
    bucket: int
    window: int

    def describe(self) -> str:
        return f"bucket {self.bucket}, window {self.window}"


@dataclasses.dataclass(frozen=True)
class MoveKey:
    """One slot's cache row copied over another's, in a `window` cache."""
    kind: ClassVar[str] = "move"
    window: int

    def describe(self) -> str:
        return f"window {self.window}"


ProgramKey = PrefillKey | InsertKey | StepKey | ResizeKey | ExtendKey | MoveKey


def describe(key) -> str:
    """"kind (sizes)", as the compile log and /health name a program."""
    return f"{key.kind} {key.describe()}"


def auto_plain_above(keeps_context: bool | None, slots: int, backend: str,
                     follows_plain_steps: bool = False) -> int | None:
    """The default `plain_above` (keeps_context None: a plain engine): on CPU, plain steps
    while more than AUTO_PLAIN_ABOVE slots are live; elsewhere, with fewer slots, or for a
    drafter that plain steps cannot carry along (one with its own cache, `keeps_context`,
    that does not follow plain steps), always Medusa (None)."""
    if (keeps_context is None or (keeps_context and not follows_plain_steps)
            or backend != "cpu" or slots <= AUTO_PLAIN_ABOVE):
        return None
    return AUTO_PLAIN_ABOVE


def attention_windows(smallest: int, capacity: int) -> list[int]:
    """The attention windows: `smallest`, each next one twice as wide, and `capacity` (the
    widest): a step attends over at most twice the cache slots it needs, and the programs
    per window grow with log(context), not with the context."""
    windows, w = [], smallest
    while w < capacity:
        windows.append(w)
        w *= 2
    return windows + [capacity]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The sizes an engine runs with (see `Layout.build`). width: tokens a step emits at
    most (1 plain); fed: tokens a step feeds (the tree's nodes, 1 plain); eos: the model's
    stop tokens."""

    slots: int
    k: int
    capacity: int
    width: int
    fed: int
    eos: tuple[int, ...]
    medusa: bool
    windows: list[int]
    buckets: list[int]
    extend_buckets: list[int]
    slot_buckets: list[int]
    prefill_batches: list[int]
    plain_above: int | None
    prefix_cache: bool

    @classmethod
    def build(cls, config: EngineConfig, *, model_context: int, width: int, fed: int,
              eos: tuple[int, ...], keeps_context: bool | None, min_bucket: int,
              backend: str = "cpu", drafter_kind: str = "",
              follows_plain_steps: bool = False,
              rebuilds_from_tokens: bool = False) -> "Layout":
        """`config`'s sizes for a model of `model_context` tokens; keeps_context,
        follows_plain_steps, rebuilds_from_tokens: what the drafter's `context` implies
        (`decoding.drafter.Context`; keeps_context None: a plain engine); width / fed: a
        step's tokens out / in;
        min_bucket: the shortest default prompt bucket (the offline decoders')."""
        medusa = keeps_context is not None
        slots = config.slots
        if config.max_context is not None and config.max_context > model_context:
            raise ValueError(f"max_context {config.max_context} is longer than the model's "
                             f"context ({model_context} tokens, max_position_embeddings)")
        capacity = config.max_context or model_context
        if capacity < min_bucket + fed + 1:
            raise ValueError(f"max_context {capacity} is too small (need at least "
                             f"{min_bucket + fed + 1})")
        windows = attention_windows(config.window_block, capacity)
        buckets = config.buckets
        if buckets is None:
            buckets, b = [capacity], min_bucket
            while b < capacity:
                buckets.append(b)
                b *= 2
        if not buckets or any(not 1 <= b <= capacity for b in buckets):
            raise ValueError(f"prefill buckets must be in 1..{capacity} (the context), "
                             f"got {list(buckets)}")
        buckets = sorted(set(int(b) for b in buckets))
        # a cached prefix pays where the rest of a prompt takes a shorter bucket than the
        # whole prompt (so never the longest)
        extend_buckets = sorted({b for b in EXTEND_BUCKETS if b < buckets[-1]}
                                | set(buckets[:-1]))
        prefix_cache = (bool(config.prefix_cache) and bool(extend_buckets)
                        and (not keeps_context or rebuilds_from_tokens))
        slot_buckets = config.slot_buckets
        if slot_buckets is None:
            slot_buckets = [slots] + [2**i for i in range(slots.bit_length()) if 2**i < slots]
        if not slot_buckets or any(not 1 <= int(r) <= slots for r in slot_buckets):
            raise ValueError(f"slot buckets must be in 1..{slots} (the slots), "
                             f"got {list(slot_buckets)}")
        slot_buckets = sorted({int(r) for r in slot_buckets} | {slots})
        most = min(config.prefill_batch, slots)  # more than the slots never fit at once
        prefill_batches = sorted({2**i for i in range(most.bit_length())} | {most})
        plain_above = config.plain_above
        if plain_above == "auto":
            plain_above = auto_plain_above(keeps_context, slots, backend, follows_plain_steps)
        if plain_above is not None and keeps_context and not follows_plain_steps:
            raise ValueError(f"plain_above={plain_above}: a {drafter_kind} drafter keeps "
                             f"its own cache of every committed token, which plain steps do "
                             f"not feed; leave plain_above unset with these heads")
        if plain_above is not None and not (medusa and 0 <= plain_above < slots):
            raise ValueError(f"plain_above must be in 0..{slots - 1} (below the slots) on a "
                             f"Medusa engine, got {plain_above!r}"
                             + ("" if medusa else " on a plain engine"))
        return cls(slots=slots, k=config.steps_per_call, capacity=capacity, width=width,
                   fed=fed, eos=tuple(eos), medusa=medusa, windows=windows, buckets=buckets,
                   extend_buckets=extend_buckets, slot_buckets=slot_buckets,
                   prefill_batches=prefill_batches, plain_above=plain_above,
                   prefix_cache=prefix_cache)

    def fit(self, n: int) -> int:
        """The narrowest window of at least n cache slots (the widest if none is)."""
        return next((w for w in self.windows if w >= n), self.windows[-1])

    def first_programs(self) -> list:
        """The programs a request with a short prompt needs: the smallest prefill bucket,
        its insert, the step over the narrowest window and the fewest slots."""
        b = self.buckets[0]
        return [PrefillKey(b, 1), InsertKey(b, 1, self.fit(b)),
                StepKey(self.windows[0], self.slot_buckets[0])]

    def programs(self) -> list:
        """Every program the engine can use, in the order a warm-up compiles them: what a
        first short request needs (`first_programs`), then what serves any request (the
        longest bucket, the widest window), then the rest from small to large."""
        b, w, r, n = self.buckets, self.windows, self.slot_buckets, self.prefill_batches
        resizes = [ResizeKey(*p) for p in zip(w, w[1:])] + [ResizeKey(*p) for p in zip(w[1:], w)]
        cover = [StepKey(w[-1], r[-1]), PrefillKey(b[-1], 1), InsertKey(b[-1], 1, w[-1])]
        rest = [x for y in n for x1 in b for x in
                [PrefillKey(x1, y)] + [InsertKey(x1, y, v) for v in w if v >= x1]]
        rest += [StepKey(x, y) for y in r for x in w]
        rest += [StepKey(x, y, plain=True) for y in r for x in w
                 if self.plain_above is not None and y > self.plain_above]
        if self.prefix_cache:  # after at least one cached token
            rest += [MoveKey(x) for x in w]
            rest += [ExtendKey(q, x) for x in w for q in self.extend_buckets if q < x]
        return list(dict.fromkeys(self.first_programs() + cover + resizes + rest))
