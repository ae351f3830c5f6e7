"""How tokens are chosen, per row: the one representation the decoding step uses.

`Rows` holds every row's sampling parameters, stop tokens and token limit as [B] arrays, so
one compiled step serves rows that sample differently (the serving engine's slots). A static
`Sampling` (what offline callers pass) is a broadcast of one row (`Rows.of`); the rows then
also carry it statically, and the compiled program keeps only the rules that row uses (all
greedy: no filtering, no PRNG work).

`check` holds the validation rules once; `Sampling` and the serving layers call it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.constants import MODES
from medusa_jax.runtime import pytree as struct

# the modes that draw a token at random where plain decoding chooses one (plain decoding has
# no tree, so "typical" means plain sampling there) and where a tree's root is chosen
PLAIN_DRAWS = ("typical", "rejection")
ROOT_DRAWS = ("rejection",)  # typical acceptance keeps the first token greedy (the paper)


def argmax(x: jax.Array) -> jax.Array:
    """Index of the largest entry along the last axis, int32: the first of equal ones, as
    `jnp.argmax` (a row holding NaN aside). Two plain reductions, the maximum and then the
    least index holding it: XLA:CPU runs `jnp.argmax`'s index-carrying reduction as a
    scalar loop, several times slower over a vocabulary, and a Medusa step takes several
    (the heads' top-k, acceptance, the next root)."""
    n = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, jnp.arange(n, dtype=jnp.int32), n - 1), axis=-1)


INT32_MAX = 2**31 - 1  # top_k, token limits and stop ids are int32 on the device
FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_number(x) -> bool:
    return is_integer(x) or isinstance(x, (float, np.floating))


def check_integer(name: str, x, low: int, note: str = "") -> None:
    """Raise a one-line ValueError unless `x` is an integer (not a bool, not a float) in
    low..INT32_MAX."""
    if not (is_integer(x) and low <= x <= INT32_MAX):
        raise ValueError(f"{name} must be an integer in {low}..{INT32_MAX}{note}, got {x!r}")


def _check_number(name: str, x) -> None:
    if not is_number(x):
        raise ValueError(f"{name} must be a number, got {x!r}")


def check(mode: str = "greedy", temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
          epsilon: float = 0.09, delta: float = 0.3) -> None:
    """Raise a one-line ValueError naming the first field out of range, or of a type the
    device's int32 / float32 rows would wrap, truncate or misread."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    for name, x in (("temperature", temperature), ("top_p", top_p), ("epsilon", epsilon),
                    ("delta", delta)):
        _check_number(name, x)
    if mode != "greedy" and not temperature > 0:
        raise ValueError(f"temperature must be > 0 for mode {mode!r}, got {temperature}")
    if not abs(temperature) <= FLOAT32_MAX:
        raise ValueError(f"temperature must be a finite number, got {temperature}")
    check_integer("top_k", top_k, 0, " (0: off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    for name, x in (("epsilon", epsilon), ("delta", delta)):
        if not 0 <= x <= FLOAT32_MAX:
            raise ValueError(f"{name} must be a finite number >= 0, got {x}")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen. Hashable: a static argument of the jitted decoders.

    mode: "greedy" (argmax; lossless), "typical" (the paper's typical acceptance; lossy),
    "rejection" (lossless speculative sampling from the temperature/top-k/top-p distribution).
    """

    mode: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    epsilon: float = 0.09  # typical: hard threshold
    delta: float = 0.3  # typical: entropy-scaled threshold (the paper's alpha)

    def __post_init__(self):
        check(self.mode, self.temperature, self.top_k, self.top_p, self.epsilon, self.delta)


def log_probs(logits: jax.Array, s: Sampling) -> jax.Array:
    """The distribution plain sampling draws from: temperature, then top-k, then top-p."""
    x = logits.astype(jnp.float32) / s.temperature
    neg = jnp.finfo(jnp.float32).min
    if s.top_k > 0:
        kth = jax.lax.top_k(x, s.top_k)[0][..., -1:]
        x = jnp.where(x < kth, neg, x)
    if s.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_x, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep = (cum - jax.nn.softmax(sorted_x, axis=-1)) < s.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, neg, x)
    return jax.nn.log_softmax(x, axis=-1)


