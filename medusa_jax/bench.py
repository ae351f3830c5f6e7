"""Benchmark building blocks: timed decoding runs, the transformers baseline, step-time curves.

Everything is measured in one process on the same prompts; compile and warm-up are excluded
(each timed function runs once before the clock starts) and the median of several repetitions
is reported. Speed claims are ratios against a baseline measured in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.acceptance import Sampling
from medusa_jax.backbone import KVCache, causal_mask, forward, init_params
from medusa_jax.config import ModelConfig, as_dtype
from medusa_jax.decode import generate, medusa_generate, pad_prompts
from medusa_jax.tree import Tree

# Named backbone shapes for random-weight step-time measurements.
SHAPES = {
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096,
                       intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
                       head_dim=128, max_position_embeddings=4096),
    "llama-2-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120,
                        intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40,
                        head_dim=128, max_position_embeddings=4096),
    "llama-2-70b": dict(model_type="llama", vocab_size=32000, hidden_size=8192,
                        intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                        head_dim=128, max_position_embeddings=4096),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, max_position_embeddings=8192, rope_theta=500000.0),
    # llama2.c's stories110M shape: the mid size that runs on a 2-core CPU
    "llama-110m": dict(model_type="llama", vocab_size=32000, hidden_size=768,
                       intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=12,
                       head_dim=64, max_position_embeddings=1024),
    "llama-15m": dict(model_type="llama", vocab_size=32000, hidden_size=288,
                      intermediate_size=768, num_layers=6, num_heads=6, num_kv_heads=6,
                      head_dim=48, max_position_embeddings=1024),
}


def random_backbone(shape: str, dtype: str = "bfloat16", seed: int = 0):
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = ModelConfig(**SHAPES[shape], param_dtype=dtype, compute_dtype=dtype)
    return cfg, init_params(cfg, jax.random.key(seed))


def read_prompt_file(path: str | Path) -> list[tuple[str, str | None]]:
    """(prompt, category) pairs: text lines, or JSONL with `prompt` or `turns` (first turn)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such prompts file")
    out = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{n}: invalid JSON ({e.msg})") from None
            text = rec.get("prompt") or (rec.get("turns") or [None])[0]
            if not isinstance(text, str):
                raise ValueError(f"{file}:{n}: no 'prompt' or 'turns' field")
            out.append((text, rec.get("category")))
        else:
            out.append((line, None))
    if not out:
        raise ValueError(f"{file}: no prompts in it")
    return out


def _median_time(fn, reps: int) -> tuple[float, object]:
    result = jax.block_until_ready(fn())  # compile + warm-up, not timed
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        result = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


