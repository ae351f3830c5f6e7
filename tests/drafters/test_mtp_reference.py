"""MTP modules against PyTorch transcriptions of vLLM's `deepseek_mtp.py` (and `mimo_mtp.py`)
(`DeepSeekMultiTokenPredictorLayer`: the embedding zeroed at position 0, enorm / hnorm,
eh_proj over [embedding; hidden], the decoder block, `residual + hidden_states`; logits
through `shared_head.norm` and `shared_head.head`), its decoder block the backbone's
(a Llama layer, as vLLM's `LlamaDecoderLayer`), on random weights, to float32 rounding:
one module, two chained (the second fed the first's output), and the drafter's carry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from medusa_jax.drafters.mtp import heads as mtp  # noqa: E402
from medusa_jax.drafters.mtp.drafter import MtpDrafter  # noqa: E402
from medusa_jax.model.backbone import init_params  # noqa: E402
from medusa_jax.model.config import ModelConfig  # noqa: E402

H, NH, KVH, F, V, L = 32, 4, 2, 48, 50, 2
D = H // NH
B, T = 2, 9
CFG = ModelConfig(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=F,
                  num_layers=L, num_heads=NH, num_kv_heads=KVH, head_dim=D,
                  max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)


class RMSNorm(torch.nn.Module):  # vLLM's RMSNorm.forward_native
    def __init__(self, w, eps=1e-5):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(w), eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope(x, positions):  # neox style (vLLM's get_rope for Llama), x [T, heads, D]
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    f = positions.float()[:, None] * inv[None]
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class LlamaLayer(torch.nn.Module):
    """vLLM's LlamaDecoderLayer with residual=None: (mlp output, residual); the caller adds."""

    def __init__(self, w):
        super().__init__()
        self.w = w
        self.input_layernorm = RMSNorm(w["attn_norm"])
        self.post_attention_layernorm = RMSNorm(w["mlp_norm"])

    def forward(self, positions, hidden_states):  # [T, H] one sequence, causal
        w = self.w
        residual = hidden_states
        x = self.input_layernorm(hidden_states)
        q = rope((x @ w["wq"]).view(-1, NH, D), positions)
        k = rope((x @ w["wk"]).view(-1, KVH, D), positions)
        v = (x @ w["wv"]).view(-1, KVH, D)
        k, v = k.repeat_interleave(NH // KVH, 1), v.repeat_interleave(NH // KVH, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
        t = x.shape[0]
        s = s.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
        a = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, NH * D) @ w["wo"]
        hidden_states = a + residual
        residual = hidden_states
        x = self.post_attention_layernorm(hidden_states)
        x = (torch.nn.functional.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]
        return x, residual


class MtpLayer(torch.nn.Module):
    """vLLM's DeepSeekMultiTokenPredictorLayer (+ its SharedHead and compute_logits)."""

    def __init__(self, heads, m, lm_head):
        super().__init__()
        t = {n: torch.tensor(np.asarray(a[m])) for n, a in heads.items()}
        self.enorm, self.hnorm = RMSNorm(t["enorm"]), RMSNorm(t["hnorm"])
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.eh_proj.weight.data = t["eh_proj"].T.contiguous()
        self.mtp_block = LlamaLayer({n[len(mtp.LAYER):]: a for n, a in t.items()
                                     if n.startswith(mtp.LAYER)})
        self.shared_norm = RMSNorm(t["final_norm"])
        self.head = torch.tensor(np.asarray(lm_head))  # [H, V]

    def forward(self, positions, previous_hidden_states, inputs_embeds):
        inputs_embeds = inputs_embeds.clone()
        inputs_embeds[positions == 0] = 0
        inputs_embeds = self.enorm(inputs_embeds)
        previous_hidden_states = self.hnorm(previous_hidden_states)
        hidden_states = self.eh_proj(torch.cat([inputs_embeds, previous_hidden_states], -1))
        hidden_states, residual = self.mtp_block(positions, hidden_states)
        return residual + hidden_states

    def compute_logits(self, hidden_states):
        return self.shared_norm(hidden_states) @ self.head


@pytest.fixture(scope="module")
def setup():
    params = init_params(CFG, jax.random.key(0), std=0.3)
    heads = mtp.init_mtp(jax.random.key(1), CFG, 2, std=0.3)
    heads = {n: a + 0.1 * jax.random.normal(jax.random.key(3), a.shape) if n.endswith("norm")
             else a for n, a in heads.items()}  # norms away from one
    ks = jax.random.split(jax.random.key(2), 2)
    hidden = jax.random.normal(ks[0], (B, T, H))
    tokens = jax.random.randint(ks[1], (B, T + 2), 0, V)
    return params, heads, hidden, tokens


