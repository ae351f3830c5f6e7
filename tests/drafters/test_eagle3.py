"""EAGLE-3 drafters against a minimal PyTorch transcription of SafeAILab/EAGLE's own code
(eagle/model/cnets.py for the drafting layer, eagle/traineagle3/cnets.py for training-time
test): the layer and draft logits with a KV cache and a tree mask, the 7-step TTT losses,
accuracies and gradients, the draft vocabulary, the published checkpoint layout (a torch
model loads what we write, strictly, and gives our logits), and bad input."""

import json
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.numpy import load_file, save_file  # noqa: E402
from safetensors.torch import load_file as load_torch  # noqa: E402

from medusa_jax.drafters import registry as drafters  # noqa: E402
from medusa_jax.decoding.drafter import BoundParams  # noqa: E402
from medusa_jax.decoding.tree import DynamicTree, Tree  # noqa: E402
from medusa_jax.drafters.eagle3 import formats  # noqa: E402
from medusa_jax.drafters.eagle3 import heads as eagle3  # noqa: E402
from medusa_jax.drafters.eagle3.drafter import (  # noqa: E402
    Eagle3Drafter,
    bind,
    draft_tree,
    extend,
    init_carry,
)
from medusa_jax.drafters.io import HeadsFormatError  # noqa: E402
from medusa_jax.drafters.eagle3.heads import eagle3_layers  # noqa: E402
from medusa_jax.model.config import ModelConfig  # noqa: E402

H, NH, KVH, F, V, VD, L = 32, 4, 2, 48, 50, 20, 8  # NH * D == H, as the reference assumes
D = H // NH
B, T = 2, 9
BACKBONE = ModelConfig(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=F,
                       num_layers=L, num_heads=NH, num_kv_heads=KVH, head_dim=D,
                       max_position_embeddings=64, rms_norm_eps=1e-5)
CFG = eagle3.default_config(BACKBONE, VD).replace(rope_theta=10000.0)  # the reference's base


def reference_ttt_loss(heads, c: eagle3.Eagle3Config, embed_table: jax.Array,
                       aux: jax.Array, tokens: jax.Array, target_logits: jax.Array,
                       loss_mask: jax.Array, attention_mask: jax.Array | None = None,
                       steps: int = eagle3.TTT_STEPS, decay: float = eagle3.TTT_DECAY
                       ) -> tuple[jax.Array, dict]:
    """The reference trainer's loss in its own form, the oracle of the recipe's
    (`training.recipes.eagle3.ttt_loss`), checked against the PyTorch transcription below:
    sum_i decay**i * loss_i, where loss_i is the cross-entropy of step i's draft
    distribution against the backbone's softmax restricted to the draft vocabulary, summed
    over it and averaged over all B*T positions, counting only positions with loss_mask
    that the backbone's argmax is in the draft vocabulary.

    target_logits [B, T, V] the backbone's logits at every position (its guess of token
    t+1), loss_mask [B, T]. Returns (loss, {"losses": [steps], "accuracies": [steps]}): the
    per-step losses, and the reference's accuracy (draft argmax == restricted target argmax,
    over loss-masked positions, divided by the step's loss_mask sum + 1e-6)."""
    logits = eagle3.ttt_logits(heads, c, embed_table, aux, tokens, attention_mask, steps)
    t2d = jnp.asarray(heads["t2d"], bool)
    keep = eagle3.target_ids(heads)
    lm = loss_mask.astype(jnp.float32)
    losses, accs = [], []
    for i in range(steps):
        tgt = jax.lax.stop_gradient(eagle3.shift(target_logits.astype(jnp.float32), i + 1))
        mask_i = eagle3.shift(lm, i)
        pos = t2d[jnp.argmax(tgt, axis=-1)].astype(jnp.float32) * mask_i  # [B, T]
        target_p = jax.nn.softmax(tgt[..., keep], axis=-1)  # [B, T, Vd]
        logp = jax.nn.log_softmax(logits[i], axis=-1)
        losses.append(-jnp.mean(jnp.sum(pos[..., None] * target_p * logp, axis=-1)))
        hit = (jnp.argmax(logits[i], -1) == jnp.argmax(target_p, -1)).astype(jnp.float32)
        accs.append(jnp.sum(hit * pos) / (jnp.sum(mask_i) + 1e-6))
    losses = jnp.stack(losses)
    total = jnp.sum(decay ** jnp.arange(steps, dtype=jnp.float32) * losses)
    return total, {"losses": losses, "accuracies": jnp.stack(accs)}


# ----------------------------------------------------------------------------- PyTorch reference
# Transcribed from SafeAILab/EAGLE (Apache-2.0): only what the drafter computes, no
# pretraining_tp, rope scaling or gradient checkpointing. `forward_kv` is eagle/model/cnets.py's
# LlamaAttention.forward (a KV cache and an additive mask); `forward_ttt` is
# eagle/traineagle3/cnets.py's (the cache of earlier TTT steps, seen on the diagonal only).


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(x, n_rep):
    b, kvh, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


