"""EAGLE-3 as a drafter (`decoding.drafter.Drafter`): the drafter's own KV cache over the
committed context, then a static tree drafted depth by depth.

The carry (`Eagle3Carry`, rows on axis 0) holds the drafter's keys/values of the committed
positions, how many there are, and the layer's output at the last one (the output that
predicts the tokens after the root). Entry p is the layer run on (the backbone's aux features
of token p, the embedding of token p+1) at rotary position p, as SafeAILab's `topK_genrate`
feeds `input_ids[:, 1:]`; so entry L-1 reads the root, and the carry is complete once the
root is chosen. `extend` appends entries (the prompt, or a step's accepted path);
`draft_tree` fills a static tree: depth-d nodes are run at position L-1+d over the context
and their own ancestors (a tree mask, SafeAILab's `tree_mask`), each node's token the r-th
most likely draft id of its parent's output, mapped to the target vocabulary by d2t.

The step passes `begin` the prompt's aux features after prefill and `advance` those of the
accepted path after each commit (`aux_layers`: the backbone layers whose inputs they are).
The drafter's configuration (aux layers, norm eps, rope) is not in its tensors' shapes, so
EAGLE-3 parameters travel bound to their drafter (`bind`: `decoding.drafter.BoundParams`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.drafter import BoundParams, Context
from medusa_jax.decoding.step import Proposal, small_top_k, tree_proposal
from medusa_jax.decoding.tree import DynamicTree, tree_plan
from medusa_jax.drafters.eagle3 import heads as eagle3
from medusa_jax.drafters.eagle3.layers import default_aux_layers
from medusa_jax.drafters.kind import Kind, refuse_unbound
from medusa_jax.drafters.toolkit import context, tree_loop
from medusa_jax.drafters.toolkit.backbone import Backbone
from medusa_jax.model.backbone import Params
from medusa_jax.model.config import ModelConfig


Eagle3Carry = context.ContextCache  # the drafter's KV cache over the committed context


def init_carry(c: eagle3.Eagle3Config, batch: int, capacity: int, dtype=jnp.float32
               ) -> Eagle3Carry:
    """An empty carry with room for `capacity` entries per row."""
    return context.init(batch, c.num_kv_heads, capacity, c.head_dim, c.hidden_size, dtype)


def extend(heads: Params, c: eagle3.Eagle3Config, embed, carry: Eagle3Carry, aux: jax.Array,
           next_tokens: jax.Array, n_valid: jax.Array) -> Eagle3Carry:
    """Append up to T entries per row: aux [B, T, 3*Ht] the backbone's features of T tokens
    at positions length + j, next_tokens [B, T] the token after each (its embedding is the
    entry's other input), n_valid [B] how many of the T are real (0: the row is unchanged).
    `embed`: tokens [B, T] -> [B, T, H] (the backbone's embedding). Size the carry to the
    backbone's cache: the backbone's own writes keep length + T within it."""
    b, t = next_tokens.shape
    s = carry.k.shape[2]
    hidden = eagle3.features(heads, aux.astype(carry.out.dtype))
    pos = carry.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
    ctx = jnp.arange(s)[None, None, :] < carry.length[:, None, None]  # [B, 1, S]
    mask = jnp.concatenate([jnp.broadcast_to(ctx, (b, t, s)),
                            jnp.broadcast_to(eagle3.causal_mask(t), (b, t, t))], axis=-1)
    out, k_new, v_new = eagle3.layer(heads, c, embed(next_tokens), hidden, pos, carry.k,
                                     carry.v, mask)
    k = context.write_rows(carry.k, k_new.astype(carry.k.dtype), carry.length)
    v = context.write_rows(carry.v, v_new.astype(carry.v.dtype), carry.length)
    last = out[jnp.arange(b), jnp.clip(n_valid - 1, 0, t - 1)]
    return Eagle3Carry(k=k, v=v, out=jnp.where((n_valid > 0)[:, None], last, carry.out),
                       length=carry.length + n_valid.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class _Depth:
    """Host-side plan of one tree depth d >= 1 (numpy, from `tree_plan`)."""

    parents: np.ndarray  # [E] the nodes at depth d-1 with children
    grand: np.ndarray  # [E] each one's parent (its hidden input when d-1 >= 1)
    seen: np.ndarray  # [E, N] bool: the tree nodes (depth >= 1) each parent attends, itself apart
    nodes: np.ndarray  # [M] the nodes at depth d
    parent_pos: np.ndarray  # [M] each one's parent's index in `parents`
    rank: np.ndarray  # [M]
    k: int  # top-k needed


def _plan(paths_ranks, num_nodes: int) -> tuple[_Depth, ...]:
    out = []
    for anc, nodes, parent_pos, rank, k in tree_plan(paths_ranks):
        seen = np.zeros((anc.shape[0], num_nodes), bool)
        for e, path in enumerate(anc):
            seen[e, path[1:-1]] = True  # ancestors below the root (the root is entry L-1)
        grand = anc[:, -2] if anc.shape[1] > 1 else np.zeros(anc.shape[0], np.int32)
        out.append(_Depth(anc[:, -1], grand, seen, nodes, parent_pos, rank, k))
    return tuple(out)


def draft_tree(heads: Params, c: eagle3.Eagle3Config, embed, carry: Eagle3Carry,
               root: jax.Array, paths_ranks, num_nodes: int, top_k_fn=small_top_k,
               want_logp: bool = True, draw=None, top_k: int = 0):
    """Fill a static tree (node i+1 = paths_ranks[i]) with EAGLE-3 drafts
    (`toolkit.tree_loop.draft_tree`): the carry and root [B] -> (tokens [B, N] target ids,
    node log-probabilities [B, N] under the draft vocabulary: each node's own, under its
    parent's output; 0 at the root; None unless `want_logp`; sampled drafts or None). One
    layer call per depth below the root, over that depth's nodes with children. `draw`
    (`decoding.step.DraftSampler`): a node of rank r takes its parent's r-th draw from the
    draft distribution instead of its r-th most likely token, and the drafts come back as
    (each node's `top_k` draws [B, N, top_k] and the distribution they were drawn from
    [B, N, V], both over the target vocabulary)."""
    b = root.shape[0]
    s, h = carry.k.shape[2], carry.out.shape[-1]
    # the nodes' keys/values, a block apart from the context's: [B, KVH, N, D]
    tree_k = jnp.zeros(carry.k.shape[:2] + (num_nodes, carry.k.shape[3]), carry.k.dtype)
    outs = jnp.zeros((b, num_nodes, h), carry.out.dtype).at[:, 0].set(carry.out)
    ctx = jnp.arange(s)[None, None, :] < carry.length[:, None, None]  # [B, 1, S]
    plan = _plan(tuple(map(tuple, paths_ranks)), num_nodes)

    def level(state, d, paths, tokens):
        tree_k, tree_v, outs = state
        step = plan[d]
        e = step.parents.shape[0]
        if d > 0:  # the parents sit at depth d >= 1: run the layer on them first
            pos = jnp.broadcast_to(carry.length[:, None] - 1 + d, (b, e))
            mask = jnp.concatenate([jnp.broadcast_to(ctx, (b, e, s)),
                                    jnp.broadcast_to(jnp.asarray(step.seen), (b, e, num_nodes)),
                                    jnp.broadcast_to(jnp.eye(e, dtype=bool), (b, e, e))], -1)
            # three key blocks (context, tree so far, these nodes), scores concatenated:
            # the context cache is only read, never copied at each depth
            out, k_new, v_new = eagle3.layer(
                heads, c, embed(tokens[:, step.parents]), outs[:, step.grand], pos,
                carry.k, carry.v, mask, extra=(tree_k, tree_v))
            tree_k = tree_k.at[:, :, step.parents].set(k_new.astype(tree_k.dtype))
            tree_v = tree_v.at[:, :, step.parents].set(v_new.astype(tree_v.dtype))
            outs = outs.at[:, step.parents].set(out)
        return (tree_k, tree_v, outs), eagle3.draft_logits(heads, c, outs[:, step.parents])

    floor = float(jnp.finfo(jnp.float32).min)

    def spread(lq):  # [..., Vd] -> [..., V]: the draft distribution on the target ids
        return jnp.full(lq.shape[:-1] + (c.vocab_size,), floor).at[
            ..., eagle3.target_ids(heads)].set(lq)

    vocab = tree_loop.Vocab(to_target=lambda ids: eagle3.to_target(heads, ids),
                            spread=spread, size=c.vocab_size, fill=floor)
    return tree_loop.draft_tree(level, (tree_k, jnp.zeros_like(tree_k), outs), root,
                                paths_ranks, num_nodes, want_logp, draw, top_k, vocab,
                                top_k_fn)


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(Kind):
    """`config`: the drafter's (its aux layers, norm eps, rope; None: `config_of` defaults),
    `model_cfg`: the backbone's, for its embedding (None: the plain table lookup)."""

    config: eagle3.Eagle3Config | None = None
    model_cfg: ModelConfig | None = None
    kind = "eagle3"
    formats = "medusa_jax.drafters.eagle3.formats:Eagle3Formats"  # its layouts, its artifact
    context = Context.HIDDEN_STATES  # its own KV cache of every committed entry
    batch_axis = 0  # of the carry: every leaf has the rows first

    @classmethod
    def matches(cls, heads: Params) -> bool:
        return eagle3.is_eagle3(heads)

    @classmethod
    def shape_of(cls, heads: Params) -> tuple[int, int]:
        return eagle3.TTT_STEPS, 1  # the depth it was trained to draft; one layer

    @classmethod
    def axes(cls, heads: Params) -> dict:
        return {n: eagle3.AXES.get(n, ()) for n in heads}  # norms, token maps: replicated

    @classmethod
    def init(cls, cfg: ModelConfig, backbone: Params, key, depth: int) -> BoundParams:
        """A fresh drafter shaped like one of `cfg`'s layers, over the full vocabulary,
        bound to its config (any depth: it drafts on its own outputs), reading the default
        layers (`layers.default_aux_layers`)."""
        c = eagle3.default_config(cfg, aux_layers=default_aux_layers(cfg.num_layers))
        return bind(eagle3.init_eagle3(key, c), c, cfg)

    @classmethod
    def from_head_fn(cls, head_fn) -> "Eagle3Drafter":
        refuse_unbound(head_fn, "EAGLE-3 drafter parameters",
                       "its aux layers are not in the tensors' shapes",
                       "drafters.eagle3.drafter.bind(heads, config, model_cfg)")

    @property
    def aux_layers(self) -> tuple:
        return () if self.config is None else tuple(self.config.aux_layers)

    def cfg(self, heads: Params) -> eagle3.Eagle3Config:
        return self.config if self.config is not None else eagle3.config_of(heads)

    def embed(self, params: Params):
        """tokens -> the backbone's embedding of them (`toolkit.backbone.Backbone`)."""
        return Backbone(self.model_cfg, params).embed

    def prepare(self, heads: Params, tree, cpu_kernels: bool = False) -> Params:
        # one layer: nothing to drop; on the CPU kernel, the backbone's decoding layout
        return BoundParams(eagle3.decoding_layout(heads), self) if cpu_kernels else heads

    def begin(self, params, heads, hidden, aux, tokens, lengths, root, capacity: int
              ) -> Eagle3Carry:
        """After prefill: aux [B, P, 3*Ht] the prompt's features, tokens [B, P] (right-padded,
        lengths [B]), root [B] the chosen next token -> the carry with entries 0..length-1
        (room for `capacity`)."""
        c = self.cfg(heads)
        nxt = context.next_tokens(tokens, lengths - 1, root)
        carry = init_carry(c, tokens.shape[0], capacity, aux.dtype)
        return extend(heads, c, self.embed(params), carry, aux, nxt, lengths)

    def advance(self, params, heads, carry, hidden, aux, tokens, acc_len, next_root,
                lengths, live) -> Eagle3Carry:
        """After commit: aux [B, D+1, 3*Ht] the features of the accepted path (root first),
        tokens [B, D+1] its tokens, acc_len [B] the nodes accepted below the root (acc_len + 1
        tokens committed), next_root [B] -> the carry extended by them (live rows only)."""
        nxt = context.next_tokens(tokens, acc_len, next_root)
        return extend(heads, self.cfg(heads), self.embed(params), carry, aux, nxt,
                      jnp.where(live, acc_len + 1, 0))

    @staticmethod
    def enlarge(heads: Params, src: ModelConfig, dst: ModelConfig, grow) -> BoundParams:
        return enlarge(heads, src, dst, grow)

    def window(self, carry: Eagle3Carry, slots: int) -> Eagle3Carry:
        """The carry over the backbone cache's window of `slots` slots: a step then attends
        over that many entries, not the whole context (entry p sits at slot p)."""
        return context.fit(carry, slots)

    def depth(self, heads) -> None:
        return None  # any depth: the drafter runs on its own outputs

    def propose(self, params, heads, carry, root, tree, draw=None) -> Proposal:
        static = tree.pool if isinstance(tree, DynamicTree) else tree
        tokens, logp, drafts = draft_tree(heads, self.cfg(heads), self.embed(params), carry,
                                          root, static.paths_ranks, static.num_nodes,
                                          small_top_k, want_logp=isinstance(tree, DynamicTree),
                                          draw=draw, top_k=static.top_k)
        return tree_proposal(tokens, logp, tree, drafts)


def bind(heads: Params, config: eagle3.Eagle3Config, model_cfg: ModelConfig | None = None
         ) -> BoundParams:
    """EAGLE-3 parameters with the drafter that decodes them: its `config` (aux layers, norm
    eps, rope) and the backbone's `model_cfg` (its embedding). Every decoder finds the
    drafter on the parameters (`decoding.drafter.drafter_for`)."""
    return BoundParams(dict(heads), Eagle3Drafter(config, model_cfg))


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def enlarge(heads, src: ModelConfig, dst: ModelConfig, grow) -> BoundParams:
    """An EAGLE-3 drafter bound to its config (`drafters.eagle3.drafter.bind`) whose layer
    has the source backbone's layer shape -> the same drafter for the enlarged backbone `dst`
    (bound to its new config): its layer grown to dst's layer shape, exactly as
    `tools.enlarge` grows a backbone layer (`grow`: that module's `plan` and `place`), its
    fc and q/k/v inputs padded block by block."""
    bound = heads.drafter if isinstance(heads, BoundParams) else None
    c = bound.config if isinstance(bound, Eagle3Drafter) else None
    if c is None:
        raise ValueError("an EAGLE-3 drafter to enlarge must carry its config (load it "
                           "with load_heads)")
    layer_shape = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim)
    if layer_shape != (src.hidden_size, src.num_heads, src.num_kv_heads, src.head_dim) \
            or c.feature_size != src.hidden_size:
        raise ValueError(f"the EAGLE-3 drafter's layer (hidden, heads, kv heads, head_dim "
                           f"{layer_shape}) is not shaped like its backbone's layers; only "
                           f"such a drafter is enlarged")
    if max(c.aux_layers) >= src.num_layers:
        raise ValueError(f"the drafter reads layers {list(c.aux_layers)} of a "
                           f"{src.num_layers}-layer source")
    p = grow.plan(src, dst)
    h, h2, f2 = src.hidden_size, dst.hidden_size, dst.intermediate_size
    nh2, kvh2, d2 = dst.num_heads, dst.num_kv_heads, dst.head_dim
    norm_scale = math.sqrt(h / h2)
    q_scale = math.sqrt(d2 / src.head_dim)
    hid = np.arange(h)
    (qs, qt), (ks, kt) = p.q_cols, p.kv_cols
    w = {k: _f64(v) for k, v in heads.items() if k not in ("d2t", "t2d")}
    blocks2 = np.concatenate([hid, h2 + hid])  # [embedding | feature] rows of q/k/v
    blocks3 = np.concatenate([hid, h2 + hid, 2 * h2 + hid])  # [low | mid | high] rows of fc

    def qkv(name, cols, out_cols, width, scale=1.0):
        a = w[name].reshape(2 * h, -1)  # [2H, heads * D]
        return grow.place((2 * h2, width), a[:, cols] * scale, blocks2, out_cols)

    out = {
        "fc": grow.place((3 * h2, h2), w["fc"], blocks3, hid),
        "wq": qkv("wq", qs, qt, nh2 * d2, q_scale).reshape(2 * h2, nh2, d2),
        "wk": qkv("wk", ks, kt, kvh2 * d2).reshape(2 * h2, kvh2, d2),
        "wv": qkv("wv", ks, kt, kvh2 * d2).reshape(2 * h2, kvh2, d2),
        "wo": grow.place((nh2 * d2, h2), w["wo"].reshape(-1, h)[qs], qt, hid).reshape(nh2, d2, h2),
        "w_gate": grow.place((h2, f2), w["w_gate"]),
        "w_up": grow.place((h2, f2), w["w_up"]),
        "w_down": grow.place((f2, h2), w["w_down"]),
        "lm_head": grow.place((h2, w["lm_head"].shape[1]), w["lm_head"]),
    }
    for name in ("input_norm", "hidden_norm", "post_attn_norm", "final_norm"):
        out[name] = grow.place((h2,), w[name] * norm_scale)
    out = {k: v.astype(np.float32) for k, v in out.items()}
    out["d2t"] = np.asarray(heads["d2t"], np.int32)
    out["t2d"] = np.asarray(heads["t2d"], bool)
    big = c.replace(hidden_size=h2, num_heads=nh2, num_kv_heads=kvh2, head_dim=d2,
                    intermediate_size=f2, target_hidden_size=h2,
                    rms_norm_eps=c.rms_norm_eps * h / h2)
    return bind(out, big, dst)
