"""MTP modules as a drafter (`drafters.kind.Kind`): each module's own KV cache over the
committed context (`toolkit.context.ContextCache`, one per module), then a static tree
drafted depth by depth (`toolkit.tree_loop`).

Module k's entry at position p is the module run on (module k-1's output at p, the
embedding of token p+k+1), as it was trained (`heads.chain_hidden`): with L tokens committed
and the root chosen, module k holds entries 0 .. L-1-k (the last one reads the root), so the
carry is complete once the root is chosen, and a module's first entries wait until the
context is long enough to give them a token. `begin` and `advance` append entries to every
module in turn (module k's hidden inputs are module k-1's outputs at the same positions,
its last old one included); each cache's `out` is the module's output at its last entry.

Drafting: the root's children come from module 0's output at its last entry (the carry);
a node at depth d >= 1 runs module d on (its own embedding, the output of its parent's
call) at position L-1, over module d's context only, and its children come from that
output through module d's final norm and the backbone's output head. A tree deeper than
the modules reuses the last module for the deeper depths (`reuse_last`), autoregressively
as vLLM runs a single MTP module for several drafts: at positions L, L+1, ..., attending
also to the entries the last module made for the node's ancestors. With `reuse_last=False`
`depth` is the module count and a deeper tree is refused in one line.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.drafter import BoundParams, Context
from medusa_jax.decoding.step import Proposal, small_top_k, tree_proposal
from medusa_jax.decoding.tree import DynamicTree
from medusa_jax.drafters.kind import Kind, refuse_unbound
from medusa_jax.drafters.mtp import heads as mtp
from medusa_jax.drafters.toolkit import context, tree_loop
from medusa_jax.model import backbone
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig

MtpCarry = tuple  # one context.ContextCache per module


def extend(params: Params, heads: Params, cfg: ModelConfig, carry: MtpCarry,
           hidden: jax.Array, next_tokens: jax.Array, n_valid: jax.Array,
           style: str = "deepseek") -> MtpCarry:
    """Append the entries of n_valid [B] new committed tokens (T at most per row) to every
    module: hidden [B, T, H] their backbone states, next_tokens [B, T] the token after each
    (the root after the last). Module k's entries lag k positions behind module 0's, so its
    j-th new entry sits at position start_k + j (start_k: its length) and reads module
    k-1's output there and the token p+k+1 (next_tokens[p + k - L])."""
    b, t = next_tokens.shape
    big_l = carry[0].length  # [B] tokens committed before these
    embed = lambda toks: backbone.embed_tokens(cfg, params, toks).astype(hidden.dtype)  # noqa: E731
    j = jnp.arange(t, dtype=jnp.int32)[None]  # [1, T]
    out_caches, prev_src, prev_start = [], None, None
    for k, c in enumerate(carry):
        start = c.length  # [B]
        pos = start[:, None] + j  # [B, T]
        if k == 0:
            h_in = hidden.astype(c.out.dtype)
            toks = next_tokens
        else:
            # module k-1's output at pos: its old last entry (index 0), or its new ones
            at = jnp.clip(pos - prev_start[:, None] + 1, 0, t)
            h_in = jnp.take_along_axis(prev_src, at[..., None], axis=1)
            toks = jnp.take_along_axis(next_tokens, jnp.clip(pos + k - big_l[:, None], 0, t - 1),
                                       axis=1)
        n = jnp.clip(big_l + n_valid - k - start, 0, t)  # entries up to L + n - 1 - k
        n = jnp.where(n_valid > 0, n, 0)
        s = c.k.shape[2]
        ctx = jnp.arange(s)[None, None, :] < start[:, None, None]
        mask = jnp.concatenate([jnp.broadcast_to(ctx, (b, t, s)),
                                jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))],
                               -1)
        out, k_new, v_new = mtp.module(heads, cfg, k, embed(toks), h_in, pos, c.k, c.v, mask,
                                       style=style)
        prev_src = mtp.fed_on(heads, cfg, k, jnp.concatenate([c.out[:, None], out], axis=1),
                              style)  # [B, 1 + T, H]
        prev_start = start
        last = out[jnp.arange(b), jnp.clip(n - 1, 0, t - 1)]
        out_caches.append(context.ContextCache(
            k=context.write_rows(c.k, k_new.astype(c.k.dtype), start),
            v=context.write_rows(c.v, v_new.astype(c.v.dtype), start),
            out=jnp.where((n > 0)[:, None], last, c.out), length=start + n))
    return tuple(out_caches)