class Rotary(torch.nn.Module):
    def __init__(self, dim, max_pos=64, base=10000):  # the reference never passes rope_theta
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.einsum("i,j->ij", torch.arange(max_pos).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None], persistent=False)

    def forward(self, seq_len):
        return self.cos_cached[:, :, :seq_len], self.sin_cached[:, :, :seq_len]


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(H * 2, NH * D, bias=False)
        self.k_proj = torch.nn.Linear(H * 2, KVH * D, bias=False)
        self.v_proj = torch.nn.Linear(H * 2, KVH * D, bias=False)
        self.o_proj = torch.nn.Linear(NH * D, H, bias=False)
        self.rotary_emb = Rotary(D)

    def _qkv(self, x):
        b, q_len, _ = x.shape
        q = self.q_proj(x).view(b, q_len, NH, D).transpose(1, 2)
        k = self.k_proj(x).view(b, q_len, KVH, D).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, KVH, D).transpose(1, 2)
        return q, k, v

    def forward_kv(self, x, attention_mask, position_ids, past_key_value):
        b, q_len, _ = x.shape
        q, k, v = self._qkv(x)
        kv_seq_len = k.shape[-2] + (past_key_value[0].shape[-2] if past_key_value else 0)
        cos, sin = self.rotary_emb(seq_len=kv_seq_len + int(position_ids.max()) + 1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        present = (k, v)
        k, v = repeat_kv(k, NH // KVH), repeat_kv(v, NH // KVH)
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(D) + attention_mask
        w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(b, q_len, H)
        return self.o_proj(out), present

    def forward_ttt(self, x, cache_hidden, attention_mask, position_ids):
        b, q_len, _ = x.shape
        q, k, v = self._qkv(x)
        lck = len(cache_hidden[0])
        cos, sin = self.rotary_emb(seq_len=q_len + lck)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids + lck)
        k, v = repeat_kv(k, NH // KVH), repeat_kv(v, NH // KVH)
        cache_k, cache_v = list(cache_hidden[0]) + [k], list(cache_hidden[1]) + [v]
        w = torch.matmul(q, cache_k[0].transpose(2, 3)) / math.sqrt(D) + attention_mask
        for i in range(1, len(cache_k)):
            wi = (q * cache_k[i]).sum(-1) / math.sqrt(D)
            w = torch.cat((w, wi[..., None]), dim=-1)
        w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w[..., :q_len], cache_v[0])
        for i in range(1, len(cache_k)):
            out = out + w[..., q_len + i - 1][..., None] * cache_v[i]
        out = out.transpose(1, 2).reshape(b, q_len, H)
        return self.o_proj(out), [cache_k, cache_v]


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(H, F, bias=False)
        self.up_proj = torch.nn.Linear(H, F, bias=False)
        self.down_proj = torch.nn.Linear(F, H, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(torch.nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(H))
        self.variance_epsilon = eps

    def forward(self, x):
        dt = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dt)


class DecoderLayeremb(torch.nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.self_attn, self.mlp = Attention(), MLP()
        self.hidden_norm, self.input_layernorm = RMSNorm(eps), RMSNorm(eps)
        self.post_attention_layernorm = RMSNorm(eps)

    def forward(self, input_emb, hidden_states, attn):
        residual = hidden_states
        x = torch.cat((self.input_layernorm(input_emb), self.hidden_norm(hidden_states)), -1)
        x, cache = attn(self.self_attn, x)
        x = residual + x
        return x + self.mlp(self.post_attention_layernorm(x)), cache


def padding(tensor):  # padding(tensor, left=False)
    return torch.cat((tensor[:, 1:], torch.zeros_like(tensor[:, -1:])), dim=1)


def make_causal_mask(b, t, past=0):
    mask = torch.full((t, t), torch.finfo(torch.float32).min)
    cond = torch.arange(t)
    mask.masked_fill_(cond < (cond + 1).view(t, 1), 0)
    if past:
        mask = torch.cat([torch.zeros(t, past), mask], dim=-1)
    return mask[None, None].expand(b, 1, t, t + past)


def expand_mask(mask, t):
    inv = 1.0 - mask[:, None, None, :].expand(mask.shape[0], 1, t, mask.shape[1]).float()
    return inv.masked_fill(inv.to(torch.bool), torch.finfo(torch.float32).min)


class RefModel(torch.nn.Module):
    """The drafter's modules under the checkpoint's names (`load_state_dict` strict)."""

    def __init__(self, eps):
        super().__init__()
        self.fc = torch.nn.Linear(H * 3, H, bias=False)
        self.midlayer = DecoderLayeremb(eps)
        self.norm = RMSNorm(eps)
        self.lm_head = torch.nn.Linear(H, VD, bias=False)
        self.register_buffer("d2t", torch.zeros(VD, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))

    def ttt(self, embed, aux, input_ids, target, loss_mask, attention_mask, length=7):
        """Model.forward after dataprepare (which shifts target and input_ids once)."""
        target, input_ids = padding(target), padding(input_ids)
        loss_mask = loss_mask[..., None]
        hidden = self.fc(aux)
        b, t, _ = hidden.shape
        position_ids = torch.arange(t).unsqueeze(0).view(-1, t)
        mask = make_causal_mask(b, t) + expand_mask(attention_mask, t)
        plosses, acces, cache_hidden = [], [], [[], []]
        for idx in range(length):
            emb = embed[input_ids]
            out, cache_hidden = self.midlayer(
                emb, hidden, lambda m, x: m.forward_ttt(x, cache_hidden, mask, position_ids))
            with torch.no_grad():
                target_mask = self.t2d[target.argmax(-1)][..., None].int()
                position_mask = target_mask * loss_mask
                target_p = torch.nn.Softmax(dim=2)(target[..., self.t2d].float())
            hidden = out
            logits = self.lm_head(self.norm(out)).float()
            plosses.append(-torch.sum(position_mask * target_p * torch.log_softmax(logits, 2),
                                      2).mean())
            acces.append(((logits.argmax(-1) == target_p.argmax(-1))
                          * position_mask.squeeze(-1)).sum().item()
                         / (loss_mask.sum().item() + 1e-6))
            if idx != length - 1:
                input_ids, target, loss_mask = padding(input_ids), padding(target), \
                    padding(loss_mask)
        return plosses, acces


def scandata_maps(token_dict: Counter, n: int):
    """Model.scandata's d2t / t2d from token counts."""
    used = sorted(k for k, _ in token_dict.most_common(n))
    return [used[i] - i for i in range(len(used))], [i in used for i in range(V)]


def torch_model(heads, c=CFG) -> RefModel:
    """The reference model holding `heads` (our layout turned into theirs)."""
    m = RefModel(c.rms_norm_eps)
    sd = {k: torch.from_numpy(np.array(a)) for k, a in formats.eagle3_tensors(heads).items()}
    m.load_state_dict(sd, strict=True)
    return m


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def drafter():
    rng = np.random.default_rng(0)
    counts = rng.permutation(V) + 1  # distinct: the reference's Counter order is then fixed
    heads = eagle3.init_eagle3(jax.random.key(1), CFG, counts, std=0.2)
    k = jax.random.split(jax.random.key(2), 4)  # norms off one, so a swap would show
    for i, n in enumerate(("input_norm", "hidden_norm", "post_attn_norm", "final_norm")):
        heads[n] = 1.0 + 0.3 * jax.random.normal(k[i], (H,))
    return {n: np.asarray(a) for n, a in heads.items()}, counts


def t_(a):
    return torch.from_numpy(np.array(a))


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ----------------------------------------------------------------------------- parity


@pytest.mark.slow
def test_vocab_maps_are_the_reference_scandata(drafter):
    _, counts = drafter
    d2t, t2d = eagle3.vocab_maps(counts, VD)
    ref_d2t, ref_t2d = scandata_maps(Counter({i: int(n) for i, n in enumerate(counts)}), VD)
    assert d2t.tolist() == ref_d2t and t2d.tolist() == ref_t2d
    eagle3.check_draft_ids(d2t, t2d, V)


@pytest.mark.slow
def test_layer_and_draft_logits_match_the_reference_with_a_cache_and_a_tree_mask(drafter):
    """A causal prefix of T positions, then 4 tree nodes (root 0 with children 1, 2; node 3
    under 1) on top of its cache, each at its depth's position."""
    heads, _ = drafter
    ref = torch_model(heads)
    rng = np.random.default_rng(3)
    emb, hid = rng.normal(size=(2, B, T, H)).astype(np.float32)
    pos = np.broadcast_to(np.arange(T), (B, T)).astype(np.int32)
    empty = jnp.zeros((B, KVH, 0, D))
    out, k1, v1 = eagle3.layer(heads, CFG, emb, hid, pos, empty, empty, eagle3.causal_mask(T))
    with torch.no_grad():
        r_out, kv = ref.midlayer(t_(emb), t_(hid), lambda m, x: m.forward_kv(
            x, make_causal_mask(B, T), t_(pos).long(), None))
        r_logits = ref.lm_head(ref.norm(r_out))
    assert max_diff(out, r_out) < 1e-5
    assert max_diff(eagle3.draft_logits(heads, CFG, out), r_logits) < 1e-5
    assert max_diff(k1, kv[0]) < 1e-5  # our cache holds what theirs does, in its layout

    parent = np.array([-1, 0, 0, 1])
    depth = np.array([0, 1, 1, 2])
    tree = np.eye(4, dtype=bool)
    for i in range(4):
        j = parent[i]
        while j >= 0:
            tree[i, j], j = True, parent[j]
    emb2, hid2 = rng.normal(size=(2, B, 4, H)).astype(np.float32)
    pos2 = np.broadcast_to(T + depth, (B, 4)).astype(np.int32)
    mask = np.concatenate([np.ones((4, T), bool), tree], axis=1)[None]
    out2, _, _ = eagle3.layer(heads, CFG, emb2, hid2, pos2, k1, v1, jnp.asarray(mask))
    add = torch.where(t_(mask), 0.0, torch.finfo(torch.float32).min)[None].expand(B, 1, 4, T + 4)
    with torch.no_grad():
        r_out2, _ = ref.midlayer(t_(emb2), t_(hid2), lambda m, x: m.forward_kv(
            x, add, t_(pos2).long(), kv))
        r_logits2 = ref.lm_head(ref.norm(r_out2))
    assert max_diff(out2, r_out2) < 1e-5
    assert max_diff(eagle3.draft_logits(heads, CFG, out2), r_logits2) < 1e-5
    # and the tree mask matters: without it node 3 would see its uncle 2
    loose = jnp.ones_like(jnp.asarray(mask))
    out3, _, _ = eagle3.layer(heads, CFG, emb2, hid2, pos2, k1, v1, loose)
    assert max_diff(out3[:, 3], r_out2[:, 3]) > 1e-3


def ttt_inputs(seed=4):
    rng = np.random.default_rng(seed)
    aux = rng.normal(size=(B, T, 3 * H)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
    target = (3 * rng.normal(size=(B, T, V))).astype(np.float32)
    loss_mask = (rng.random((B, T)) < 0.8).astype(np.int32)
    attention_mask = np.ones((B, T), np.int32)
    attention_mask[1, T - 2:] = 0  # row 1 is padded at the end
    embed = rng.normal(size=(V, H)).astype(np.float32)
    return aux, tokens, target, loss_mask, attention_mask, embed


@pytest.mark.slow
def test_training_time_test_losses_accuracies_and_gradients_match_the_reference(drafter):
    heads, _ = drafter
    aux, tokens, target, loss_mask, attn, embed = ttt_inputs()
    ref = torch_model(heads)
    plosses, acces = ref.ttt(t_(embed), t_(aux), t_(tokens).long(), t_(target), t_(loss_mask),
                             t_(attn))
    total = sum(0.8 ** i * p for i, p in enumerate(plosses))  # main.py's ploss
    total.backward()

    weights = {n: jnp.asarray(heads[n]) for n in eagle3.WEIGHTS}
    maps = {n: jnp.asarray(heads[n]) for n in ("d2t", "t2d")}

    def loss(w):
        return reference_ttt_loss({**w, **maps}, CFG, jnp.asarray(embed), aux, tokens, target,
                               loss_mask, attn)

    (ours, parts), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(weights)
    assert len(plosses) == eagle3.TTT_STEPS == 7
    assert max_diff(parts["losses"], [p.item() for p in plosses]) < 1e-5
    assert abs(float(ours) - total.item()) < 1e-5
    assert np.allclose(parts["accuracies"], acces, atol=1e-6)
    assert len(set(np.round(np.asarray(parts["losses"]), 4))) > 1  # steps differ
    names = formats.tensor_names()
    torch_grads = {n: formats.from_torch(n, ref.get_parameter(names[n].removesuffix(".weight")
                                                              + ".weight").grad.numpy(), CFG)
                   for n in eagle3.WEIGHTS}
    for n in eagle3.WEIGHTS:
        scale = float(np.max(np.abs(torch_grads[n])))
        assert scale > 0, n
        assert max_diff(grads[n], torch_grads[n]) < 1e-4 * scale + 1e-7, n


def test_a_fresh_drafter_starts_as_the_references():
    """init_eagle3's linear weights as torch's default nn.Linear: uniform in
    +-1/sqrt(fan_in) (wo's fan-in: NH x D), norms at one; std= draws normal(0, std)."""
    heads = eagle3.init_eagle3(jax.random.key(0), CFG)
    shapes = eagle3.param_shapes(CFG)
    for name in eagle3.WEIGHTS:
        w = np.asarray(heads[name])
        if "norm" in name:
            assert np.all(w == 1), name
            continue
        fan_in = NH * D if name == "wo" else shapes[name][0]
        bound = 1 / math.sqrt(fan_in)
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound, name
        assert abs(w.std() - bound / math.sqrt(3)) < 0.1 * bound, name  # uniform's spread
    small = eagle3.init_eagle3(jax.random.key(0), CFG, std=0.02)
    assert abs(float(np.std(small["lm_head"])) - 0.02) < 0.005


@pytest.mark.slow
@pytest.mark.parametrize("draft_vocab", [VD, V])
def test_the_training_recipes_loss_is_the_references(draft_vocab):
    """The recipe's loss (`training.recipes.eagle3.ttt_loss`: the backbone's side computed
    once for every step, the steps' masks from the batch) gives `reference_ttt_loss`'s
    loss, per-step losses and gradients on rows of one example each (padded at the end),
    over a reduced and over the whole vocabulary."""
    from medusa_jax.training.recipes import eagle3 as recipe

    c = eagle3.default_config(BACKBONE, draft_vocab)
    counts = np.arange(V)[::-1]  # a draft vocabulary that is not 0..Vd-1
    heads = eagle3.init_eagle3(jax.random.key(0), c, counts, std=0.3)
    aux, tokens, target, _, attn, embed = ttt_inputs()
    t = tokens.shape[1]
    segments = jnp.asarray(attn, jnp.int32)
    batch = {"tokens": tokens, "segments": segments,
             "loss_mask": (segments > 0) & (jnp.arange(t)[None] > 2)}
    steps = 4
    # the reference counts step i at t by the label-ness of token t+i; the recipe by that of
    # its target t+i+2: the same positions for the reference's mask moved two left
    labels = eagle3.shift(batch["loss_mask"], 2)
    maps = {n: heads[n] for n in ("d2t", "t2d")}
    w = {n: heads[n] for n in eagle3.WEIGHTS}
    valid = segments > 0

    def theirs(w):
        return reference_ttt_loss({**w, **maps}, c, embed, aux, tokens, target, labels,
                                  valid, steps, 0.8)

    def ours(w):
        h = {**w, **maps}
        logits = eagle3.ttt_logits(h, c, embed, aux, tokens, valid, steps, segments=segments)
        return recipe.ttt_loss(h, c, logits, target, recipe.step_masks(batch, steps), 0.8)

    @jax.jit
    def run(w):
        return (jax.value_and_grad(theirs, has_aux=True)(w),
                jax.value_and_grad(ours, has_aux=True)(w))

    ((want, parts), g_want), ((got, losses), g_got) = run(w)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(losses), np.asarray(parts["losses"]), rtol=1e-5,
                               atol=1e-7)
    assert len(set(np.round(np.asarray(losses), 4))) > 1  # the steps differ
    for n in eagle3.WEIGHTS:
        scale = float(jnp.max(jnp.abs(g_want[n])))
        assert scale > 0, n
        np.testing.assert_allclose(np.asarray(g_got[n]), np.asarray(g_want[n]),
                                   atol=1e-5 * scale, err_msg=n)


# ----------------------------------------------------------------------------- the layout


@pytest.mark.slow
def test_write_read_round_trip_and_the_reference_loads_what_we_write(tmp_path, drafter):
    heads, _ = drafter
    files = formats.write_eagle3(heads, tmp_path, CFG, model_cfg=BACKBONE, base_model="toy")
    assert [f.name for f in files] == ["model.safetensors", "config.json"]
    conf = json.loads((tmp_path / "config.json").read_text())
    ours = eagle3_layers(L)
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in ours]
    assert conf["eagle_aux_hidden_state_layer_ids"] == list(ours)  # vLLM's: inputs of layers
    assert conf["draft_vocab_size"] == VD and conf["architectures"] == ["LlamaForCausalLMEagle3"]
    # SafeAILab's Model loads the target's embedding only without target_hidden_size
    assert "target_hidden_size" not in conf and conf["rope_scaling"] is None

    back, c, meta = formats.read_eagle3(tmp_path, BACKBONE)
    assert c == CFG and meta["aux_layers"] == list(ours)
    assert meta["base_model_name_or_path"] == "toy"
    for n in eagle3.NAMES:
        assert back[n].dtype == (np.int32 if n == "d2t" else heads[n].dtype), n
        assert np.array_equal(back[n], heads[n]), n

    sd = load_torch(str(tmp_path / "model.safetensors"))
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    ref = RefModel(c.rms_norm_eps)
    ref.load_state_dict(sd, strict=True)  # exactly the reference's tensors, no more, no fewer
    rng = np.random.default_rng(5)
    emb, hid = rng.normal(size=(2, 1, T, H)).astype(np.float32)
    pos = np.arange(T, dtype=np.int32)[None]
    empty = jnp.zeros((1, KVH, 0, D))
    out, _, _ = eagle3.layer(back, c, emb, hid, pos, empty, empty, eagle3.causal_mask(T))
    logits = eagle3.draft_logits(back, c, out)
    with torch.no_grad():
        r_out, _ = ref.midlayer(t_(emb), t_(hid), lambda m, x: m.forward_kv(
            x, make_causal_mask(1, T), t_(pos).long(), None))
        r_logits = ref.lm_head(ref.norm(r_out))
    assert max_diff(logits, r_logits) < 1e-5
    # draft id -> target id as the reference's topK_genrate: topk_index + d2t[topk_index]
    top = torch.topk(r_logits[0, -1], 5).indices
    assert eagle3.to_target(back, jnp.asarray(top.numpy())).tolist() == \
        (top + ref.d2t[top]).tolist()
    assert np.all(np.asarray(back["t2d"])[eagle3.to_target(back, jnp.arange(VD))])


def test_published_variants_read_the_same(tmp_path, drafter, one_line_error):
    """vLLM's layers.0. names, a saved copy of the embedding, a pickle, the full vocabulary
    without d2t/t2d, and the aux ids at vLLM's top level."""
    heads, _ = drafter
    formats.write_eagle3(heads, tmp_path / "a", CFG)
    sd = load_file(str(tmp_path / "a" / "model.safetensors"))
    conf = json.loads((tmp_path / "a" / "config.json").read_text())

    def folder(name, tensors, config, pickle=False):
        p = tmp_path / name
        p.mkdir()
        if pickle:
            torch.save({k: torch.from_numpy(np.array(a)) for k, a in tensors.items()},
                       str(p / "pytorch_model.bin"))
        else:
            save_file(tensors, str(p / "model.safetensors"))
        (p / "config.json").write_text(json.dumps(config))
        return p

    renamed = {k.replace("midlayer.", "layers.0."): a for k, a in sd.items()}
    renamed["embed_tokens.weight"] = np.zeros((V, H), np.float32)
    top = {k: v for k, v in conf.items() if k != "eagle_config"}  # vLLM's field alone
    assert top["eagle_aux_hidden_state_layer_ids"] == list(CFG.aux_layers)
    conf = {k: v for k, v in conf.items() if k != "eagle_aux_hidden_state_layer_ids"}
    for p, source in ((folder("vllm", renamed, top), "vLLM's input-of-layer ids"),
                      (folder("pickle", sd, conf, pickle=True), "eagle_config.")):
        back, c, meta = formats.read_eagle3(p, BACKBONE, np.zeros((V, H)))
        assert c == CFG and source in meta["aux_layers_source"], p
        assert all(np.array_equal(back[n], heads[n]) for n in eagle3.NAMES), p
    assert not meta["embedding_copy_dropped"]
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(
        tmp_path / "vllm", BACKBONE, np.ones((V, H))),
        "tensor embed_tokens.weight is not the backbone's embedding", "max abs difference 1")

    full = eagle3.default_config(BACKBONE)
    fheads = eagle3.init_eagle3(jax.random.key(3), full)
    formats.write_eagle3(fheads, tmp_path / "full", full)
    fsd = load_file(str(tmp_path / "full" / "model.safetensors"))
    fconf = json.loads((tmp_path / "full" / "config.json").read_text())
    del fconf["eagle_config"], fconf["draft_vocab_size"], fconf["eagle_aux_hidden_state_layer_ids"]
    p = folder("nomaps", {k: a for k, a in fsd.items() if k not in ("d2t", "t2d")}, fconf)
    back, c, meta = formats.read_eagle3(p, BACKBONE)
    assert c.aux_layers == eagle3_layers(L) and meta["aux_layers_source"].startswith("default")
    assert np.array_equal(back["d2t"], np.zeros(V)) and back["t2d"].all()


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def written(tmp_path, drafter):
    heads, _ = drafter
    formats.write_eagle3(heads, tmp_path / "d", CFG)
    p = tmp_path / "d"
    return p, load_file(str(p / "model.safetensors")), json.loads((p / "config.json").read_text())


