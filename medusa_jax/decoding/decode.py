"""Jitted offline decoding: plain `generate` and speculative `medusa_generate` (Medusa or
Hydra heads), the offline driver of the shared step (`decoding.step`).

Each is ONE jitted function: prefill, then a `lax.while_loop` of steps that runs until every
row is done (on the CPU compiled with `runtime.xla_options`' schedule). Nothing goes back to
the host per token. Shapes are static: prompts are right-padded to a power-of-two bucket, so
a new prompt length only recompiles when it crosses a bucket. The static `Sampling` becomes
every row's `sampling.Rows`; the program holds only its rule. Given `rows` instead
(`Rows.values`: runtime arrays), one program serves every temperature, filter, seed and
token limit up to `max_new_tokens`, which then only sizes the buffers (`length_bucket`
rounds it so that nearby limits share a program).

Attention reads every cache slot its mask covers, so both loops run in a few phases
(`cache_phases`): each phase is its own `while_loop` whose steps attend over a static
leading window of the cache just wide enough for that phase (one cache buffer throughout;
shapes stay static; the step is compiled once per phase). A drafter's own cache is cut to
the window with it (`Drafter.window`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax import kernels
from medusa_jax.decoding import step
from medusa_jax.decoding.drafter import carry_window, drafter_for, put_leading
from medusa_jax.decoding.sampling import Rows, Sampling

# the stages, for callers that run or test them one by one
from medusa_jax.decoding.step import (  # noqa: F401
    DecodeState,
    Proposal,
    commit,
    emit,
    propose_candidates,
    small_top_k,
    tree_proposal,
    verify,
)
from medusa_jax.decoding.tree import DynamicTree, Tree
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig
from medusa_jax.runtime import pytree as struct  # flax.struct without importing Flax
from medusa_jax.runtime.xla_options import decoder_jit

MIN_BUCKET = 16


def prompt_bucket(length: int) -> int:
    """Pad prompts to the next power of two (at least 16): few distinct compiled shapes."""
    return max(MIN_BUCKET, 1 << (max(1, length) - 1).bit_length())


def pad_prompts(prompts: list[list[int]],
                bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to a bucket. Returns (tokens [B, bucket], lengths [B])."""
    if not prompts:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError(f"prompt {int(np.argmin(lengths))} is empty: give at least one token")
    bucket = bucket or prompt_bucket(int(lengths.max()))
    tokens = np.zeros((len(prompts), bucket), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def length_bucket(max_new_tokens: int, room: int | None = None) -> int:
    """The buffers' size for a runtime token limit: the next power of two (at least 16), so
    limits in the same bucket share a program; `room` (the context left after the prompt's
    bucket and the tree) caps it, never below `max_new_tokens` itself."""
    bucket = prompt_bucket(max_new_tokens)
    if room is not None:
        bucket = min(bucket, max(room, max_new_tokens))
    return bucket


def _rows(sampling: Sampling, rows: Rows | None, b: int, max_new_tokens: int,
          eos: tuple[int, ...]) -> Rows:
    """The rows' sampling and limits: `rows` as given (runtime values), or `sampling` for
    every row with `eos` and `max_new_tokens` (static)."""
    if rows is None:
        return Rows.of(sampling, b, max_new_tokens, eos)
    if rows.mode.shape != (b,):
        raise ValueError(f"rows hold {rows.mode.shape[0]} rows for a batch of {b} prompts")
    # the output and the cache hold max_new_tokens per row: a larger limit is clipped to it
    # (the limits are runtime values, so a refusal would need them on the host in the jit)
    return rows.replace(max_tokens=jnp.minimum(rows.max_tokens, max_new_tokens))


def check_fits(cfg: ModelConfig, prompt_len: int, max_new_tokens: int, tree_tokens: int = 1):
    """Raise before compiling when prompt + new tokens + tree overflow the context."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    need = prompt_len + max_new_tokens + tree_tokens
    if need > cfg.max_position_embeddings:
        # tree_tokens=0: plain decoding (its last token is emitted, never fed)
        tree = f" + tree ({tree_tokens} tokens)" if tree_tokens else ""
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}){tree} = {need} "
            f"exceeds the model's context of {cfg.max_position_embeddings}; shorten the "
            f"prompt or lower max_new_tokens")


# Cache phases: each widens the attention window by at least CACHE_BLOCK slots, a decode
# whose cache is at most 2 * CACHE_BLOCK slots past the prompt has one phase, and no decode
# has more than MAX_CACHE_PHASES (each compiles the step once more). What they gain:
# docs/benchmarks/2026-12-01-stories260K.md.
CACHE_BLOCK = 128
MAX_CACHE_PHASES = 4


def cache_phases(start: int, final: int, per_step: int, block: int | None = None,
                 max_phases: int | None = None) -> tuple[int, ...]:
    """Attention windows (leading cache slots) of the decoding loop's phases, for prompts of
    `start` slots (the bucket) and a cache of `final` slots; a step feeds up to `per_step`
    tokens past the committed ones. Increasing; the last is `final`."""
    block = CACHE_BLOCK if block is None else block
    max_phases = MAX_CACHE_PHASES if max_phases is None else max_phases
    if not (isinstance(max_phases, int) and max_phases >= 1 and block >= 1):
        raise ValueError(f"max_cache_phases must be an int >= 1, got {max_phases!r}")
    span = final - start
    if max_phases == 1 or span <= 2 * block:
        return (final,)
    step = max(block, per_step, -(-span // max_phases))
    caps = list(range(start + step, final, step))
    if caps and final - caps[-1] < step // 2:  # a short last phase is not worth a compile
        caps.pop()
    return tuple(caps) + (final,)


def run_phases(step, carry, windows: tuple[int, ...], per_step: int, drafter=None):
    """`while_loop(not all done, step)` in cache phases: phase i calls `step(c, window=
    windows[i])` while every row's next step fits in that many slots (lengths + per_step <=
    window); the last phase (the whole cache) runs until every row is done. The carry is a
    `DecodeState`, or holds one as `.state`; a `drafter`'s carry (`draft`) is cut to each
    phase's window with the cache (`Drafter.window`), so its own attention reads only it."""
    def state(c):
        return getattr(c, "state", c)

    def with_cache(c, cache, draft):
        s = state(c).replace(cache=cache)
        if draft is not None:
            s = s.replace(draft=draft)
        return c.replace(state=s) if hasattr(c, "state") else s

    c = carry
    for i, window in enumerate(windows):
        last = i == len(windows) - 1

        def cond(c, window=window, last=last):
            s = state(c)
            go = ~jnp.all(s.done)
            return go if last else go & (jnp.max(s.cache.lengths) + per_step <= window)

        full = state(c).cache
        draft = getattr(state(c), "draft", None) if drafter is not None else None
        if window < full.capacity:  # the phase's loop carries only its window
            c = with_cache(c, full.leading(full.lengths.shape[0], window),
                           carry_window(drafter, draft, window))
        c = jax.lax.while_loop(cond, functools.partial(step, window=window), c)
        if window < full.capacity:
            c = with_cache(c, full.put_leading(state(c).cache),
                           put_leading(draft, getattr(state(c), "draft", None)))
    return c


