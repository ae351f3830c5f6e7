"""The CPU kernels on the JAX side: `KernelWeight` and `matmul` (few-row products),
`attention` (few-query attention over a per-layer cache), wrapping a backbone.

See the package docstring (`medusa_jax.kernels`)."""


from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import tree_util

from medusa_jax.kernels import build
from medusa_jax.kernels.flags import ENV, off_by_env  # noqa: F401 (re-exported)

TARGET = "medusa_fewrow_matmul"
ATTENTION_TARGET = "medusa_fewquery_attention"
_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16)

_state: dict = {}  # "ready": bool once decided, "why": the reason when not


def available() -> bool:
    """True when the kernel is built, loaded and registered with XLA for this process's CPU
    backend. Decided once per process (building it the first time on this machine, a few
    seconds); a reason it is not is printed once."""
    if off_by_env():
        return False
    if "ready" not in _state:
        _state["ready"], _state["why"] = _prepare()
        if not _state["ready"] and _state["why"]:
            build.note(f"CPU kernels off: {_state['why']}; using XLA's products")
    return _state["ready"]


def _prepare() -> tuple[bool, str]:
    if jax.default_backend() != "cpu":
        return False, ""  # silent: the kernels are for the CPU only
    path, why = build.library()
    if path is None:
        return False, why
    lib = build.load(path)
    if lib is None:
        return False, ""
    try:
        for target in (TARGET, ATTENTION_TARGET):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)),
                                        platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: XLA's products
        return False, f"registering with XLA failed ({e})"
    return True, ""


PANEL = 64  # columns per packed panel (`fewrow_matmul.cc`'s PW)


@functools.partial(tree_util.register_dataclass, data_fields=["w"],
                   meta_fields=["n", "transposed"])
@dataclasses.dataclass(frozen=True, eq=False)
class KernelWeight:
    """A weight [..., K, N] laid out as the CPU kernel reads it: packed into panels of 64
    columns, `w` [..., ceil(N/64), K, 64] (`pack`), or, `transposed`, as the [..., N, K]
    array it is stored as (a tied embedding read as the output layer). `shape` is the
    logical [..., K, N]; indexing the leading (stacking) axes and `astype` act as on an
    array, so code written for arrays reads it unchanged."""

    w: jax.Array
    n: int
    transposed: bool = False

    @classmethod
    def pack(cls, w: jax.Array) -> "KernelWeight":
        """w [..., K, N] -> panels [..., ceil(N/64), K, 64], zero-padded."""
        *lead, k, n = w.shape
        panels = -(-n // PANEL)
        w = jnp.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, panels * PANEL - n)])
        return cls(jnp.swapaxes(w.reshape(*lead, k, panels, PANEL), -3, -2), n)

    @classmethod
    def of_transposed(cls, w: jax.Array) -> "KernelWeight":
        """w [..., N, K], read as the [..., K, N] matrix it is the transpose of."""
        return cls(w, w.shape[-2], transposed=True)

    def array(self) -> jax.Array:
        """The plain [..., K, N] array."""
        if self.transposed:
            return jnp.swapaxes(self.w, -1, -2)
        *lead, panels, k, _ = self.w.shape
        return jnp.swapaxes(self.w, -3, -2).reshape(*lead, k, panels * PANEL)[..., :self.n]

    @property
    def shape(self):
        lead = self.w.shape[:-2] if self.transposed else self.w.shape[:-3]
        k = self.w.shape[-1] if self.transposed else self.w.shape[-2]
        return (*lead, k, self.n)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def dtype(self):
        return self.w.dtype

    def astype(self, dtype):
        """Casting for a float32 product keeps the stored weight: the kernel widens
        bfloat16 itself (exactly), so a cast would only double the bytes read."""
        return self if jnp.dtype(dtype) == jnp.float32 else self.array().astype(dtype)

    def __getitem__(self, index):
        """Index the leading axes only (a stack of heads, a head's layers)."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.ndim - 2 or any(i is Ellipsis for i in index):
            raise IndexError("a KernelWeight indexes its leading (stacking) axes only")
        return KernelWeight(self.w[index], self.n, self.transposed)


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """The mark, under `ATTENTION_KEY` in a backbone's parameters, that its decoding
    passes attend with the CPU kernel (`attention`). It holds no arrays: the pytree keeps
    it as static data, so it is part of every jitted function's cache key, as wrapped
    weights are."""


tree_util.register_static(AttentionKernel)
ATTENTION_KEY = "cpu_attention"


def attends_with_kernel(params) -> bool:
    """Whether `params` carry the mark of the attention kernel."""
    return isinstance(params, dict) and isinstance(params.get(ATTENTION_KEY), AttentionKernel)


def describe(params) -> str:
    """Which kernels decoding `params` runs: the CPU kernel's products (for how many
    matrices) and attention, or XLA's."""
    leaves = jax.tree.leaves(params, is_leaf=is_kernel_weight)
    wrapped = sum(is_kernel_weight(x) for x in leaves)
    parts = ([f"products of {wrapped} matrices"] if wrapped else []) + (
        ["attention"] if attends_with_kernel(params) else [])
    return f"CPU kernel ({', '.join(parts)})" if parts else "XLA's products"