def rewrite(p, tensors=None, conf=None):
    if tensors is not None:
        save_file(tensors, str(p / "model.safetensors"))
    if conf is not None:
        (p / "config.json").write_text(json.dumps(conf))
    return p


def test_wrong_backbone_is_refused(written, one_line_error):
    p, _, _ = written
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, BACKBONE.replace(
        hidden_size=48)), "hidden_size=32", "backbone's hidden size is 48")
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, BACKBONE.replace(
        vocab_size=60)), "vocab_size=50", "backbone's vocabulary is 60")
    # eagle3_layers(8) = (2, 4, 5); a 5-layer backbone has no layer 5
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, BACKBONE.replace(
        num_layers=5)), "aux_layers: 5", "5-layer backbone")


def test_layer_ids_beyond_the_backbone_and_conflicting_ids(written, one_line_error):
    p, _, conf = written
    del conf["eagle_aux_hidden_state_layer_ids"]  # the ids as SafeAILab/SpecForge write them
    conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 8]  # ours 2, 4, 9
    rewrite(p, conf=conf)
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, BACKBONE),
                   "aux_layers: 9", "8-layer backbone")
    conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    conf["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]  # vLLM reads these as inputs
    rewrite(p, conf=conf)
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, BACKBONE),
                   "name different layers", "[1, 3, 4]")