@struct.dataclass
class Output:
    """Per-row results (device arrays). `tokens[b, :num_new[b]]` are row b's new tokens."""

    tokens: jax.Array  # [B, max_new_tokens] int32
    num_new: jax.Array  # [B] int32
    steps: jax.Array  # [B] int32: decoding steps (forward passes after prefill)
    accept_hist: jax.Array  # [B, D+2] int32: how many steps emitted 0 .. D+1 tokens


@struct.dataclass
class Run:
    """The offline loop's carry: the rows, and every token they emitted."""

    state: DecodeState
    out: jax.Array  # [B, max_new_tokens + W] int32 (W: a step's chunk; the tail is cut)


def drive(one_step, run: Run, window: int | None = None) -> Run:
    """One step of `one_step(state, window) -> (state, chunk, n)`, its tokens appended."""
    s, chunk, _ = one_step(run.state, window=window)
    return Run(state=s, out=step.append(run.out, chunk, run.state.count, ~run.state.done))


def _row_keys(key, b):
    return jax.random.split(key, b)


def plain_capacity(prompt_slots: int, max_new_tokens: int) -> int:
    """KV cache slots a plain decode needs at most."""
    return prompt_slots + max_new_tokens + 1


def plain_init(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
               key: jax.Array, sampling: Sampling, max_new_tokens: int,
               eos: tuple[int, ...] = (), rows: Rows | None = None) -> DecodeState:
    """Prefill the prompts and choose each row's first token."""
    b, p = tokens.shape
    return step.start(params, cfg, tokens, lengths, _row_keys(key, b),
                      _rows(sampling, rows, b, max_new_tokens, eos),
                      plain_capacity(p, max_new_tokens))


