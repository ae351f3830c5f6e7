"""A pool of n-grams shared across requests (the server's `--ngram-shared`), as llama.cpp's
ngram-mod: a bounded, hashed table from the hash of n tokens to the `width` tokens that
followed them in an earlier request (its prompt and output).

`NgramPool` is the table on the host (numpy): `add(tokens)` writes every n-gram of a finished
request, direct-mapped (entry = hash mod size; a later n-gram evicts an earlier one at the
same entry, so the table never holds more than `size`); the engine calls it between calls,
never inside the decoding loop, and hands the table to the device with `into(heads)` (the
entries written since the last time, scattered into it; the same shapes each time: nothing
recompiles). `drafter.PooledNgramDrafter` is the n-gram drafter that also looks the
context's last n tokens up there (`lookup`: one hash and one gather per row). The pool's
context is `max_n` tokens, as long as any match in the row's own history: where it hits, it
drafts the best continuation. A hash collision only drafts wrong tokens, which verification
rejects: the pool changes no output.

The carry counts each row's lookups that found an entry (`pool_hits`), the server's
`medusa_ngram_pool_hits_total`.
"""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.drafter import BoundParams

POOL_WIDTH = 8  # tokens kept after each n-gram
MAX_POOL_BYTES = 4 << 30  # the stated bound on the table, besides the free memory
ENTRY_BYTES = 4 * (POOL_WIDTH + 2)  # key, length, tokens (int32 each)
KEYS, LENS, NEXT = "ngram_pool_keys", "ngram_pool_lens", "ngram_pool_next"

_FNV_OFFSET, _FNV_PRIME = 2166136261, 16777619


def hash_tokens(ctx) -> np.ndarray:
    """ctx [..., n] int -> [...] uint32 (FNV-1a over the tokens' 32 bits; `hash_device`
    computes the same on the device)."""
    ctx = np.asarray(ctx).astype(np.uint32)
    h = np.full(ctx.shape[:-1], _FNV_OFFSET, np.uint32)
    with np.errstate(over="ignore"):  # modulo 2**32, as the device's
        for t in range(ctx.shape[-1]):
            h = (h ^ ctx[..., t]) * np.uint32(_FNV_PRIME)
    return h


def hash_device(ctx: jax.Array) -> jax.Array:
    """`hash_tokens` on the device: ctx [..., n] int32 -> [...] uint32."""
    ctx = ctx.astype(jnp.uint32)
    h = jnp.full(ctx.shape[:-1], _FNV_OFFSET, jnp.uint32)
    for t in range(ctx.shape[-1]):
        h = (h ^ ctx[..., t]) * jnp.uint32(_FNV_PRIME)
    return h


