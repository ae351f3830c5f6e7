"""The drafter protocol: what the decoding step asks of whatever proposes its tree.

A drafter turns the last accepted token's hidden state into a carry (`start`: any pytree,
e.g. head logits [K, B, V] or a hidden state [1, B, H]) and proposes the tree's candidates
from that carry and the root (`propose`, stage 1 of the step). Drafters are frozen
dataclasses: hashable, so they are static arguments of the jitted decoders.

The kinds of drafter live in `medusa_jax.drafters` (one folder each); this layer names them
in `DRAFTERS` as "module:class" and imports one only when heads of its kind are decoded,
so decoding never imports a drafter's code. Adding a kind is a folder there and a line here.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

Params = Any  # a parameter pytree


class Drafter(Protocol):
    kind: str  # the artifact's kind ("medusa", "hydra", "eagle3")
    batch_axis: int  # the axis of the carry's leaves that holds the rows

    @classmethod
    def matches(cls, heads: Params) -> bool:
        """Whether `heads` (arrays, numpy or shapes) are this kind's parameters."""

    @classmethod
    def shape_of(cls, heads: Params) -> tuple[int, int]:
        """(number of heads, residual blocks per head), read off the parameters."""

    @classmethod
    def axes(cls, heads: Params) -> dict:
        """{name: logical axes} of the parameters `heads` has (`runtime.sharding`)."""

    def prepare(self, heads: Params, tree, cpu_kernels: bool) -> Params:
        """The parameters the tree uses (deeper heads dropped; the CPU kernel's layout when
        `cpu_kernels`)."""

    def start(self, params: Params, heads: Params, hidden, lengths):
        """hidden [B, H] of the last accepted token, lengths [B] -> the carry (a pytree whose
        leaves have the rows on axis `batch_axis`)."""

    def num_heads(self, heads: Params, carry) -> int:
        """How deep a tree this drafter can fill."""

    def propose(self, params: Params, heads: Params, carry, root, tree):
        """Stage 1: the carry and the root [B] -> a `step.Proposal`."""


# kind -> "module:class", imported on first use; the first whose `matches` says yes drafts
DRAFTERS = {
    "eagle3": "medusa_jax.drafters.eagle3.drafter:Eagle3Drafter",
    "hydra": "medusa_jax.drafters.hydra.drafter:HydraDrafter",
    "medusa": "medusa_jax.drafters.medusa.drafter:MedusaDrafter",
}


def drafter_class(kind: str) -> type:
    """The drafter class registered for `kind`."""
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter kind {kind!r}; known: {', '.join(DRAFTERS)}")
    module, name = DRAFTERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def kind_of(heads: Params) -> str:
    """The kind of drafter `heads` are the parameters of."""
    for kind in DRAFTERS:
        if drafter_class(kind).matches(heads):
            return kind
    names = ", ".join(sorted(heads)) if isinstance(heads, dict) else type(heads).__name__
    raise ValueError(f"these heads are of no known drafter kind ({', '.join(DRAFTERS)}); "
                     f"their tensors: {names}")


def drafter_for(heads: Params, head_fn=None) -> Drafter:
    """The drafter of `heads`: `head_fn` when it is a drafter already, else the registered
    kind's, built from `head_fn` (a Medusa head function, for tests' oracle heads)."""
    if head_fn is not None and hasattr(head_fn, "propose"):
        return head_fn
    if head_fn is not None and not any(drafter_class(k).matches(heads) for k in DRAFTERS):
        # a Medusa head function takes whatever parameters it likes (tests' oracle heads)
        return drafter_class("medusa").from_head_fn(head_fn)
    return drafter_class(kind_of(heads)).from_head_fn(head_fn)


def shape_of(heads: Params) -> tuple[int, int]:
    """(number of heads, residual blocks per head) of heads of any kind."""
    return drafter_class(kind_of(heads)).shape_of(heads)


def axes_of(heads: Params) -> dict:
    """{name: logical axes} of heads of any kind."""
    return drafter_class(kind_of(heads)).axes(heads)