def test_half_written_folder(written, one_line_error):
    p, _, _ = written
    (p / "config.json").unlink()
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, BACKBONE),
                   "no config.json", "half-written")
    (p / "model.safetensors").write_bytes(b"\0" * 10)  # truncated too
    rewrite(p, conf={"architectures": ["LlamaForCausalLMEagle3"]})
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, BACKBONE), "needs hidden_size")


@pytest.mark.parametrize("case", ["duplicate", "outside", "t2d_extra", "t2d_short"])
def test_maps_that_are_not_one_subset_of_the_vocabulary(written, case, one_line_error):
    p, sd, _ = written
    d2t, t2d = sd["d2t"].copy(), sd["t2d"].copy()
    targets = np.arange(VD) + d2t
    if case == "duplicate":  # draft ids 3 and 4 -> one target id
        d2t[4] = targets[3] - 4
        needle = "draft id 4 maps to target id"
    elif case == "outside":
        d2t[-1] = V
        needle = f"outside the vocabulary [0, {V})"
    elif case == "t2d_extra":
        t2d[np.flatnonzero(~t2d)[0]] = True
        needle = "t2d disagrees with d2t: it marks target id"
    else:
        t2d[targets[0]] = False
        needle = f"does not mark target id {targets[0]}"
    rewrite(p, {**sd, "d2t": d2t, "t2d": t2d})
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, BACKBONE), needle)
    with pytest.raises(ValueError, match="d2t|t2d"):
        eagle3.check_draft_ids(d2t, t2d, V)