def is_kernel_weight(x) -> bool:
    return isinstance(x, KernelWeight)


def active(params) -> bool:
    """Whether `params` carries kernel weights or the attention kernel's mark (the
    decoders' static choice)."""
    return attends_with_kernel(params) or any(
        is_kernel_weight(x) for x in jax.tree.leaves(params, is_leaf=is_kernel_weight))


def unwrap(params):
    """The same parameters with every `KernelWeight` replaced by its array and the
    attention kernel's mark dropped (XLA throughout)."""
    if attends_with_kernel(params):
        params = {k: v for k, v in params.items() if k != ATTENTION_KEY}
    return jax.tree.map(lambda x: x.array() if is_kernel_weight(x) else x, params,
                        is_leaf=is_kernel_weight)


# Matrices smaller than this many bytes as float32 stay with XLA: its emitted loops beat a
# library call there, and a step over such a model is bound by per-kernel overhead, not
# bandwidth. Counted as float32 for bfloat16 weights too: XLA converts those to float32 at
# every step before its product, which the kernel does not.
MIN_BYTES = 1 << 20


def wants(w) -> bool:
    """Whether the kernel should multiply by this [..., K, N] weight."""
    return (w.dtype in _KERNEL_DTYPES and w.ndim >= 2
            and w.shape[-1] * w.shape[-2] * 4 >= MIN_BYTES)


# The decoding layout's products, by parameter name (see `backbone.decoding_layout`).
BACKBONE_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down", "wq", "wk", "wv", "w_gate", "w_up")


def use_cpu_kernels(params, enabled: bool | None = None, head_dim: int | None = None):
    """Wrap a backbone's decoding-layout products (and an untied lm_head) of at least
    `MIN_BYTES` in `KernelWeight`, and mark it to attend with the kernel (`ATTENTION_KEY`)
    when its heads are `head_dim` wide and `attention_wants` that, when the kernels are
    available and every weight is on the CPU; otherwise (or with `enabled=False`) return
    the parameters unchanged, unwrapped. A backbone without any weight that large keeps
    XLA's products and attention throughout. Parameters
    already wrapped are returned as they are (`Medusa` lays out what `load_pretrained`
    already did: unpacking and packing again would hold a second copy of every weight)."""
    if enabled is not False and active(params) and available():
        return params
    params = unwrap(params)
    if enabled is False or not isinstance(params.get("layers"), (tuple, list)):
        return params
    leaves = jax.tree.leaves(params)
    if not all(isinstance(x, jax.Array) and x.is_fully_addressable
               and all(d.platform == "cpu" for d in x.devices()) for x in leaves):
        return params
    if not available():
        return params

    def wrap_layer(layer):
        return {k: KernelWeight.pack(v) if k in BACKBONE_WEIGHTS and wants(v) else v
                for k, v in layer.items()}

    out = dict(params, layers=tuple(wrap_layer(layer) for layer in params["layers"]))
    if "lm_head" in out and wants(out["lm_head"]):
        out["lm_head"] = KernelWeight.pack(out["lm_head"])
    if not active(out):
        return params
    if head_dim is not None and attention_wants(head_dim):
        out[ATTENTION_KEY] = AttentionKernel()
    return out


HEADS_WEIGHTS = ("w", "proj", "in_w", "res_w")  # Medusa's blocks and projection, Hydra's too