def draft_tree(params: Params, heads: Params, cfg: ModelConfig, carry: MtpCarry,
               root: jax.Array, paths_ranks, num_nodes: int, want_logp: bool = True,
               draw=None, top_k: int = 0, style: str = "deepseek"):
    """Fill a static tree (node i+1 = paths_ranks[i]) with MTP drafts: -> (tokens [B, N],
    node log-probabilities [B, N] or None, sampled drafts or None), as
    `toolkit.tree_loop.draft_tree`."""
    b = root.shape[0]
    last_mod = len(carry) - 1
    c0 = carry[0]
    h = c0.out.shape[-1]
    big_l = c0.length
    # the last module's entries for the tree's nodes (used only by reused depths)
    kv_shape = c0.k.shape[:2] + (num_nodes, c0.k.shape[3])
    tree_k = jnp.zeros(kv_shape, c0.k.dtype)
    outs = jnp.zeros((b, num_nodes, h), c0.out.dtype).at[:, 0].set(c0.out)

    def level(state, d, paths, tokens):
        tree_k, tree_v, outs = state
        parents = np.asarray(paths)[:, -1]
        if d > 0:
            m = min(d, last_mod)
            c = carry[m]
            e, s = parents.shape[0], c.k.shape[2]
            grand = np.asarray(paths)[:, -2]
            pos = jnp.broadcast_to(big_l[:, None] - 1 + max(0, d - last_mod), (b, e))
            seen = np.zeros((e, num_nodes), bool)
            if d > last_mod:  # the last module's entries of the ancestors it ran on
                lo = max(1, last_mod)
                for i, path in enumerate(np.asarray(paths)):
                    seen[i, path[lo:-1]] = True
            ctx = jnp.arange(s)[None, None, :] < c.length[:, None, None]
            mask = jnp.concatenate([jnp.broadcast_to(ctx, (b, e, s)),
                                    jnp.broadcast_to(jnp.asarray(seen), (b, e, num_nodes)),
                                    jnp.broadcast_to(jnp.eye(e, dtype=bool), (b, e, e))], -1)
            x_embed = backbone.embed_tokens(cfg, params, tokens[:, parents])
            m_grand = min(d - 1, last_mod)  # the module whose call gave the parent
            out, k_new, v_new = mtp.module(heads, cfg, m, x_embed.astype(outs.dtype),
                                           mtp.fed_on(heads, cfg, m_grand, outs[:, grand], style),
                                           pos, c.k, c.v, mask, extra=(tree_k, tree_v),
                                           style=style)
            tree_k = tree_k.at[:, :, parents].set(k_new.astype(tree_k.dtype))
            tree_v = tree_v.at[:, :, parents].set(v_new.astype(tree_v.dtype))
            outs = outs.at[:, parents].set(out)
        m = min(d, last_mod)
        return (tree_k, tree_v, outs), mtp.logits(params, cfg, heads, m, outs[:, parents])

    return tree_loop.draft_tree(level, (tree_k, jnp.zeros_like(tree_k), outs), root,
                                paths_ranks, num_nodes, want_logp, draw, top_k,
                                tree_loop.Vocab(), small_top_k)


