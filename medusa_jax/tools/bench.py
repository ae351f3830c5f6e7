"""Benchmark building blocks: timed decoding runs, the transformers baseline, step-time curves.

Everything is measured in one process on the same prompts; compile and warm-up are excluded
(each timed function runs once before the clock starts) and the median of several repetitions
is reported; the decoders' compile is timed on its own (`RunResult.compile`). Speed claims
are ratios against a baseline measured in the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.decoding.acceptance import Sampling
from medusa_jax.decoding.decode import generate, medusa_generate, pad_prompts
from medusa_jax.decoding.sampling import Rows
from medusa_jax.decoding.step import STAGES, medusa_step
from medusa_jax.decoding.tree import Tree
from medusa_jax.drafters import registry
from medusa_jax.model.backbone import KVCache, causal_mask, forward, init_params, is_decoding_layout
from medusa_jax.model.config import ModelConfig, as_dtype
from medusa_jax.model.shapes import SHAPES  # noqa: E402 - the named shapes (no JAX there)
from medusa_jax.runtime import timing, xla_options
from medusa_jax.tools.hlo import count_kernels


def random_backbone(shape: str, dtype: str = "bfloat16", seed: int = 0):
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = ModelConfig(**SHAPES[shape], param_dtype=dtype, compute_dtype=dtype)
    return cfg, init_params(cfg, jax.random.key(seed))


from medusa_jax.text.prompt_files import read_prompt_file  # noqa: E402,F401 - re-exported
from medusa_jax.tools.sizing import size_model  # noqa: E402,F401 - re-exported


def _median_time(fn, reps: int, progress=None) -> tuple[float, object]:
    """Median wall time of `reps` calls after a warm-up call. `progress(text)`, when given,
    hears of the warm-up and of each repetition as it ends ("rep 2/3: 0.213 s")."""
    t0 = time.perf_counter()
    result = jax.block_until_ready(fn())  # compile + warm-up, not timed
    if progress is not None:
        progress(f"warm-up {time.perf_counter() - t0:.3f} s")
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        result = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
        if progress is not None:
            progress(f"rep {i + 1}/{reps}: {times[-1]:.3f} s")
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
    compile: timing.Compile = dataclasses.field(default_factory=timing.Compile)

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
                name: str = "", max_cache_phases: int | None = None,
                progress=None) -> RunResult:
    """Time plain (heads=None) or Medusa decoding of all prompts in fixed-size batches
    (`max_cache_phases`: see `decode.cache_phases`; default the decoders' own).
    `progress(text)`: told of the compile, the warm-up and each repetition as they end."""
    phases = {} if max_cache_phases is None else {"max_cache_phases": max_cache_phases}
    batches = []
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s:s + batch_size]
        batches.append((len(chunk), *pad_prompts(chunk + [chunk[-1]] * (batch_size - len(chunk)))))
    key = jax.random.key(seed)
    # sampled modes pass their values at run time, as the notebook API does (one program
    # for every sampled setting); greedy keeps its own program, as there
    if sampling.mode == "greedy":
        how = dict(sampling=sampling, eos=eos)
    else:
        how = dict(rows=Rows.values(batch_size, max_new_tokens, eos, mode=sampling.mode,
                                    temperature=sampling.temperature, top_k=sampling.top_k,
                                    top_p=sampling.top_p, epsilon=sampling.epsilon,
                                    delta=sampling.delta))

    def run(call=lambda fn, *args, **kw: fn(*args, **kw)):
        outs = []
        for _, tokens, lengths in batches:
            if heads is None:
                outs.append(call(generate, params, cfg, tokens, lengths, key,
                                 max_new_tokens=max_new_tokens, **how, **phases))
            else:
                outs.append(call(medusa_generate, params, heads, cfg, tokens, lengths, key,
                                 tree=tree, max_new_tokens=max_new_tokens, **how, **phases))
        return outs

    compiled = sum(run(timing.precompile), timing.Compile())  # the compile, timed apart
    if progress is not None:
        progress(f"compiled in {timing.fmt_seconds(compiled.seconds)}"
                 f"{' (from the compilation cache)' if compiled.cached else ''}")
    seconds, outs = _median_time(run, reps, progress)
    rows, steps, loop_steps = [], [], 0
    for (n, _, _), out in zip(batches, outs):
        out = jax.device_get(out)
        loop_steps += int(out.steps.max())
        for i in range(n):
            rows.append(out.tokens[i, : out.num_new[i]].tolist())
            steps.append(int(out.steps[i]))
    return RunResult(name, batch_size, seconds, sum(map(len, rows)), sum(steps), rows, steps,
                     loop_steps, compiled)


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
                "plain_tok_s": p.tokens_per_second, "medusa_tok_s": m.tokens_per_second,
                "plain_compile_s": p.compile.seconds, "medusa_compile_s": m.compile.seconds}


def compare_decoding(params, heads, cfg: ModelConfig, prompts: list[list[int]], tree: Tree, *,
                     max_new_tokens: int, eos: tuple[int, ...], batch_size: int = 1,
                     sampling: Sampling = Sampling(), reps: int = 1,
                     plain: RunResult | None = None,
                     max_cache_phases: int | None = None, progress=None) -> Comparison:
    """Time Medusa decoding against plain decoding (`plain`, or timed here with the same
    sampling) of the same prompts. The one plain-vs-Medusa comparison of the project: the
    training commands, `infer.bench` and `infer.tree` all report through it."""
    common = dict(batch_size=batch_size, max_new_tokens=max_new_tokens, eos=eos,
                  sampling=sampling, reps=reps, max_cache_phases=max_cache_phases)
    if plain is None:
        plain = run_decoder(params, cfg, prompts, name="plain", **common)
    medusa = run_decoder(params, cfg, prompts, heads=heads, tree=tree, name="drafted",
                         progress=progress, **common)
    return Comparison(plain, medusa, tree, sampling.mode, max_new_tokens)


def print_comparison(c: Comparison, title: str, label: str = "drafted"):
    """The comparison as the training commands print it (`label`: the drafter's kind)."""
    p, m = c.plain, c.medusa
    print(f"\n{title}, {len(m.rows)} held-out prompts, batch {m.batch_size}, up to "
          f"{c.max_new_tokens} new tokens, tree {c.tree.name} (decoding timed after a "
          f"warm-up run):")
    print(f"  plain : {timing.speed_line(p.compile, p.new_tokens, p.seconds)}; 1.00 tokens/step, "
          f"{1e3 * p.step_seconds:.2f} ms/step")
    print(f"  {label:6s}: {timing.speed_line(m.compile, m.new_tokens, m.seconds)}; "
          f"{m.tokens_per_step:.2f} tokens/step, {1e3 * m.step_seconds:.2f} ms/step "
          f"({c.tree.num_nodes} tokens verified per step)")
    print(f"  speedup {c.speedup:.2f}x; outputs identical to plain {c.mode} for "
          f"{c.identical_rows}/{len(m.rows)} prompts")


def run_transformers(model_dir: str | Path, prompts: list[list[int]], *, batch_size: int,
                     max_new_tokens: int, eos: tuple[int, ...], reps: int = 3,
                     progress=None) -> RunResult | None:
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

    seconds, outs = _median_time(run, reps, progress)
    rows = []
    for out in outs:
        for row in out.tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
    n = sum(map(len, rows))
    return RunResult("transformers", batch_size, seconds, n, n, rows, [len(r) for r in rows],
                     len(batches) * max_new_tokens)


def _layout_for(cfg: ModelConfig, params):
    """The layout the decoder runs (`Medusa` puts a one-device backbone in it at load)."""
    from medusa_jax.model.backbone import decoding_layout

    sharded = any(len(getattr(a, "devices", lambda: [None])()) > 1
                  for a in jax.tree.leaves(params))
    return params if sharded else decoding_layout(cfg, params)


def verification_pass(cfg: ModelConfig, params, num_tokens: int, *, prefix: int,
                      capacity: int | None = None, batch: int = 1, iters: int = 20):
    """A jitted program running `iters` backbone passes over `num_tokens` new tokens per row
    after a `prefix`-token cache, inside a `lax.fori_loop` (a while loop, as the decoders
    run their steps), each pass feeding on the last one's logits so none can be dropped or
    hoisted; the new keys/values are written each time at the same slots. The cost of a
    pass does not depend on the mask's pattern, so a causal block stands in for a tree.
    Returns (fn, cache): `fn(params, cache)` runs the loop."""
    t = num_tokens
    capacity = capacity or prefix + t
    cache = KVCache.init(cfg, batch, capacity, per_layer=is_decoding_layout(params))
    cache = cache.replace(lengths=jnp.full((batch,), prefix, jnp.int32))
    positions = cache.lengths[:, None] + jnp.arange(t)[None]
    mask = causal_mask(cache.lengths, t, capacity)

    def run(p, c):
        def body(_, carry):
            c, tok = carry
            logits, _, c = forward(p, cfg, tok, positions, mask, c)
            return c, (tok + (logits[:, :, 0] > 0)) % cfg.vocab_size

        return jax.lax.fori_loop(0, iters, body, (c, jnp.ones((batch, t), jnp.int32)))[1]

    # compiled as the decoders are (their CPU schedule), so a pass costs what it does there
    return jax.jit(run, compiler_options=xla_options.for_backend()), cache


def step_time_curve(cfg: ModelConfig, params, tree_sizes: list[int], *, prefix: int = 256,
                    batch: int = 1, reps: int = 10, iters: int = 20,
                    capacity: int | None = None) -> dict[int, float]:
    """Seconds for one backbone pass over T = N + 1 new tokens after a `prefix`-token
    cache, for each tree size N (N = 0 is a plain decoding step), in the layout the decoder
    uses and inside a loop as it runs (`verification_pass`): median of `reps` runs of
    `iters` passes, divided by `iters`."""
    params = _layout_for(cfg, params)
    out = {}
    for size in tree_sizes:
        fn, cache = verification_pass(cfg, params, size + 1, prefix=prefix, batch=batch,
                                      iters=iters, capacity=capacity)
        out[size] = _median_time(lambda: fn(params, cache), reps)[0] / iters
    return out


def compare_layouts(cfg: ModelConfig, params, prompts: list[list[int]], *,
                    max_new_tokens: int, eos: tuple[int, ...] = (), reps: int = 5) -> dict:
    """Plain greedy decoding (batch 1) with the stacked layers scanned (training's layout,
    and what deep models decoded with before) against `decoding_layout`, the repetitions
    alternating between the two in this process. `params`: the stacked layout."""
    from medusa_jax.model.backbone import decoding_layout

    layouts = {"stacked scan": params, "decoding layout": decoding_layout(cfg, params)}
    key = jax.random.key(0)
    padded = [pad_prompts([p]) for p in prompts]

    def run(p):
        return [generate(p, cfg, t, n, key, max_new_tokens=max_new_tokens, eos=eos)
                for t, n in padded]

    outs = {name: jax.block_until_ready(run(p)) for name, p in layouts.items()}  # compile
    times = {name: [] for name in layouts}
    for _ in range(reps):
        for name, p in layouts.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run(p))
            times[name].append(time.perf_counter() - t0)
    tokens = {name: [o.tokens[0, :int(o.num_new[0])].tolist() for o in out]
              for name, out in outs.items()}
    new = sum(len(t) for t in tokens["decoding layout"])
    rows = {}
    for name, ts in times.items():
        ms = 1e3 * statistics.median(ts) / new
        rows[name] = {"ms_per_token": ms, "ms_per_layer": ms / cfg.num_layers}
    return {"layers": cfg.num_layers, "new_tokens": new, "rows": rows,
            "speedup": rows["stacked scan"]["ms_per_token"] /
            rows["decoding layout"]["ms_per_token"],
            "identical": tokens["stacked scan"] == tokens["decoding layout"]}


# ----------------------------------------------------------------------------- the bound


def measure_bandwidth(nbytes: int = 512 * 2**20, reps: int = 10, dtype="float32") -> float:
    """Bytes per second a jitted reduction reads from a `nbytes` buffer of device memory."""
    dt = as_dtype(dtype)
    x = jnp.ones((nbytes // jnp.dtype(dt).itemsize,), dt)
    fn = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    return x.size * x.dtype.itemsize / _median_time(lambda: fn(x), reps)[0]


def measure_peak(n: int = 2048, reps: int = 10, dtype="float32") -> float:
    """FLOP per second of a jitted [n, n] x [n, n] matrix product (the matrix peak)."""
    dt = as_dtype(dtype)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dt)
    fn = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / _median_time(lambda: fn(a, a), reps)[0]


def loop_overhead(iters: int = 1000, reps: int = 10) -> float:
    """Seconds per iteration of a jitted `fori_loop` that does almost nothing: what a
    decoding loop costs per step before any work."""
    fn = jax.jit(lambda x: jax.lax.fori_loop(0, iters, lambda i, v: v * 1.0001 + 1.0, x))
    return _median_time(lambda: fn(jnp.zeros((8,), jnp.float32)), reps)[0] / iters


def pass_cost(cfg: ModelConfig, num_tokens: int, context: int, batch: int = 1
              ) -> tuple[float, float]:
    """(bytes read, FLOPs) of one backbone pass over `num_tokens` new tokens per row after
    `context` cached ones: every layer weight and the output projection read once, the
    cached keys/values read once per row; 2 FLOPs per weight per token, and the attention's
    two products over context + new tokens."""
    from medusa_jax.model.backbone import param_shapes

    itemsize = jnp.dtype(as_dtype(cfg.param_dtype)).itemsize
    shapes = param_shapes(cfg)
    layer_weights = sum(int(np.prod(s)) for s in jax.tree.leaves(
        shapes["layers"], is_leaf=lambda x: isinstance(x, tuple)))
    out_proj = cfg.hidden_size * cfg.vocab_size
    weights = layer_weights + out_proj + cfg.hidden_size
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * context * cfg.head_dim * batch
    kv_itemsize = jnp.dtype(as_dtype(cfg.compute_dtype)).itemsize
    t = num_tokens * batch
    attn = 4 * t * (context + num_tokens) * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return weights * itemsize + kv * kv_itemsize, 2 * t * (layer_weights + out_proj) + attn


def bound_seconds(cfg: ModelConfig, num_tokens: int, context: int, bandwidth: float,
                  peak: float, batch: int = 1) -> float:
    """The hardware's lower bound for a pass: max(bytes / bandwidth, FLOPs / peak)."""
    nbytes, flops = pass_cost(cfg, num_tokens, context, batch)
    return max(nbytes / bandwidth, flops / peak)


def hardware_report(shape: str, *, dtype: str = "bfloat16", token_counts=(1, 5, 9, 17, 33, 65),
                    contexts=(512, 4096), layers=(1, 2), iters: int = 10, reps: int = 5,
                    progress=None) -> dict:
    """Whether Medusa pays on this device, at `shape` (random weights): the measured
    bandwidth and matrix peak; for each context and token count T, one backbone pass in a
    loop (`verification_pass`) timed with each of `layers` layer counts and extrapolated
    linearly to the shape's depth, against the bound; the loop's own cost per iteration;
    the compile time of the T = 1 and largest-T programs (at the largest layer count); and
    the speedup the shipped heads' tokens/step predicts at each tree size
    (`predicted_speedups`)."""
    say = progress or (lambda msg: None)
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    full = ModelConfig(**SHAPES[shape], param_dtype=dtype, compute_dtype=dtype)
    layers = sorted(set(min(n, full.num_layers) for n in layers))
    device = jax.devices()[0]
    say("measuring bandwidth and matrix peak ...")
    big = 2 * 2**30 if device.platform != "cpu" else 512 * 2**20
    bandwidth = measure_bandwidth(big, dtype=dtype)
    peak = measure_peak(8192 if device.platform != "cpu" else 1024, dtype=dtype)
    overhead = loop_overhead()
    rows, compile_s = [], {}
    for context in contexts:
        per_layers = {}
        for n in layers:
            cfg = full.replace(num_layers=n)
            params = _layout_for(cfg, init_params(cfg, jax.random.key(0)))
            times = {}
            for t in token_counts:
                say(f"context {context}, {n} layer(s), T = {t} ...")
                fn, cache = verification_pass(cfg, params, t, prefix=context,
                                              capacity=context + t, iters=iters)
                t0 = time.perf_counter()
                compiled = fn.lower(params, cache).compile()
                if context == contexts[0] and n == layers[-1] and \
                        t in (token_counts[0], token_counts[-1]):
                    compile_s[t] = time.perf_counter() - t0
                times[t] = _median_time(lambda: compiled(params, cache), reps)[0] / iters
            per_layers[n] = times
            del params
        for t in token_counts:
            a, b = layers[0], layers[-1]
            per_layer = (per_layers[b][t] - per_layers[a][t]) / (b - a) if b > a else 0.0
            if per_layer > 0:  # linear in depth: t(L) = t(a) + (L - a) (t(b) - t(a)) / (b - a)
                sec = per_layers[a][t] + (full.num_layers - a) * per_layer
            else:  # one layer count, or noise above the layers' cost: proportional
                sec = per_layers[b][t] * full.num_layers / b
            nbytes, flops = pass_cost(full, t, context)
            bound = max(nbytes / bandwidth, flops / peak)
            rows.append({"context": context, "tokens": t, "ms": 1e3 * sec,
                         "gb_per_s": nbytes / sec / 1e9, "bound_ms": 1e3 * bound,
                         "vs_bound": sec / bound,
                         "vs_one_token": None})
        first = next(r for r in rows if r["context"] == context and r["tokens"] == 1)
        for r in rows:
            if r["context"] == context:
                r["vs_one_token"] = r["ms"] / first["ms"]
    return {"shape": shape, "dtype": dtype, "platform": device.platform,
            "device": getattr(device, "device_kind", str(device)),
            "layers": full.num_layers, "layers_measured": layers,
            "extrapolated": layers[-1] < full.num_layers,
            "bandwidth_gb_per_s": bandwidth / 1e9, "peak_tflop_per_s": peak / 1e12,
            "loop_iteration_us": 1e6 * overhead, "compile_seconds": compile_s,
            "iters": iters, "reps": reps, "rows": rows}


# Trees of the published `mc_sim_7b_63` by size: a tree of N nodes verifies N + 1 tokens.
PREDICTION_TREES = {4: "mc_sim_7b_63:4", 8: "mc_sim_7b_63:8", 16: "mc_sim_7b_63:16",
                    32: "mc_sim_7b_63:32", 64: "mc_sim_7b_63"}


def shipped_tokens_per_step(num_prompts: int = 8, max_new_tokens: int = 128,
                            max_nodes: int | None = None) -> dict[int, float]:
    """Tokens per step of the embedded model with its shipped heads, greedy, held-out
    openings, for each tree of `PREDICTION_TREES` (up to `max_nodes`; the acceptance a real
    model's trained heads reach is of the same order: docs/performance.md)."""
    from medusa_jax.api import Medusa
    from medusa_jax.runtime import assets

    m = Medusa.load(heads="default")
    prompts = assets.heldout_prompts()[:num_prompts]
    out = {}
    for size, name in PREDICTION_TREES.items():
        if max_nodes is not None and size > max_nodes:
            continue
        gens = m.generate(prompts, max_new_tokens=max_new_tokens, tree=name, batch_size=8)
        out[size] = sum(g.new_tokens for g in gens) / sum(g.steps for g in gens)
    return out


def predicted_speedups(report: dict, tokens_per_step: dict[int, float]) -> list[dict]:
    """Speedup = tokens/step / (pass over N + 1 tokens / pass over 1 token), per context
    and tree size N (using the report's nearest measured T >= N + 1); the heads' own cost
    and acceptance bookkeeping are left out, so this is an upper estimate."""
    out = []
    for context in sorted({r["context"] for r in report["rows"]}):
        rows = {r["tokens"]: r for r in report["rows"] if r["context"] == context}
        for size, tps in sorted(tokens_per_step.items()):
            t = min((t for t in rows if t >= size + 1), default=None)
            if t is None:
                continue
            ratio = rows[t]["vs_one_token"]
            out.append({"context": context, "tree_nodes": size, "tokens_fed": t,
                        "tokens_per_step": tps, "step_vs_plain": ratio,
                        "predicted_speedup": tps / ratio})
    return out


# ----------------------------------------------------------------------------- breakdown


MEDUSA_STAGES = STAGES  # the stages `--breakdown` leaves out one at a time (`step.STAGES`)


def _step_with(params, cfg, drafter, heads, tree, stages, s):
    """The decoders' step (`step.medusa_step`) with only `stages` (the backbone pass always)."""
    return medusa_step(params, cfg, drafter, heads, tree, s, stages=stages)[0]


def step_breakdown(params, heads, cfg: ModelConfig, prompt: list[int], trees: list[Tree], *,
                   max_new_tokens: int = 128, eos: tuple[int, ...] = (), iters: int = 200,
                   reps: int = 5) -> list[dict]:
    """Where a decoding step's time goes, greedy, batch 1, after `prompt`: for the plain step
    and each tree, the kernels of the compiled step and the cost of each stage, measured by
    leaving it out of the whole step (each stage's row: the step without it, and what the
    whole step costs more). Adding stages one at a time instead would charge a stage for
    the rescheduling XLA does of the stages before it. All configurations are timed in this
    process, alternating rep by rep."""
    from medusa_jax.decoding import decode

    tokens, lengths = pad_prompts([prompt])
    key = jax.random.key(0)
    plain_state = decode.plain_init(params, cfg, tokens, lengths, key, Sampling(),
                                    max_new_tokens, eos)

    def forward_only(s):
        logits, _, cache = forward(params, cfg, s.root[:, None], s.cache.lengths[:, None],
                                   causal_mask(s.cache.lengths, 1, s.cache.capacity), s.cache)
        return s.replace(cache=cache, root=(s.root + (logits[:, 0, 0] > 0)) % cfg.vocab_size)

    def full_plain(s):
        return decode.step.plain_step(params, cfg, s)[0]

    # (config, stage, step function, its state); "whole step" first in each config
    runs = [("plain", "whole step", full_plain, plain_state),
            ("plain", "- sampling, bookkeeping", forward_only, plain_state)]
    for tree in trees:
        state, used = decode.medusa_init(params, heads, cfg, tokens, lengths, key, tree,
                                         Sampling(), max_new_tokens, eos=eos)
        drafter = registry.drafter_for(heads)
        config = f"{drafter.kind} {tree.name} ({tree.num_nodes} tokens)"
        every = frozenset(MEDUSA_STAGES)
        variants = [("whole step", every)] + [(f"- {stage}", every - {stage})
                                              for stage in MEDUSA_STAGES]
        variants.append(("backbone pass alone", frozenset()))
        for label, stages in variants:  # the real step, with those stages
            fn = functools.partial(_step_with, params, cfg, drafter, used, tree, stages)
            runs.append((config, label, fn, state))
    loops = [jax.jit(lambda st, fn=fn: jax.lax.fori_loop(0, iters, lambda i, s: fn(s), st),
                     compiler_options=xla_options.for_backend()) for _, _, fn, _ in runs]
    for loop, run in zip(loops, runs):
        jax.block_until_ready(loop(run[3]))  # compiled before any clock starts
    times = [[] for _ in runs]
    for _ in range(reps):
        for i, (loop, run) in enumerate(zip(loops, runs)):
            t0 = time.perf_counter()
            jax.block_until_ready(loop(run[3]))
            times[i].append((time.perf_counter() - t0) / iters)
    rows = []
    for (config, label, fn, state), ts in zip(runs, times):
        kernels = count_kernels(jax.jit(fn).lower(state).compile().as_text())
        rows.append({"config": config, "stage": label, "ms": 1e3 * statistics.median(ts),
                     "kernels": kernels})
    whole = {r["config"]: r["ms"] for r in rows if r["stage"] == "whole step"}
    for r in rows:
        r["vs_plain_step"] = r["ms"] / whole["plain"]
        # a left-out stage costs what the whole step costs more; a whole pass costs itself
        r["stage_ms"] = (whole[r["config"]] - r["ms"] if r["stage"].startswith("- ")
                         else r["ms"])
    return rows


# ----------------------------------------------------------------------------- heads' cost


def heads_cost(hidden: int, vocab: int, *, kind: str = registry.HEAD_FN_KIND, **kw
               ) -> dict[str, float]:
    """Seconds of one drafting call of a fresh drafter of `kind` on one token, per variant
    of its parameters (the kind's `cost`; Medusa's: its projection layouts)."""
    return registry.drafter_class(kind).cost(hidden, vocab, **kw)