@pytest.mark.parametrize("case", ["missing", "extra", "shape", "d2t_float", "t2d_uint8", "nan"])
def test_bad_tensors(written, case, one_line_error):
    p, sd, _ = written
    sd = dict(sd)
    if case == "missing":
        del sd["norm.weight"]
        needles = ("missing tensor norm.weight", "expected shape (32,)")
    elif case == "extra":
        sd["midlayer.self_attn.q_proj.bias"] = np.zeros(H, np.float32)
        needles = ("unexpected tensor midlayer.self_attn.q_proj.bias",)
    elif case == "shape":
        sd["lm_head.weight"] = np.zeros((VD + 1, H), np.float32)
        needles = ("tensor lm_head.weight has shape (21, 32), expected (20, 32)",)
    elif case == "d2t_float":
        sd["d2t"] = sd["d2t"].astype(np.float32)
        needles = ("tensor d2t has dtype float32, expected an integer type",)
    elif case == "t2d_uint8":
        sd["t2d"] = sd["t2d"].astype(np.uint8)
        needles = ("tensor t2d has dtype uint8, expected bool",)
    else:
        w = sd["fc.weight"].copy()
        w[0, 0] = np.nan
        sd["fc.weight"] = w
        needles = ("tensor fc has non-finite values",)
    rewrite(p, sd)
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, BACKBONE), *needles)