@dataclasses.dataclass(frozen=True)
class MtpDrafter(Kind):
    """`model_cfg`: the backbone's (the modules' layer is one of its layers), `style`: the
    layout's conventions (`heads.STYLES`: "deepseek", the embedding first, as DeepSeek-V3,
    GLM and Qwen3.5; "mimo", the hidden state first and the normed output fed on),
    `reuse_last`: whether the last module drafts the depths past the module count."""

    model_cfg: ModelConfig | None = None
    style: str = "deepseek"
    reuse_last: bool = True
    kind = mtp.KIND
    formats = "medusa_jax.drafters.mtp.formats:MtpFormats"
    context = Context.HIDDEN_STATES  # each module's own KV cache over the context
    batch_axis = 0

    @classmethod
    def matches(cls, heads: Params) -> bool:
        return mtp.is_mtp(heads)

    @classmethod
    def axes(cls, heads: Params) -> dict:
        return mtp.axes(heads)

    @classmethod
    def shape_of(cls, heads: Params) -> tuple[int, int]:
        return mtp.num_modules(heads), 1

    @classmethod
    def from_head_fn(cls, head_fn) -> "MtpDrafter":
        refuse_unbound(head_fn, "MTP modules", "their layer is the backbone's kind",
                       "drafters.mtp.drafter.bind(heads, model_cfg)")

    @classmethod
    def init(cls, cfg, backbone_params, key, depth: int) -> BoundParams:
        return bind(mtp.init_mtp(key, cfg, depth), cfg)

    def _cfg(self) -> ModelConfig:
        if self.model_cfg is None:
            raise ValueError("an MTP drafter needs its backbone's config: bind the modules "
                             "with drafters.mtp.drafter.bind(heads, model_cfg)")
        return self.model_cfg

    def depth(self, heads) -> int | None:
        return None if self.reuse_last else mtp.num_modules(heads)

    def begin(self, params, heads, hidden, aux, tokens, lengths, root, capacity: int
              ) -> MtpCarry:
        cfg = self._cfg()
        b = tokens.shape[0]
        empty = context.init(b, cfg.num_kv_heads, capacity, cfg.head_dim, cfg.hidden_size,
                             hidden.dtype)
        carry = (empty,) * mtp.num_modules(heads)
        nxt = context.next_tokens(tokens, lengths - 1, root)
        return extend(params, heads, cfg, carry, hidden, nxt, lengths, self.style)

    def advance(self, params, heads, carry, hidden, aux, tokens, acc_len, next_root,
                lengths, live) -> MtpCarry:
        nxt = context.next_tokens(tokens, acc_len, next_root)
        return extend(params, heads, self._cfg(), carry, hidden, nxt,
                      jnp.where(live, acc_len + 1, 0), self.style)

    @staticmethod
    def enlarge(heads: Params, src: ModelConfig, dst: ModelConfig, grow) -> Params:
        return enlarge(heads, src, dst, grow)

    def window(self, carry: MtpCarry, slots: int) -> MtpCarry:
        return tuple(context.fit(c, slots) for c in carry)

    def propose(self, params, heads, carry, root, tree, draw=None) -> Proposal:
        static = tree.pool if isinstance(tree, DynamicTree) else tree
        if not self.reuse_last and static.depth > len(carry):
            raise ValueError(f"a tree of depth {static.depth} needs {static.depth} MTP modules, "
                             f"these have {len(carry)} (reuse_last is off)")
        tokens, logp, drafts = draft_tree(
            params, heads, self._cfg(), carry, root, static.paths_ranks, static.num_nodes,
            want_logp=isinstance(tree, DynamicTree), draw=draw, top_k=static.top_k,
            style=self.style)
        return tree_proposal(tokens, logp, tree, drafts)


def bind(heads: Params, model_cfg: ModelConfig, style: str = "deepseek",
         reuse_last: bool = True) -> BoundParams:
    """MTP modules with the drafter that decodes them (the backbone's config, the layout's
    style, whether the last module is reused for deeper depths)."""
    if style not in mtp.STYLES:
        raise ValueError(f"MTP style {style!r} is not one of {', '.join(mtp.STYLES)}")
    return BoundParams(dict(heads), MtpDrafter(model_cfg, style, reuse_last))


def enlarge(heads: Params, src: ModelConfig, dst: ModelConfig, grow) -> Params:
    """MTP modules for the backbone `src` -> the same modules for its enlargement `dst`
    (`tools.enlarge`; `grow`: that module): each decoder layer grown exactly as a backbone
    layer is (through `grow.enlarge_backbone` on the layers alone), the norms scaled as the
    backbone's, eh_proj padded block by block (its embedding and hidden halves each to the
    first H of their H'-wide block). The construction is the same for either style; bound
    modules stay bound (to `dst`, their style and reuse kept)."""
    mtp.check(dict(heads), src, "the MTP modules to enlarge")
    d, h, h2 = mtp.num_modules(heads), src.hidden_size, dst.hidden_size
    layers = {n[len(mtp.LAYER):]: np.asarray(a) for n, a in heads.items()
              if n.startswith(mtp.LAYER)}
    # the layers as a vocabulary-less backbone of d layers: no extra (identity) layer
    alone = src.replace(num_layers=d, vocab_size=1, tie_word_embeddings=True)
    shape = {f: getattr(dst, f) for f in grow.SHAPE_FIELDS} | {"num_layers": d}
    _, grown = grow.enlarge_backbone(alone, {"embed": np.zeros((1, h)),
                                             "final_norm": np.ones(h), "layers": layers}, shape)
    hid = np.arange(h)
    blocks = np.concatenate([hid, h2 + hid])  # [first | second] H-wide input blocks
    scale = np.sqrt(h / h2)
    out = {mtp.LAYER + n: a for n, a in grown["layers"].items()}
    for n in ("enorm", "hnorm", "final_norm"):
        out[n] = grow.place((d, h2), np.asarray(heads[n], np.float64) * scale)
    out["eh_proj"] = np.stack([grow.place((2 * h2, h2), np.asarray(w, np.float64), blocks, hid)
                               for w in heads["eh_proj"]])
    out = {n: a.astype(np.float32) for n, a in out.items()}
    bound = heads.drafter if isinstance(heads, BoundParams) else None
    if isinstance(bound, MtpDrafter):
        return bind(out, dst, bound.style, bound.reuse_last)
    return out