def row_log_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> jax.Array:
    """`log_probs` with per-row parameters: logits [B, ..., V], the rest [B]. Temperature,
    then top-k, then top-p, as plain sampling does (temperature <= 0 reads as 1)."""
    v = logits.shape[-1]
    shape = (-1,) + (1,) * (logits.ndim - 1)
    t = jnp.where(temperature > 0, temperature, 1.0).reshape(shape)
    k, p = top_k.reshape(shape), top_p.reshape(shape)
    x = logits.astype(jnp.float32) / t
    neg = jnp.finfo(jnp.float32).min

    def filtered(x):
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        idx = jnp.broadcast_to(jnp.clip(k - 1, 0, v - 1), sorted_x.shape[:-1] + (1,))
        kth = jnp.take_along_axis(sorted_x, idx, axis=-1)
        use_k = k > 0
        x = jnp.where(use_k & (x < kth), neg, x)
        sorted_x = jnp.where(use_k & (sorted_x < kth), neg, sorted_x)  # still sorted
        sm = jax.nn.softmax(sorted_x, axis=-1)
        keep = (jnp.cumsum(sm, axis=-1) - sm) < p  # the smallest prefix reaching top_p
        cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        return jnp.where((p < 1.0) & (x < cutoff), neg, x)

    # the sort over the vocabulary only when some row filters (a runtime choice: rows
    # without top-k and top-p are the common case)
    x = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)), filtered, lambda x: x, x)
    return jax.nn.log_softmax(x, axis=-1)


