"""Medusa heads as a drafter (`decoding.drafter.Drafter`): every head reads the same hidden
state; the carry is their logits [K, B, V], and the tree is filled from their top-k."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from medusa_jax import kernels
from medusa_jax.decoding.drafter import FromLastHidden
from medusa_jax.drafters.kind import Kind
from medusa_jax.decoding.step import Proposal, propose_candidates
from medusa_jax.drafters.medusa import heads as medusa_heads
from medusa_jax.drafters.medusa.heads import apply_heads
from medusa_jax.model.backbone import Params


def _pad(a: np.ndarray, tail: tuple) -> np.ndarray:
    """`a` [..., *t] in the leading corner of zeros [..., *tail]."""
    out = np.zeros((*a.shape[:a.ndim - len(tail)], *tail))
    out[(...,) + tuple(slice(0, n) for n in a.shape[a.ndim - len(tail):])] = a
    return out


def standard_heads(heads: Params, hidden: jax.Array, lengths: jax.Array) -> jax.Array:
    """The head function of Medusa: hidden [B, H] -> logits [K, B, V] (lengths unused)."""
    del lengths
    return apply_heads(heads, hidden)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(FromLastHidden, Kind):
    """`head_fn(heads, hidden [B, H], lengths [B]) -> [K, B, V]`: tests plug in oracle
    heads here."""

    head_fn: object = standard_heads
    kind = "medusa"
    formats = "medusa_jax.drafters.medusa.formats:MedusaFormats"  # its layouts, its artifact
    batch_axis = 1  # of the carry: [K, B, V] logits

    @classmethod
    def matches(cls, heads: Params) -> bool:
        return medusa_heads.is_medusa(heads)

    @classmethod
    def shape_of(cls, heads: Params) -> tuple[int, int]:
        return tuple(int(n) for n in heads["w"].shape[:2])

    @classmethod
    def axes(cls, heads: Params) -> dict:
        return medusa_heads.heads_axes(heads)

    @classmethod
    def init(cls, cfg, backbone: Params, key, depth: int) -> Params:
        """Fresh heads, `depth` of them (zero blocks, copies of the output projection)."""
        return medusa_heads.init_heads(cfg, backbone, medusa_heads.HeadsConfig(depth))

    @staticmethod
    def cost(hidden: int, vocab: int, **kw) -> dict:
        from medusa_jax.drafters.medusa.cost import heads_cost

        return heads_cost(hidden, vocab, **kw)

    @staticmethod
    def enlarge(heads: Params, src, dst, grow) -> Params:
        """For a backbone grown from `src` to `dst` (`tools.enlarge`): blocks and
        projections padded to H' with zeros, so the heads compute what they did."""
        h2 = dst.hidden_size
        w, b, proj = (np.asarray(heads[n], np.float64) for n in ("w", "b", "proj"))
        out = {"w": _pad(w, (h2, h2)), "b": _pad(b, (h2,)),
               "proj": _pad(proj, (h2, proj.shape[2]))}
        out = {k: v.astype(np.float32) for k, v in out.items()}
        if "token_index" in heads:
            out["token_index"] = np.asarray(heads["token_index"], np.int32)
        return out

    @classmethod
    def from_head_fn(cls, head_fn) -> "MedusaDrafter":
        return cls(head_fn or standard_heads)

    def prepare(self, heads: Params, tree, cpu_kernels: bool = False) -> Params:
        """Heads deeper than the tree never propose and are not run; on the CPU kernel, the
        heads' products too."""
        if self.head_fn is not standard_heads:
            return heads
        heads = jax.tree.map(lambda x: x[:tree.depth], heads)
        if cpu_kernels:
            heads = kernels.wrap_heads(heads)
        # one buffer per block, cut here once: a block's slice of the stacked [K, L, ...]
        # weight is strided, and a loop would copy it out at every step
        heads["w"] = tuple(heads["w"][:, layer] for layer in range(heads["w"].shape[1]))
        return heads

    def start(self, params, heads, hidden, lengths):
        return self.head_fn(heads, hidden, lengths)  # [K, B, V]

    def depth(self, heads) -> int | None:
        """One level per head; a plain head function's own heads are its caller's."""
        if self.head_fn is not standard_heads:
            return None
        return int(heads["b"].shape[0])

    def propose(self, params, heads, carry, root, tree, draw=None) -> Proposal:
        return propose_candidates(root, carry, tree, draw)