def available_bytes() -> int | None:
    """The machine's available memory (None where it cannot be read)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_size(size) -> None:
    """A one-line ValueError unless a pool of `size` entries fits: an integer >= 1 whose
    table is within MAX_POOL_BYTES and the available memory."""
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
        raise ValueError(f"ngram pool size must be an integer >= 1 (entries), got {size!r}")
    need = int(size) * ENTRY_BYTES
    free = available_bytes()
    for bound, what in ((MAX_POOL_BYTES, "the pool's bound"), (free, "the available memory")):
        if bound is not None and need > bound:
            raise ValueError(f"ngram pool size {size} entries needs {need / 2**30:.2f} GiB "
                             f"({ENTRY_BYTES} bytes each), over {what} "
                             f"({bound / 2**30:.2f} GiB)")


class NgramPool:
    """The host table: `size` entries of (hash of n tokens [uint32], how many tokens
    followed [int32, 0: empty], those tokens [width] int32)."""

    def __init__(self, size: int, n: int, width: int = POOL_WIDTH):
        check_size(size)
        self.size, self.n, self.width = int(size), int(n), int(width)
        self.keys = np.zeros((self.size,), np.uint32)
        self.lens = np.zeros((self.size,), np.int32)
        self.next = np.zeros((self.size, self.width), np.int32)
        self.lock = threading.Lock()
        self.dirty = False  # added to since `into` last ran
        self._changed: list[np.ndarray] = []  # entries written since then

    @property
    def entries(self) -> int:
        return int(np.count_nonzero(self.lens))

    def add(self, tokens) -> int:
        """Every n-gram of `tokens` (a request's prompt and output) with the tokens after it
        (up to `width`); later ones win an entry. Returns the n-grams written."""
        seq = np.asarray(tokens, np.int64).reshape(-1)
        count = len(seq) - self.n  # n-grams that have a next token
        if count < 1:
            return 0
        i = np.arange(count)[:, None]
        ctx = seq[i + np.arange(self.n)[None]]  # [C, n]
        h = hash_tokens(ctx)
        at = i + self.n + np.arange(self.width)[None]  # [C, W]
        cont = np.where(at < len(seq), seq[np.minimum(at, len(seq) - 1)], 0)
        lens = np.minimum(len(seq) - (np.arange(count) + self.n), self.width)
        slot = (h % np.uint32(self.size)).astype(np.int64)
        with self.lock:  # duplicate slots: numpy keeps the last write (the latest n-gram)
            self.keys[slot] = h
            self.lens[slot] = lens
            self.next[slot] = cont
            self._changed.append(slot)
            self.dirty = True
        return count

    def lookup(self, ctx) -> list[int] | None:
        """The tokens after the n tokens `ctx` (the host's answer, as the device's), or None."""
        h = hash_tokens(np.asarray(ctx)[-self.n:])
        s = int(h % np.uint32(self.size))
        if self.lens[s] == 0 or self.keys[s] != h:
            return None
        return [int(t) for t in self.next[s, :self.lens[s]]]

    def arrays(self) -> dict:
        """The whole table, as device arrays."""
        with self.lock:
            self.dirty, self._changed = False, []
            return {KEYS: jnp.asarray(self.keys), LENS: jnp.asarray(self.lens),
                    NEXT: jnp.asarray(self.next)}

    def into(self, heads) -> BoundParams:
        """`heads` (the drafter's prepared parameters, holding the table as `into` left it)
        with the table as it is now: the entries written since are scattered into it (padded
        to a power of two, so few programs compile), the whole table only where they are
        more than a quarter of it."""
        with self.lock:
            changed = np.unique(np.concatenate(self._changed)) if self._changed else \
                np.zeros((0,), np.int64)
            if KEYS not in heads or 4 * len(changed) > self.size:
                table = None
            else:
                pad = max(64, 1 << max(len(changed) - 1, 0).bit_length())
                at = np.full((pad,), self.size, np.int32)  # past the table: dropped
                at[:len(changed)] = changed
                rows = np.minimum(at, self.size - 1)
                table = _scatter(heads[KEYS], heads[LENS], heads[NEXT], at,
                                 self.keys[rows], self.lens[rows], self.next[rows])
                self.dirty, self._changed = False, []
        if table is None:
            return BoundParams({**dict(heads), **self.arrays()}, heads.drafter)
        return BoundParams({**dict(heads), **dict(zip((KEYS, LENS, NEXT), table))},
                           heads.drafter)

    def add_request(self, prompt, tokens) -> int:
        """The engine's hook: a finished request's prompt and output."""
        return self.add(list(prompt) + list(tokens))


@jax.jit
def _scatter(keys, lens, nxt, at, k, n, t):
    """The table with entries at [U] set to k [U], n [U], t [U, W]; entries past the table
    are dropped. Not donated: a call in flight and a program being compiled may still hold
    the table handed out before."""
    return (keys.at[at].set(k, mode="drop"), lens.at[at].set(n, mode="drop"),
            nxt.at[at].set(t, mode="drop"))


def lookup(heads, hist: jax.Array, last: jax.Array, n: int):
    """hist [B, S] with each row's context ending at last [B] -> (found [B] bool, tokens [B,
    W] int32, their count [B]): the pool's entry for the context's last n tokens."""
    idx = last[:, None] - (n - 1) + jnp.arange(n)[None]  # [B, n]
    ctx = jnp.take_along_axis(hist, jnp.maximum(idx, 0), axis=1)
    h = hash_device(ctx)
    keys, lens, nxt = heads[KEYS], heads[LENS], heads[NEXT]
    slot = (h % jnp.uint32(keys.shape[0])).astype(jnp.int32)
    found = (keys[slot] == h) & (lens[slot] > 0) & (last >= n - 1)
    return found, nxt[slot], lens[slot]