def torch_chain(params, heads, hidden, tokens, depths):
    """The two modules chained as vLLM's proposer feeds them: module k at position i reads
    token i+k+1 and module k-1's output at i."""
    emb = torch.tensor(np.asarray(params["embed"]))
    mods = [MtpLayer(heads, m, params["lm_head"]) for m in range(depths)]
    pos = torch.arange(T)
    outs, logits = [], []
    for b in range(B):
        h = torch.tensor(np.asarray(hidden[b]))
        row_o, row_l = [], []
        for k, mod in enumerate(mods):
            ids = torch.tensor(np.asarray(tokens[b, k + 1:k + 1 + T]))
            h = mod(pos, h, emb[ids])
            row_o.append(h)
            row_l.append(mod.compute_logits(h))
        outs.append(torch.stack(row_o))
        logits.append(torch.stack(row_l))
    return torch.stack(outs, 1).detach().numpy(), torch.stack(logits, 1).detach().numpy()


def test_two_chained_modules_match_vllms_forward(setup):
    params, heads, hidden, tokens = setup
    want_h, want_logits = torch_chain(params, heads, hidden, tokens, 2)
    # our chain over T + 2 positions (the hidden states zero-padded: causal attention keeps
    # the first T as they are) reads tokens[i + k + 1] at the first T
    padded = jnp.pad(hidden, ((0, 0), (0, 2), (0, 0)))
    got = jax.jit(lambda: mtp.chain_hidden(params, CFG, heads, padded, tokens, depths=2))()
    for k in range(2):
        g = got[k][:, :T]
        assert float(jnp.max(jnp.abs(g - want_h[k]))) < 1e-4, k
        lg = mtp.logits(params, CFG, heads, k, g)
        assert float(jnp.max(jnp.abs(lg - want_logits[k]))) < 1e-4, k


def test_the_drafters_carry_holds_vllms_outputs(setup):
    """`begin` over T tokens with the root t_T: module 0's entries are vLLM's module 0 over
    tokens 1..T (the root last), module 1's over tokens 2..T (its last entry reads the
    root); each cache's `out` is that module's output at its last entry."""
    params, heads, hidden, tokens = setup
    want_h, _ = torch_chain(params, heads, hidden, tokens, 2)
    d = MtpDrafter(CFG)
    lengths = jnp.full((B,), T)
    carry = jax.jit(lambda: d.begin(params, heads, hidden, None, tokens[:, :T], lengths,
                                    tokens[:, T], 16))()
    assert np.array_equal(np.asarray(carry[0].length), [T] * B)
    assert np.array_equal(np.asarray(carry[1].length), [T - 1] * B)
    assert np.max(np.abs(np.asarray(carry[0].out) - want_h[0][:, T - 1])) < 1e-4
    assert np.max(np.abs(np.asarray(carry[1].out) - want_h[1][:, T - 2])) < 1e-4


class MimoLayer(MtpLayer):
    """vLLM's MiMoMultiTokenPredictorLayer: [hidden; embedding] into input_proj, and the
    output returned after final_layernorm (what the next step reads); logits the lm_head's."""

    def forward(self, positions, previous_hidden_states, inputs_embeds):
        inputs_embeds = inputs_embeds.clone()
        inputs_embeds[positions == 0] = 0
        inputs_embeds = self.enorm(inputs_embeds)
        previous_hidden_states = self.hnorm(previous_hidden_states)
        hidden_states = self.eh_proj(torch.cat([previous_hidden_states, inputs_embeds], -1))
        hidden_states, residual = self.mtp_block(positions, hidden_states)
        return self.shared_norm(residual + hidden_states)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.head


def test_mimo_style_matches_vllms_mimo_forward(setup):
    params, heads, hidden, tokens = setup
    emb = torch.tensor(np.asarray(params["embed"]))
    mods = [MimoLayer(heads, m, params["lm_head"]) for m in range(2)]
    padded = jnp.pad(hidden, ((0, 0), (0, 2), (0, 0)))
    got = jax.jit(lambda: mtp.chain_hidden(params, CFG, heads, padded, tokens, depths=2,
                                           style="mimo"))()
    for b in range(B):
        h = torch.tensor(np.asarray(hidden[b]))
        for k, mod in enumerate(mods):
            h = mod(torch.arange(T), h, emb[torch.tensor(np.asarray(tokens[b, k + 1:k + 1 + T]))])
            ours = got[k][b, :T]
            assert float(jnp.max(jnp.abs(mtp.normed(heads, CFG, k, ours) - h.detach().numpy()))
                         ) < 1e-4, (b, k)
            lg = mtp.logits(params, CFG, heads, k, ours)
            assert float(jnp.max(jnp.abs(lg - mod.compute_logits(h).detach().numpy()))) < 1e-4