@dataclasses.dataclass
class RunResult:
    name: str
    batch_size: int
    seconds: float  # median wall time over all prompts
    new_tokens: int
    steps: int  # decoding steps, summed over rows
    rows: list[list[int]]  # new tokens per prompt
    per_row_steps: list[int]
    loop_steps: int = 0  # iterations of the decode loops (a batch runs until its slowest row)

    @property
    def step_seconds(self) -> float:
        return self.seconds / max(self.loop_steps, 1)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(self.steps, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds


def run_decoder(params, cfg: ModelConfig, prompts: list[list[int]], *, batch_size: int,
                max_new_tokens: int, eos: tuple[int, ...], sampling: Sampling = Sampling(),
                heads=None, tree: Tree | None = None, reps: int = 3, seed: int = 0,
                name: str = "") -> RunResult:
    """Time plain (heads=None) or Medusa decoding of all prompts in fixed-size batches."""
    batches = []
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        batches.append((len(chunk), *pad_prompts(chunk + [chunk[-1]] * (batch_size - len(chunk)))))
    key = jax.random.key(seed)

    def run():
        outs = []
        for _, tokens, lengths in batches:
            if heads is None:
                outs.append(generate(params, cfg, tokens, lengths, key, sampling=sampling,
                                     max_new_tokens=max_new_tokens, eos=eos))
            else:
                outs.append(medusa_generate(params, heads, cfg, tokens, lengths, key, tree=tree,
                                            sampling=sampling, max_new_tokens=max_new_tokens,
                                            eos=eos))
        return outs

    seconds, outs = _median_time(run, reps)
    rows, steps, loop_steps = [], [], 0
    for (n, _, _), out in zip(batches, outs):
        out = jax.device_get(out)
        loop_steps += int(out.steps.max())
        for i in range(n):
            rows.append(out.tokens[i, : out.num_new[i]].tolist())
            steps.append(int(out.steps[i]))
    return RunResult(name, batch_size, seconds, sum(map(len, rows)), sum(steps), rows, steps,
                     loop_steps)


@dataclasses.dataclass
class Comparison:
    """Plain vs Medusa decoding of the same prompts, timed in the same process."""

    plain: RunResult
    medusa: RunResult
    tree: Tree
    mode: str
    max_new_tokens: int

    @property
    def identical_rows(self) -> int:
        """Prompts whose Medusa output equals the plain output token for token."""
        return sum(a == b for a, b in zip(self.plain.rows, self.medusa.rows))

    @property
    def speedup(self) -> float:
        return self.medusa.tokens_per_second / self.plain.tokens_per_second

    @property
    def step_overhead(self) -> float:
        """Seconds of a Medusa step over seconds of a plain step."""
        return self.medusa.step_seconds / self.plain.step_seconds

    def to_json(self) -> dict:
        p, m = self.plain, self.medusa
        return {"prompts": len(m.rows), "tree": self.tree.name, "mode": self.mode,
                "batch_size": m.batch_size, "max_new_tokens": self.max_new_tokens,
                "new_tokens": m.new_tokens, "medusa_steps": m.steps,
                "tokens_per_step": m.tokens_per_step, "plain_s": p.seconds, "medusa_s": m.seconds,
                "speedup": self.speedup, "step_overhead": self.step_overhead,
                "plain_ms_per_step": 1e3 * p.step_seconds,
                "medusa_ms_per_step": 1e3 * m.step_seconds,
                "identical_outputs": self.identical_rows,
                "plain_tok_s": p.tokens_per_second, "medusa_tok_s": m.tokens_per_second}


def compare_decoding(params, heads, cfg: ModelConfig, prompts: list[list[int]], tree: Tree, *,
                     max_new_tokens: int, eos: tuple[int, ...], batch_size: int = 1,
                     sampling: Sampling = Sampling(), reps: int = 1,
                     plain: RunResult | None = None) -> Comparison:
    """Time Medusa decoding against plain decoding (`plain`, or timed here with the same
    sampling) of the same prompts. The one plain-vs-Medusa comparison of the project: the
    training commands, `infer.bench` and `infer.tree` all report through it."""
    common = dict(batch_size=batch_size, max_new_tokens=max_new_tokens, eos=eos,
                  sampling=sampling, reps=reps)
    if plain is None:
        plain = run_decoder(params, cfg, prompts, name="plain", **common)
    medusa = run_decoder(params, cfg, prompts, heads=heads, tree=tree, name="medusa", **common)
    return Comparison(plain, medusa, tree, sampling.mode, max_new_tokens)


def print_comparison(c: Comparison, title: str):
    """The comparison as the training commands print it."""
    p, m = c.plain, c.medusa
    print(f"\n{title}, {len(m.rows)} held-out prompts, batch {m.batch_size}, up to "
          f"{c.max_new_tokens} new tokens, tree {c.tree.name} (compile excluded):")
    print(f"  plain : {p.seconds:.2f}s  {p.tokens_per_second:.0f} tok/s  1.00 tokens/step"
          f"  {1e3 * p.step_seconds:.2f} ms/step")
    print(f"  medusa: {m.seconds:.2f}s  {m.tokens_per_second:.0f} tok/s  "
          f"{m.tokens_per_step:.2f} tokens/step  {1e3 * m.step_seconds:.2f} ms/step "
          f"({c.tree.num_nodes} tokens verified per step)")
    print(f"  speedup {c.speedup:.2f}x; outputs identical to plain {c.mode} for "
          f"{c.identical_rows}/{len(m.rows)} prompts")


def run_transformers(model_dir: str | Path, prompts: list[list[int]], *, batch_size: int,
                     max_new_tokens: int, eos: tuple[int, ...], reps: int = 3) -> RunResult | None:
    """transformers' PyTorch greedy `generate` on the same prompts (None without torch)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    batches = []
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        width = max(map(len, chunk))
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding, as transformers expects for generation
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        batches.append((ids, mask))

    def run():
        outs = []
        with torch.no_grad():
            for ids, mask in batches:
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     do_sample=False, eos_token_id=list(eos) or None,
                                     pad_token_id=0)
                outs.append(out[:, ids.shape[1]:])
        return outs

    seconds, outs = _median_time(run, reps)
    rows = []
    for out in outs:
        for row in out.tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
    n = sum(map(len, rows))
    return RunResult("transformers", batch_size, seconds, n, n, rows, [len(r) for r in rows],
                     len(batches) * max_new_tokens)


def step_time_curve(cfg: ModelConfig, params, tree_sizes: list[int], *, prefix: int = 256,
                    batch: int = 1, reps: int = 10) -> dict[int, float]:
    """Seconds for one backbone pass over T new tokens after a `prefix`-token cache, for each
    tree size N (T = N + 1; N = 0 is a plain decoding step). The cost of a pass does not depend
    on the mask's pattern, so a causal block stands in for the tree."""
    out = {}
    for size in tree_sizes:
        t = size + 1
        capacity = prefix + t
        cache = KVCache.init(cfg, batch, capacity)
        cache = cache.replace(lengths=jnp.full((batch,), prefix, jnp.int32))
        mask = causal_mask(cache.lengths, t, capacity)
        tokens = jnp.ones((batch, t), jnp.int32)
        positions = cache.lengths[:, None] + jnp.arange(t)[None]
        fn = jax.jit(lambda p, c, tk=tokens, ps=positions, m=mask: forward(p, cfg, tk, ps, m, c)[0])
        out[size] = _median_time(lambda: fn(params, cache), reps)[0]
    return out


# ----------------------------------------------------------------------------- sizing


def _shard_bytes(x, s) -> int:
    shape = s.shard_shape(tuple(x.shape))
    return int(np.prod(shape)) * np.dtype(x.dtype).itemsize


def size_model(shape: str, layers: int, mesh_spec: str, *, dtype: str = "bfloat16",
               batch: int = 1, context: int = 2048, tree: Tree | None = None,
               num_heads: int = 5, steps: int = 4, seed: int = 0) -> dict:
    """Per-device memory of Medusa decoding of a real backbone shape, measured on `layers`
    of its layers (random weights, created directly in their shardings) and extrapolated
    to all of them.

    Compiles `medusa_generate` on the mesh (batch rows, a `context`-token KV cache), runs
    it for `steps` new tokens, and reads each buffer's per-device bytes from its sharding
    and the compiled step's temporaries from `compiled.memory_analysis()`. Per-layer
    tensors (stacked on the layers axis) and the KV cache scale with the depth; the
    embedding, output projection and heads do not; the temporaries (KV cache aside) are
    extrapolated from their growth between a compile at `layers` and one at `layers + 1`
    (from shapes only)."""
    from medusa_jax import api, sharding
    from medusa_jax.heads import HeadsConfig

    full = ModelConfig(**SHAPES[shape], param_dtype=dtype, compute_dtype=dtype) \
        if shape in SHAPES else None
    if full is None:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if not 1 <= layers <= full.num_layers:
        raise ValueError(f"--layers must be in 1..{full.num_layers} for {shape}")
    cfg = full.replace(num_layers=layers)
    mesh = sharding.make_mesh(mesh_spec)
    api.check_model_axis(cfg, mesh)
    tree = tree or Tree.load("mc_sim_7b_63")
    bb_sh, _ = api.decode_shardings(cfg, mesh)
    params = jax.jit(lambda k: init_params(cfg, k), out_shardings=bb_sh)(jax.random.key(seed))
    hcfg = HeadsConfig(num_heads=num_heads)

    def make_heads(p):
        from medusa_jax.heads import init_heads
        return init_heads(cfg, p, hcfg)

    abstract_heads = jax.eval_shape(make_heads, params)
    _, hd_sh = api.decode_shardings(cfg, mesh, abstract_heads)
    heads = jax.jit(make_heads, out_shardings=hd_sh)(params)

    prompt = min(context // 2, 256)
    max_new = context - prompt - tree.num_nodes - 1
    tokens = np.ones((batch, prompt), np.int32)
    lengths = np.full((batch,), prompt, np.int32)
    key = jax.random.key(seed)

    def compiled_at(n: int):
        """The decoder compiled for n layers, from shapes and shardings only."""
        c = cfg.replace(num_layers=n)
        bb, hd = api.decode_shardings(c, mesh, abstract_heads)
        spec = lambda tree, sh: jax.tree.map(  # noqa: E731
            lambda x, s_: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s_), tree, sh)
        abs_params = spec(jax.eval_shape(lambda k: init_params(c, k), key), bb)
        return medusa_generate.lower(spec(abs_params, bb), spec(abstract_heads, hd), c,
                                     tokens, lengths, key, tree=tree, max_new_tokens=max_new,
                                     eos=()).compile()

    with jax.set_mesh(mesh):
        compiled = compiled_at(layers)
        deeper = compiled_at(layers + 1) if layers < full.num_layers else None
        # a few steps only: the same loop with a small token budget, on the random weights
        small = medusa_generate.lower(params, heads, cfg, tokens, lengths, key, tree=tree,
                                      max_new_tokens=steps, eos=()).compile()
        t0 = time.perf_counter()
        out = jax.block_until_ready(small(params, heads, tokens, lengths, key))
        run_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    scale = full.num_layers / layers

    def by_depth(tree_, shardings):
        per_layer = fixed = 0
        for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(tree_)[0],
                                jax.tree.leaves(shardings)):
            b = _shard_bytes(x, s)
            if any(getattr(k, "key", None) == "layers" for k in path):
                per_layer += b
            else:
                fixed += b
        return per_layer, fixed

    p_layer, p_fixed = by_depth(params, bb_sh)
    h_layer, h_fixed = by_depth(heads, hd_sh)
    capacity = prompt + max_new + tree.num_nodes + 1
    kv_spec = sharding.cache_spec(mesh, cfg.num_kv_heads, batch)
    kv_shape = (layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    kv_local = jax.sharding.NamedSharding(mesh, kv_spec).shard_shape(kv_shape)
    kv = 2 * int(np.prod(kv_local)) * np.dtype(as_dtype(dtype)).itemsize
    temp = int(mem.temp_size_in_bytes)
    other_temp = max(temp - kv, 0)
    # what the temporaries (KV cache aside) grow by per layer, from a compile one layer deeper
    per_layer_temp = 0 if deeper is None else max(
        int(deeper.memory_analysis().temp_size_in_bytes) - temp - kv // layers, 0)
    gib = 2 ** 30
    measured = {"params": p_layer + p_fixed, "heads": h_layer + h_fixed, "kv_cache": kv,
                "temporaries": other_temp}
    extrapolated = {"params": p_layer * scale + p_fixed, "heads": h_layer + h_fixed,
                    "kv_cache": kv * scale,
                    "temporaries": other_temp + per_layer_temp * (full.num_layers - layers)}
    return {
        "shape": shape, "layers_measured": layers, "layers": full.num_layers,
        "mesh": sharding.mesh_str(mesh), "devices": mesh.size, "dtype": dtype,
        "batch": batch, "context": capacity, "tree_nodes": tree.num_nodes,
        "heads": num_heads, "platform": jax.devices()[0].platform,
        "compiled_argument_bytes": int(mem.argument_size_in_bytes),
        "compiled_temp_bytes": temp, "temp_bytes_per_layer": per_layer_temp,
        "measured_gib": {k: v / gib for k, v in measured.items()},
        "per_device_gib": {k: v / gib for k, v in extrapolated.items()},
        "total_per_device_gib": sum(extrapolated.values()) / gib,
        "run_seconds": run_s, "new_tokens": int(np.asarray(out.num_new).max()),
    }
