"""The notebook API: load a model (and heads), then generate for a list of prompts.

    from medusa_jax import Medusa
    m = Medusa.load(heads="runs/medusa1-.../heads")      # default model: embedded stories260K
    for g in m.generate(["Once upon a time"], max_new_tokens=64):
        print(g.text, g.tokens_per_step)

Batches have a fixed size (the last one is padded) and prompts are bucketed, so repeated
calls reuse the compiled decoder. The sampling values, the seed and `max_new_tokens` are
runtime values: a call compiles only for a new drafter, tree, batch size, prompt bucket,
length bucket (`max_new_tokens` rounded up to a power of two) or the first sampled call
after greedy ones (greedy has a program of its own, with nothing but argmax in it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from medusa_jax.decoding.decode import (
    check_fits,
    generate,
    length_bucket,
    medusa_generate,
    pad_prompts,
)
from medusa_jax.decoding.sampling import MODES, Rows
from medusa_jax.decoding.sampling import check as check_sampling
from medusa_jax.decoding.tree import DEFAULT_TREE, DynamicTree, Tree, check_size
from medusa_jax.drafters import registry, resolve, shipped
from medusa_jax.drafters.formats import bundled_model, load_heads
from medusa_jax.model.backbone import Params, decoding_layout, head_units, param_axes, param_specs
from medusa_jax.model.config import ModelConfig, stop_tokens
from medusa_jax.model.weights import (
    check_headers,
    default_model_dir,
    load_pretrained,
    tokenizer_files,
)
from medusa_jax.runtime import assets, compile_cache, hub, sharding, timing
from medusa_jax.text import tokenizer as text_tokenizer
from medusa_jax.text.encoder import TextEncoder


@dataclasses.dataclass
class Generation:
    """One prompt's result.

    - `prompt`: the prompt as given (text or token ids).
    - `text`: the generated continuation only, **without the prompt** (decoded with the
      prompt and cut after it, so a leading space survives; special tokens skipped);
      `prompt + text` is the whole story, as `infer.generate` prints it.
    - `token_ids`, `new_tokens`: the new token ids and how many (an EOS that ended the row
      is included in both).
    - `steps`: decoding steps, i.e. forward passes of the model after the prompt's prefill.
      Plain decoding emits one token per step; a Medusa step emits 1 + the number of
      drafted tokens the model accepted on the tree's best path.
    - `tokens_per_step`: `new_tokens / steps` (1.0 for plain decoding).
    - `accept_hist`: `accept_hist[n]` is how many steps emitted n tokens (n - 1 accepted
      drafts plus the model's own next token; a last step cut by `max_new_tokens` or an
      EOS counts the tokens it kept). Its length is the tree's depth + 2, so
      `sum(accept_hist) == steps` and `sum(n * c for n, c in enumerate(accept_hist)) ==
      new_tokens`. E.g. `[0, 2, 6, 2, 11]`: 21 steps, 2 of them emitted 1 token, 6 two, 2
      three and 11 four (64 tokens). Plain decoding: `[0, steps, 0]`.
    - `seconds`: decoding time of the batch this prompt ran in (compile excluded);
      `compile_seconds`: compiling its decoder first (0 when already compiled).
    """

    prompt: str | list[int]
    text: str  # the continuation, without the prompt
    token_ids: list[int]  # the new tokens only (an EOS that ended the row is included)
    new_tokens: int
    steps: int  # decoding steps (forward passes after prefill)
    tokens_per_step: float
    accept_hist: list[int]  # accept_hist[n]: steps that emitted n tokens
    seconds: float  # decoding time of the batch this prompt ran in (compile excluded)
    compile_seconds: float = 0.0  # compiling its decoder first (0 when already compiled)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerateTiming(timing.Timed):
    """`Medusa.last_timing`: compile and decode time of the last `generate` call, with what
    it decoded. `line()` is the summary `infer.generate` prints, in the form

        1 prompt, medusa stories260K_cpu greedy: compiled in 0.91 s (from the compilation
        cache); 128 tokens in 0.12 s (1,110 tokens/s); 3.20 tokens/step (40 steps)

    (an `infer.generate --heads default` run)."""

    label: str = ""  # "1 prompt, medusa stories260K_cpu greedy"
    steps: int = 0

    def line(self) -> str:
        text = super().line()
        if self.label:
            text = f"{self.label}: {text}"
        if self.steps:
            text += f"; {self.tokens / self.steps:.2f} tokens/step ({self.steps} steps)"
        return text


def default_heads_dir() -> Path:
    """The heads trained by the default `python -m train.medusa1`, shipped for stories260K."""
    return assets.heads_dir()


def shipped_heads_dir(name: str) -> Path:
    """The folder of a drafter shipped for stories260K by the name `heads=` takes (one of
    `drafters.shipped.NAMES`: "default", "hydra", "eagle")."""
    return shipped.folder(name)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_arg(name: str, value, minimum: int | None = None) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {_clip(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _float_arg(name: str, value) -> float:
    if not (_is_int(value) or isinstance(value, (float, np.floating))):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {_clip(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return float(value)


def _clip(x, n: int = 40) -> str:
    r = repr(x)
    return r if len(r) <= n else r[:n] + "..."


def decode_shardings(cfg: ModelConfig, mesh, heads: Params | None = None):
    """(backbone shardings, heads shardings or None) for tensor-parallel decoding on `mesh`:
    Megatron-style over the `model` axis, replicated over the batch axes."""
    mesh = sharding.make_mesh(mesh)
    bb = sharding.decode_shardings(param_axes(cfg), param_specs(cfg), mesh, head_units(cfg))
    hd = None if heads is None else sharding.decode_shardings(registry.axes_of(heads), heads, mesh)
    return bb, hd


check_model_axis = sharding.check_model_axis  # the one rule, shared with training


def shard_for_decoding(cfg: ModelConfig, params: Params, heads: Params | None, mesh):
    """Place a backbone (and heads) on `mesh` for decoding; each device receives only its
    shards. Returns (params, heads)."""
    check_model_axis(cfg, mesh)
    bb, hd = decode_shardings(cfg, mesh, heads)
    params = jax.tree.map(sharding.put, params, bb)
    if heads is not None:
        heads = jax.tree.map(sharding.put, heads, hd)
    return params, heads


class Medusa:
    """A backbone, its tokenizer and (optionally) a drafter of any kind (`drafter_kind`);
    with a `mesh`, placed for tensor-parallel decoding (see `sharding`), and `generate` runs
    under it. Also exported as `Decoder`: the name says what it is for any kind of drafter."""

    def __init__(self, cfg: ModelConfig, params: Params, tokenizer, heads: Params | None = None,
                 model_dir: Path | None = None, default_tree: str | Path = DEFAULT_TREE,
                 mesh=None):
        self.cfg, self.params, self.tokenizer, self.heads = cfg, params, tokenizer, heads
        self.model_dir = model_dir
        self.default_tree = default_tree
        self.eos = stop_tokens(cfg, tokenizer)
        self._text_encoder = None  # built on first use: copying a large tokenizer takes time
        self.last_timing = GenerateTiming()  # compile and decode time of the last `generate`
        self.verbose = True  # the "compiling the decoder (first call) ..." line on stderr
        self._compiled: set = set()  # the decoder calls compiled so far
        self.ngram = None  # n-gram chain nodes merged into the drafter's tree (None: none)
        self.ngram_sizes = (None, None)  # (max_n, min_n) of those n-grams (None: default)
        self.mesh = None if mesh is None else sharding.make_mesh(mesh)
        if self.mesh is not None:
            self.params, self.heads = shard_for_decoding(cfg, params, heads, self.mesh)
        else:
            self.params = decoding_layout(cfg, params)

    @classmethod
    def load(cls, model: str | Path | None = None, heads: str | Path | None = None, *,
             param_dtype: str = "float32", compute_dtype: str = "float32",
             heads_dtype: str = "float32", mesh=None, ngram: bool | int | None = None,
             ngram_max: int | None = None, ngram_min: int | None = None) -> "Medusa":
        """`model`: a Hugging Face directory (default: the embedded stories260K).
        `heads`: a heads artifact (directory or .safetensors) from `train.medusa1` or
        `train.hydra` (the kind is read from it), heads in another layout (`drafters.formats`:
        the reference's, vLLM's, a Medusa-2 model folder, whose backbone is then the default
        `model`, a published EAGLE-3 drafter), or "default" / "hydra" / "eagle" for the
        embedded model's Medusa heads / Hydra heads / EAGLE-3 drafter.
        `heads_dtype`: "bfloat16" stores the heads' weight matrices in bfloat16 (half what a
        step reads of them; they still compute in `compute_dtype`, and only what they
        propose can change, not what is emitted).
        `mesh`: "data=2,model=4" (or a `jax.sharding.Mesh`) for tensor-parallel decoding; the
        tensors are read into host memory and each device receives only its shards.
        `heads="ngram"`: the n-gram (prompt-lookup) drafter, no files, any model; it decodes
        a chain unless `generate` is given a tree. `ngram=True` (or N chain nodes): merge
        n-gram drafts into the loaded drafter's tree in every `generate` (docs/ngram.md).
        `ngram_max` / `ngram_min`: the n-gram lengths looked up (default 4 / 1).
        Turns on the persistent compilation cache (`compile_cache`) unless it is off."""
        compile_cache.enable()
        for name, value in (("model", model), ("heads", heads)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name} must be a path (str or Path) or None, got "
                                f"{type(value).__name__} {_clip(value)}")
        for name, value in (("param_dtype", param_dtype), ("compute_dtype", compute_dtype),
                            ("heads_dtype", heads_dtype)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str such as 'float32' or 'bfloat16', got "
                                f"{type(value).__name__} {_clip(value)}")
        registry.check_heads_dtype(heads_dtype, "heads_dtype")
        ngram = _ngram_arg(ngram)
        shipped.check_ngram(heads, ngram, ngram_max, ngram_min, names=_NGRAM_ARGS)
        fileless = shipped.fileless(heads)
        if mesh is not None:
            mesh = sharding.make_mesh(mesh)  # a bad mesh fails before anything is read
        model = hub.local(model, "model")
        if heads not in assets.SHIPPED_HEADS and not fileless:
            heads = hub.local(heads, "heads", hub.HEADS_FILES)
        if model is None and heads is not None and heads not in assets.SHIPPED_HEADS and \
                not fileless and bundled_model(heads):
            model = heads
        model_dir = Path(model) if model is not None else default_model_dir()
        # cheap checks first, in this order: config.json's fields, that there is a
        # tokenizer, the weights' headers (truncated, garbage); then the weights (NaN, inf),
        # and the tokenizer last, as transformers may import PyTorch (seconds). A missing
        # folder is reported by load_pretrained.
        if model_dir.is_dir():
            context = ModelConfig.from_dir(model_dir).max_position_embeddings  # named first
            shipped.check_ngram(heads, ngram, ngram_max, ngram_min, context, _NGRAM_ARGS)
            tokenizer_files(model_dir)
            check_headers(model_dir)
        if heads in assets.SHIPPED_HEADS:
            if model is not None:
                raise ValueError(f'heads="{heads}" is only defined for the embedded model')
            heads = assets.shipped_heads_dir(heads)
        # with a mesh, read into host memory first: no accelerator holds a full copy
        host = jax.default_device(jax.devices("cpu")[0]) if mesh is not None else \
            contextlib.nullcontext()
        with host:
            # on one device, the decoding layout straight from the files (no stacked copy)
            cfg, params = load_pretrained(model_dir, param_dtype=param_dtype,
                                          compute_dtype=compute_dtype,
                                          decoding_layout=mesh is None)
            if fileless:
                shipped.check_ngram(heads, ngram, ngram_max, ngram_min,
                                    cfg.max_position_embeddings, _NGRAM_ARGS)
                head_params = registry.without_files(heads, max_n=ngram_max, min_n=ngram_min)
            else:
                head_params = load_heads(heads, cfg, base_model=model_dir,
                                         embed=params["embed"])[0] if heads is not None else None
            if head_params is not None and heads_dtype != "float32":
                head_params = registry.with_weight_dtype(head_params, heads_dtype)
        tokenizer = text_tokenizer.load_tokenizer(model_dir)
        tree = registry.default_tree_of(head_params) if head_params is not None else None
        m = cls(cfg, params, tokenizer, head_params, model_dir,
                tree or assets.default_tree(model), mesh=mesh)
        m.ngram, m.ngram_sizes = ngram, (ngram_max, ngram_min)
        return m

    @property
    def drafter_kind(self) -> str | None:
        """The kind of the loaded drafter (`drafters.registry`; None without heads)."""
        if self.heads is None:
            return None
        return registry.kind_of(self.heads)

    def under_mesh(self):
        """The context decoding runs in: `jax.set_mesh(self.mesh)` (the KV cache is then
        created sharded), or nothing without a mesh."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def encode(self, prompt: str | list[int], where: str = "prompt") -> list[int]:
        """Text -> token ids; a list of token ids is checked against the vocabulary.
        Text is text, as the server reads it (`text.encoder`): a "</s>" in it is those
        characters, not EOS; give token ids to put a control token in a prompt.
        Raises TypeError / ValueError naming `where` (e.g. "prompts[2]")."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError(f"{where} is text but this model has no tokenizer; "
                                f"give token ids (a list of ints)")
            if self._text_encoder is None:
                self._text_encoder = TextEncoder(self.tokenizer)
            ids = self._text_encoder.prompt(prompt)
            if not ids:
                raise ValueError(f"{where} {_clip(prompt)} encodes to no tokens")
            return ids
        if isinstance(prompt, (bytes, bytearray)):
            raise TypeError(f"{where} is bytes ({_clip(prompt)}); give text as str "
                            f"(.decode() it) or token ids as a list of ints")
        if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"{where} must be a str or a list of token ids, got "
                            f"{type(prompt).__name__} {_clip(prompt)}")
        if not prompt:
            raise ValueError(f"{where} is an empty list of token ids")
        vocab = self.cfg.vocab_size
        for j, t in enumerate(prompt):
            if not _is_int(t):
                raise TypeError(f"{where}[{j}] must be an int token id, got "
                                f"{type(t).__name__} {_clip(t)}")
            if not 0 <= t < vocab:
                raise ValueError(f"{where}[{j}] = {t} is not a token id of this model "
                                 f"(0..{vocab - 1})")
        return [int(t) for t in prompt]

    def _continuation(self, prompt_ids: list[int], new_ids: list[int]) -> str:
        """Decode prompt + new tokens together (SentencePiece drops a leading space when
        new tokens are decoded alone) and return the part after the prompt."""
        if self.tokenizer is None:
            return ""
        dec = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        full, head = dec(prompt_ids + new_ids), dec(prompt_ids)
        return full[len(head):] if full.startswith(head) else dec(new_ids)

    def tree(self, spec: str | Path | Tree | DynamicTree | None = None) -> Tree | DynamicTree:
        """A tree checked against the loaded heads (depth) and the vocabulary (ranks)."""
        k = registry.depth_of(self.heads) if self.heads is not None else None
        try:
            return self._tree(spec, k)
        except ValueError as e:  # the tree module's message names Medusa heads
            name = registry.WHAT[self.drafter_kind] if self.heads is not None else None
            if name is not None and "Medusa heads" in str(e):
                raise ValueError(str(e).replace("Medusa heads", name)) from None
            raise

    def _tree(self, spec, k):
        spec = self.default_tree if spec is None else spec
        context = self.cfg.max_position_embeddings  # checked before a spec is built
        if isinstance(spec, DynamicTree):  # its pool is not fed, only the chosen nodes
            check_size(spec.name, spec.size, 1, context=context)
            return DynamicTree(Tree.from_paths(spec.pool.paths_ranks, k, spec.pool.top_k,
                                               spec.pool.name, vocab_size=self.cfg.vocab_size),
                               spec.size, spec.name)
        if isinstance(spec, Tree):
            return Tree.from_paths(spec.paths_ranks, k, spec.top_k, spec.name,
                                   vocab_size=self.cfg.vocab_size, context=context)
        if spec is not None and not isinstance(spec, (str, os.PathLike)):
            raise TypeError(f"tree must be a tree name, a JSON file path or a Tree, got "
                            f"{type(spec).__name__} {_clip(spec)}")
        return Tree.load(spec, num_heads=k, vocab_size=self.cfg.vocab_size, context=context)

    def generate(self, prompts: list[str | list[int]] | str, *, max_new_tokens: int = 128,
                 mode: str = "greedy", tree: str | Path | Tree | None = None,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 epsilon: float = 0.09, delta: float = 0.3, seed: int = 0,
                 batch_size: int = 8, medusa: bool | None = None,
                 ngram: bool | int | None = None) -> list[Generation]:
        """Generate for every prompt. Medusa decoding when heads are loaded (or `medusa=True`),
        plain decoding otherwise. Returns one `Generation` per prompt, in order.

        Every argument is checked before anything is compiled: a bad one raises one-line
        TypeError / ValueError naming it (and the prompt's index). `mode` (greedy or not),
        `tree`, the batch size (`min(batch_size, len(prompts))`), the longest prompt's
        bucket and `max_new_tokens`' bucket (`length_bucket`) choose the compiled program;
        temperature, top-k, top-p, epsilon, delta, the seed and `max_new_tokens` within its
        bucket, and moving between "typical" and "rejection", compile nothing.
        `ngram`: True (or N chain nodes) merges n-gram drafts into the drafter's tree, False
        decodes without; None: as `Medusa.load(ngram=...)` said."""
        if isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, (bytes, bytearray)):
            raise TypeError(f"prompts is bytes ({_clip(prompts)}); give text as str "
                            f"(.decode() it) or token ids as a list of ints")
        elif isinstance(prompts, np.ndarray) and prompts.ndim in (1, 2):
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        elif not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str or a list of prompts (str, or lists of "
                            f"token ids), got {type(prompts).__name__} {_clip(prompts)}")
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        if all(_is_int(p) for p in prompts):
            raise TypeError(f"prompts[0] is an int: give one token-id prompt as a list inside "
                            f"the list, e.g. [{_clip(list(prompts), 30)}]")
        max_new_tokens = _int_arg("max_new_tokens", max_new_tokens, 1)
        if not isinstance(mode, str):
            raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        temperature, top_p = _float_arg("temperature", temperature), _float_arg("top_p", top_p)
        epsilon, delta = _float_arg("epsilon", epsilon), _float_arg("delta", delta)
        top_k = _int_arg("top_k", top_k, 0)
        check_sampling(mode, temperature, top_k, top_p, epsilon, delta)  # the decoder's rules
        if top_k > self.cfg.vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size "
                             f"({self.cfg.vocab_size}), got {top_k}")
        seed = _int_arg("seed", seed)
        if not -2**63 <= seed < 2**63:  # what jax.random.key takes
            raise ValueError(f"seed must be in -2**63..2**63-1, got {seed}")
        batch_size = _int_arg("batch_size", batch_size, 1)
        if medusa is not None and not isinstance(medusa, (bool, np.bool_)):
            raise TypeError(f"medusa must be True, False or None, got {type(medusa).__name__} "
                            f"{_clip(medusa)}")
        use_medusa = self.heads is not None if medusa is None else bool(medusa)
        if use_medusa and self.heads is None:
            raise ValueError("medusa=True needs heads: Medusa.load(..., heads=PATH)")
        ngram = self.ngram if ngram is None else (_ngram_arg(ngram) if ngram is not False
                                                  else None)
        if ngram is not None:
            self._check_merge(ngram, use_medusa)
        if mode == "greedy":
            temperature = 1.0  # unused
        the_tree = self.tree(tree) if use_medusa else None
        heads = self.heads
        if ngram is not None:
            # the drafter built again is equal to the last one: its decoder is compiled once
            merged = resolve.resolve(heads, the_tree, ngram, self.ngram_sizes)
            heads, the_tree = merged.heads, merged.tree
        encoded = [self.encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        longest = max(len(e) for e in encoded)
        tree_tokens = the_tree.num_nodes if the_tree else 0
        check_fits(self.cfg, longest, max_new_tokens, tree_tokens)
        batch_size = min(batch_size, len(encoded))
        key = jax.random.key(seed)
        results: list[Generation] = []
        total = timing.Timed()
        steps_total = 0
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start:start + batch_size]
            padded = chunk + [chunk[-1]] * (batch_size - len(chunk))  # fixed batch shape
            tokens, lengths = pad_prompts(padded)
            key, sub = jax.random.split(key)
            if use_medusa:
                fn, args = medusa_generate, (self.params, heads, self.cfg)
                kw = dict(tree=the_tree)
            else:
                fn, args, kw = generate, (self.params, self.cfg), {}
            args += (tokens, lengths, sub)
            # sampling values and the token limit are runtime arrays: the program depends on
            # the batch and prompt buckets, the tree, greedy or not, and the limit's bucket
            rows = Rows.values(len(padded), max_new_tokens, self.eos, mode=mode,
                               temperature=temperature, top_k=top_k, top_p=top_p,
                               epsilon=epsilon, delta=delta)
            room = self.cfg.max_position_embeddings - tokens.shape[1] - tree_tokens - 1
            bucket = length_bucket(max_new_tokens, room)
            kw.update(max_new_tokens=bucket, rows=rows)
            with self.under_mesh():
                program = (fn.__name__, tokens.shape, the_tree, rows.modes, bucket)
                if program in self._compiled:
                    compiled = timing.Compile()
                else:
                    if self.verbose:
                        print("compiling the decoder (first call) ...", end="",
                              file=sys.stderr, flush=True)
                    compiled = timing.precompile(fn, *args, **kw)  # timed apart from decoding
                    if self.verbose:
                        cached = " (from the compilation cache)" if compiled.cached else ""
                        print(f" {timing.fmt_seconds(compiled.seconds)}{cached}",
                              file=sys.stderr, flush=True)
                    self._compiled.add(program)
                t0 = time.perf_counter()
                out = fn(*args, **kw)
            out = sharding.to_host(out)
            seconds = time.perf_counter() - t0
            total += timing.Timed(compiled, seconds, int(np.sum(out.num_new[:len(chunk)])))
            for i in range(len(chunk)):
                n = int(out.num_new[i])
                ids = [int(t) for t in np.asarray(out.tokens[i, :n])]
                steps = int(out.steps[i])
                steps_total += steps
                text = self._continuation(chunk[i], ids)
                results.append(Generation(
                    prompt=prompts[start + i], text=text, token_ids=ids, new_tokens=n,
                    steps=steps, tokens_per_step=n / max(steps, 1),
                    accept_hist=[int(x) for x in out.accept_hist[i]], seconds=seconds,
                    compile_seconds=compiled.seconds))
        n = len(prompts)
        decoding = f"{self.drafter_kind} {the_tree.name}" if use_medusa else "plain"
        if ngram is not None:  # "medusa+ngram stories260K_cpu+ngram3"
            decoding = f"{heads.drafter.name} {the_tree.name}"
        self.last_timing = GenerateTiming(total.compile, total.seconds, total.tokens,
                                          label=f"{n} prompt{'s' * (n != 1)}, {decoding} "
                                                f"{mode}", steps=steps_total)
        return results

    def _check_merge(self, ngram: int, use_medusa: bool) -> None:
        if not use_medusa:
            raise ValueError("ngram merges n-gram drafts into a drafter's tree; plain "
                             "decoding (no heads, or medusa=False) drafts nothing")
        shipped.check_ngram(self.drafter_kind, ngram, *self.ngram_sizes,
                            self.cfg.max_position_embeddings, _NGRAM_ARGS)


_NGRAM_ARGS = shipped.API_ARGS  # the arguments, as `shipped.check_ngram` names them


def _ngram_arg(value) -> int | None:
    """`ngram=`: None / False (not merged), True (the measured default) or chain nodes."""
    if value is None or value is False:
        return None
    if value is True:
        return shipped.NGRAM_MERGED_DEFAULT
    if not _is_int(value):
        raise TypeError(f"ngram must be True, False, None or a number of chain nodes, got "
                        f"{type(value).__name__} {_clip(value)}")
    return int(value)


Decoder = Medusa  # the drafter-neutral name: a drafter of any kind