@decoder_jit(static_argnames=("cfg", "sampling", "max_new_tokens", "eos", "max_cache_phases"))
def generate(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
             key: jax.Array, *, sampling: Sampling = Sampling(), max_new_tokens: int = 128,
             eos: tuple[int, ...] = (), max_cache_phases: int = MAX_CACHE_PHASES,
             rows: Rows | None = None) -> Output:
    """Plain autoregressive decoding. tokens [B, P] right-padded, lengths [B].
    `max_cache_phases`: 1 attends over the whole cache at every step (`cache_phases`).
    `rows` (`Rows.values`): each row's sampling, stop tokens and token limit as runtime
    values, in place of `sampling` and `eos`; a limit past `max_new_tokens` is clipped to
    it."""
    b, p = tokens.shape
    state = plain_init(params, cfg, tokens, lengths, key, sampling, max_new_tokens, eos, rows)
    run = Run(state=state, out=jnp.zeros((b, max_new_tokens + 1), jnp.int32))
    one = functools.partial(step.plain_step, params, cfg)
    run = run_phases(functools.partial(drive, one), run,
                     cache_phases(p, state.cache.capacity, 1, max_phases=max_cache_phases), 1)
    count = run.state.count
    hist = jnp.zeros((b, 3), jnp.int32).at[:, 1].set(count)
    return Output(tokens=run.out[:, :max_new_tokens], num_new=count, steps=count,
                  accept_hist=hist)


def medusa_capacity(prompt_slots: int, max_new_tokens: int, tree: Tree | DynamicTree) -> int:
    """KV cache slots a Medusa decode needs at most (the last step verifies a whole tree)."""
    return prompt_slots + max_new_tokens + tree.num_nodes + 1


def medusa_init(params: Params, heads: Params, cfg: ModelConfig, tokens: jax.Array,
                lengths: jax.Array, key: jax.Array, tree: Tree, sampling: Sampling,
                max_new_tokens: int, head_fn=None, eos: tuple[int, ...] = (),
                rows: Rows | None = None) -> tuple[DecodeState, Params]:
    """Prefill, choose each row's root and start the drafter. Returns (state, the heads the
    tree uses: those deeper than the tree never propose a candidate and are not run)."""
    drafter = drafter_for(heads, head_fn)
    have = drafter.depth(heads)
    if have is not None and have < tree.depth:
        raise ValueError(f"tree {tree.name!r} has depth {tree.depth} but there are only "
                         f"{have} {drafter.kind.title()} heads")
    b, p = tokens.shape
    heads = drafter.prepare(heads, tree, cpu_kernels=kernels.active(params))
    state = step.start(params, cfg, tokens, lengths, _row_keys(key, b),
                       _rows(sampling, rows, b, max_new_tokens, eos),
                       medusa_capacity(p, max_new_tokens, tree), drafter, heads,
                       width=tree.depth + 1)
    return state, heads


@decoder_jit(static_argnames=("cfg", "tree", "sampling", "max_new_tokens", "eos", "head_fn",
                              "max_cache_phases"))
def medusa_generate(params: Params, heads: Params, cfg: ModelConfig, tokens: jax.Array,
                    lengths: jax.Array, key: jax.Array, *, tree: Tree,
                    sampling: Sampling = Sampling(), max_new_tokens: int = 128,
                    eos: tuple[int, ...] = (), head_fn=None,
                    max_cache_phases: int = MAX_CACHE_PHASES,
                    rows: Rows | None = None) -> Output:
    """Medusa decoding with tree verification. tokens [B, P] right-padded, lengths [B].
    `max_cache_phases`: 1 attends over the whole cache at every step (`cache_phases`).
    `rows` (`Rows.values`): each row's sampling, stop tokens and token limit as runtime
    values, in place of `sampling` and `eos`; a limit past `max_new_tokens` is clipped to
    it.

    `heads`: Medusa heads or Hydra heads (`drafters/`); the drafter is chosen from
    them (`drafter_for`). `head_fn(heads, hidden [B, H], lengths [B]) -> [K, B, V]` turns
    the hidden state of the last committed token (at slot lengths - 1) into Medusa head
    logits; the default applies the Medusa heads. Tests plug in oracle heads here. A
    drafter (`MedusaDrafter`, `HydraDrafter`) may be given as `head_fn` too.
    """
    b = tokens.shape[0]
    state, heads = medusa_init(params, heads, cfg, tokens, lengths, key, tree, sampling,
                               max_new_tokens, head_fn, eos, rows)
    drafter = drafter_for(heads, head_fn)
    one = functools.partial(step.medusa_step, params, cfg, drafter, heads, tree)
    run = Run(state=state, out=jnp.zeros((b, max_new_tokens + tree.depth + 1), jnp.int32))
    windows = cache_phases(tokens.shape[1], state.cache.capacity, tree.num_nodes,
                           max_phases=max_cache_phases)
    run = run_phases(functools.partial(drive, one), run, windows, tree.num_nodes, drafter)
    s = run.state
    return Output(tokens=run.out[:, :max_new_tokens], num_new=s.count, steps=s.steps,
                  accept_hist=s.hist)
