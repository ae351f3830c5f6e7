"""Hydra heads as a drafter (`decoding.drafter.Drafter`): each head also reads the
embeddings of the path drafted above it, one head call per tree depth; the carry is the
hidden state [1, B, H]."""

from __future__ import annotations

import dataclasses

import numpy as np

from medusa_jax import kernels
from medusa_jax.decoding.drafter import FromLastHidden, refuse_head_fn
from medusa_jax.drafters.kind import Kind
from medusa_jax.decoding.step import Proposal, small_top_k, tree_proposal
from medusa_jax.decoding.tree import DynamicTree
from medusa_jax.drafters.hydra import heads as hydra
from medusa_jax.model.backbone import Params


@dataclasses.dataclass(frozen=True)
class HydraDrafter(FromLastHidden, Kind):
    kind = "hydra"
    formats = "medusa_jax.drafters.hydra.formats:HydraFormats"  # its layouts, its artifact
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
    def init(cls, cfg, backbone: Params, key, depth: int) -> Params:
        """Fresh heads, `depth` of them (each starts as the backbone's output layer)."""
        return hydra.init_hydra(cfg, backbone, num_heads=depth)

    @staticmethod
    def enlarge(heads: Params, src, dst, grow) -> Params:
        """Hydra heads padded to H': every H x H block of in_w / res_w [K, K+1, H, H] (one
        per input slot: h, then each path embedding) to the leading corner of its H' x H'
        block, so slot j of the padded input (the source's slot j, zeros after H) meets the
        source's weights; biases, residual blocks and projection rows padded with zeros.
        The new output dimensions of the input block are 0 + SiLU(0) = 0, and stay 0
        through the blocks."""
        h, h2 = src.hidden_size, dst.hidden_size
        out = {}
        for name in ("in_w", "res_w", "w"):  # [K, S, H, H] -> [K, S, H', H']
            a = np.asarray(heads[name], np.float64)
            out[name] = np.zeros((*a.shape[:-2], h2, h2))
            out[name][..., :h, :h] = a
        for name in ("in_b", "res_b", "b"):  # [..., H] -> [..., H']
            a = np.asarray(heads[name], np.float64)
            out[name] = np.zeros((*a.shape[:-1], h2))
            out[name][..., :h] = a
        proj = np.asarray(heads["proj"], np.float64)  # [K, H, V]
        out["proj"] = np.zeros((proj.shape[0], h2, proj.shape[2]))
        out["proj"][:, :h] = proj
        out["proj_b"] = np.asarray(heads["proj_b"], np.float64)  # [K, V]
        return {k: v.astype(np.float32) for k, v in out.items()}

    @classmethod
    def from_head_fn(cls, head_fn) -> "HydraDrafter":
        refuse_head_fn(head_fn, "these are Hydra heads (they draft along the tree's paths)")
        return cls()

    def prepare(self, heads: Params, tree, cpu_kernels: bool = False) -> Params:
        return hydra.split_per_head(kernels.wrap_heads(heads) if cpu_kernels else heads)

    def start(self, params, heads, hidden, lengths):
        return hidden[None]  # [1, B, H]

    def depth(self, heads) -> int:
        return hydra.config_of(heads)[0]  # one level per head

    def propose(self, params, heads, carry, root, tree, draw=None) -> Proposal:
        static = tree.pool if isinstance(tree, DynamicTree) else tree
        tokens, logp, drafts = hydra.draft_tree(heads, params["embed"], carry[0], root,
                                                static.paths_ranks, static.num_nodes,
                                                small_top_k,
                                                want_logp=isinstance(tree, DynamicTree),
                                                draw=draw, top_k=static.top_k)
        return tree_proposal(tokens, logp, tree, drafts)