@pytest.mark.parametrize("field,value,needle", [
    ("num_hidden_layers", 2, "only one-layer drafters"),
    ("tie_word_embeddings", True, "tie_word_embeddings=True is not supported"),
    ("norm_before_residual", True, "norm_before_residual=True is not supported"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("architectures", ["MistralForCausalLM"], "names no EAGLE-3 drafter"),  # Llama: traineagle3
    ("speculators_config", {}, "speculators config"),
    ("num_attention_heads", 0, "num_attention_heads=0 is not a positive integer"),
    ("rope_scaling", "linear", "rope_scaling must be a JSON object"),
    ("rope_scaling", ["linear", 2.0], "rope_scaling must be a JSON object"),
    ("rope_parameters", "default", "rope_parameters must be a JSON object"),
    ("rms_norm_eps", -1, "rms_norm_eps must be a finite number > 0, got -1"),
    ("rope_theta", "big", "rope_theta must be a number > 0, got str 'big'"),
])
def test_unsupported_configs(written, field, value, needle, one_line_error):
    p, _, conf = written
    rewrite(p, conf={**conf, field: value})
    one_line_error(HeadsFormatError, lambda: formats.read_eagle3(p, BACKBONE),
                   p / "config.json", needle)


@pytest.mark.parametrize("changes, needle", [
    (dict(rms_norm_eps=-1.0), "rms_norm_eps=-1.0 is not a finite number > 0"),
    (dict(rope_theta="big"), "rope_theta='big' is not a finite number > 0"),
    (dict(rope_scaling=("linear",)), "rope_scaling=['linear'] is not"),
    (dict(rope_scaling=("linear", float("nan"))), "rope_scaling=nan is not a finite number"),
    (dict(head_dim=0), "head_dim=0 is not an integer >= 1"),
])
def test_config_values_are_checked_wherever_the_config_comes_from(drafter, changes, needle,
                                                                   one_line_error):
    heads, _ = drafter
    one_line_error(ValueError, lambda: eagle3.check(heads, BACKBONE, CFG.replace(**changes),
                                                    "here"), "here: ", needle)


def test_writing_checks_first(tmp_path, drafter, one_line_error):
    heads, _ = drafter
    bad = {**heads, "t2d": ~heads["t2d"]}
    one_line_error(HeadsFormatError, lambda: formats.write_eagle3(bad, tmp_path / "w", CFG),
                   "write_eagle3", "t2d disagrees with d2t")
    assert not (tmp_path / "w").exists()
    one_line_error(ValueError, lambda: eagle3.check(heads, BACKBONE, CFG.replace(
        aux_layers=(2, 4))), "exactly three")


# ----------------------------------------------------------------------------- drafting

TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 1]])


