"""The notebook API: load a model (and heads), then generate for a list of prompts.

    from medusa_jax import Medusa
    m = Medusa.load(heads="runs/medusa1-.../heads")      # default model: embedded stories260K
    for g in m.generate(["Once upon a time"], max_new_tokens=64):
        print(g.text, g.tokens_per_step)

Batches have a fixed size (the last one is padded) and prompts are bucketed, so repeated
calls reuse the compiled decoder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np

from medusa_jax import assets, sharding
from medusa_jax.acceptance import Sampling
from medusa_jax.backbone import Params, head_units, param_axes, param_specs
from medusa_jax.config import ModelConfig, stop_tokens
from medusa_jax.decode import check_fits, generate, medusa_generate, pad_prompts
from medusa_jax.heads import heads_axes, heads_config_of, load_heads
from medusa_jax.heads_formats import is_medusa2_model
from medusa_jax.tree import DEFAULT_TREE, Tree
from medusa_jax.weights import default_model_dir, load_pretrained


@dataclasses.dataclass
class Generation:
    """One prompt's result."""

    prompt: str | list[int]
    text: str
    token_ids: list[int]  # the new tokens only (an EOS that ended the row is included)
    new_tokens: int
    steps: int  # decoding steps (forward passes after prefill)
    tokens_per_step: float
    accept_hist: list[int]  # accept_hist[n]: steps that emitted n tokens
    seconds: float  # wall time of the batch this prompt ran in (compile excluded if warm)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def default_heads_dir() -> Path:
    """The heads trained by the default `python -m train.medusa1`, shipped for stories260K."""
    return assets.heads_dir()


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def decode_shardings(cfg: ModelConfig, mesh, heads: Params | None = None):
    """(backbone shardings, heads shardings or None) for tensor-parallel decoding on `mesh`:
    Megatron-style over the `model` axis, replicated over the batch axes."""
    mesh = sharding.make_mesh(mesh)
    bb = sharding.decode_shardings(param_axes(cfg), param_specs(cfg), mesh, head_units(cfg))
    hd = None if heads is None else sharding.decode_shardings(heads_axes(heads), heads, mesh)
    return bb, hd


def check_model_axis(cfg: ModelConfig, mesh):
    """A `model` axis that splits none of the backbone's big dimensions would only copy the
    model to every device: refuse it in one line."""
    m = sharding.make_mesh(mesh).shape["model"]
    if m == 1:
        return
    if cfg.vocab_size % m and cfg.intermediate_size % m and cfg.num_heads % m:
        raise ValueError(f"mesh model={m} splits none of this model's tensors (vocabulary "
                         f"{cfg.vocab_size}, MLP width {cfg.intermediate_size}, "
                         f"{cfg.num_heads} attention heads): pick a model size that divides "
                         f"them")


def shard_for_decoding(cfg: ModelConfig, params: Params, heads: Params | None, mesh):
    """Place a backbone (and heads) on `mesh` for decoding; each device receives only its
    shards. Returns (params, heads)."""
    check_model_axis(cfg, mesh)
    bb, hd = decode_shardings(cfg, mesh, heads)
    params = jax.tree.map(lambda x, s: sharding.put(jax.device_get(x), s), params, bb)
    if heads is not None:
        heads = jax.tree.map(lambda x, s: sharding.put(jax.device_get(x), s), heads, hd)
    return params, heads