@struct.dataclass
class Rows:
    """Every row's sampling and limits (B rows). Row b follows `modes[mode[b]]`."""

    mode: jax.Array  # [B] int32: index into `modes`
    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32; 0 = off
    top_p: jax.Array  # [B] float32; 1 = off
    epsilon: jax.Array  # [B] float32 (typical)
    delta: jax.Array  # [B] float32 (typical)
    max_tokens: jax.Array  # [B] int32: the row is done once it has emitted this many
    stop: jax.Array  # [B, N] int32: tokens that end the row (kept), -1 = none
    # static: the modes rows may follow (a program is compiled for these only), and the one
    # Sampling every row follows when they all sample alike (its filters then stay static)
    modes: tuple[str, ...] = struct.static_field(default=("greedy",))
    same: Sampling | None = struct.static_field(default=None)

    @classmethod
    def of(cls, s: Sampling, b: int, max_tokens: int, stop: tuple[int, ...] = ()) -> "Rows":
        """`s` for each of b rows, each ending at `stop` tokens or after `max_tokens`."""
        full = lambda x, dtype: jnp.full((b,), x, dtype)  # noqa: E731
        stop_ids = jnp.broadcast_to(jnp.asarray(stop or (-1,), jnp.int32), (b, max(1, len(stop))))
        return cls(mode=full(0, jnp.int32), temperature=full(s.temperature, jnp.float32),
                   top_k=full(s.top_k, jnp.int32), top_p=full(s.top_p, jnp.float32),
                   epsilon=full(s.epsilon, jnp.float32), delta=full(s.delta, jnp.float32),
                   max_tokens=full(max_tokens, jnp.int32), stop=stop_ids, modes=(s.mode,),
                   same=s)

    @classmethod
    def values(cls, b: int, max_tokens, stop: tuple[int, ...] = (), *, mode="greedy",
               temperature=1.0, top_k=0, top_p=1.0, epsilon: float = 0.09,
               delta: float = 0.3) -> "Rows":
        """b rows whose sampling values and token limits are runtime arrays, so one compiled
        program serves every temperature, filter, threshold and limit: the program depends
        only on `modes`, which is ("greedy",) when every row is greedy (nothing but argmax
        is compiled) and every mode otherwise (moving between typical and rejection
        compiles nothing either). Each value is a scalar or a length-b sequence (per row),
        checked as `check` checks one `Sampling`; a wrong length names the field."""
        def per_row(name, x):
            # Python values (object): checked before any conversion could wrap or truncate
            a = np.asarray(x, dtype=object)
            if a.ndim > 1 or (a.ndim == 1 and a.shape[0] != b):
                raise ValueError(f"{name} has {a.shape[0] if a.ndim == 1 else a.shape} "
                                 f"values for {b} rows: give one, or one per row")
            return np.broadcast_to(a, (b,))

        modes = per_row("mode", mode)
        vals = dict(temperature=per_row("temperature", temperature), top_k=per_row("top_k", top_k),
                    top_p=per_row("top_p", top_p), epsilon=per_row("epsilon", epsilon),
                    delta=per_row("delta", delta))
        limit = per_row("max_tokens", max_tokens)
        for i in range(b):
            try:
                check(str(modes[i]), *(vals[f][i] for f in vals))
                check_integer("max_tokens", limit[i], 1)
            except ValueError as e:
                raise ValueError(f"row {i}: {e}" if b > 1 else str(e)) from None
        for t in stop:
            if not (is_integer(t) and 0 <= t <= INT32_MAX):
                raise ValueError(f"stop token ids must be integers in 0..{INT32_MAX}, got {t!r}")
        all_modes = ("greedy",) if all(m == "greedy" for m in modes) else MODES
        stop_ids = np.broadcast_to(np.asarray(stop or (-1,), np.int32), (b, max(1, len(stop))))
        as_ = lambda a, dtype: jnp.asarray(a.astype(dtype))  # noqa: E731
        f32 = {f: as_(vals[f], np.float32) for f in ("temperature", "top_p", "epsilon", "delta")}
        return cls(mode=jnp.asarray([all_modes.index(m) for m in modes], jnp.int32),
                   top_k=as_(vals["top_k"], np.int32), max_tokens=as_(limit, np.int32),
                   stop=jnp.asarray(stop_ids), modes=all_modes, **f32)

    def log_probs(self, logits: jax.Array) -> jax.Array:
        """Each row's plain-sampling distribution: logits [B, ..., V] -> log-probs."""
        if self.same is not None:
            return log_probs(logits, self.same)
        return row_log_probs(logits, self.temperature, self.top_k, self.top_p)

    def draws(self, which: tuple[str, ...]) -> bool:
        """Whether any row may follow one of the modes `which` (static)."""
        return any(m in which for m in self.modes)

    def follows(self, which: tuple[str, ...]) -> jax.Array | bool:
        """[B] bool: the rows that follow one of the modes `which` (True: all of them)."""
        idx = [i for i, m in enumerate(self.modes) if m in which]
        if len(idx) == len(self.modes):
            return True
        return jnp.isin(self.mode, jnp.asarray(idx, jnp.int32))

    def is_stop(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, C] -> [B, C] bool: which are the row's stop tokens."""
        return jnp.any(tokens[:, :, None] == self.stop[:, None, :], axis=-1)


def split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row keys [B] -> (carried [B], for use now [B])."""
    both = jax.vmap(jax.random.split)(keys)
    return both[:, 0], both[:, 1]


def next_keys(keys: jax.Array, used: bool) -> tuple[jax.Array, jax.Array]:
    """(carried keys, keys for this step). Rules that draw nothing do no PRNG work."""
    return split_rows(keys) if used else (keys, keys)


def sample_rows(keys: jax.Array, logits: jax.Array, rows: Rows,
                draw: tuple[str, ...] = PLAIN_DRAWS, live: jax.Array | None = None) -> jax.Array:
    """Each row's next token: logits [B, V] -> [B] int32, drawn from its distribution where
    it follows a mode in `draw`, else its argmax. Rows of mixed modes draw only when some
    live row (live [B], default all) needs it (a `cond`: greedy batches skip the filters)."""
    greedy = argmax(logits)
    if not rows.draws(draw):
        return greedy

    def drawn(_):
        logp = rows.log_probs(logits)
        return jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)

    follows = rows.follows(draw)
    if follows is True:
        return drawn(None)
    some = jnp.any(follows if live is None else follows & live)
    return jnp.where(follows, jax.lax.cond(some, drawn, lambda _: greedy, None), greedy)
