"""The drafter protocol, runtime half: what the decoding step asks of whatever proposes
its tree (`Drafter`, a base class whose defaults and one-line refusals every kind inherits,
so the decoders find no capability by probing for it).

A drafter keeps a carry (any pytree, e.g. head logits [K, B, V], a hidden state [1, B, H],
or a drafter's own KV cache) and proposes the tree's candidates from it and the root
(`propose`, stage 1 of the step). The step hands it what the backbone computed twice: after
prefill (`begin`: the prompt's hidden states, and the inputs of the backbone layers the
drafter names in `aux_layers`) and after each commit (`advance`: the same along the accepted
path, with its tokens and the next root). What the carry holds of the context is declared
once (`context`, a `Context`): it decides whether plain steps may run beside the drafter and
whether it can start after a cached prefix. Drafters that read only the last accepted token's
hidden state (Medusa, Hydra) implement `start` and take `begin`/`advance` from
`FromLastHidden`. A drafter with its own cache over the context cuts it to the backbone's
attention window where the decoders cut theirs (`window`; `put_leading` writes it back).
Drafters are frozen dataclasses: hashable, so they are static arguments of the jitted
decoders.

Parameters may carry their drafter (`BoundParams`: a dict with a `drafter`, static in the
pytree): a drafter whose configuration the tensors' shapes do not hold (EAGLE-3's aux layers,
its norm eps and rope) travels with its parameters through every decoder that way.

The kinds of drafter live in `medusa_jax.drafters` (one folder each), registered in
`drafters.registry`, the one door to them; that layer installs its lookup of unbound
parameters here (`decoding.kinds`), so decoding never imports a drafter's code. The kind's
half of the protocol (file formats, axes, init, cost, enlarging...) is `drafters.kind.Kind`;
the conformance test (tests/drafters/test_conformance.py) is the recipe.
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp

from medusa_jax.decoding import kinds

Params = Any  # a parameter pytree


class Context(enum.Enum):
    """What a drafter's carry holds of the committed context, which decides how it meets
    plain steps (the engine runs them for busy batches) and a cached prefix."""

    # only the last committed token's hidden state (Medusa, Hydra): plain steps leave the
    # carry as it was (verification decides), and after a cached prefix it begins from the
    # last prompt token
    LAST_HIDDEN = "last_hidden"
    # state built from every committed token's id (the n-gram history): plain steps hand it
    # their token (`append`), and after a cached prefix it is begun on the whole prompt's
    # tokens (of `hidden`, only each row's last prompt token is read)
    TOKENS = "tokens"
    # state built from every committed position's hidden states (EAGLE-3's own KV cache): no
    # plain steps beside it, no start after a cached prefix
    HIDDEN_STATES = "hidden_states"


class Drafter:
    """The runtime half of the protocol. A kind declares `kind` (its artifact's kind),
    `batch_axis` (the axis of the carry's leaves that holds the rows) and `context`, and
    implements `begin`, `advance` and `propose`; the rest has defaults here."""

    kind: str
    batch_axis: int
    context: Context
    aux_layers: tuple = ()  # backbone layers whose inputs `begin`/`advance` receive

    @property
    def name(self) -> str:
        """How logs and the server name this drafter."""
        return self.kind

    # derived from `context`, for the decoders and the serving layout
    @property
    def keeps_context(self) -> bool:
        """Whether the carry holds state of every committed token."""
        return self.context is not Context.LAST_HIDDEN

    @property
    def follows_plain_steps(self) -> bool:
        """Whether plain steps hand it their tokens (`append`) to keep the carry complete."""
        return self.context is Context.TOKENS

    @property
    def rebuilds_from_tokens(self) -> bool:
        """Whether, after a cached prefix, it is begun on the whole prompt's tokens."""
        return self.context is not Context.HIDDEN_STATES

    def depth(self, heads: Params) -> int | None:
        """How many levels of a tree this drafter can fill with `heads` (None: any): the
        one answer the API, the decoders and the tools check a tree against."""
        return None

    def prepare(self, heads: Params, tree, cpu_kernels: bool = False) -> Params:
        """The parameters the tree uses (deeper heads dropped; the CPU kernel's layout when
        `cpu_kernels`)."""
        return heads

    def begin(self, params: Params, heads: Params, hidden, aux, tokens, lengths, root,
              capacity: int):
        """After prefill: hidden [B, P, H] the prompts' final hidden states, aux [B, P, A]
        the inputs of `aux_layers` (None without any), tokens [B, P] right-padded to
        lengths [B], root [B] each row's first token, `capacity` the cache slots a row may
        fill -> the carry (a pytree whose leaves have the rows on axis `batch_axis`)."""
        raise NotImplementedError(f"drafter kind {self.kind!r} does not implement begin")

    def advance(self, params: Params, heads: Params, carry, hidden, aux, tokens, acc_len,
                next_root, lengths, live):
        """After commit: hidden [B, W, H] and aux [B, W, A] (or None) of the path the step
        verified and kept, root first (W = tree depth + 1; entries past acc_len are not
        committed), tokens [B, W] its tokens, acc_len [B] nodes accepted below the root,
        next_root [B], lengths [B] the cache lengths after commit, live [B] the rows that
        stepped -> the next carry (rows not live are restored by the step)."""
        raise NotImplementedError(f"drafter kind {self.kind!r} does not implement advance")

    def propose(self, params: Params, heads: Params, carry, root, tree, draw=None):
        """Stage 1: the carry and the root [B] -> a `step.Proposal`. `draw` (a
        `step.DraftSampler`, given when some row accepts by rejection sampling): pick each
        node's children with `draw.top_k` instead of the top-k, and return the drafts in the
        Proposal (`draws`, `draft_logq`); the step calls `propose` without it otherwise."""
        raise NotImplementedError(f"drafter kind {self.kind!r} does not implement propose")

    def append(self, carry, tokens, live):
        """Only where `follows_plain_steps`: after a plain step, tokens [B] the token each
        row committed (its root), live [B] the rows that stepped -> the carry with them."""
        raise ValueError(f"a {self.name} drafter does not follow plain steps")

    def window(self, carry, slots: int):
        """The carry with its context (what it keeps per committed position, if anything)
        cut, or zero-padded at the end, to `slots` positions, as the backbone's cache is to
        an attention window: only a row's first `length` positions hold anything. The
        decoders cut the carry with it where they cut the cache (a cache phase, a serving
        call, a resize) and write it back with `put_leading`. A carry without a context
        comes back as it is (this default)."""
        return carry

    def shared_pool(self, size: int):
        """(this drafter reading a pool shared across requests of `size` entries, the pool),
        or None: this default, a drafter that keeps no such pool."""
        return None

    def pool_hits(self, carry):
        """[B] int32: each row's lookups that found an entry of a shared pool (None: the
        drafter reads none)."""
        return None


class FromLastHidden(Drafter):
    """`begin` and `advance` of a drafter whose carry is `start(params, heads, hidden [B, H]
    of the last committed token, lengths [B])`: Medusa and Hydra heads."""

    context = Context.LAST_HIDDEN

    def begin(self, params, heads, hidden, aux, tokens, lengths, root, capacity):
        last = hidden[jnp.arange(hidden.shape[0]), lengths - 1]
        return self.start(params, heads, last, lengths)

    def advance(self, params, heads, carry, hidden, aux, tokens, acc_len, next_root,
                lengths, live):
        return self.start(params, heads, hidden[jnp.arange(hidden.shape[0]), acc_len],
                          lengths)


def carry_window(drafter: Drafter | None, carry, slots: int):
    """`drafter.window(carry, slots)`: the carry's context cut or padded to `slots`
    positions (no drafter, no carry: plain decoding)."""
    return carry if carry is None or drafter is None else drafter.window(carry, slots)


def put_leading(full, sub):
    """`sub` (a carry, or any pytree of `full`'s structure whose leaves are leading blocks of
    `full`'s: fewer rows, a narrower context) written over the start of `full`'s leaves (in
    place when `full` is donated or dead afterwards); a leaf of the same shape is `sub`'s."""
    def at(a, b):
        if a.shape == b.shape:
            return b.astype(a.dtype)
        return jax.lax.dynamic_update_slice(a, b.astype(a.dtype), (0,) * a.ndim)
    return None if full is None else jax.tree.map(at, full, sub)


class BoundParams(dict):
    """A drafter's parameters with the drafter that decodes them (`drafter`), which a pytree
    keeps as static data: jitted functions see it, and it survives `jax.tree.map`,
    `device_put` and sharding. `dict(...)` of it gives the bare parameters."""

    def __init__(self, params: dict, drafter):
        super().__init__(params)
        self.drafter = drafter

    def __repr__(self):
        return f"BoundParams({sorted(self)}, drafter={self.drafter!r})"


jax.tree_util.register_pytree_with_keys(
    BoundParams,
    lambda p: ([(jax.tree_util.DictKey(k), p[k]) for k in sorted(p)],
               (tuple(sorted(p)), p.drafter)),
    lambda aux, leaves: BoundParams(dict(zip(aux[0], leaves)), aux[1]))


def drafter_for(heads: Params, head_fn=None) -> Drafter:
    """The drafter of `heads`: `head_fn` when it is a drafter, else the one bound to `heads`
    (`BoundParams`), else the registered kind's (`drafters.registry.drafter_for`)."""
    if isinstance(head_fn, Drafter):
        return head_fn
    if head_fn is None and isinstance(heads, BoundParams):
        return heads.drafter
    return kinds.lookup(heads, head_fn)


def refuse_head_fn(head_fn, what: str) -> None:
    """`Drafter.from_head_fn` of a kind without Medusa heads: a head function is refused in
    one line (`what`: what the parameters are instead)."""
    if head_fn is not None:
        raise ValueError(f"head_fn is a Medusa head function, but {what}; leave head_fn unset")