def drafting_inputs(seed=6, p=7, lengths=(7, 5)):
    rng = np.random.default_rng(seed)
    aux = rng.normal(size=(B, p, 3 * H)).astype(np.float32)
    tokens = rng.integers(3, V, size=(B, p)).astype(np.int32)
    root = rng.integers(3, V, size=(B,)).astype(np.int32)
    table = rng.normal(size=(V, H)).astype(np.float32)
    return aux, tokens, root, np.asarray(lengths, np.int32), table


def reference_tree(ref, heads, table, aux, tokens, root, n):
    """One row through the torch reference, as topK_genrate feeds it (input_ids[:, 1:] with
    the root last, then one call per node on its path with past_key_value), every path of
    TREE drafted on its own: {node: (target token, its draft log-probability)}."""
    nxt = np.append(tokens[1:n], root)
    with torch.no_grad():
        hid = ref.fc(t_(aux[None, :n]))
        out, kv = ref.midlayer(t_(table[nxt])[None], hid, lambda m, x: m.forward_kv(
            x, make_causal_mask(1, n), torch.arange(n)[None], None))
        index = {(): 0, **{p: i + 1 for i, p in enumerate(TREE.paths_ranks)}}
        state = {(): (out[:, -1:], kv)}  # path -> (the output predicting its children, cache)
        got = {}
        for path in TREE.paths_ranks:
            prev, past = state[path[:-1]]
            lp = torch.log_softmax(ref.lm_head(ref.norm(prev))[0, 0], -1)
            draft = torch.topk(lp, path[-1] + 1).indices[-1]
            token = int(draft + ref.d2t[draft])
            got[index[path]] = (token, float(lp[draft]))
            add = torch.zeros(1, 1, 1, past[0].shape[2] + 1)  # the path is all it sees
            o, kv2 = ref.midlayer(t_(table[[token]])[None], prev, lambda m, x: m.forward_kv(
                x, add, torch.tensor([[n - 1 + len(path)]]), past))
            state[path] = (o, kv2)
    return got


@pytest.fixture(scope="module")
def drafted(drafter):
    """The drafter begun on a prompt (rows of lengths 7 and 5) and TREE drafted, jitted."""
    heads, _ = drafter
    aux, tokens, root, lengths, table = drafting_inputs()
    params = {"embed": jnp.asarray(table)}
    d = Eagle3Drafter(CFG)

    @jax.jit
    def run(params, heads):
        carry = d.begin(params, heads, None, aux, tokens, lengths, root, 16)
        return carry, draft_tree(heads, CFG, d.embed(params), carry, root, TREE.paths_ranks,
                                 TREE.num_nodes)

    carry, (ours, logp, _) = run(params, heads)
    return dict(heads=heads, aux=aux, tokens=tokens, root=root, lengths=lengths, table=table,
                params=params, d=d, carry=carry, ours=np.asarray(ours), logp=np.asarray(logp))


@pytest.mark.slow
def test_draft_tree_equals_the_reference_drafting_each_path_alone(drafted):
    x = drafted
    ref = torch_model(x["heads"])
    ours, logp = x["ours"], x["logp"]
    for b in range(B):
        want = reference_tree(ref, x["heads"], x["table"], x["aux"][b], x["tokens"][b],
                              x["root"][b], int(x["lengths"][b]))
        assert int(ours[b, 0]) == x["root"][b]
        assert [int(ours[b, i]) for i in sorted(want)] == [want[i][0] for i in sorted(want)]
        assert max_diff([logp[b, i] for i in sorted(want)], [want[i][1] for i in sorted(want)]) \
            < 1e-5
    assert np.all(np.asarray(x["heads"]["t2d"])[ours[:, 1:]])  # draft-vocabulary tokens


def test_extending_in_pieces_equals_extending_at_once(drafted):
    """The prompt at once, or its first 4 tokens then the rest with one row shorter (the
    entries past a row's count are written but not counted, as a step's unaccepted nodes)."""
    x = drafted
    heads, d, params, lengths, tokens = x["heads"], x["d"], x["params"], x["lengths"], x["tokens"]

    @jax.jit
    def pieces(params, heads):
        first = extend(heads, CFG, d.embed(params), init_carry(CFG, B, 16), x["aux"][:, :4],
                       tokens[:, 1:5], jnp.array([4, 4]))
        # the rest as an accepted path: acc_len = count - 1
        return d.advance(params, heads, first, None, x["aux"][:, 4:], tokens[:, 4:],
                         lengths - 5, x["root"], lengths, jnp.ones((B,), bool))

    rest, whole = pieces(params, heads), x["carry"]
    assert np.array_equal(rest.length, lengths) and np.array_equal(whole.length, lengths)
    assert max_diff(rest.out, whole.out) < 1e-5
    for b in range(B):
        n = int(lengths[b])
        assert max_diff(rest.k[b, :, :n], whole.k[b, :, :n]) < 1e-5
        assert max_diff(rest.v[b, :, :n], whole.v[b, :, :n]) < 1e-5