class Medusa:
    """A backbone, its tokenizer and (optionally) Medusa heads; with a `mesh`, placed for
    tensor-parallel decoding (see `sharding`), and `generate` runs under it."""

    def __init__(self, cfg: ModelConfig, params: Params, tokenizer, heads: Params | None = None,
                 model_dir: Path | None = None, default_tree: str | Path = DEFAULT_TREE,
                 mesh=None):
        self.cfg, self.params, self.tokenizer, self.heads = cfg, params, tokenizer, heads
        self.model_dir = model_dir
        self.default_tree = default_tree
        self.eos = stop_tokens(cfg, tokenizer)
        self.mesh = None if mesh is None else sharding.make_mesh(mesh)
        if self.mesh is not None:
            self.params, self.heads = shard_for_decoding(cfg, params, heads, self.mesh)

    @classmethod
    def load(cls, model: str | Path | None = None, heads: str | Path | None = None, *,
             param_dtype: str = "float32", compute_dtype: str = "float32",
             mesh=None) -> "Medusa":
        """`model`: a Hugging Face directory (default: the embedded stories260K).
        `heads`: a heads artifact (directory or .safetensors) from `train.medusa1`, heads in
        another layout (`heads_formats`: the reference's, vLLM's, a Medusa-2 model folder, whose
        backbone is then the default `model`), or "default" for the embedded model's heads.
        `mesh`: "data=2,model=4" (or a `jax.sharding.Mesh`) for tensor-parallel decoding; the
        tensors are read into host memory and each device receives only its shards."""
        if mesh is not None:
            mesh = sharding.make_mesh(mesh)  # a bad mesh fails before anything is read
        if model is None and heads not in (None, "default") and is_medusa2_model(heads):
            model = heads
        model_dir = Path(model) if model is not None else default_model_dir()
        if heads == "default":
            if model is not None:
                raise ValueError('heads="default" is only defined for the embedded model')
            heads = default_heads_dir()
        # with a mesh, read into host memory first: no accelerator holds a full copy
        host = jax.default_device(jax.devices("cpu")[0]) if mesh is not None else \
            contextlib.nullcontext()
        with host:
            cfg, params = load_pretrained(model_dir, param_dtype=param_dtype,
                                          compute_dtype=compute_dtype)
            head_params = load_heads(heads, cfg, base_model=model_dir)[0] \
                if heads is not None else None
        return cls(cfg, params, _load_tokenizer(model_dir), head_params, model_dir,
                   assets.default_tree(model), mesh=mesh)

    def under_mesh(self):
        """The context decoding runs in: `jax.set_mesh(self.mesh)` (the KV cache is then
        created sharded), or nothing without a mesh."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError(f"prompt {prompt!r} encodes to no tokens")
            return ids
        return [int(t) for t in prompt]

    def _continuation(self, prompt_ids: list[int], new_ids: list[int]) -> str:
        """Decode prompt + new tokens together (SentencePiece drops a leading space when
        new tokens are decoded alone) and return the part after the prompt."""
        if self.tokenizer is None:
            return ""
        dec = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        full, head = dec(prompt_ids + new_ids), dec(prompt_ids)
        return full[len(head):] if full.startswith(head) else dec(new_ids)

    def tree(self, spec: str | Path | Tree | None = None) -> Tree:
        if isinstance(spec, Tree):
            return spec
        k = heads_config_of(self.heads).num_heads if self.heads is not None else None
        return Tree.load(spec or self.default_tree, num_heads=k)

    def generate(self, prompts: list[str | list[int]] | str, *, max_new_tokens: int = 128,
                 mode: str = "greedy", tree: str | Path | Tree | None = None,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 epsilon: float = 0.09, delta: float = 0.3, seed: int = 0,
                 batch_size: int = 8, medusa: bool | None = None) -> list[Generation]:
        """Generate for every prompt. Medusa decoding when heads are loaded (or `medusa=True`),
        plain decoding otherwise. Returns one `Generation` per prompt, in order."""
        if isinstance(prompts, (str, bytes)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        use_medusa = self.heads is not None if medusa is None else medusa
        if use_medusa and self.heads is None:
            raise ValueError("medusa=True needs heads: Medusa.load(..., heads=PATH)")
        if mode == "greedy":
            temperature = 1.0  # unused
        sampling = Sampling(mode=mode, temperature=temperature, top_k=top_k, top_p=top_p,
                            epsilon=epsilon, delta=delta)
        the_tree = self.tree(tree) if use_medusa else None
        encoded = [self.encode(p) for p in prompts]
        longest = max(len(e) for e in encoded)
        check_fits(self.cfg, longest, max_new_tokens, the_tree.num_nodes if the_tree else 1)
        batch_size = max(1, min(batch_size, len(encoded)))
        key = jax.random.key(seed)
        results: list[Generation] = []
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start:start + batch_size]
            padded = chunk + [chunk[-1]] * (batch_size - len(chunk))  # fixed batch shape
            tokens, lengths = pad_prompts(padded)
            key, sub = jax.random.split(key)
            t0 = time.perf_counter()
            with self.under_mesh():
                if use_medusa:
                    out = medusa_generate(self.params, self.heads, self.cfg, tokens, lengths,
                                          sub, tree=the_tree, sampling=sampling,
                                          max_new_tokens=max_new_tokens, eos=self.eos)
                else:
                    out = generate(self.params, self.cfg, tokens, lengths, sub,
                                   sampling=sampling, max_new_tokens=max_new_tokens,
                                   eos=self.eos)
            out = sharding.to_host(out)
            seconds = time.perf_counter() - t0
            for i in range(len(chunk)):
                n = int(out.num_new[i])
                ids = [int(t) for t in np.asarray(out.tokens[i, :n])]
                steps = int(out.steps[i])
                text = self._continuation(chunk[i], ids)
                results.append(Generation(
                    prompt=prompts[start + i], text=text, token_ids=ids, new_tokens=n,
                    steps=steps, tokens_per_step=n / max(steps, 1),
                    accept_hist=[int(x) for x in out.accept_hist[i]], seconds=seconds))
        return results
