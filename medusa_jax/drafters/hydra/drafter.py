"""Hydra heads as a drafter (`decoding.drafter.Drafter`): each head also reads the
embeddings of the path drafted above it, one head call per tree depth; the carry is the
hidden state [1, B, H]."""

from __future__ import annotations

import dataclasses

from medusa_jax import kernels
from medusa_jax.decoding.drafter import FromLastHidden
from medusa_jax.decoding.step import Proposal, small_top_k, tree_proposal
from medusa_jax.decoding.tree import DynamicTree
from medusa_jax.drafters.hydra import heads as hydra
from medusa_jax.model.backbone import Params


@dataclasses.dataclass(frozen=True)
class HydraDrafter(FromLastHidden):
    kind = "hydra"
    batch_axis = 1  # of the carry: [1, B, H] hidden state

    @classmethod
    def matches(cls, heads: Params) -> bool:
        return hydra.is_hydra(heads)

    @classmethod
    def shape_of(cls, heads: Params) -> tuple[int, int]:
        return hydra.config_of(heads)

    @classmethod
    def axes(cls, heads: Params) -> dict:
        return {n: a for n, a in hydra.axes().items() if n in heads}

    @classmethod
    def from_head_fn(cls, head_fn) -> "HydraDrafter":
        if head_fn is not None:
            raise ValueError("head_fn is a Medusa head function, but these are Hydra heads "
                             "(they draft along the tree's paths); leave head_fn unset")
        return cls()

    def prepare(self, heads: Params, tree, cpu_kernels: bool = False) -> Params:
        return hydra.split_per_head(kernels.wrap_heads(heads) if cpu_kernels else heads)

    def start(self, params, heads, hidden, lengths):
        return hidden[None]  # [1, B, H]

    def num_heads(self, heads, carry) -> int:
        return hydra.config_of(heads)[0]

    def propose(self, params, heads, carry, root, tree, draw=None) -> Proposal:
        static = tree.pool if isinstance(tree, DynamicTree) else tree
        tokens, logp, drafts = hydra.draft_tree(heads, params["embed"], carry[0], root,
                                                static.paths_ranks, static.num_nodes,
                                                small_top_k,
                                                want_logp=isinstance(tree, DynamicTree),
                                                draw=draw, top_k=static.top_k)
        return tree_proposal(tokens, logp, tree, drafts)