def test_no_step_copies_the_context_cache(drafter):
    """The drafter attends over the context cache, the tree drafted so far and the new
    nodes as three key blocks (scores concatenated): no depth of `draft_tree`, nor
    `extend`, concatenates or transposes the carry's keys or values (a copy of the whole
    context, per depth). Read from the lowered program, with a capacity no other
    dimension has."""
    import re

    heads, _ = drafter
    cap = 61
    carry = init_carry(CFG, B, cap)
    table = jnp.zeros((V, H))
    root = jnp.zeros((B,), jnp.int32)
    aux, nxt = jnp.zeros((B, 3, 3 * H)), jnp.zeros((B, 3), jnp.int32)
    programs = {
        "draft_tree": jax.jit(lambda h, cr: draft_tree(
            h, CFG, lambda t: table[t], cr, root, TREE.paths_ranks, TREE.num_nodes)),
        "extend": jax.jit(lambda h, cr: extend(
            h, CFG, lambda t: table[t], cr, aux, nxt, jnp.full((B,), 3))),
    }
    whole = {f"tensor<{B}x{KVH}x{cap}x{D}xf32>", f"tensor<{B}x{cap}x{KVH}x{D}xf32>"}
    for name, fn in programs.items():
        text = fn.lower(heads, carry).as_text()
        ops = [line for line in text.splitlines()
               if re.search(r"stablehlo\.(concatenate|transpose)", line)]
        assert ops, name  # the pattern still finds the ops it counts
        copies = [line.strip() for line in ops
                  if any(t in line.split("->")[0] for t in whole)]
        assert copies == [], (name, copies)


@pytest.mark.slow
def test_the_drafter_is_registered_and_travels_bound_to_its_parameters(drafted,
                                                                       one_line_error):
    x = drafted
    heads = x["heads"]
    assert drafters.kind_of(heads) == "eagle3"
    assert drafters.drafter_class("eagle3") is Eagle3Drafter
    # bare parameters do not say which backbone layers the drafter reads
    one_line_error(ValueError, lambda: drafters.drafter_for(heads), "bind", "aux layers")
    bound = bind(heads, CFG, BACKBONE)
    assert drafters.drafter_for(bound) == Eagle3Drafter(CFG, BACKBONE)
    assert bound.drafter.aux_layers == CFG.aux_layers
    # the binding survives tree maps and jit (static: a new config is a new program)
    mapped = jax.tree.map(lambda a: a, bound)
    assert isinstance(mapped, BoundParams) and mapped.drafter == bound.drafter
    assert jax.jit(lambda h: h)(bound).drafter == bound.drafter
    root = jnp.asarray(x["root"])
    static, dynamic = jax.jit(lambda cr: (
        x["d"].propose(x["params"], heads, cr, root, TREE),
        x["d"].propose(x["params"], heads, cr, root, DynamicTree(TREE, 4))))(x["carry"])
    assert static.fed.shape == (B, TREE.num_nodes)
    assert np.array_equal(static.fed, x["ours"]) and np.array_equal(static.tokens, x["ours"])
    assert np.array_equal(static.fed_mask, TREE.mask)
    # a dynamic tree: the pool is the static drafts, the 4 nodes of most probable paths kept
    assert np.array_equal(dynamic.tokens, x["ours"]) and dynamic.fed.shape == (B, 5)
    path_lp = x["logp"] @ np.asarray(TREE.mask, np.float32).T  # [B, N]: each node's path
    for b in range(B):
        chosen = np.flatnonzero(np.asarray(dynamic.valid)[b])
        best = np.argsort(-path_lp[b, 1:], kind="stable")[:4] + 1
        assert chosen[0] == 0 and sorted(chosen[1:]) == sorted(best)


@pytest.mark.slow
def test_training_time_test_learns_on_the_backbones_own_features(stories):
    """The embedded stories260K (5 layers: aux layers 1, 2, 4 by hand) feeds its features
    and logits to the TTT loss (3 steps here) of a drafter over its 128 most frequent tokens;
    30 Adam steps on one story fit it (the loss falls by half and more)."""
    import optax

    from medusa_jax.model.backbone import KVCache, causal_mask, forward

    cfg, params, tok = stories
    ids = tok("Once upon a time, there was a little girl named Lily. She loved to play "
              "outside in the park. One day, she saw a big, red ball.").input_ids
    t = len(ids)
    tokens = jnp.asarray([ids], jnp.int32)
    cache = KVCache.init(cfg, 1, t)
    logits, _, _, aux = forward(params, cfg, tokens, jnp.arange(t)[None],
                                causal_mask(cache.lengths, t, t), cache, empty_cache=True,
                                aux_layers=(1, 2, 4))
    c = eagle3.default_config(cfg, 128, aux_layers=(1, 2, 4))
    heads = eagle3.init_eagle3(jax.random.key(0), c, np.bincount(ids, minlength=cfg.vocab_size))
    eagle3.check(heads, cfg, c)
    maps = {n: heads.pop(n) for n in ("d2t", "t2d")}
    mask = jnp.ones((1, t), jnp.int32)
    opt = optax.adam(1e-2)

    @jax.jit
    def step(w, state):
        (loss, parts), g = jax.value_and_grad(lambda w: reference_ttt_loss(
            {**w, **maps}, c, params["embed"], aux, tokens, logits, mask, steps=3),
            has_aux=True)(w)
        updates, state = opt.update(g, state, w)
        return optax.apply_updates(w, updates), state, loss, parts

    state = opt.init(heads)
    first = None
    for _ in range(30):
        heads, state, loss, parts = step(heads, state)
        first = float(loss) if first is None else first
    assert np.isfinite(first) and float(loss) < 0.5 * first, (first, float(loss))
    assert float(parts["accuracies"][0]) > 0.5