def wrap_heads(heads):
    """Medusa or Hydra heads with their block and projection weights multiplied by the
    kernel (inside a decoder whose backbone carries kernel weights)."""
    out = dict(heads)
    for name in HEADS_WEIGHTS:
        if name in out and not is_kernel_weight(out[name]) and wants(out[name]):
            out[name] = KernelWeight.pack(out[name])
    return out


def output_weight(embed: jax.Array) -> KernelWeight:
    """A tied embedding [V, H] as the output layer [H, V], read in place (no transpose)."""
    return KernelWeight.of_transposed(embed)


# ----------------------------------------------------------------------------- products


def _xla_product(x, w: KernelWeight):
    """x [G, M, K] @ w [G, K, N] -> [G, M, N] float32, by XLA."""
    return jnp.einsum("gmk,gkn->gmn", x, w.array().astype(x.dtype),
                      preferred_element_type=jnp.float32)


def _ffi_product(x, w: KernelWeight):
    g, m, _ = x.shape
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((g, m, w.n), jnp.float32))
    return call(x, w.w, transposed=w.transposed)


@jax.custom_jvp
def _product(x, w: KernelWeight):
    return jax.lax.platform_dependent(x, w, cpu=_ffi_product, default=_xla_product)


@_product.defjvp
def _product_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    dw = KernelWeight(dw.w.astype(x.dtype), w.n, w.transposed)
    return _product(x, w), _xla_product(dx, w) + _xla_product(x, dw)


def matmul(x: jax.Array, w) -> jax.Array:
    """x [..., K] @ w [K, N] (or, with `w` [G, K, N], x [G, ..., K] @ w[g] for each g:
    stacked heads; G = 1 shares one weight). `w` a `KernelWeight`: the CPU kernel, float32
    out; an array: XLA's product in x's dtype, as `x @ w.astype(x.dtype)`."""
    if not is_kernel_weight(w) or x.dtype != jnp.float32 or not available():
        arr = w.array() if is_kernel_weight(w) else w
        if arr.ndim == 2:
            return x @ arr.astype(x.dtype)
        if arr.shape[0] == 1:
            return jnp.einsum("g...k,kn->g...n", x, arr[0].astype(x.dtype))
        return jnp.einsum("g...k,gkn->g...n", x, arr.astype(x.dtype))
    k = x.shape[-1]
    if w.ndim == 2 or w.shape[0] == 1:  # one weight (shared by every group): one product
        if w.ndim == 2:
            w = KernelWeight(w.w[None], w.n, w.transposed)
        y = _product(x.reshape(1, -1, k), w)
        return y.reshape(*x.shape[:-1], w.n)
    g = w.shape[0]
    y = _product(x.reshape(g, -1, k), w)
    return y.reshape(g, *x.shape[1:-1], w.n)


# ----------------------------------------------------------------------------- attention


def attention_wants(head_dim: int) -> bool:
    """Whether the attention kernel pays at this head size: it reads a key 16 floats at a
    time; smaller heads (the embedded model's 8) are faster with XLA's loops."""
    return head_dim % 16 == 0


def _xla_attention(q, k, v, mask):
    """q [H, R, D] (scaled), k, v [H, W, D], mask [B, T, W] -> [H, R, D] float32, by XLA:
    row r of KV head h is token r % T of batch row h // (H / B)."""
    b, t, w = mask.shape
    h, r, d = q.shape
    s = jnp.einsum("hrd,hwd->hrw", q, k, preferred_element_type=jnp.float32)
    s = s.reshape(b, h // b, r // t, t, w)
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(s, axis=-1).reshape(h, r, w)
    return jnp.einsum("hrw,hwd->hrd", probs, v.astype(jnp.float32))


def _ffi_attention(q, k, v, mask):
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k, v, mask)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention of a few query rows over a per-layer cache, by the CPU kernel (XLA's on
    other platforms, or for anything but float32). q [H, R, D], already scaled, H = B * KVH
    (each batch row's KV heads), R = G * T (the query heads sharing a KV head times the T
    new tokens; row r is token r % T); k, v [H, W, D]; mask [B, T, W] bool. Returns
    [H, R, D] float32; a row the mask hides everything from gets zeros."""
    if not (q.dtype == k.dtype == v.dtype == jnp.float32) or not available():
        return _xla_attention(q, k, v, mask)
    return jax.lax.platform_dependent(q, k, v, mask.astype(bool), cpu=_ffi_attention,
                                      default=_xla_attention)
